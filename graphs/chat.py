"""A toy chat "LLM" that opts in to the OpenAI-compatible endpoint; deterministic, no model.

A graph serves ``/v1/chat/completions`` when it has a Placeholder named ``messages`` (the
OpenAI messages list) and an output field ``text`` (each frame is a text delta). Here
template.last_user picks the text of the last user message and reverser.generate streams its
words in reverse order, one frame per word (role names are distinct from the other example
graphs' so that one server can serve them together):

    [{"role": "user", "content": "hello omniflow world"}]  ->  "world", " omniflow", " hello"

    omniflow serve graphs/chat.py
    curl -N http://127.0.0.1:8000/v1/graphs/chat/call \\
         -d '{"inputs": {"messages": [{"role": "user", "content": "hello omniflow world"}]}}'
    omniflow run graphs/chat.py --input 'messages=[{"role": "user", "content": "hi there"}]'
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import omniflow as of


def _content_text(content: Any) -> str:
    """A message's text: a plain string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return " ".join(str(p.get("text", "")) for p in parts)
    return ""


class Prompt(of.Role):
    @of.interface(inputs_or=[["messages"]], outputs=["prompt"])
    async def last_user(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            # The request is wrong, not the graph: an InputError is the client's 400.
            raise of.InputError(
                "the conversation has no user message; add {'role': 'user', ...}",
                graph="chat",
                field="messages",
            )
        return {"prompt": _content_text(users[-1].get("content"))}


class ReverseLlm(of.Role):
    """Streams the prompt's words last to first, each after the first with a leading space."""

    @of.interface(inputs_or=[["prompt"]], outputs=["text"])
    async def generate(self, prompt: str) -> AsyncIterator[dict[str, Any]]:
        for i, word in enumerate(reversed(prompt.split())):
            yield {"text": word if i == 0 else " " + word}


graph = of.Graph(
    "chat",
    roles={"template": Prompt(), "reverser": ReverseLlm()},
    inputs=[of.Placeholder("messages")],
    outputs=["text"],
)
