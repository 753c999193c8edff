"""ParamsPool by example: layout, views, tiers, exhaustion, copy-on-write, sharing, runtime."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import omniflow as of
from omniflow.data.kv import MemoryMetadata
from omniflow.data.kv._slots import L1, L2, L3

LAYOUT = of.PageLayout(("l0", "l1"), {"k": (2, 4), "v": (2, 4)}, page_tokens=4, dtype="float32")


@pytest.fixture
def make(params_pools: Callable[..., of.ParamsPool]) -> Callable[..., of.ParamsPool]:
    """Pools named "kv" on LAYOUT (``layout=``, ``name=``, ``capacity=`` override)."""
    return functools.partial(params_pools, layout=LAYOUT, capacity={"l1": 8, "l2": 8, "l3": 0})


def fill_page(pool: of.ParamsPool, slot: int, seed: int) -> dict[tuple[str, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for sub, sl in pool.layout.coords():
        t = torch.randn(pool.view(slot, sub, sl).shape, generator=gen)
        pool.view(slot, sub, sl).copy_(t)
        out[(sub, sl)] = t
    return out


def same(pool: of.ParamsPool, slot: int, data: dict[tuple[str, str], torch.Tensor]) -> bool:
    return all(torch.equal(pool.view(slot, sub, sl), t) for (sub, sl), t in data.items())


# -- layout -------------------------------------------------------------------------------------


def test_layout_id_is_sha256_of_canonical_json() -> None:
    a = of.PageLayout(("l0",), {"k": (8, 64), "v": (8, 64)}, page_tokens=16, dtype="float16")
    b = of.PageLayout(["l0"], {"k": [8, 64], "v": [8, 64]}, 16, "float16")
    assert a == b and a.layout_id == b.layout_id
    assert a.layout_id == hashlib.sha256(a.canonical_json().encode()).hexdigest()[:16]
    assert of.PageLayout.from_json(a.canonical_json()) == a
    assert a.layout_id != of.PageLayout(("l0",), {"k": (8, 64)}, 16, "float16").layout_id
    assert a.page_bytes == 2 * 16 * 8 * 64 * 2


@pytest.mark.parametrize(
    "args",
    [
        ((), {"k": (1,)}, 4, "float16"),
        (("a", "a"), {"k": (1,)}, 4, "float16"),
        (("a",), {}, 4, "float16"),
        (("a",), {"k": (0,)}, 4, "float16"),
        (("a",), {"k": (1,)}, 0, "float16"),
        (("a",), {"k": (1,)}, 4, "complex64"),
    ],
)
def test_bad_layouts_are_data_errors(args: Any) -> None:
    with pytest.raises(of.DataError, match="PageLayout"):
        of.PageLayout(*args)


PAGES = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=3), min_size=1, max_size=6)


@given(PAGES, PAGES)
def test_chain_hashes_are_equal_exactly_for_equal_prefixes(a: Any, b: Any) -> None:
    ha, hb = of.chain_hashes(a), of.chain_hashes(b)
    for i in range(min(len(a), len(b))):
        assert (ha[i] == hb[i]) == (a[: i + 1] == b[: i + 1])
    assert of.chain_hashes([b"x", b"y"])[0] == of.chain_hashes([b"x"])[0]


# -- views and tiers ----------------------------------------------------------------------------


async def test_views_are_zero_copy_and_gather_covers_every_coordinate(make: Any) -> None:
    pool = make()
    slots = await pool.alloc("o", 3)
    data = [fill_page(pool, s, i) for i, s in enumerate(slots)]
    v = pool.view(slots[1], "l1", "v")
    assert v.shape == (4, 2, 4)
    store = pool.storage("l1", "v")
    assert store.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # a view
    v.add_(1.0)
    data[1][("l1", "v")] += 1.0
    got = pool.gather(["l0", "l1"], slots, ["k", "v"])
    assert set(got) == {(s, sl) for s in ("l0", "l1") for sl in ("k", "v")}
    for (sub, sl), t in got.items():
        assert t.shape == (3, 4, 2, 4)
        for i in range(3):
            assert torch.equal(t[i], data[i][(sub, sl)])
    table = pool.block_table(slots)
    assert torch.equal(store.index_select(0, table)[1], pool.view(slots[1], "l1", "v"))
    with pytest.raises(of.DataError, match="sub_name"):
        pool.view(slots[0], "l9", "k")
    await pool.release("o")
    assert pool.stats()["pinned"] == 0 and pool.stats()["pages"]["l1"] == 0


async def test_demoted_to_l3_and_read_back_bit_identical(make: Any, tmp_path: Any) -> None:
    pool = make(capacity={"l1": 2, "l2": 2, "l3": 4}, l3_dir=str(tmp_path))
    keys = of.chain_hashes([[i] for i in range(6)])
    data = {}
    for i, key in enumerate(keys):
        (slot,) = await pool.alloc("w", 1)
        data[key] = fill_page(pool, slot, 100 + i)
        pool.set_fill(slot, 4 if i < 5 else 3)  # the last page is partial: kept whole
        await pool.publish("s", [key], [slot])
        await pool.release("w")
    assert pool.statistics()["pages"] == {"l1": 2, "l2": 2, "l3": 2}
    assert pool.stats() == pool.statistics()  # (the contract's name)
    assert len(os.listdir(tmp_path)) == len(LAYOUT.coords())  # one file per (sub, slice)
    first = pool._core.lookup(keys[0])
    assert first is not None and first.tier == L3
    m = await pool.match("s", keys[:2], "r")
    assert m.pages == 2
    for key, slot in zip(keys[:2], m.slots, strict=True):
        assert pool._core.slot(slot).tier == L1
        assert same(pool, slot, data[key])
    await pool.release("r")
    m = await pool.match("s", keys, "r2")
    # l1 holds 2 pinned pages at most: the match pins the prefix that fits
    assert m.pages == 2
    await pool.release("r2")
    assert pool.stats()["evictions"] == 0 and pool.stats()["bytes_moved"] > 0
    assert pool.fill(pool._core.lookup(keys[5]).slot) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize("pages", [2, 16])
async def test_a_matched_run_is_read_back_in_one_batch(make: Any, pages: int) -> None:
    """Whatever the run's length: one metadata lookup, one call marking the pages moving and
    one placing them, one slice copy per (sub, slice) for a contiguous run, bytes intact."""
    pool = make(capacity={"l1": 2 * pages, "l2": 2 * pages, "l3": 0})
    keys = of.chain_hashes([[i] for i in range(pages)])
    slots = await pool.alloc("w", pages)
    data = {
        key: fill_page(pool, slot, i) for i, (key, slot) in enumerate(zip(keys, slots, strict=True))
    }
    await pool.publish("s", keys, slots)
    await pool.release("w")
    await pool.alloc("burst", 2 * pages)  # the chain goes down to L2
    await pool.release("burst")
    assert pool.stats()["pages"]["l2"] == pages
    meta = pool._meta
    assert meta is not None
    copies: list[int] = []
    real = torch.Tensor.copy_

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append(self.shape[0])
        return real(self, *args, **kwargs)

    before = meta.round_trips
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "copy_", counting)
        m = await pool.match("s", keys, "r")
    assert m.pages == pages
    assert meta.round_trips - before == 3  # match (+ run lock), mark moving, new places
    assert copies == [pages] * len(LAYOUT.coords())  # one run: one copy per (sub, slice)
    for key, slot in zip(keys, m.slots, strict=True):
        assert pool._core.slot(slot).tier == L1 and same(pool, slot, data[key])
    assert pool.stats()["hits"] == pages
    await pool.release("r")


async def test_a_redis_match_is_one_request_even_an_owners_first(redis: Any) -> None:
    """Counted on the wire: every request the client sends (a command, a pipeline or a
    script) goes through one ``send_packed_command`` of a connection."""
    from redis.asyncio.connection import AbstractConnection

    pool = of.ParamsPool("kv", LAYOUT, {"l1": 16, "l2": 0}, metadata=redis.url)
    try:
        keys = of.chain_hashes([[i] for i in range(8)])
        slots = await pool.alloc("w", 8)
        await pool.publish("chat", keys, slots)
        await pool.release("w")
        warm = await pool.match("chat", keys, "warm")  # the connection is made
        assert warm.pages == 8
        sent: list[Any] = []
        real = AbstractConnection.send_packed_command

        async def counting(self: Any, command: Any, check_health: bool = True) -> None:
            sent.append(command)
            await real(self, command, check_health)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(AbstractConnection, "send_packed_command", counting)
            m = await pool.match("chat", keys, "reader")  # first match of this owner
            assert m.pages == 8 and len(sent) == 1
            m2 = await pool.match("chat", keys[:4], "reader")  # again: no second run lock
            assert m2.pages == 4 and len(sent) == 2
        dump = await pool._meta.dump("kv")  # type: ignore[union-attr]
        assert dump["runs"] == {"s:chat": 2}  # "warm" and "reader" hold the session
        await pool.release("reader")
        await pool.release("warm")
        assert (await pool._meta.dump("kv"))["runs"] == {}  # type: ignore[union-attr]
    finally:
        await pool.aclose()


async def test_alloc_fails_at_once_without_touching_owned_pages(make: Any) -> None:
    pool = make(capacity={"l1": 4, "l2": 0})
    slots = await pool.alloc("a", 3)
    data = [fill_page(pool, s, i) for i, s in enumerate(slots)]
    with pytest.raises(of.PoolExhaustedError, match="pinned") as info:
        await asyncio.wait_for(pool.alloc("b", 2), 10)
    assert info.value.requested == 2
    with pytest.raises(of.PoolExhaustedError):
        await pool.alloc("b", 5)
    assert all(same(pool, s, d) for s, d in zip(slots, data, strict=True))
    assert await pool.alloc("b", 1)
    await pool.release("a")
    await pool.release("b")
    assert pool.stats()["pages"]["l1"] == 0


async def test_copy_on_write_of_a_shared_page(make: Any) -> None:
    pool = make()
    (slot,) = await pool.alloc("a", 1)
    assert await pool.writable("a", slot) == slot  # private: written in place
    data = fill_page(pool, slot, 1)
    pool.set_fill(slot, 2)
    key = of.chain_hashes([[1, 2]])
    await pool.publish(None, key, [slot])
    m = await pool.match("other", key, "b")  # public: every session matches it
    assert m.slots == (slot,)
    new = await pool.writable("b", slot)
    assert new != slot and same(pool, new, data) and pool.fill(new) == 2
    pool.view(new, "l0", "k").fill_(7.0)
    assert same(pool, slot, data)  # the shared page is untouched
    await pool.release("a")
    await pool.release("b")
    assert pool.stats()["pinned"] == 0


async def test_sessions_never_match_each_others_chains(make: Any) -> None:
    pool = make()
    keys = of.chain_hashes([[1], [2]])
    slots = await pool.alloc("a", 2)
    await pool.publish("alice", keys, slots)
    await pool.release("a")
    assert (await pool.match("bob", keys, "b")).pages == 0
    assert (await pool.match("alice", keys, "c")).pages == 2
    await pool.release("c")


async def test_a_running_sessions_chain_moves_down_but_is_not_dropped(make: Any) -> None:
    pool = make(capacity={"l1": 2, "l2": 1})
    keys = of.chain_hashes([[1], [2]])
    slots = await pool.alloc("turn1", 2)
    await pool.publish("chat", keys, slots)
    await pool.release("turn1")
    await pool.match("chat", of.chain_hashes([[9]]), "turn2")  # a call of the session runs
    with pytest.raises(of.PoolExhaustedError):
        await pool.alloc("other", 2)  # would drop one of the chat's pages
    assert pool.stats()["evictions"] == 0
    (x,) = await pool.alloc("other", 1)  # moving one down to l2 is fine
    assert {pool._core.lookup(k).tier for k in keys} == {L1, L2}  # type: ignore[union-attr]
    await pool.release("other")
    await pool.release("turn2")  # the call ended: the chain may go
    await pool.alloc("other", 2)
    assert pool.stats()["evictions"] == 1
    await pool.release("other")
    _ = x


async def test_cross_node_pull_and_concurrent_misses_share_one_transfer(make: Any) -> None:
    meta = MemoryMetadata()
    a = make(name="kv", metadata=meta, host="node-a")
    b = make(name="kv", metadata=meta, host="node-b")
    keys = of.chain_hashes([[i] for i in range(5)])
    slots = await a.alloc("w", 5)
    data = [fill_page(a, s, 50 + i) for i, s in enumerate(slots)]
    await a.publish(None, keys, slots)
    await a.release("w")
    m1, m2 = await asyncio.gather(b.match("s", keys, "r1"), b.match("s", keys, "r2"))
    assert m1.pages == m2.pages == 5 and m1.slots == m2.slots
    assert b.stats()["pulled"] == 5  # one transfer for both requests
    assert all(same(b, s, d) for s, d in zip(m1.slots, data, strict=True))
    assert b.stats()["bytes_moved"] == 5 * LAYOUT.page_bytes
    dump = await meta.dump("kv")
    assert all(len(p) == 2 for p in dump["providers"].values())  # b is a provider now
    await b.release("r1")
    await b.release("r2")
    assert b.stats()["pinned"] == 0 and (await meta.dump("kv"))["locks"] == {}


async def test_a_shared_l1_is_read_in_place_by_a_colocated_pool(make: Any) -> None:
    meta = MemoryMetadata()
    a = make(name="kv", metadata=meta, capacity={"l1": 4, "l2": 0}, shared_l1=True)
    b = make(name="kv", metadata=meta, capacity={"l1": 4, "l2": 0})
    keys = of.chain_hashes([[i] for i in range(3)])
    slots = await a.alloc("w", 3)
    data = [fill_page(a, s, i) for i, s in enumerate(slots)]
    await a.publish("s", keys, slots)
    m = await b.match("s", keys, "r")
    assert m.pages == 3 and b.stats()["shared"] == 3
    assert a.stats()["bytes_moved"] == b.stats()["bytes_moved"] == 0
    for key, slot, d in zip(keys, m.slots, data, strict=True):
        assert same(b, slot, d)
        page = a._core.lookup(key)
        assert page is not None and page.tier == L1
        mine = a.storage("l0", "k")[page.index]
        mine.add_(1.0)  # a's write is b's read: one shared memory, no copy
        assert torch.equal(b.view(slot, "l0", "k"), mine)
        mine.sub_(1.0)
    await a.release("w")
    with pytest.raises(of.PoolExhaustedError):
        await a.alloc("burst", 4)  # b's replica lock keeps its pages where b reads them
    await b.release("r")
    assert len(await a.alloc("burst", 4)) == 4  # (l2 0: the unlocked chain is dropped)
    b.validate()
    a.validate()


async def test_a_shared_l1_on_cuda_is_refused_by_name() -> None:
    """Viewing a GPU L1 from another process needs CUDA IPC, not implemented: opening such a
    pool says so (the condition is the device; no GPU is needed to check it)."""
    pool = of.ParamsPool("kv", LAYOUT, {"l1": 1, "l2": 0}, shared_l1=True, device="cuda")
    with pytest.raises(
        of.DataError, match=r"params pool '\w*_kv_\w*': a shared L1 on cuda needs CUDA IPC"
    ):
        await pool.open()
    assert not pool.opened


def test_a_colocated_pool_is_sized_before_it_opens() -> None:
    pool = of.ParamsPool("kv", LAYOUT, {"l1": 1, "l2": 0})
    pool.colocate(7, shared=True)
    assert pool.capacity["l1"] == 7 and pool.shared_l1
    with pytest.raises(of.DataError, match="l1_pages must be an int >= 1"):
        pool.colocate(0, shared=True)


async def test_same_node_pools_share_l2_pages_in_place(make: Any) -> None:
    meta = MemoryMetadata()
    a = make(name="kv", metadata=meta, capacity={"l1": 4, "l2": 8})
    b = make(name="kv", metadata=meta, capacity={"l1": 4, "l2": 8})
    keys = of.chain_hashes([[i] for i in range(4)])
    slots = await a.alloc("w", 4)
    data = [fill_page(a, s, i) for i, s in enumerate(slots)]
    await a.publish("s", keys, slots)
    await a.release("w")
    await a.alloc("burst", 4)  # the chain moves to a's L2
    await a.release("burst")
    assert a.stats()["pages"]["l2"] == 4
    m = await b.match("s", keys, "r")
    assert m.pages == 4 and b.stats()["shared"] == 4 and b.stats()["bytes_moved"] == 0
    for key, slot, d in zip(keys, m.slots, data, strict=True):
        assert same(b, slot, d)
        page = a._core.lookup(key)
        assert page is not None and page.tier == L2
        mine = a._store.store(L2, "l0", "k")[page.index]  # type: ignore[union-attr]
        mine.add_(1.0)  # a's write is b's read: one memory, no copy
        assert torch.equal(b.view(slot, "l0", "k"), mine)
        mine.sub_(1.0)
    await a.alloc("burst", 4)  # a locked replica is neither moved nor dropped
    await a.release("burst")
    assert all(a._core.lookup(k).tier == L2 for k in keys)  # type: ignore[union-attr]
    await b.release("r")
    assert (await meta.dump("kv"))["locks"] == {}


# -- publish notifications and preload ----------------------------------------------------------


@pytest.mark.parametrize("host", ["node-b", None])  # another node, or this one (L2 shared)
@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_subscriber_preloads_a_published_chain_and_then_hits_locally(
    make: Any, host: str | None, backend: str, request: pytest.FixtureRequest
) -> None:
    meta: Any = MemoryMetadata() if backend == "memory" else request.getfixturevalue("redis").url
    a = make(name="kv", metadata=meta, host="node-a" if host else None)
    b = make(name="kv", metadata=meta, host=host)
    held: list[tuple[Any, ...]] = []
    holding = [host is None]
    if host is None:
        # b takes its notices only once a's chain sits in a's L2: a notice that arrived while
        # a moved the pages would find them marked moving, a miss by design (a preload is
        # best effort), and the pub/sub delivery through Redis may come at any moment.
        deliver = b._subscriptions.notified
        b._subscriptions.notified = lambda *n: held.append(n) if holding[0] else deliver(*n)
    await b.subscribe("chat", preload=True)
    await b.subscribe("other")  # notified, no preload
    keys = of.chain_hashes([[i] for i in range(6)])
    slots = await a.alloc("w", 6)
    data = [fill_page(a, s, 70 + i) for i, s in enumerate(slots)]
    await a.publish("chat", keys[:4], slots[:4])  # one batch per publish
    await a.publish("chat", keys[4:], slots[4:])
    await a.release("w")
    if host is None:
        await a.alloc("burst", 6)  # the chain moves to a's L2, where b could view it in place
        await a.release("burst")
        await b.preloads()  # every notice has arrived, and been held
        assert len(held) == 2 and not b.stats()["notified"]
        holding[0] = False
        for notice in held:
            deliver(*notice)
    await b.preloads()
    assert list(b.notices) == [("chat", keys[:4]), ("chat", keys[4:])]
    assert b.stats()["notified"] == 2 and b.stats()["preloaded"] == 6
    assert b.stats()["pinned"] == 0  # preloading pins nothing once done
    pulled, misses = b.stats()["pulled"], b.stats()["misses"]
    assert pulled == 6
    m = await b.match("chat", keys, "turn-2")
    assert m.pages == 6 and all(same(b, s, d) for s, d in zip(m.slots, data, strict=True))
    st = b.stats()
    assert (st["pulled"], st["misses"], st["shared"]) == (pulled, misses, 0)  # no fetch now
    assert st["hits"] == 6
    await b.release("turn-2")
    await b.unsubscribe("chat")
    more = await a.alloc("w2", 1)
    await a.publish("chat", of.chain_hashes([[99]]), more)
    await b.preloads()
    assert b.stats()["notified"] == 2  # unsubscribed: not told any more
    dump = await a._meta.dump("kv")
    assert dump["locks"] == {}
    if backend == "memory":
        assert dump["subs"] == {"s:other": [b.node]}
    else:  # sealed pub/sub messages, every one authentic
        wire = b.stats()["wire"]
        assert wire["notice_accepted"] == 2
        assert sum(v for k, v in wire.items() if k.startswith("notice_dropped")) == 0
    b.validate()
    await b.aclose()  # before the private Redis goes (it was set up after ``make``)
    await a.aclose()


async def test_forged_and_replayed_redis_notices_are_dropped_and_counted(redis: Any) -> None:
    """Anyone who can write to Redis can PUBLISH on a pool's channel: only notices sealed
    with the cluster key, for this pool and session, never seen before, start a preload."""
    import redis.asyncio as aioredis

    from omniflow.data.kv._notice import NoticeSeal
    from omniflow.transport._auth import generate_key

    a = of.ParamsPool("kv", LAYOUT, {"l1": 8, "l2": 0}, metadata=redis.url, host="node-a")
    b = of.ParamsPool("kv", LAYOUT, {"l1": 8, "l2": 0}, metadata=redis.url, host="node-b")
    raw = aioredis.from_url(redis.url, decode_responses=True)
    spy = raw.pubsub()
    try:
        await b.subscribe("chat", preload=True)
        channel = "ofkv:kv:notify:s:chat"
        await spy.subscribe(channel)
        assert (await spy.get_message(timeout=30))["type"] == "subscribe"
        keys = of.chain_hashes([[i] for i in range(3)])
        slots = await a.alloc("w", 3)
        await a.publish("chat", keys, slots)
        await b.preloads()
        assert b.stats()["preloaded"] == 3
        captured = (await spy.get_message(timeout=30))["data"]
        assert captured.startswith("0,1,2|")
        wire = lambda: {k[7:]: v for k, v in b.stats()["wire"].items() if k.startswith("notice_")}  # noqa: E731
        assert wire()["accepted"] == 1

        other = await a.alloc("w", 1)
        fresh = of.chain_hashes([[9]])
        await a.publish(None, fresh, other)  # a real page nobody told b about
        evil = NoticeSeal("kv", "evil", generate_key())  # not the cluster key
        await raw.publish(channel, "0|" + evil.seal("chat", fresh))
        await raw.publish(channel, captured)  # a replay of an authentic notice
        await raw.publish(channel, "0|not base64!")
        public = NoticeSeal("kv", a.node, a._cluster_key())
        await raw.publish(channel, "0|" + public.seal(None, fresh))  # another chain's notice
        await raw.publish(channel, "7|" + public.seal("chat", fresh))  # index out of range
        await b.preloads()
        assert wire() == {
            "accepted": 3, "dropped_bad_mac": 1, "dropped_replay": 1,
            "dropped_malformed": 2, "dropped_foreign": 1, "dropped_unknown_kind": 0,
        }  # fmt: skip
        assert b.stats()["notified"] == 1 and b.stats()["preloaded"] == 3  # nothing more
        assert list(b.notices) == [("chat", keys)]
    finally:
        await spy.aclose()
        await raw.aclose()
        await a.aclose()
        await b.aclose()


# -- graphs and the runtime ---------------------------------------------------------------------


class Engine(of.Role):
    async def setup(self) -> None:
        self.pool = self.pools["kv"]

    @of.interface(inputs_or=[["tokens"]], outputs=["pages"])
    async def prefill(self, tokens: list[int]) -> dict[str, Any]:
        ctx = of.context()
        pool = ctx.pools["kv"]
        assert pool is self.pool
        keys = of.chain_hashes([tokens[i : i + 4] for i in range(0, len(tokens), 4)])
        m = await pool.match(ctx.session, keys, ctx.call_id)
        fresh = await pool.alloc(ctx.call_id, len(keys) - m.pages)
        await pool.publish(ctx.session, keys[m.pages :], fresh)
        if tokens and tokens[0] < 0:
            raise ValueError("boom")
        return {"pages": (m.pages, len(fresh))}


async def settled(pool: of.ParamsPool) -> None:
    """The runtime releases in a task of its own: let it run (bounded, not timed)."""
    for _ in range(1000):
        if pool.stats()["pinned"] == 0 and not pool._runs:
            return
        await asyncio.sleep(0)


async def test_runtime_releases_a_calls_pages_when_it_ends(make: Any) -> None:
    pool = make()
    graph = of.Graph("chat", roles={"engine": Engine()}, inputs=[of.Placeholder("tokens")],
                     outputs=["pages"], pools=[pool])  # fmt: skip
    async with of.Runtime(graph) as rt:
        out = await rt.run("chat", {"tokens": list(range(8))}, session="s")
        assert out["pages"] == [(0, 2)]
        await settled(pool)
        assert pool.stats()["pinned"] == 0 and pool.stats()["pages"]["l1"] == 2
        out = await rt.run("chat", {"tokens": list(range(12))}, session="s")
        assert out["pages"] == [(2, 1)]
        with pytest.raises(of.NodeError):
            await rt.run("chat", {"tokens": [-1, 2, 3, 4]}, session="t")
        await settled(pool)
        assert pool.stats()["pinned"] == 0 and not pool._runs


async def until(cond: Callable[[], bool]) -> None:
    """The runtime releases and closes pools in tasks of its own: let them run (bounded)."""
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)


class Keeper(of.Role):
    """Pins a session's chain for an owner that outlives the call (a session-long reader)."""

    @of.interface(inputs_or=[["tokens"]], outputs=["pages"])
    async def keep(self, tokens: list[int]) -> dict[str, Any]:
        ctx = of.context()
        pool = ctx.pools["kv"]
        keys = of.chain_hashes([tokens[i : i + 4] for i in range(0, len(tokens), 4)])
        fresh = await pool.alloc(ctx.call_id, len(keys))
        await pool.publish(ctx.session, keys, fresh)
        m = await pool.match(ctx.session, keys, f"keeper-{ctx.session}")
        return {"pages": m.pages}


async def test_close_session_drops_the_sessions_run_locks_in_its_pools(make: Any) -> None:
    pool = make()
    graph = of.Graph("keep", roles={"k": Keeper()}, inputs=[of.Placeholder("tokens")],
                     outputs=["pages"], pools=[pool])  # fmt: skip
    async with of.Runtime(graph) as rt:
        assert (await rt.run("keep", {"tokens": list(range(8))}, session="s1"))["pages"] == [2]
        await until(lambda: list(pool._runs) == ["keeper-s1"])  # the call's lock went with it
        assert pool._runs == {"keeper-s1": {"s1"}}
        await rt.close_session("s1")
        await until(lambda: not pool._runs)
        assert pool._runs == {}
        await pool.release("keeper-s1")
        assert pool.stats()["pinned"] == 0


def test_graph_pools_must_be_params_pools() -> None:
    pool = of.ParamsPool("kv", LAYOUT)
    with pytest.raises(of.GraphError, match="pools must be"):
        of.Graph("g", roles={"e": Engine()}, pools=[object()])
    with pytest.raises(of.GraphError, match="two pools"):
        of.Graph("g", roles={"e": Engine()}, pools=[pool, of.ParamsPool("kv", LAYOUT)])
    with pytest.raises(of.DataError, match="redis://"):
        of.ParamsPool("kv", LAYOUT, metadata="http://x")
