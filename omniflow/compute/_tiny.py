"""A tiny random-init Llama with a locally trained tokenizer, for tests, demos and benchmarks.

>>> # path = make_tiny_model("/tmp/tiny", arch="llama")

No model hub is needed: the weights are random (its words are noise) but the directory has the
exact layout of a real checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template), so the real loading code runs on it unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "make_tiny_model", "train_tokenizer"]

#: A ChatML template (the Qwen2 family's format).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A stream of tokens flows through it.
Roles declare interfaces; the runtime fires a node when its inputs are ready. Hello, how are you?
I am fine, thank you. What is the weather like today? It is sunny and warm with a light breeze.
Omniflow serves multimodal pipelines: an encoder, a language model, and a speech synthesizer.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048. Punctuation! Questions? Quotes "like this" too.
"""

_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(out: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE on a small corpus; write tokenizer.json + tokenizer_config.json.

    Returns the vocabulary size actually reached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # it writes to stdout, where `serve --port 0` prints its URL
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return int(tok.get_vocab_size())


def make_tiny_model(
    out: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-init ``arch`` ("llama" | "qwen2" | "mistral") model with a tokenizer."""
    import torch
    import transformers as tf

    root = Path(out)
    vocab = train_tokenizer(root)
    eos = json.loads((root / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in eos}
    kwargs: dict[str, Any] = {
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["</s>"],
        **overrides,
    }
    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    if arch == "qwen2":  # random biases, so a loader that drops them fails the equivalence
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    save: dict[str, Any] = {}
    if max_shard_size is not None:
        save["max_shard_size"] = max_shard_size
    model.save_pretrained(root, **save)
    return root
