"""Provider liveness: a dead provider is a miss, never an error, and never a lock left held.

A pool registers under a lease it renews; the metadata forgets a node whose lease ran out (or
at once, when a pool proves it gone: its process or its shared memory vanished). A match that
meets a vanished provider counts the rest of the chain as missed, holds no lock, shuns that
provider for the chain, and waits for other nodes out of one budget per match.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import _kv_workers as workers
import pytest
import torch

import omniflow as of
from omniflow.data.kv import MemoryMetadata
from omniflow.data.kv._lease import Budget, Shunned

LAYOUT = of.PageLayout(("l0", "l1"), {"k": (2, 4), "v": (2, 4)}, page_tokens=4, dtype="float32")


class Clock:
    """A clock the test moves (leases and shunned entries read it, never the wall)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def content(key: str) -> dict[tuple[str, str], torch.Tensor]:
    """The bytes of the page with chain hash ``key`` (equal prefix, equal KV: as an engine)."""
    gen = torch.Generator().manual_seed(int(key[:12], 16))
    return {
        (sub, sl): torch.randn((LAYOUT.page_tokens, *LAYOUT.slice_shape(sl)), generator=gen)
        for sub, sl in LAYOUT.coords()
    }


def same(pool: of.ParamsPool, slot: int, key: str) -> bool:
    return all(torch.equal(pool.view(slot, s, c), t) for (s, c), t in content(key).items())


async def provide(pool: of.ParamsPool, session: str | None, keys: list[str]) -> None:
    """Compute (write) the pages of ``keys``, publish them, unpin them."""
    slots = await pool.alloc("compute", len(keys))
    for key, slot in zip(keys, slots, strict=True):
        for (sub, sl), t in content(key).items():
            pool.view(slot, sub, sl).copy_(t)
    await pool.publish(session, keys, slots)
    await pool.release("compute")


async def to_l2(pool: of.ParamsPool, n: int) -> None:
    await pool.alloc("burst", n)  # every unpinned page moves down to L2 (shared memory)
    await pool.release("burst")


async def crash(pool: of.ParamsPool) -> None:
    """``pool`` ends as a killed process's does: no leave, no more heartbeats, no pull
    server, its shared memory gone; the metadata still names it a provider."""
    beat, pool._heartbeat = pool._heartbeat, None
    if beat is not None:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
    if pool._server is not None:
        await pool._server.close()
        pool._server = None
    if pool._client is not None:
        pool._client.close()
        pool._client = None
    for att in pool._attached.values():
        att.close()
    pool._attached.clear()
    if pool._store is not None:
        pool._store.close()
        pool._store = None
    if isinstance(pool.metadata, str) and pool._meta is not None:
        await pool._meta.close()  # (its connections died with it)
    pool._closed = True


async def silence(pool: of.ParamsPool) -> None:
    """``pool`` on another host stops answering (its node is lost): pulls to it time out."""
    beat, pool._heartbeat = pool._heartbeat, None
    if beat is not None:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
    assert pool._server is not None
    await pool._server.close()
    pool._server = None


async def no_leftovers(pool: of.ParamsPool, meta: Any) -> None:
    """``pool.stats()`` and the metadata agree: nothing pinned, no lock, no run lock."""
    stats = pool.stats()
    assert stats["pinned"] == 0 and stats["owners"] == 0 and stats["inflight"] == 0, stats
    dump = await meta.dump(pool.name)
    assert dump["locks"] == {} and dump["runs"] == {}, dump
    pool.validate()
    if isinstance(meta, MemoryMetadata):
        meta.validate(pool.name)


@pytest.fixture
def make(params_pools: Callable[..., of.ParamsPool]) -> Callable[..., of.ParamsPool]:
    """Pools named "kv" on LAYOUT (``layout=``, ``name=``, ``capacity=`` override)."""
    return functools.partial(params_pools, layout=LAYOUT, capacity={"l1": 8, "l2": 16, "l3": 0})


@pytest.fixture(params=["memory", "redis"])  # (before ``make``: Redis outlives the pools)
def backend(request: pytest.FixtureRequest) -> Callable[[], Any]:
    """Metadata for pools: one MemoryMetadata shared by them, or a private Redis's URL."""
    if request.param == "memory":
        shared = MemoryMetadata()
        return lambda: shared
    url = request.getfixturevalue("redis").url
    return lambda: url


# -- the parts ----------------------------------------------------------------------------------


def test_a_shunned_provider_is_skipped_for_its_chain_until_a_lease_has_passed() -> None:
    clock = Clock()
    shunned = Shunned(30.0, limit=2, clock=clock)
    shunned.add("s:a", "n1")
    assert shunned.usable("s:a", {"n1": "1:0:4", "n2": "1:1:4"}) == {"n2": "1:1:4"}
    assert not shunned.blocked("s:b", "n1")  # another chain still asks it
    shunned.add("s:b", "n1")
    shunned.add("s:c", "n2")  # over the limit: the oldest entry goes
    assert not shunned.blocked("s:a", "n1") and len(shunned) == 2
    clock.now += 30.0
    assert not shunned.blocked("s:b", "n1") and not shunned.blocked("s:c", "n2")
    shunned.validate()


def test_a_budget_is_spent_by_time_or_by_a_wait_that_ran_out() -> None:
    clock = Clock()
    budget = Budget(5.0, clock=clock)
    assert budget.left() == 5.0
    clock.now += 2.0
    assert budget.left() == 3.0
    budget.spend()  # a pull timed out: it waited all that was left
    assert budget.left() == 0.0 and budget.spent
    late = Budget(1.0, clock=clock)
    clock.now += 1.0
    assert late.left() == 0.0 and late.spent


async def test_a_lease_that_runs_out_takes_the_providers_pages_out_of_every_chain(
    make: Any,
) -> None:
    clock = Clock()
    meta = MemoryMetadata(clock=clock)
    a = make(metadata=meta, host="node-a", provider_ttl=30.0)
    b = make(metadata=meta, host="node-b", provider_ttl=30.0)
    keys = of.chain_hashes([[i] for i in range(4)])
    await provide(a, "chat", keys)
    await provide(a, None, keys[:1])  # public too
    clock.now += 29.0
    assert await b.renew_lease()  # b renews, a does not
    clock.now += 1.0  # a's lease ran out
    m = await b.match("chat", keys, "r")
    assert m.pages == 0  # the match itself forgot a first: no provider past its lease
    dump = await meta.dump("kv")
    assert dump["providers"] == {} and dump["chains"] == {}
    assert await meta.nodes("kv", [a.node, b.node]) == {b.node: meta._pools["kv"].nodes[b.node]}
    await b.release("r")
    await no_leftovers(b, meta)
    # a was only stalled: its next renewal finds it forgotten and registers it again; its
    # pages had left every chain, so it provides none of them (they are computed again).
    assert not await a.renew_lease()
    assert a.stats()["providers"]["leases_lost"] == 1
    assert (await meta.dump("kv"))["providers"] == {}
    await provide(a, "chat", keys)
    assert (await b.match("chat", keys, "r2")).pages == 4
    await b.release("r2")
    await no_leftovers(b, meta)


async def test_a_stalled_provider_provides_again_the_pages_still_in_a_chain(make: Any) -> None:
    clock = Clock()
    meta = MemoryMetadata(clock=clock)
    a = make(metadata=meta, host="node-a")
    b = make(metadata=meta, host="node-b")
    keys = of.chain_hashes([[i] for i in range(3)])
    await provide(a, "chat", keys)
    m = await b.match("chat", keys, "r")  # b pulls them: a second provider of each
    assert m.pages == 3 and all(same(b, s, k) for s, k in zip(m.slots, keys, strict=True))
    await b.release("r")
    clock.now += 20.0
    assert await b.renew_lease()
    clock.now += 15.0  # a's lease ran out, b's did not
    assert await meta.sweep("kv") == [a.node]
    assert all(
        p == [b.node] for p in [sorted(v) for v in (await meta.dump("kv"))["providers"].values()]
    )  # type: ignore[attr-defined]
    assert not await a.renew_lease()
    providers = (await meta.dump("kv"))["providers"]
    assert {k: sorted(v) for k, v in providers.items()} == {  # type: ignore[attr-defined]
        k: sorted([a.node, b.node]) for k in keys
    }
    meta.validate("kv")


async def test_a_provider_whose_memory_vanished_is_a_miss_and_is_forgotten_at_once(
    make: Any,
) -> None:
    """Memory metadata, two pools on this host: the provider's L2 goes as a killed process's
    does. Every match recomputes, none raises, no lock is left; the first proves it gone."""
    meta = MemoryMetadata()
    a = make(metadata=meta, provider_ttl=600.0)
    b = make(metadata=meta)
    keys = of.chain_hashes([[i] for i in range(6)])
    await provide(a, "chat", keys)
    await to_l2(a, 8)
    assert a.stats()["pages"]["l2"] == 6
    await crash(a)
    for i in range(20):
        m = await b.match("chat", keys, f"turn-{i}")
        assert m.pages == 0
        await b.release(f"turn-{i}")
    stats = b.stats()
    assert stats["providers"]["proven_gone"] == 1 and stats["providers"]["vanished"] == 1
    assert stats["misses"] == 6  # the first match's; the chain then left the metadata
    assert stats["wire"]["pull_failures"] == 0  # nothing waited on
    dump = await meta.dump("kv")
    assert dump["providers"] == {} and dump["chains"] == {}
    assert await meta.nodes("kv", [a.node]) == {}
    await no_leftovers(b, meta)
    await provide(b, "chat", keys)  # the caller computes the pages again
    m = await b.match("chat", keys, "again")
    assert m.pages == 6 and all(same(b, s, k) for s, k in zip(m.slots, keys, strict=True))
    await b.release("again")
    await no_leftovers(b, meta)


async def test_a_vanished_provider_in_mid_chain_leaves_the_prefix_before_it(
    backend: Any, make: Any
) -> None:
    a = make(metadata=backend(), provider_ttl=600.0)
    c = make(metadata=backend(), host="node-c")
    b = make(metadata=backend())
    keys = of.chain_hashes([[i] for i in range(8)])
    await provide(c, "chat", keys[:3])  # c (alive, another node) holds the first 3
    await provide(a, "chat", keys[3:])  # a (this host, about to die) the next 5
    await to_l2(a, 8)
    await crash(a)
    m = await b.match("chat", keys, "turn")
    assert m.pages == 3 and all(same(b, s, k) for s, k in zip(m.slots, keys[:3], strict=True))
    assert b.stats()["providers"]["proven_gone"] == 1  # a's pages were asked for: gone
    assert b.stats()["misses"] == 8  # 3 pulled from c, then a's 5: all missed locally
    await b.release("turn")
    assert b._meta is not None
    await no_leftovers(b, b._meta)
    providers = (await b._meta.dump("kv"))["providers"]
    assert all(a.node not in p for p in providers.values())  # type: ignore[attr-defined]


async def test_a_provider_on_another_host_that_stops_answering_costs_one_wait(
    backend: Any, make: Any
) -> None:
    """Its pulls time out: the first match waits once (one budget), then shuns it for the
    chain; 19 more matches ask nobody. Misses, never errors, never a lock left."""
    a = make(metadata=backend(), host="node-a", provider_ttl=600.0)
    b = make(metadata=backend(), host="node-b", pull_timeout=0.3)
    keys = of.chain_hashes([[i] for i in range(6)])
    await provide(a, "chat", keys)
    await silence(a)
    for i in range(20):
        m = await b.match("chat", keys, f"turn-{i}")
        assert m.pages == 0
        await b.release(f"turn-{i}")
    stats = b.stats()
    assert stats["wire"]["pull_failures"] == 1  # one wait of at most pull_timeout, in all
    assert stats["providers"]["vanished"] == 1 and stats["providers"]["proven_gone"] == 0
    assert stats["providers"]["shunned_pages"] == 19 * 6
    assert stats["misses"] == 20 * 6
    assert b._meta is not None
    await no_leftovers(b, b._meta)
    assert (await b.match("other", keys, "x")).pages == 0  # another chain: not shunned,
    assert b.stats()["wire"]["pull_failures"] == 1  # but no session of it was published
    await b.release("x")
    await provide(b, "chat", keys)  # recomputed here: the local pages win from now on
    m = await b.match("chat", keys, "again")
    assert m.pages == 6 and all(same(b, s, k) for s, k in zip(m.slots, keys, strict=True))
    await b.release("again")
    await no_leftovers(b, b._meta)


async def test_one_match_waits_one_budget_however_many_providers_are_silent(make: Any) -> None:
    """Two silent providers of the same pages: the first pull's timeout spends the match's
    budget, so the second is not asked in that match (one wait per match, not per provider)."""
    meta = MemoryMetadata()
    a1 = make(metadata=meta, host="node-a1")
    a2 = make(metadata=meta, host="node-a2")
    b = make(metadata=meta, host="node-b", pull_timeout=0.3)
    keys = of.chain_hashes([[i] for i in range(4)])
    await provide(a1, "chat", keys)
    await provide(a2, "chat", keys)
    await silence(a1)
    await silence(a2)
    assert (await b.match("chat", keys, "t0")).pages == 0
    assert b.stats()["wire"]["pull_failures"] == 1  # a1 waited on; a2 not asked
    assert (await b.match("chat", keys, "t1")).pages == 0
    assert b.stats()["wire"]["pull_failures"] == 2  # a1 shunned; a2's one wait
    for i in range(2, 20):
        assert (await b.match("chat", keys, f"t{i}")).pages == 0
    assert b.stats()["wire"]["pull_failures"] == 2
    for i in range(20):
        await b.release(f"t{i}")
    await no_leftovers(b, meta)


# -- a killed process, Redis metadata (the acceptance of issue 33) -------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_sigkilled_provider_is_a_miss_for_every_match_and_holds_no_lock(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Process A publishes a 32-page chain into its L2 and is SIGKILLed (no leave; a lease
    that would outlive the test). 20 matches of the chain from this process: each counts its
    pages missed and returns no page, none raises, none waits on a pull; the first proves A
    gone and A leaves the metadata. The pages computed again here equal a fresh run's."""
    monkeypatch.setenv("OMNIFLOW_CLUSTER_KEY", "k" * 32)
    ctx = multiprocessing.get_context("spawn")
    info = ctx.Queue()
    proc = ctx.Process(target=workers.doomed_provider, args=(redis.url, info))
    proc.start()
    pool = of.ParamsPool("kv", workers.LAYOUT, {"l1": 32, "l2": 32}, metadata=redis.url)
    keys = workers.keys()
    prefix, coords = "", 0
    try:
        a_node, prefix, coords = info.get(timeout=120)
        proc.kill()
        proc.join(60)
        assert proc.exitcode == -9
        meta = await pool._open()
        before = (await meta[1].dump("kv"))["providers"]
        assert all(p == {a_node: p[a_node]} for p in before.values())  # type: ignore[attr-defined]
        for i in range(20):
            m = await pool.match("chat", keys, f"turn-{i}")
            assert m.pages == 0
            await pool.release(f"turn-{i}")
        stats = pool.stats()
        assert stats["misses"] == workers.PAGES  # then the chain left the metadata with A
        assert stats["providers"]["proven_gone"] == 1
        assert stats["wire"]["pull_failures"] == 0 and stats["shared"] == 0
        dump = await meta[1].dump("kv")
        assert dump["providers"] == {} and dump["chains"] == {} and dump["locks"] == {}
        assert await meta[1].nodes("kv", [a_node]) == {}
        await no_leftovers(pool, meta[1])
        # The caller computes the chain again: equal to a fresh run, matched in full.
        slots = await pool.alloc("compute", workers.PAGES)
        for key, slot in zip(keys, slots, strict=True):
            for (sub, sl), t in workers.page_bytes(key).items():
                pool.view(slot, sub, sl).copy_(t)
        await pool.publish("chat", keys, slots)
        await pool.release("compute")
        m = await pool.match("chat", keys, "turn-21")
        assert m.pages == workers.PAGES
        for key, slot in zip(keys, m.slots, strict=True):
            for (sub, sl), t in workers.page_bytes(key).items():
                assert torch.equal(pool.view(slot, sub, sl), t)
        await pool.release("turn-21")
        await no_leftovers(pool, meta[1])
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(60)
        await pool.aclose()
        for i in range(coords):  # A's L2, left behind by the kill (this process's tracker)
            seg = SharedMemory(name=f"{prefix}_{i}")
            seg.close()
            seg.unlink()
