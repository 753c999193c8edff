"""Where the engine meets the ``ParamsPool`` (docs/contract.md §7): layout, lookup, page hashing.

>>> # pool = pool_for(ModelConfig.from_dir(d), "kv", capacity={"l1": 512})

A pool and its engine agree on layout, dtype and device: ``placement`` resolves ``"auto"`` for
``TorchEngine.pool`` exactly as the engine resolves it when it loads (``resolve_device``,
``resolve_dtype``), and ``resolve_pool`` refuses a pool that differs in any of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from omniflow._exceptions import OmniflowError
from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import EngineError
from omniflow.compute._kv import PagePool, kv_slices, layer_names
from omniflow.compute._loader import resolve_device, resolve_dtype

__all__ = ["chain_hashes", "layout_for", "placement", "pool_for", "resolve_pool", "same_device"]


def chain_hashes(pages: Sequence[list[int] | bytes]) -> list[str]:
    """One hash per page, each covering its predecessor (the pool's ``of.chain_hashes``)."""
    from omniflow.data.kv import chain_hashes as chain

    return chain(pages)


def placement(
    cfg: ModelConfig, device: str | torch.device, dtype: str | torch.dtype
) -> tuple[torch.device, str]:
    """The device and dtype name the engine would resolve ``device``/``dtype`` to for ``cfg``
    (``"auto"``: cuda when present, there the checkpoint's dtype; cpu and float32 otherwise)."""
    dev = resolve_device(device)
    return dev, str(resolve_dtype(dtype, cfg, dev)).removeprefix("torch.")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (a bare "cuda" is the current cuda device)."""
    return _indexed(a) == _indexed(b)


def _indexed(device: torch.device) -> torch.device:
    index: int | None = device.index  # None for a bare "cuda" (torch's stubs say int)
    if device.type != "cuda" or index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)


def pool_for(
    cfg: ModelConfig,
    name: str,
    *,
    capacity: dict[str, int] | None = None,
    page_tokens: int = 16,
    dtype: str = "float32",
    **kwargs: Any,
) -> Any:
    """A ``ParamsPool`` laid out for ``cfg``: one sub_name per layer, slices ``k`` and ``v``."""
    from omniflow.data.kv import ParamsPool

    layout = layout_for(cfg, page_tokens=page_tokens, dtype=dtype)
    return ParamsPool(name, layout, capacity or {"l1": 4096, "l2": 0, "l3": 0}, **kwargs)


def layout_for(cfg: ModelConfig, *, page_tokens: int = 16, dtype: str = "float32") -> Any:
    """The ``PageLayout`` of ``cfg``'s KV pages (e.g. for a co-located ``KvPoolBarrier``)."""
    from omniflow.data.kv import PageLayout

    return PageLayout(
        sub_names=layer_names(cfg.num_layers),
        slices=kv_slices(cfg),
        page_tokens=page_tokens,
        dtype=dtype,
    )


class PoolUser(Protocol):
    """What ``resolve_pool`` reads of an engine (``EngineBase``)."""

    #: A ParamsPool, the name of the graph's pool, or None (a private pool).
    _pool_arg: Any
    #: The private pool's size and page size.
    pool_pages: int
    page_tokens: int
    #: Set when the engine made (and so owns) its pool.
    _own_pool: bool


async def resolve_pool(engine: PoolUser, model: Any) -> PagePool:
    """The engine's pool: the object given, the graph's pool of that name, or a private one.

    ``model`` is any of our models: ``cfg`` (``num_layers``, ``num_kv_heads``, ``head_dim``),
    ``device`` and ``dtype`` say which layout its KV pages need."""
    arg: Any = engine._pool_arg
    kind = type(engine).__name__
    if isinstance(arg, str):
        from omniflow.dsl._context import role_pools  # lazy: compute imports without a role

        try:
            pools = role_pools()
        except Exception as exc:
            raise EngineError(
                f"{kind}(pool={arg!r}) looks the pool up among the role's pools; start the "
                "engine from the role's setup() or a method, or pass the ParamsPool itself"
            ) from exc
        if arg not in pools:
            raise EngineError(
                f"{kind}(pool={arg!r}): no pool named {arg!r} in the role's graphs (have "
                f"{sorted(pools)}); declare {kind}.pool(model_dir, {arg!r}) in the graph's pools"
            )
        arg = pools[arg]
    if arg is None:
        dtype = str(model.dtype).removeprefix("torch.")
        arg = pool_for(
            model.cfg,
            "engine-kv",
            capacity={"l1": engine.pool_pages, "l2": 0, "l3": 0},
            page_tokens=engine.page_tokens,
            dtype=dtype,
            device=model.device,
        )
        engine._own_pool = True
    open_pool = getattr(arg, "open", None)
    if open_pool is not None:
        await open_pool()  # idempotent; the L1 arrays exist from here on
    _check_layout(arg, model)
    pool: PagePool = arg
    return pool


def _check_layout(pool: Any, model: Any) -> None:
    layout = getattr(pool, "layout", None)
    if layout is None:
        return
    want_names = layer_names(model.cfg.num_layers)
    want_slices = kv_slices(model.cfg)
    names = tuple(layout.sub_names)
    slices = {k: tuple(v) for k, v in dict(layout.slices).items()}
    dtype = str(getattr(layout, "dtype", "")).removeprefix("torch.")
    model_dtype = str(model.dtype).removeprefix("torch.")
    name = getattr(pool, "name", "?")
    if names != want_names or slices != want_slices or (dtype and dtype != model_dtype):
        raise EngineError(
            f"pool {name!r} has layout {names}/{slices}/{dtype} but the "
            f"model needs {want_names}/{want_slices}/{model_dtype}; build it with "
            "TorchEngine.pool(model_dir, name, dtype=...)"
        )
    where = _pool_device(pool, want_names[0])
    if where is not None and not same_device(where, torch.device(model.device)):
        raise EngineError(
            f"pool {name!r} keeps its pages on {where} but the engine runs on "
            f"{torch.device(model.device)}: attention would read across devices; build the pool "
            f"with TorchEngine.pool(model_dir, {name!r}, device=...) on the engine's device, or "
            "start the engine with device= where the pool is"
        )


def _pool_device(pool: Any, sub_name: str) -> torch.device | None:
    """Where the pool's L1 pages live (None: a pool without local L1 arrays)."""
    storage = getattr(pool, "storage", None)
    if storage is None:
        return None
    try:
        store: torch.Tensor = storage(sub_name, "k")
    except OmniflowError:
        return None
    return store.device
