"""A hypothesis state machine drives one ParamsPool against a plain-dict model, on both backends.

Rules: alloc, write (copy-on-write when the page is shared), publish, match (also two owners
at once: concurrent misses), release, pressure (a burst that demotes everything unpinned down
L1 -> L2 -> L3 and drops from L3), close_session. After every step: the slot engine validates,
every page an owner holds is still live with exactly the bytes the model says (no owned page
is ever evicted, readback is bit-identical), and the pinned count equals the model's. At the
end every owner is released and every counter is back to zero.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
from typing import Any

import pytest
import torch
from _hosted_wire import hosted_client
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import omniflow as of
from omniflow.data.kv._meta import MemoryMetadata
from omniflow.data.kv._slots import L1

LAYOUT = of.PageLayout(("l0", "l1"), {"k": (2, 3), "v": (3,)}, page_tokens=4, dtype="float32")
CAP = {"l1": 4, "l2": 2, "l3": 2}
OWNERS = ("a", "b", "c")
SESSIONS = (None, "s1", "s2")
#: Two branches of one conversation: equal first two pages, then they differ.
BRANCHES = (
    of.chain_hashes([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]),
    of.chain_hashes([[1, 2], [3, 4], [6, 5], [8, 7], [10, 9]]),
    of.chain_hashes([[1, 2], [4, 3], [5, 6], [7, 8]]),
    of.chain_hashes([[2, 1], [3, 4], [5, 6], [7, 8]]),
)


def content(key: str) -> dict[tuple[str, str], torch.Tensor]:
    """The bytes a page with chain hash ``key`` holds (equal prefix, equal KV: as an engine)."""
    gen = torch.Generator().manual_seed(int(key[:12], 16))
    return {
        (sub, sl): torch.randn((LAYOUT.page_tokens, *LAYOUT.slice_shape(sl)), generator=gen)
        for sub, sl in LAYOUT.coords()
    }


def random_content(seed: int) -> dict[tuple[str, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        (sub, sl): torch.randn((LAYOUT.page_tokens, *LAYOUT.slice_shape(sl)), generator=gen)
        for sub, sl in LAYOUT.coords()
    }


class PoolMachine(RuleBasedStateMachine):
    metadata: Any = None
    #: Use metadata hosted by a "front" (over the sealed protocol) instead of its own.
    hosted = False

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory(prefix="kvprops-")
        self.pool = of.ParamsPool(
            f"p{secrets.token_hex(4)}",
            LAYOUT,
            CAP,
            l3_dir=self.tmp.name,
            metadata=self.metadata,
            serve_pulls=False if self.hosted else None,
        )
        if self.hosted:
            assert self.pool.use_metadata(hosted_client(MemoryMetadata()))
        #: owner -> slot -> expected bytes
        self.owned: dict[str, dict[int, dict[tuple[str, str], torch.Tensor]]] = {}
        #: chain name -> keys published (model; pages may since have been dropped)
        self.published: dict[str | None, set[str]] = {}
        self.dropped_any = False
        self.recent: list[tuple[str | None, int]] = []

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def write(self, slot: int, data: dict[tuple[str, str], torch.Tensor]) -> None:
        for (sub, sl), t in data.items():
            self.pool.view(slot, sub, sl).copy_(t)

    @initialize()
    def open(self) -> None:
        self.run(self.pool.open())

    # -- rules --------------------------------------------------------------------------------

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(1, 3), seed=st.integers(0, 2**16))
    def alloc(self, owner: str, n: int, seed: int) -> None:
        pinned_l1 = sum(1 for s in self.pool._core.slots() if s.active and s.tier == L1)
        try:
            slots = self.run(self.pool.alloc(owner, n))
        except of.PoolExhaustedError:
            if not self.pool._runs:  # without run locks only pinned L1 pages can block it
                assert pinned_l1 + n > CAP["l1"], "alloc refused although pages could move"
            return
        for i, slot in enumerate(slots):
            data = random_content(seed + i)
            self.write(slot, data)
            self.owned.setdefault(owner, {})[slot] = data

    @precondition(lambda self: any(self.owned.values()))
    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def append(self, data: st.DataObject, seed: int) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, s in self.owned.items() if s)))
        slot = data.draw(st.sampled_from(sorted(self.owned[owner])))
        shared = self.pool._core.slot(slot).key is not None if self.pool._core.has(slot) else True
        try:
            new = self.run(self.pool.writable(owner, slot))
        except of.PoolExhaustedError:
            return
        assert (new != slot) == shared, "copy-on-write exactly when the page is shared"
        assert (
            self.pool.fill(new) == self.pool.fill(slot)
            if new != slot and self.pool._core.has(slot)
            else True
        )
        old = self.owned[owner].pop(slot)
        for (sub, sl), t in old.items():  # the copy holds the old bytes before the append
            assert torch.equal(self.pool.view(new, sub, sl), t)
        fresh = random_content(seed)
        self.write(new, fresh)
        self.owned[owner][new] = fresh

    @precondition(lambda self: any(self.owned.values()))
    @rule(
        data=st.data(), session=st.sampled_from(SESSIONS), branch=st.integers(0, len(BRANCHES) - 1)
    )
    def publish(self, data: st.DataObject, session: str | None, branch: int) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, s in self.owned.items() if s)))
        mine = sorted(self.owned[owner])
        k = data.draw(st.integers(1, min(len(mine), len(BRANCHES[branch]))))
        slots = mine[:k]
        keys = BRANCHES[branch][:k]
        for slot, key in zip(slots, keys, strict=True):
            if self.pool._core.has(slot) and self.pool._core.slot(slot).key not in (None, key):
                return  # already published under another hash: an engine would not do this
        for slot, key in zip(slots, keys, strict=True):
            c = content(key)
            self.write(slot, c)
            self.owned[owner][slot] = c
            self.pool.set_fill(slot, 3 if key == keys[-1] else 4)  # last page partly filled
        self.run(self.pool.publish(session, keys, slots))
        self.published.setdefault(session, set()).update(keys)

    @rule(
        owner=st.sampled_from(OWNERS),
        session=st.sampled_from(SESSIONS),
        branch=st.integers(0, len(BRANCHES) - 1),
    )
    def match(self, owner: str, session: str | None, branch: int) -> None:
        keys = BRANCHES[branch]
        m = self.run(self.pool.match(session, keys, owner))
        self.check_match(m, session, keys, owner)

    @rule(session=st.sampled_from(SESSIONS), branch=st.integers(0, len(BRANCHES) - 1))
    def concurrent_match(self, session: str | None, branch: int) -> None:
        keys = BRANCHES[branch]

        async def both() -> Any:
            return await asyncio.gather(
                self.pool.match(session, keys, "a"), self.pool.match(session, keys, "b")
            )

        ma, mb = self.run(both())
        self.check_match(ma, session, keys, "a")
        self.check_match(mb, session, keys, "b")
        common = min(ma.pages, mb.pages)
        assert ma.slots[:common] == mb.slots[:common], "one page, one slot"

    def check_match(self, m: of.Match, session: str | None, keys: list[str], owner: str) -> None:
        visible = self.published.get(session, set()) | self.published.get(None, set())
        assert m.pages == len(m.slots)
        assert all(k in visible for k in keys[: m.pages]), "matched a chain of another session"
        if not self.dropped_any and self.pool.stats()["evictions"] == 0:
            expect = 0
            while expect < len(keys) and keys[expect] in visible:
                expect += 1
            assert m.pages <= expect
        for i, slot in enumerate(m.slots):
            want = content(keys[i])
            for (sub, sl), t in want.items():
                assert torch.equal(self.pool.view(slot, sub, sl), t), "bytes differ"
            assert self.pool._core.slot(slot).tier == L1
            self.owned.setdefault(owner, {})[slot] = want

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner: str) -> None:
        self.run(self.pool.release(owner))
        self.owned.pop(owner, None)

    @rule()
    def pressure(self) -> None:
        """Fill L1 with a burst (demotes every unpinned page; L3 drops its coldest)."""
        free = CAP["l1"] - sum(1 for s in self.pool._core.slots() if s.active and s.tier == L1)
        if free > 0:
            try:
                self.run(self.pool.alloc("burst", free))
            except of.PoolExhaustedError:
                assert self.pool._runs, "a burst into unpinned pages was refused"
            self.run(self.pool.release("burst"))
        self.dropped_any = self.dropped_any or self.pool.stats()["evictions"] > 0

    @rule(branch=st.integers(0, len(BRANCHES) - 1), session=st.sampled_from(SESSIONS))
    def compute_and_publish(self, branch: int, session: str | None) -> None:
        """What an engine does on a miss: alloc the whole chain, fill it, publish, finish."""
        keys = BRANCHES[branch]
        try:
            slots = self.run(self.pool.alloc("engine", len(keys)))
        except of.PoolExhaustedError:
            return
        for slot, key in zip(slots, keys, strict=True):
            self.write(slot, content(key))
        self.run(self.pool.publish(session, keys, slots))
        self.published.setdefault(session, set()).update(keys)
        self.recent.append((session, branch))
        self.run(self.pool.release("engine"))

    @precondition(lambda self: bool(self.recent))
    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def rematch(self, data: st.DataObject, owner: str) -> None:
        """A later turn of a session that computed a chain (hits, readbacks from L2/L3)."""
        session, branch = data.draw(st.sampled_from(self.recent))
        m = self.run(self.pool.match(session, BRANCHES[branch], owner))
        self.check_match(m, session, BRANCHES[branch], owner)

    @rule(session=st.sampled_from(("s1", "s2")))
    def close_session(self, session: str) -> None:
        self.run(self.pool.close_session(session))

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.pool.validate()
        held = set()
        for owner, slots in self.owned.items():
            for slot, data in slots.items():
                assert self.pool._core.has(slot), f"owned slot {slot} of {owner} was evicted"
                assert owner in self.pool._core.slot(slot).active
                for (sub, sl), t in data.items():
                    assert torch.equal(self.pool.view(slot, sub, sl), t), "owned bytes changed"
                held.add(slot)
        assert self.pool.stats()["pinned"] == len(held)

    def teardown(self) -> None:
        try:
            for owner in OWNERS:
                self.run(self.pool.release(owner))
            stats = self.pool.stats()
            assert stats["pinned"] == 0 and stats["owners"] == 0, stats
            assert stats["tasks"] == 0 and stats["inflight"] == 0, stats
            assert not self.pool._runs
            dump = self.run(self.pool._meta.dump(self.pool.name))  # type: ignore[union-attr]
            assert dump["runs"] == {} and dump["locks"] == {}, dump
            self.pool.validate()
        finally:
            self.run(self.pool.aclose())
            self.loop.close()
            self.tmp.cleanup()


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.timeout(300)
def test_pool_machine_memory() -> None:
    class Memory(PoolMachine):
        metadata = None

    run_state_machine_as_test(Memory, settings=SETTINGS)


@pytest.mark.timeout(300)
def test_pool_machine_front_hosted() -> None:
    class Front(PoolMachine):
        hosted = True

    run_state_machine_as_test(Front, settings=settings(SETTINGS, max_examples=20))


@pytest.mark.timeout(300)
def test_pool_machine_redis(redis: Any) -> None:
    class Redis(PoolMachine):
        metadata = redis.url

    run_state_machine_as_test(Redis, settings=settings(SETTINGS, max_examples=20))
