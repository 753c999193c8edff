"""A role's ``setup()``, as every placement awaits it (the front in-process, a worker).

>>> await setup_role("llm", role.setup, facts)                   # doctest: +SKIP
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from omniflow._exceptions import StartError

__all__ = ["setup_role"]


async def setup_role(name: str, setup: Any, colocation: Any = None) -> None:
    """Await a role's ``setup()``; a failure says which role (both placements use this).

    The role's ``pools`` are reachable while it runs (``omniflow.dsl._context.role_pools``), so
    an engine built with ``pool="name"`` and started here finds the graph's pool; so are this
    process's co-location facts (``colocation``: which roles it hosts, its group on the node),
    so a co-located pool's barrier knows which partners are in other processes."""
    from omniflow.dsl._context import _colocation, _setup_pools

    pools = getattr(getattr(setup, "__self__", None), "pools", None)
    token = _setup_pools.set(pools if pools is not None else MappingProxyType({}))
    ctoken = _colocation.set(colocation)
    try:
        await setup()
    except Exception as exc:
        raise StartError(
            f"role '{name}' setup() failed: {type(exc).__name__}: {exc}", roles=[name]
        ) from exc
    finally:
        _colocation.reset(ctoken)
        _setup_pools.reset(token)
