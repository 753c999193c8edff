"""Processes for the multi-process Params Pool tests (imported by spawned children)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

import omniflow as of
from omniflow.data.kv._slots import L2

LAYOUT = of.PageLayout(("l0", "l1"), {"k": (2, 8), "v": (2, 8)}, page_tokens=16, dtype="float16")
PAGES = 32


def keys() -> list[str]:
    return of.chain_hashes([list(range(i * 16, i * 16 + 16)) for i in range(PAGES)])


def page_bytes(key: str) -> dict[tuple[str, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(int(key[:12], 16))
    return {
        (sub, sl): torch.randn((16, 2, 8), generator=gen).to(torch.float16)
        for sub, sl in LAYOUT.coords()
    }


async def publish_into_l2(pool: of.ParamsPool) -> None:
    """Publish the PAGES-page chain ``keys()`` from ``pool`` and push it down to its L2
    (shared memory, where other processes on the host read it in place)."""
    slots = await pool.alloc("turn-1", PAGES)
    for key, slot in zip(keys(), slots, strict=True):
        for (sub, sl), t in page_bytes(key).items():
            pool.view(slot, sub, sl).copy_(t)
    await pool.publish("chat", keys(), slots)
    await pool.release("turn-1")
    await pool.alloc("burst", PAGES)  # the chain moves down to L2
    await pool.release("burst")
    assert pool.stats()["pages"]["l2"] == PAGES


def provider(url: str, info: Any, b_read: Any, a_wrote: Any, done: Any) -> None:
    """Process A: publish a 32-page chain, move it to L2, then prove B reads A's memory."""
    asyncio.run(_provider(url, info, b_read, a_wrote, done))


async def _provider(url: str, info: Any, b_read: Any, a_wrote: Any, done: Any) -> None:
    pool = of.ParamsPool("kv", LAYOUT, {"l1": PAGES, "l2": 2 * PAGES}, metadata=url)
    try:
        await publish_into_l2(pool)
        info.put(pool.node)
        await asyncio.get_running_loop().run_in_executor(None, b_read.wait, 60)
        first = pool._core.lookup(keys()[0])
        assert first is not None and first.tier == L2
        assert pool._store is not None
        pool._store.store(L2, "l0", "k")[first.index].add_(1.0)  # visible to B iff shared
        a_wrote.set()
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 60)
    finally:
        await pool.aclose()


def doomed_provider(url: str, info: Any) -> None:
    """A provider that publishes the 32-page chain into its L2, says so, and waits to be killed
    (SIGKILL: it never leaves the metadata; a lease it renews would outlive the test)."""
    asyncio.run(_doomed_provider(url, info))


async def _doomed_provider(url: str, info: Any) -> None:
    pool = of.ParamsPool(
        "kv", LAYOUT, {"l1": PAGES, "l2": 2 * PAGES}, metadata=url, provider_ttl=600.0
    )
    await publish_into_l2(pool)
    assert pool._store is not None
    info.put((pool.node, pool._store.prefix, len(LAYOUT.coords())))
    await asyncio.sleep(3600)  # until killed
