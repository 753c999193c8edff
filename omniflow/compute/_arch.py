"""Which engine runs a checkpoint: the architectures its ``config.json`` names, and the engine
classes registered for them.

>>> # engine_for_architecture(dit_dir)   # -> DiTEngine (its config names OmniflowDiT)
>>> # check_architecture(TorchEngine, dit_dir)   # ModelLoadError: run it with DiTEngine

Each ``EngineBase`` subclass registers the architectures it runs when it is defined; an engine
refuses at ``start()`` a checkpoint that another engine claims, naming that engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniflow.compute._config import read_config_json
from omniflow.compute._errors import ModelLoadError

__all__ = ["check_architecture", "engine_for_architecture", "read_architectures", "register"]

#: architecture name (config.json "architectures") -> the engine class that runs it
_ENGINES: dict[str, type[Any]] = {}


def register(cls: type[Any], architectures: frozenset[str]) -> None:
    """``cls`` runs checkpoints naming any of ``architectures``."""
    for arch in architectures:
        _ENGINES[arch] = cls


def read_architectures(model_dir: str | Path) -> tuple[str, ...]:
    """The ``architectures`` a checkpoint's ``config.json`` names (empty when it names none)."""
    raw = read_config_json(model_dir)
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    return tuple(a for a in archs or () if isinstance(a, str))


def engine_for_architecture(model_dir: str | Path) -> type[Any] | None:
    """The engine class that runs ``model_dir`` by its config's architecture, if one claims it."""
    for arch in read_architectures(model_dir):
        if arch in _ENGINES:
            return _ENGINES[arch]
    return None


def check_architecture(cls: type[Any], model_dir: Path) -> None:
    """Refuse a checkpoint another engine claims, naming that engine. Architectures nobody
    claims are left to the loader (``TorchEngine`` goes by ``model_type``, so old spellings
    such as ``LLaMAForCausalLM`` still load)."""
    archs = read_architectures(model_dir)
    other = engine_for_architecture(model_dir)
    if other is None or set(archs) & cls.architectures or issubclass(cls, other):
        return
    raise ModelLoadError(
        f"{model_dir / 'config.json'} names architectures {list(archs)}, which "
        f"{cls.__name__} does not run; run it with {other.__name__}",
        path=str(model_dir),
    )
