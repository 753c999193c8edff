"""Issue 35's six sentences: what espeak-ng speaks and pocketsphinx must hear back, in the
roles' own tests (tests/roles/test_roles.py) and through the served graphs
(tests/serve/test_openai_real.py)."""

SENTENCES = (
    "what is the weather like today",
    "please open the front door for me",
    "the quick brown fox jumps over the lazy dog",
    "tell me a story about a cat",
    "i would like to order a pizza",
    "how far is the moon from the earth",
)
