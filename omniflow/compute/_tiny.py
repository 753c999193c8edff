"""A tiny random-init Llama with a locally trained tokenizer, for tests, demos and benchmarks.

>>> # path = make_tiny_model("/tmp/tiny", arch="llama")

No model hub is needed: the weights are random (its words are noise) but the directory has the
exact layout of a real checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template), so the real loading code runs on it unchanged. It is
written with what ``omniflow[compute]`` installs (torch, tokenizers; the safetensors files by
``_bytes.save_safetensors``): neither transformers nor numpy is needed. Every tensor is
random, norms and biases too (not left at their init constants 1 and 0), so a loader that
dropped or misplaced one would compute other tokens than transformers.
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
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-init ``arch`` ("llama" | "qwen2" | "mistral") model with a tokenizer.

    ``overrides`` are further ``config.json`` fields (``attention_bias=True``, ``head_dim=32``,
    ``rope_scaling={...}``, ...); the tensors written are the ones that config reads.
    ``max_shard_size`` ("40KB", "2MiB" or bytes) splits the weights into shards with a
    ``model.safetensors.index.json``, as ``save_pretrained`` does."""
    import torch

    from omniflow.compute._config import SUPPORTED_MODEL_TYPES, ModelConfig
    from omniflow.compute._weights import expected_tensors

    if arch not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"arch {arch!r}: one of {sorted(SUPPORTED_MODEL_TYPES)}")
    root = Path(out)
    vocab = train_tokenizer(root)
    eos = json.loads((root / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in eos}
    config: dict[str, Any] = {
        "architectures": [f"{SUPPORTED_MODEL_TYPES[arch]}ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["</s>"],
        "torch_dtype": "float32",
        **overrides,
    }
    cfg = ModelConfig.from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensors(cfg).items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * noise  # RMSNorm gains around 1
        elif name.endswith(".bias"):
            tensors[name] = 0.2 * noise
        else:
            tensors[name] = 0.02 * noise  # transformers' initializer_range
    (root / "config.json").write_text(json.dumps(config, indent=2))
    _save(root, tensors, None if max_shard_size is None else _bytes(max_shard_size))
    return root


def _save(root: Path, tensors: dict[str, Any], shard_bytes: int | None) -> None:
    """``model.safetensors``, or shards of at most ``shard_bytes`` and their index."""
    from omniflow.compute._bytes import save_safetensors

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes is not None and shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_safetensors(shards[0], root / "model.safetensors", meta)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, root / file, meta)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def _bytes(size: str | int) -> int:
    """``"40KB"`` -> 40000 (``save_pretrained``'s spelling: KB is 10**3, KiB 2**10)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, scale in _UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)
