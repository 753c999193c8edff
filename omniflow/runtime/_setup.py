"""A role's ``setup()``, as both placements await it (the front in-process, a worker), and what
a worker tells its front when it does not start.

>>> facts = worker_colocation(["llm"], "deploy:slot0")          # doctest: +SKIP
>>> await setup_role("llm", role.setup, facts)                   # doctest: +SKIP

A worker that raises writes why to the file its front reads (``record_start_error``); one that
dies without a word (killed, ``os._exit``) leaves there what it said last it was doing
(``Colocation.last_words``: a co-located pool's barrier says "role 'dit' died during the
barrier of pool 't2i-kv'" while that role loads its weights), so the front's ``StartError``
names the role and the pool either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

from omniflow._exceptions import StartError
from omniflow.dsl._context import Colocation
from omniflow.runtime._launch import START_ERROR_ENV

__all__ = ["record_start_error", "setup_role", "worker_colocation"]


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


def _write(path: str, text: str) -> None:
    with contextlib.suppress(OSError), open(path, "w") as f:
        f.write(text)


def record_start_error(exc: BaseException) -> None:
    """Tell the front that spawned this worker why it did not start (it reads the file)."""
    path = os.environ.get(START_ERROR_ENV)
    if path:
        _write(path, str(exc))


def worker_colocation(roles: Iterable[str], key: str) -> Colocation:
    """A worker's co-location facts; what a role leaves as its last words (``last_words``) goes
    to the file its front reads when the process dies before it is ready (a kill, ``os._exit``:
    nothing else could say why)."""
    path = os.environ.get(START_ERROR_ENV)

    def last_words(text: str | None) -> None:
        if path:
            _write(path, text or "")

    return Colocation(frozenset(roles), key, last_words=last_words if path else None)
