"""A fake KV pool and the shell's carry-out, for the schedulers' page tests: what the engine's
``ParamsPool`` answers and what ``EngineBase._carry_out`` does with a plan's I/O, in a few lines."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from omniflow.compute._dit_sched import DenoisePlan, DenoiseScheduler
from omniflow.compute._pages import PageIO, PageOp
from omniflow.compute._scheduler import Scheduler, StepPlan


class Refused(Exception):
    pass


class FakePool:
    """Pages pinned per owner, published pages kept (evictable) until room is needed, and pages
    another user holds (``other``): what the engine's ``ParamsPool`` answers, in a few lines."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pins: dict[str, set[int]] = {}
        self.cached: list[list[int]] = []  #: published chains (pages stay until evicted)
        self.resident: set[int] = set()
        self.other = 0
        self.refusals = 0
        self._ids = itertools.count(100)  # the tests' made-up pages are below 100

    def pinned(self) -> set[int]:
        return set().union(*self.pins.values()) if self.pins else set()

    def alloc(self, owner: str, n: int) -> list[int]:
        if len(self.pinned()) + self.other + n > self.capacity:
            self.refusals += 1
            raise Refused(f"{n} pages: {len(self.pinned())} pinned, {self.other} elsewhere")
        pinned = self.pinned()
        for page in sorted(self.resident - pinned):  # evict published pages, oldest first
            if len(self.resident) + self.other + n <= self.capacity:
                break
            self.resident.discard(page)
        fresh = [next(self._ids) for _ in range(n)]
        self.resident.update(fresh)
        self.pins.setdefault(owner, set()).update(fresh)
        return fresh

    def trim(self) -> None:
        """Evict published pages until what is resident fits beside the other user's."""
        for page in sorted(self.resident - self.pinned()):
            if len(self.resident) + self.other <= self.capacity:
                break
            self.resident.discard(page)

    def squeeze(self, pages: int) -> None:
        """Another user takes up to ``pages`` free pages (published ones are evicted for it)."""
        free = self.capacity - len(self.pinned()) - self.other
        self.other += min(pages, max(free, 0))
        self.trim()

    def match(self, owner: str, chain: list[int]) -> list[int]:
        got = list(itertools.takewhile(lambda p: p in self.resident, chain))
        if got:
            self.pins.setdefault(owner, set()).update(got)
        return got

    def release(self, owner: str, publish: list[int] | None = None) -> None:
        self.pins.pop(owner, None)
        if publish:
            self.cached.append(publish)


def carry(
    sched: Scheduler | DenoiseScheduler, plan: StepPlan | DenoisePlan, pool: FakePool
) -> list[PageIO[Any]]:
    """What ``EngineBase._carry_out`` does, against ``pool``; the I/O done, in order."""
    done = []
    while plan.io:
        io = plan.io.popleft()
        if io.op is PageOp.ALLOC:
            try:
                fresh = pool.alloc(io.seq.request_id, io.pages)
            except Refused as exc:
                sched.refused(plan, io.seq, str(exc))
                continue
            sched.allocated(io.seq, fresh)
        elif io.op is PageOp.PREEMPT:
            assert isinstance(sched, Scheduler), "the DiT's scheduler never preempts"
            pool.release(io.seq.request_id)
            sched.preempted(io.seq)
        else:
            sched.remove(io.seq)
        done.append(io)
    return done


class Squeezed(RuleBasedStateMachine):
    """The rules of a state machine whose ``pool`` another user squeezes now and then."""

    pool: FakePool

    @rule(pages=st.integers(1, 6))
    def squeeze(self, pages: int) -> None:
        """Another user of the pool takes free pages (the budget cannot know it)."""
        self.pool.squeeze(pages)

    @rule()
    def relax(self) -> None:
        self.pool.other = 0
