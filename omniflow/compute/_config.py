"""The model's shape, read from a Hugging Face ``config.json`` (Llama, Qwen2, Mistral).

>>> cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
...     "vocab_size": 300})
>>> (cfg.head_dim, cfg.num_kv_heads, cfg.rope_type)
(16, 2, 'default')

Every field is read as transformers' class for that ``model_type`` reads it (its defaults, and
which flags it honours: ``LlamaAttention`` gives q/k/v/o a bias when ``attention_bias``,
``Qwen2Attention`` always gives q/k/v one and o none, Mistral none), so a checkpoint computes what
it computes there. A value TorchEngine cannot reproduce exactly is refused by field name.

Both spellings of RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (checkpoints written
by transformers 4.x, i.e. every checkpoint on the hub) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.compute._errors import ModelLoadError

__all__ = ["ROPE_TYPES", "SUPPORTED_MODEL_TYPES", "ModelConfig", "read_config_json"]

#: model_type -> the architecture's name in messages (transformers' class prefix).
SUPPORTED_MODEL_TYPES: dict[str, str] = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}

#: model_type -> ``max_position_embeddings`` when config.json leaves it out (transformers').
_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}

#: The RoPE scalings computed exactly as transformers computes them.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: RoPE scalings transformers knows that TorchEngine refuses, and why.
_REFUSED_ROPE = {
    "dynamic": "its frequencies change with the length of each forward pass, so pages cached "
    "at one length would be wrong at another",
    "longrope": "it switches frequency sets with the sequence's length, so pages cached "
    "before the switch would be wrong after it",
    "proportional": "it belongs to another architecture (Gemma)",
}


def read_config_json(model_dir: str | Path) -> Any:
    """The parsed ``config.json`` of a checkpoint directory (the one place that reads it)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(
            f"model directory {str(model_dir)!r} has no config.json; point the engine at a "
            "Hugging Face-format directory (config.json, *.safetensors; tokenizer.json for an "
            "LLM)",
            path=str(model_dir),
        ) from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}", path=str(path)) from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", path=str(path)) from exc


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the forward pass needs to know about a Llama-family checkpoint."""

    model_type: str  #: "llama" | "mistral" | "qwen2"
    hidden_size: int  #: width of the residual stream
    intermediate_size: int  #: width of the SwiGLU MLP
    num_layers: int  #: decoder layers (one pool sub_name each)
    num_heads: int  #: query heads
    num_kv_heads: int  #: key/value heads (GQA when fewer than num_heads)
    head_dim: int  #: per-head width
    vocab_size: int  #: rows of the embedding and of lm_head
    rms_norm_eps: float  #: RMSNorm epsilon
    rope_theta: float  #: RoPE base
    rope_type: str  #: one of ``ROPE_TYPES``
    #: the scaling's parameters, complete (defaults filled in; yarn's ``truncate`` as 0/1 and
    #: its cos/sin scale as ``attention_factor``)
    rope_params: dict[str, float] = field(default_factory=dict)
    attention_bias: bool = False  #: q/k/v projections carry a bias (Qwen2; Llama's flag)
    o_bias: bool = False  #: the output projection carries a bias (Llama's ``attention_bias``)
    mlp_bias: bool = False  #: gate/up/down projections carry a bias (Llama's ``mlp_bias``)
    tie_word_embeddings: bool = False  #: lm_head shares the embedding matrix
    sliding_window: int | None = None  #: attend to at most this many previous positions
    #: per layer whether it slides (None: every layer does when ``sliding_window`` is set)
    sliding_layers: tuple[bool, ...] | None = None
    max_position_embeddings: int = 4096  #: trained context length
    eos_token_ids: tuple[int, ...] = ()  #: generation stops on any of these
    bos_token_id: int | None = None  #: prepended by tokenizers that add special tokens
    torch_dtype: str | None = None  #: the dtype the checkpoint was saved in

    @property
    def arch(self) -> str:
        """The architecture's name in messages ("Llama", "Qwen2", "Mistral")."""
        return SUPPORTED_MODEL_TYPES[self.model_type]

    def window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends to everything)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra EOS ids)."""
        path = Path(model_dir) / "config.json"
        raw = read_config_json(model_dir)
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.exists():
            gen = json.loads(gen_path.read_text())
            if "eos_token_id" in gen:
                raw = {**raw, "_generation_eos": gen["eos_token_id"]}
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Validate and normalise a parsed ``config.json``."""
        model_type = str(raw.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported by TorchEngine; "
                f"supported: {sorted(SUPPORTED_MODEL_TYPES)}",
                path=source,
                field="model_type",
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            max_pos = int(raw.get("max_position_embeddings") or _MAX_POSITIONS[model_type])
            theta, rope_type, rope_params = _rope_settings(raw, max_pos, source)
            act = raw.get("hidden_act", "silu")
            if act not in ("silu", "swish"):
                raise _refuse(
                    source,
                    "hidden_act",
                    f"hidden_act {act!r} is not supported (TorchEngine's MLP is SwiGLU: silu)",
                )
            window, sliding = _sliding(model_type, raw, layers, source)
            # which flags each architecture reads is transformers' (module docstring)
            llama = model_type == "llama"
            qkv_bias = bool(raw.get("attention_bias", False)) if llama else model_type == "qwen2"
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_type=rope_type,
                rope_params=rope_params,
                attention_bias=qkv_bias,
                o_bias=llama and bool(raw.get("attention_bias", False)),
                mlp_bias=llama and bool(raw.get("mlp_bias", False)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                sliding_window=window,
                sliding_layers=sliding,
                max_position_embeddings=max_pos,
                eos_token_ids=_eos_ids(raw.get("eos_token_id"), raw.get("_generation_eos")),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except KeyError as exc:
            raise ModelLoadError(
                f"{source}: missing field {exc.args[0]!r}; is this a Llama-family config?",
                path=source,
                field=str(exc.args[0]),
            ) from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: {exc}", path=source) from exc


def _refuse(source: str, name: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: {why}", path=source, field=name)


def _sliding(
    model_type: str, raw: dict[str, Any], layers: int, source: str
) -> tuple[int | None, tuple[bool, ...] | None]:
    """The window and which layers slide: Mistral slides every layer (4096 unless told),
    Qwen2 only with ``use_sliding_window``, the layers from ``max_window_layers`` on (or as
    ``layer_types`` says), Llama never (it does not read the field)."""
    if model_type == "mistral":
        window = raw.get("sliding_window", 4096)
        return (int(window) if window else None), None
    if model_type != "qwen2" or not raw.get("use_sliding_window", False):
        return None, None
    window = raw.get("sliding_window", 4096)
    if not window:
        return None, None
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    kinds = {"sliding_attention", "full_attention"}
    if not isinstance(types, list) or len(types) != layers or not set(types) <= kinds:
        raise _refuse(
            source,
            "layer_types",
            f"layer_types {types!r} is not one of {sorted(kinds)} per layer ({layers} layers)",
        )
    return int(window), tuple(t == "sliding_attention" for t in types)


def _rope_settings(
    raw: dict[str, Any], max_pos: int, source: str
) -> tuple[float, str, dict[str, float]]:
    """RoPE base, type and parameters, as transformers' ``standardize_rope_params`` and
    ``ROPE_INIT_FUNCTIONS`` read them (``rope_scaling`` wins over ``rope_parameters``)."""
    name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params: dict[str, Any] = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = str(params.pop("rope_type", None) or params.pop("type", None) or "default")
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        why = _REFUSED_ROPE.get(rope_type, "transformers' Llama does not know it")
        raise _refuse(
            source,
            name,
            f"RoPE scaling {rope_type!r} ({name}.rope_type) is not supported: {why}; "
            f"supported: {', '.join(ROPE_TYPES)}",
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise _refuse(
            source,
            "partial_rotary_factor",
            f"partial_rotary_factor {partial} is not supported: the Llama family rotates the "
            "whole head (transformers' Llama cannot run it either)",
        )
    if rope_type in ("llama3", "yarn"):  # transformers: a top-level value wins, then max_pos
        top = raw.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = (
            top if top is not None else params.get("original_max_position_embeddings", max_pos)
        )
    needed = {
        "default": (),
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "yarn": ("factor",),
    }[rope_type]
    missing = [k for k in needed if k not in params]
    if missing:
        raise _refuse(source, name, f"RoPE scaling {rope_type!r} lacks {missing} in {name}")
    if rope_type == "yarn":
        return theta, rope_type, _yarn(params, max_pos)
    keep = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(rope_type, ())
    return theta, rope_type, {k: float(params[k]) for k in keep}


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _yarn(params: dict[str, Any], max_pos: int) -> dict[str, float]:
    """YaRN's parameters with transformers' defaults and its cos/sin scale worked out."""
    original = float(params["original_max_position_embeddings"])
    factor = params["factor"]
    if factor is None:  # transformers: the ratio of the two context lengths
        factor = max_pos / original
    factor = float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _mscale(factor, mscale) / _mscale(factor, mscale_all)
        else:
            attention = _mscale(factor)
    return {
        "factor": factor,
        "original_max_position_embeddings": original,
        "attention_factor": float(attention),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": 1.0 if params.get("truncate", True) else 0.0,
    }


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return tuple(ids)
