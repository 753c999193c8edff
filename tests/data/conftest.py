"""Fixtures for the data-plane tests: pools (buffer pools, Params Pools) that are validated and
closed, and a leak check."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import omniflow as of
from omniflow.data import SharedBufferPool, _shm


@pytest.fixture(autouse=True)
def no_leaked_segments(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every shared-memory segment a test creates must be gone from /dev/shm when it ends."""
    created: list[str] = []
    create = _shm.Segment.create.__func__  # type: ignore[attr-defined]

    def recording_create(cls: type[_shm.Segment], name: str, size: int) -> _shm.Segment:
        created.append(name)
        return create(cls, name, size)  # type: ignore[no-any-return]

    monkeypatch.setattr(_shm.Segment, "create", classmethod(recording_create))
    yield created
    leaked = [name for name in created if os.path.exists(f"/dev/shm/{name}")]
    assert not leaked, f"shared-memory segments left behind: {leaked}"


@pytest.fixture
def make_pool() -> Iterator[Callable[..., SharedBufferPool]]:
    """``make_pool(capacity, chunk_size=...)``: pools validated at teardown, then closed."""
    pools: list[SharedBufferPool] = []

    def make(capacity: int, **kwargs: Any) -> SharedBufferPool:
        pool = SharedBufferPool(capacity, **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        if not pool.closed:
            pool.validate()
        pool.close()


@pytest.fixture
async def params_pools() -> AsyncIterator[Callable[..., of.ParamsPool]]:
    """``params_pools(layout=..., name="kv", **kwargs)``: ParamsPools validated at teardown
    (those still open), then closed. Test files bind their layout and capacity (``make``)."""
    pools: list[of.ParamsPool] = []

    def make(*, layout: of.PageLayout, name: str = "kv", **kwargs: Any) -> of.ParamsPool:
        pool = of.ParamsPool(name, layout, **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        if not pool.closed and pool._store is not None:
            pool.validate()
        await pool.aclose()
