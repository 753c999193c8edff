"""The model's shape, read from a Hugging Face ``config.json`` (Llama, Qwen2, Mistral).

>>> cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
...     "vocab_size": 300})
>>> (cfg.head_dim, cfg.num_kv_heads, cfg.rope_type)
(16, 2, 'default')

Both spellings of RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (checkpoints written
by transformers 4.x, i.e. every checkpoint on the hub) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.compute._errors import ModelLoadError

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "read_config_json"]

#: model_type -> whether q/k/v projections carry a bias by default.
SUPPORTED_MODEL_TYPES: dict[str, bool] = {"llama": False, "mistral": False, "qwen2": True}


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
    rope_type: str  #: "default" | "linear" | "llama3"
    rope_params: dict[str, float] = field(default_factory=dict)  #: the scaling's parameters
    attention_bias: bool = False  #: q/k/v projections carry a bias (Qwen2)
    mlp_bias: bool = False  #: MLP projections carry a bias
    tie_word_embeddings: bool = False  #: lm_head shares the embedding matrix
    sliding_window: int | None = None  #: attend to at most this many previous positions
    max_position_embeddings: int = 4096  #: trained context length
    eos_token_ids: tuple[int, ...] = ()  #: generation stops on any of these
    bos_token_id: int | None = None  #: prepended by tokenizers that add special tokens
    torch_dtype: str | None = None  #: the dtype the checkpoint was saved in

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
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            theta, rope_type, rope_params = _rope_settings(raw)
            window = raw.get("sliding_window")
            if model_type == "qwen2" and not raw.get("use_sliding_window", False):
                window = None
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_type=rope_type,
                rope_params=rope_params,
                attention_bias=bool(raw.get("attention_bias", SUPPORTED_MODEL_TYPES[model_type])),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                sliding_window=int(window) if window else None,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                eos_token_ids=_eos_ids(raw.get("eos_token_id"), raw.get("_generation_eos")),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except KeyError as exc:
            raise ModelLoadError(
                f"{source}: missing field {exc.args[0]!r}; is this a Llama-family config?",
                path=source,
            ) from exc


def _rope_settings(raw: dict[str, Any]) -> tuple[float, str, dict[str, float]]:
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelLoadError(
            f"config.json: RoPE scaling {rope_type!r} is not supported; "
            "supported: default, linear, llama3",
            path="config.json",
        )
    needed = {"default": (), "linear": ("factor",), "llama3": _LLAMA3_KEYS}[rope_type]
    missing = [k for k in needed if k not in params and k != "original_max_position_embeddings"]
    if missing:
        raise ModelLoadError(
            f"config.json: RoPE scaling {rope_type!r} lacks {missing}", path="config.json"
        )
    if rope_type == "llama3" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw.get("max_position_embeddings", 8192)
    kept = {k: float(v) for k, v in params.items() if isinstance(v, int | float)}
    return theta, rope_type, kept


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return tuple(ids)
