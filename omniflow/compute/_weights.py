"""The tensors a Llama-family checkpoint holds, by name and shape, worked out from its config.

>>> from omniflow.compute._config import ModelConfig
>>> cfg = ModelConfig.from_dict({"model_type": "qwen2", "hidden_size": 64,
...     "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
...     "num_key_value_heads": 2, "vocab_size": 300})
>>> expected_tensors(cfg)["model.layers.0.self_attn.k_proj.bias"]
(32,)

One table serves the loader (every tensor of a checkpoint is in it, or the checkpoint is refused
naming the tensor; every tensor in it is in the checkpoint with its shape) and ``make_tiny_model``
(which writes exactly these), so what is loaded and what is computed cannot drift apart.
"""

from __future__ import annotations

import re

import torch

from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import ModelLoadError

__all__ = ["check_tensors", "expected_tensors"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
#: Buffers some checkpoints carry that hold what the config already says (checked, not used).
_INV_FREQ = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``cfg``'s architecture reads (lm_head only when untied)."""
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        linears = {
            a + "q_proj": ((q, hidden), cfg.attention_bias),
            a + "k_proj": ((kv, hidden), cfg.attention_bias),
            a + "v_proj": ((kv, hidden), cfg.attention_bias),
            a + "o_proj": ((hidden, q), cfg.o_bias),
            m + "gate_proj": ((inter, hidden), cfg.mlp_bias),
            m + "up_proj": ((inter, hidden), cfg.mlp_bias),
            m + "down_proj": ((hidden, inter), cfg.mlp_bias),
        }
        for name, (shape, bias) in linears.items():
            out[name + ".weight"] = shape
            if bias:
                out[name + ".bias"] = shape[:1]
        out[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
    out["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, hidden)
    return out


def check_tensors(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    inv_freqs: list[torch.Tensor],
    source: str,
) -> None:
    """Refuse ``weights`` unless they are exactly ``expected_tensors(cfg)`` with those shapes.

    Tolerated besides, because they only repeat the config: ``lm_head.weight`` equal to the
    embedding when tied, and ``rotary_emb.inv_freq`` buffers (older transformers saved them;
    its loader skips them) equal to one of ``inv_freqs``, the frequencies the config gives
    with and without its scaling (older scaled classes kept the unscaled ones)."""
    want = expected_tensors(cfg)
    unexpected: list[tuple[str, str]] = []
    for name, tensor in weights.items():
        if name in want:
            continue
        why = _unexpected(name, tensor, weights, cfg, inv_freqs)
        if why is not None:
            unexpected.append((name, why))
    if unexpected:
        name, why = unexpected[0]
        rest = unexpected[1:]
        more = f" (and {len(rest)} more: {_names(rest)})" if rest else ""
        raise ModelLoadError(
            f"{source}: unexpected tensor {name}: {why}{more}; TorchEngine never drops a weight, "
            "so this checkpoint is refused",
            path=source,
            tensor=name,
        )
    missing = [n for n in want if n not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if missing[1:] else ""
        raise ModelLoadError(
            f"{source}: tensor {missing[0]!r} is missing from the safetensors files{more}; "
            f"the checkpoint does not match its config ({_summary(cfg)})",
            path=source,
            tensor=missing[0],
        )
    for name, shape in want.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {got} but config.json needs {shape} "
                f"({_summary(cfg)})",
                path=source,
                tensor=name,
            )


def _unexpected(
    name: str,
    tensor: torch.Tensor,
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    inv_freqs: list[torch.Tensor],
) -> str | None:
    """Why ``name`` cannot be honoured, or None when it only repeats the config."""
    if name == "lm_head.weight":  # only unexpected when tied
        embed = weights.get("model.embed_tokens.weight")
        if embed is not None and torch.equal(tensor, embed):
            return None
        return (
            "config.json has tie_word_embeddings=true (the output head is the embedding "
            "matrix) but this head differs from model.embed_tokens.weight; set "
            "tie_word_embeddings to false to use it"
        )
    if _INV_FREQ.fullmatch(name):
        saved = tensor.float().cpu()
        if any(
            saved.shape == f.shape and torch.allclose(saved, f, rtol=1e-2, atol=0.0)
            for f in inv_freqs
        ):
            return None
        return (
            "these RoPE frequencies are not the ones config.json's rope settings give "
            f"(rope_theta={cfg.rope_theta}, rope_type={cfg.rope_type!r})"
        )
    layer = _LAYER.match(name)
    if layer is not None and int(layer.group(1)) >= cfg.num_layers:
        return f"config.json has num_hidden_layers={cfg.num_layers}"
    if name.endswith(".bias"):
        return _bias_reason(name, cfg)
    return f"{cfg.arch} ({_summary(cfg)}) has no such tensor"


def _bias_reason(name: str, cfg: ModelConfig) -> str:
    arch = cfg.arch
    if ".self_attn." in name:
        if cfg.model_type == "llama":
            return "config.json has attention_bias=false (set it if the model was trained with it)"
        if cfg.model_type == "qwen2":
            return f"{arch} attention has no o_proj bias (transformers' Qwen2Attention)"
        return f"{arch} attention has no biases (it does not read attention_bias)"
    if ".mlp." in name and cfg.model_type == "llama":
        return "config.json has mlp_bias=false (set it if the model was trained with it)"
    if ".mlp." in name:
        return f"the {arch} MLP has no biases (it does not read mlp_bias)"
    return f"{arch} has no such bias"


def _names(items: list[tuple[str, str]]) -> str:
    names = [n for n, _ in items[:5]]
    return ", ".join(names) + (", ..." if len(items) > 5 else "")


def _summary(cfg: ModelConfig) -> str:
    return (
        f"{cfg.model_type}, {cfg.num_layers} layers, hidden_size={cfg.hidden_size}, "
        f"heads={cfg.num_heads}/{cfg.num_kv_heads}, head_dim={cfg.head_dim}"
    )
