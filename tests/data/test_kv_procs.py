"""Two processes on one node share L2 pages in place; the Redis metadata is the one truth."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from typing import Any

# A sibling module, so the spawned child imports just torch, omniflow and it.
import _kv_workers as workers
import pytest
import torch

import omniflow as of

#: Every test here spawns processes.
pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
async def test_process_b_reads_process_a_chain_through_l2_without_a_copy(
    redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both processes hold the cluster key (node records are signed with it).
    monkeypatch.setenv("OMNIFLOW_CLUSTER_KEY", "k" * 32)
    ctx = multiprocessing.get_context("spawn")
    info, b_read, a_wrote, done = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=workers.provider, args=(redis.url, info, b_read, a_wrote, done))
    proc.start()
    pool = of.ParamsPool("kv", workers.LAYOUT, {"l1": 8, "l2": 8}, metadata=redis.url)
    try:
        a_node = info.get(timeout=60)
        keys = workers.keys()
        m = await pool.match("chat", keys, "turn-2")
        assert m.pages == workers.PAGES
        stats = pool.stats()
        assert stats["shared"] == workers.PAGES and stats["bytes_moved"] == 0
        assert stats["pages"] == {"l1": 0, "l2": 0, "l3": 0}  # nothing copied into B's tiers
        segment = pool._attached[a_node]._segments[0]  # A's L2 of (l0, k), mapped by name
        assert segment.name.startswith("ofkv_kv_")
        lo = segment.address
        for key, slot in zip(keys, m.slots, strict=True):
            for (sub, sl), t in workers.page_bytes(key).items():
                assert torch.equal(pool.view(slot, sub, sl), t)
            ptr = pool.view(slot, "l0", "k").data_ptr()
            assert lo <= ptr < lo + len(segment.buf)  # type: ignore[arg-type]
        before = pool.view(m.slots[0], "l0", "k").clone()
        b_read.set()
        assert a_wrote.wait(60)
        assert torch.equal(pool.view(m.slots[0], "l0", "k"), before + 1.0)  # A's write, seen
        await pool.release("turn-2")
        assert pool.stats()["pinned"] == 0
        assert (await pool._meta.dump("kv"))["locks"] == {}  # type: ignore[union-attr]
    finally:
        done.set()
        proc.join(60)
        await pool.aclose()
    assert proc.exitcode == 0


@pytest.mark.timeout(120)
async def test_a_worker_process_releases_a_calls_pages_when_it_ends() -> None:
    import kv_graphs

    async with of.Runtime(kv_graphs.kv_worker, placement="process") as rt:
        (first,) = (await rt.run("kv_worker", {"n": 3}))["held"]
        assert first[0] != os.getpid() and first[1:] == (0, 3)  # ran in the worker
        # end_call travels behind later runs (runs skip the writer queue): poll, bounded.
        for _ in range(500):
            (later,) = (await rt.run("kv_worker", {"n": 0}))["held"]
            if later[1] == 0:
                break
        assert later[0] == first[0] and later[1] == 0, "the worker kept a finished call's pages"


@pytest.mark.timeout(120)
async def test_a_worker_pool_and_the_front_pool_pull_with_the_runtime_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No key given: the runtime generates one, hands it to its worker through the env, and
    gives it to the front process's own pool; both pools seal pulls with that key."""
    import kv_graphs

    monkeypatch.delenv("OMNIFLOW_CLUSTER_KEY", raising=False)
    own = kv_graphs.key_print(kv_graphs.KEYED)  # before: this process's fallback key
    async with of.Runtime(kv_graphs.kv_keyed, placement="process") as rt:
        front = kv_graphs.key_print(kv_graphs.KEYED)
        assert front != own  # the runtime's generated key, not the fallback
        assert front == kv_graphs.key_print(of.ParamsPool("x", kv_graphs.KEYED.layout,
                                            cluster_key=rt.remote.cluster_key))  # fmt: skip
        ((pid, worker),) = (await rt.run("kv_keyed", {"n": 1}))["key"]
        assert pid != os.getpid() and worker == front


@pytest.mark.timeout(180)
async def test_two_workers_share_one_front_hosted_metadata_and_l2() -> None:
    """metadata=None, placement="process": the writer (one worker) publishes a 32-page chain,
    the reader (another worker) matches it through the metadata its front hosts and reads the
    writer's L2 in place; the front's metadata is the one truth and ends unlocked."""
    import kv_graphs

    async with of.Runtime(kv_graphs.kv_share, placement="process") as rt:
        out = await rt.run("kv_share", {"n": 1}, session="chat")
        (read,) = out["read"]
        assert read["pid"] != os.getpid()
        assert read["hosted"] == "HostedMetadata"
        n = kv_graphs.SHARE_PAGES
        assert read["pages"] == n and read["equal"] == n  # the same bytes
        assert read["in_place"] == n  # each view lies in the writer's shared segment
        assert read["shared"] == n and read["bytes_moved"] == 0
        assert read["local"] == {"l1": 0, "l2": 0, "l3": 0}  # no copy in the reader's tiers
        assert read["other_session"] == 0  # sessions never read each other's cache
        assert rt.remote is not None
        meta = rt.remote.pool_meta
        dump = await meta.dump("kvs")
        assert sorted(dump["chains"]["s:chat"]) == sorted(kv_graphs.share_keys())  # type: ignore[index]
        # The reader's call ended: its pins, and so its locks on the writer's replicas, go.
        for _ in range(600):
            if not (await meta.dump("kvs"))["locks"]:
                break
            await asyncio.sleep(0.05)
        assert (await meta.dump("kvs"))["locks"] == {}
        writers = {n for rep in rt.remote.fleet.replicas.values() for _, n in rep.pool_nodes}
        assert len(writers) == 2  # both workers' pools registered with the front
    # Both workers left: the front forgot their pools, so nothing points at their memory.
    assert (await meta.dump("kvs"))["providers"] == {}


@pytest.mark.timeout(180)
async def test_a_worker_subscribed_to_a_session_preloads_what_another_publishes() -> None:
    """The reader (one worker) subscribes with preload, the writer (another worker) publishes
    a 32-page chain: the reader gets one notification batch through the front, copies the
    pages in, and its match is then a local hit with no fetch at match time."""
    import kv_graphs

    async with of.Runtime(kv_graphs.kv_notify, placement="process") as rt:
        (read,) = (await rt.run("kv_notify", {"n": 1}, session="chat"))["read"]
    n = kv_graphs.SHARE_PAGES
    assert read["pid"] != os.getpid()
    assert read["notices"] == [("chat", n)]  # one batch
    assert read["preloaded"] == n
    assert read["pages"] == n and read["equal"] == n
    assert read["hits"] == n and read["fetched_at_match"] == 0 and read["pulled_at_match"] == 0
    assert read["shared"] == 0  # copied in by the preload, not viewed in the writer's memory
