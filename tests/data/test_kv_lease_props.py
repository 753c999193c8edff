"""A hypothesis state machine over provider death, heartbeats, clock and matches.

Two provider pools and one reader share a ``MemoryMetadata`` on one host, timed by a clock the
machine moves. Rules: a provider publishes a chain (into its L2, where the reader views it in
place), crashes (as SIGKILL leaves it: no leave, its memory gone), renews its lease; the clock
moves; the reader matches (and recomputes what it missed), releases, the metadata sweeps.

After every step: the metadata and the reader ``validate()``; no match raised; every page a
match returned holds its chain's bytes; the reader's replica locks in the metadata are exactly
the pages it views in place (while it is registered); every provider in the metadata is a
registered node; a crashed provider is forgotten once a sweep ran after its lease ran out. At
the end every owner is released and nothing is pinned or locked.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_kv_lease import LAYOUT, Clock, content, crash, provide, same, to_l2

import omniflow as of
from omniflow.data.kv import MemoryMetadata

TTL = 30.0
OWNERS = ("r1", "r2")
SESSIONS = ("chat", None)
#: Two branches of one conversation: equal first two pages, then they differ.
BRANCHES = (
    of.chain_hashes([[1], [2], [3], [4]]),
    of.chain_hashes([[1], [2], [4], [3]]),
)


class LivenessMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.meta = MemoryMetadata(clock=self.clock)
        cap = {"l1": 4, "l2": 16, "l3": 0}
        # No pull servers: every page crosses processes through L2, so nothing waits on time.
        self.providers = [
            of.ParamsPool("kv", LAYOUT, cap, metadata=self.meta, serve_pulls=False,
                          provider_ttl=TTL)
            for _ in range(2)
        ]  # fmt: skip
        self.reader = of.ParamsPool(
            "kv", LAYOUT, cap, metadata=self.meta, serve_pulls=False, provider_ttl=TTL
        )
        self.alive = [True, True]
        #: crashed provider node -> clock time its lease ran out
        self.deadline: dict[str, float] = {}
        #: clock time of the latest step that swept the metadata
        self.swept = 0.0
        self.held: set[str] = set()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @initialize()
    def open(self) -> None:
        for pool in (*self.providers, self.reader):
            self.run(pool.open())

    # -- rules --------------------------------------------------------------------------------

    @rule(p=st.integers(0, 1), b=st.integers(0, 1), s=st.sampled_from(SESSIONS),
          n=st.integers(1, 4))  # fmt: skip
    def publish(self, p: int, b: int, s: str | None, n: int) -> None:
        if not self.alive[p]:
            return
        pool = self.providers[p]
        try:
            self.run(provide(pool, s, list(BRANCHES[b][:n])))
            self.run(to_l2(pool, 4))
        except of.PoolExhaustedError:  # the reader's running sessions keep pages: fine
            self.run(pool.release("compute"))
            self.run(pool.release("burst"))

    @rule(p=st.integers(0, 1))
    def crash(self, p: int) -> None:
        if not self.alive[p]:
            return
        pool = self.providers[p]
        until = self.meta._pools["kv"].leases.get(pool.node)
        if until is not None:  # (else forgotten already, and it never beats again)
            self.deadline[pool.node] = until
        self.run(crash(pool))
        self.alive[p] = False

    @rule(dt=st.sampled_from([1.0, 11.0, 31.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule(p=st.integers(0, 2))
    def beat(self, p: int) -> None:
        if p < 2 and not self.alive[p]:
            return
        pool = self.reader if p == 2 else self.providers[p]
        self.run(pool.renew_lease())
        self.swept = self.clock.now

    @rule()
    def sweep(self) -> None:
        self.run(self.meta.sweep("kv"))
        self.swept = self.clock.now

    @rule(owner=st.sampled_from(OWNERS), b=st.integers(0, 1), s=st.sampled_from(SESSIONS),
          recompute=st.booleans())  # fmt: skip
    def match(self, owner: str, b: int, s: str | None, recompute: bool) -> None:
        keys = list(BRANCHES[b])
        m = self.run(self.reader.match(s, keys, owner))  # never raises for a dead provider
        self.swept = self.clock.now
        self.held.add(owner)
        assert all(same(self.reader, slot, k) for slot, k in zip(m.slots, keys, strict=False))
        if recompute and m.pages < len(keys):
            try:
                slots = self.run(self.reader.alloc(owner, len(keys) - m.pages))
            except of.PoolExhaustedError:
                return
            for key, slot in zip(keys[m.pages :], slots, strict=True):
                for (sub, sl), t in content(key).items():
                    self.reader.view(slot, sub, sl).copy_(t)
            self.run(self.reader.publish(s, keys, [*m.slots, *slots]))

    @precondition(lambda self: self.held)
    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner: str) -> None:
        self.run(self.reader.release(owner))
        self.held.discard(owner)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.meta.validate("kv")
        self.reader.validate()
        p = self.meta._pools["kv"]
        for key, prov in p.providers.items():
            for node in prov:
                assert node in p.nodes, f"{key} provided by {node}, which is not registered"
        mine: Counter[tuple[str, str]] = Counter()
        for (key, provider), readers in p.locks.items():
            if self.reader.node in readers:
                mine[(key, provider)] = readers[self.reader.node]
        unlocked = self.reader._unlocked  # (both leases ran out: retried at each renewal)
        viewed = Counter(
            (f.key, f.provider) for v, f in self.reader._foreign.items() if v not in unlocked
        )
        if self.reader.node in p.nodes:  # (forgotten: its locks went; back at its next beat)
            assert mine == viewed, (mine, viewed)
        else:
            assert not mine, mine

    @invariant()
    def dead_providers_leave_in_bounded_time(self) -> None:
        nodes = self.meta._pools["kv"].nodes
        for node, until in self.deadline.items():
            if self.swept >= until:
                assert node not in nodes, f"{node} crashed, its lease ran out, still known"

    @rule()
    def everyone_beats(self) -> None:
        for p, pool in enumerate(self.providers):
            if self.alive[p]:
                self.run(pool.renew_lease())
        self.run(self.reader.renew_lease())
        self.swept = self.clock.now
        alive = {pool.node for p, pool in enumerate(self.providers) if self.alive[p]}
        provided = self.meta._pools["kv"].providers
        for view in self.reader._unlocked:  # a view of a page a live provider lists is locked
            f = self.reader._foreign[view]
            assert f.provider not in alive or f.provider not in provided.get(f.key, {})

    def teardown(self) -> None:
        try:
            for owner in OWNERS:
                self.run(self.reader.release(owner))
            stats = self.reader.stats()
            assert stats["pinned"] == 0 and stats["owners"] == 0 and stats["inflight"] == 0
            dump = self.run(self.meta.dump("kv"))
            assert dump["runs"] == {} and dump["locks"] == {}, dump
            self.meta.validate("kv")
            self.reader.validate()
        finally:
            for pool in (*self.providers, self.reader):
                self.run(pool.aclose())
            self.loop.close()


def test_providers_die_beat_and_expire_in_any_order_and_matches_stay_right() -> None:
    run_state_machine_as_test(
        LivenessMachine, settings=settings(max_examples=60, stateful_step_count=30)
    )
