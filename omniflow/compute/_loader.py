"""Load a Hugging Face-format checkpoint: ``config.json`` and ``*.safetensors`` (sharded too).

>>> # cfg, model = load_model("path/to/model", device="auto", dtype="auto")

Sharded checkpoints are read through ``model.safetensors.index.json``; single-file ones from
``model.safetensors``. Tied embeddings (no ``lm_head.weight``) share the embedding matrix. Tensors
are read one at a time and copied straight to the target device and dtype: a private load holds
its own copy, never a view of the file's page cache (``share``: the node's one copy instead).
Every tensor is used or the checkpoint is refused naming it (``_weights.check_tensors``): a
weight is never dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import ModelLoadError
from omniflow.compute._files import shard_files
from omniflow.compute._model import LlamaModel
from omniflow.compute._rope import inv_frequencies
from omniflow.compute._weights import check_tensors

logger = logging.getLogger("omniflow.compute")

#: Devices whose "weights stay private here" was already logged (once per process and device).
_PRIVATE_LOGGED: set[str] = set()

__all__ = [
    "checkpoint_mismatch",
    "load_checkpoint",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "shares_weights",
]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is cuda when available, else cpu."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class _SavedDtype(Protocol):
    @property
    def torch_dtype(self) -> str | None: ...


def resolve_dtype(dtype: str | torch.dtype, cfg: _SavedDtype, device: torch.device) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on cuda, float32 on cpu (half matmuls are slow there);
    ``cfg`` is any config with a ``torch_dtype`` (the LLM's ``ModelConfig``, ``DitConfig``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = cfg.torch_dtype or "bfloat16"
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_weights(
    model_dir: Path, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, on ``device`` in ``dtype``."""
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in shard_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    # copy=True: a CPU tensor of the file's dtype would otherwise stay a view
                    # of the file's mmap (page cache every process on the node shares), not
                    # this process's own copy, which is what a private load promises.
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype, copy=True)
        except (OSError, ValueError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}", path=str(path)) from exc
    return weights


def load_checkpoint(
    root: Path,
    cfg: _SavedDtype,
    device: str | torch.device,
    dtype: str | torch.dtype,
    *,
    share: bool = False,
) -> tuple[torch.device, dict[str, torch.Tensor]]:
    """The resolved device and every tensor of the checkpoint at ``root`` on it, in the
    resolved dtype (``resolve_device``, ``resolve_dtype``). ``share`` on the CPU: bound to the
    node's one copy of this checkpoint in this dtype (``_shared.load_shared_weights``); on a GPU
    weights stay private (sharing them needs CUDA IPC, not implemented), said once in the log
    (``shares_weights``)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, cfg, dev)
    if shares_weights(dev, share, root):
        from omniflow.compute._shared import load_shared_weights

        return dev, load_shared_weights(root, dt)
    return dev, load_weights(root, dev, dt)


def shares_weights(dev: torch.device, share: bool, root: Path) -> bool:
    """Whether a load asked to ``share`` binds to the node's one copy: on the CPU only. On any
    other device the engine holds a private copy; since ``share_weights`` is on by default (a
    GPU engine did not ask for anything unusual), that is logged at INFO, once per process and
    device, rather than refused."""
    if not share or dev.type == "cpu":
        return share
    if str(dev) not in _PRIVATE_LOGGED:
        _PRIVATE_LOGGED.add(str(dev))
        logger.info(
            "%s: weight sharing across processes (share_weights=True) is CPU-only; this engine "
            "holds a private copy of its weights on %s (sharing GPU weights would need CUDA "
            "IPC, not implemented; pass share_weights=False to silence this)",
            root, dev,
        )  # fmt: skip
    return False


def checkpoint_mismatch(root: Path, what: str, config: str) -> ModelLoadError:
    """The error for a checkpoint whose tensors do not fit its config (``what`` is missing;
    ``config`` sums the config up)."""
    return ModelLoadError(
        f"{root}: {what}; the checkpoint does not match its config ({config})", path=str(root)
    )


def load_model(
    model_dir: str | Path,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    share: bool = False,
) -> LlamaModel:
    """Read config and weights of ``model_dir`` into a ready ``LlamaModel`` (``share``: the
    node's one copy of the weights, see ``load_checkpoint``)."""
    root = Path(model_dir)
    cfg = ModelConfig.from_dir(root)
    dev, weights = load_checkpoint(root, cfg, device, dtype, share=share)
    inv_freqs = [
        inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_params),
        inv_frequencies(cfg.head_dim, cfg.rope_theta, "default", {}),
    ]
    check_tensors(weights, cfg, inv_freqs, str(root))
    return LlamaModel(cfg, weights, dev)
