"""Processes of one node that take seats at one co-located pool's barrier (spawned by tests)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from omniflow.compute._colocate import KvPoolBarrier
from omniflow.data.kv import PageLayout, ParamsPool

LAYOUT = PageLayout(("l0",), {"k": (2, 4), "v": (2, 4)}, page_tokens=4, dtype="float32")


def member(group: str, name: str, pages: int, go: Any, out: Any, die: bool = False) -> None:
    """Arrive as ``name`` (as an engine does before loading), then either die or wait for
    ``go`` (the test orders who 'finished loading' first), propose, and report the pool."""

    async def run() -> None:
        from omniflow.dsl._context import Colocation, _colocation, _setup_pools

        pool = ParamsPool("kv", LAYOUT, {"l1": 1, "l2": 0, "l3": 0})
        _setup_pools.set({"kv": pool})  # the graph's pool, as in a worker's setup()
        _colocation.set(Colocation(frozenset({name}), group))  # partners: other processes
        barrier = KvPoolBarrier("kv", None, members=("a", "b"), timeout=120)
        barrier.arrive(name)
        if die:
            os._exit(3)  # dies while 'loading its weights'
        await asyncio.to_thread(go.wait)
        barrier.propose(name, pages)
        try:
            got = await barrier.wait(name)
            out.put((name, barrier.size, got.capacity["l1"], got.shared_l1))
        except Exception as exc:
            out.put((name, "error", str(exc)))
        finally:
            await barrier.leave(name)  # (an engine's stop() does this)

    asyncio.run(run())
