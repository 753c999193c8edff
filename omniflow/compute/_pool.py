"""Where the engine meets the ``ParamsPool`` (CONTRACT §7): layout, lookup, page hashing.

>>> # pool = pool_for(ModelConfig.from_dir(d), "kv", capacity={"l1": 512})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import EngineError
from omniflow.compute._kv import PagePool, kv_slices, layer_names

if TYPE_CHECKING:
    from omniflow.compute._base import EngineBase

__all__ = ["chain_hashes", "layout_for", "pool_for", "resolve_pool"]


def chain_hashes(pages: Sequence[list[int] | bytes]) -> list[str]:
    """One hash per page, each covering its predecessor (the pool's ``of.chain_hashes``)."""
    from omniflow.data.kv import chain_hashes as chain

    return chain(pages)


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


async def resolve_pool(engine: EngineBase[Any, Any, Any], model: Any) -> PagePool:
    """The engine's pool: the object given, the graph's pool of that name, or a private one.

    ``model`` is any of our models: ``cfg`` (``num_layers``, ``num_kv_heads``, ``head_dim``),
    ``device`` and ``dtype`` say which layout its KV pages need."""
    arg: Any = engine._pool_arg
    kind = type(engine).__name__
    if isinstance(arg, str):
        from omniflow.dsl import context  # lazy: compute imports without a role running

        try:
            pools = context().pools
        except Exception as exc:
            raise EngineError(
                f"{kind}(pool={arg!r}) looks the pool up in the role's context; start the "
                "engine from the role's setup() or pass the ParamsPool object itself"
            ) from exc
        if arg not in pools:
            raise EngineError(
                f"no pool named {arg!r} in this graph (have {sorted(pools)}); declare "
                f"TorchEngine.pool(model_dir, {arg!r}) in the graph's pools"
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
    if names != want_names or slices != want_slices or (dtype and dtype != model_dtype):
        raise EngineError(
            f"pool {getattr(pool, 'name', '?')!r} has layout {names}/{slices}/{dtype} but the "
            f"model needs {want_names}/{want_slices}/{model_dtype}; build it with "
            "TorchEngine.pool(model_dir, name, dtype=...)"
        )
