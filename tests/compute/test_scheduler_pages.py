"""The scheduler's page budget: the exact pool I/O it plans for given states, and a state
machine that carries the I/O out against a fake pool the way ``TorchEngine``'s shell does."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from omniflow.compute._pages import PageOp
from omniflow.compute._scheduler import Scheduler, StepPlan
from omniflow.compute._sequence import SeqStatus, Sequence
from tests.compute.fake_pool import FakePool, Squeezed, carry

PT = 4  #: tokens per page in these tests


def seq(name: str, n: int, new: int = 4, slots: list[int] | None = None) -> Sequence:
    s = Sequence(name, list(range(1, n + 1)), max_new_tokens=new)
    if slots:
        s.slots = list(slots)
        s.num_computed = s.cached_tokens = len(slots) * PT
    return s


def ops(plan: StepPlan) -> list[tuple[str, str, int]]:
    return [(io.op.value, io.seq.request_id, io.pages) for io in plan.io]


def names(plan: StepPlan | list[tuple[Sequence, int]]) -> list[tuple[str, int]]:
    items = plan.items if isinstance(plan, StepPlan) else plan
    return [(s.request_id, n) for s, n in items]


# ---- the exact plan for given states ------------------------------------------------------


def test_sequences_that_fit_the_budget_get_their_pages() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=10)
    a, b = seq("a", 8), seq("b", 6)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert names(plan) == [("a", 8), ("b", 6)]
    assert ops(plan) == [("alloc", "a", 2), ("alloc", "b", 2)]
    pool = FakePool(10)
    carry(sched, plan, pool)
    assert sched.held == 4 and a.slots == [100, 101] and b.slots == [102, 103]
    sched.validate()


def test_a_sequence_short_of_pages_preempts_the_newest_running_after_it() -> None:
    """Decoding sequences come first (admission order), then prefill chunks; one the budget
    cannot serve preempts the newest sequences admitted after it (their planned pages too),
    so the oldest always advances; the preempted wait at the head of the queue."""
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=5)
    a = seq("a", 9, slots=[0, 1])  # 8 computed: decoding its 9th token needs a third page
    b, c = seq("b", 8), seq("c", 12)
    for s in (b, c, a):
        sched.add(s)
    plan = sched.schedule()
    assert names(plan.scheduled) == [("a", 1), ("b", 8), ("c", 12)]
    # a: 1 page (2 free), b: 2 (0 free), c: 3 -> a, the newest, is preempted: 1 + 2 back
    assert ops(plan) == [("alloc", "b", 2), ("preempt", "a", 2), ("alloc", "c", 3)]
    assert names(plan) == [("b", 8), ("c", 12)]
    assert plan.io[1].why == "'c' needs 3 pages, 0 are free"
    carry(sched, plan, FakePool(5))
    assert list(sched.waiting) == [a] and a.status is SeqStatus.WAITING and a.num_computed == 0
    assert sched.held == 5
    sched.validate()


def test_a_preempted_newer_sequence_leaves_the_step_even_when_it_needed_no_page() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=5)
    a = seq("a", 16)  # older, prefilling: four pages
    b = seq("b", 6, slots=[0, 1])  # newer, decoding inside its second page
    b.num_computed = 5
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert names(plan.scheduled) == [("b", 1), ("a", 16)]
    assert ops(plan) == [("preempt", "b", 2), ("alloc", "a", 4)]
    assert names(plan) == [("a", 16)]


def test_the_newest_short_of_pages_is_preempted_itself() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=5)
    a = seq("a", 9, slots=[0, 1])
    b, c = seq("b", 8), seq("c", 12)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "a", 1), ("alloc", "b", 2), ("preempt", "c", 0)]
    assert names(plan) == [("a", 1), ("b", 8)]
    assert plan.io[2].why == "needs 3 pages, 0 of the budget's 5 are free"
    sched.validate()


def test_preempting_the_newer_happens_only_when_it_makes_room() -> None:
    """b is short by 2 pages; c, newer, holds none and plans none: preempting it would not help,
    so b waits itself and c gets b's pages."""
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=6)
    a = seq("a", 12, slots=[0, 1])  # prefilling: needs one more page
    b = seq("b", 8, slots=[2, 3])  # needs two more
    a.num_computed = b.num_computed = 7
    b.tokens.extend([9, 9, 9, 9, 9])
    sched.add(a)
    sched.add(b)
    c = seq("c", 8)
    sched.add(c)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "a", 1), ("preempt", "b", 2), ("alloc", "c", 2)]
    assert names(plan) == [("a", 5), ("c", 8)]
    carry(sched, plan, FakePool(6))
    assert sched.held == 5 and b.slots == [] and b.num_computed == 0
    sched.validate()


def test_a_sequence_that_cannot_fit_alone_fails() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=2)
    a = seq("a", 12)
    sched.add(a)
    plan = sched.schedule()
    assert ops(plan) == [("fail", "a", 0)] and plan.items == []
    assert plan.io[0].why == "needs 3 pages, the budget is 2"


def test_a_finishing_sequence_makes_a_lone_one_wait_for_its_pages() -> None:
    """A sequence that finished (left the queues) still pins its pages until the shell reports
    them released: the lone sequence that needs them is preempted, not failed, and gets them
    at the next step."""
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=4)
    pool = FakePool(4)
    a, b = seq("a", 8), seq("b", 12)
    sched.add(a)
    carry(sched, sched.schedule(), pool)
    sched.remove(a)  # finished by length; its pages are released after the next plan
    sched.add(b)
    plan = sched.schedule()
    assert ops(plan) == [("preempt", "b", 0)] and plan.items == []
    carry(sched, plan, pool)
    pool.release("a")
    sched.released("a")
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "b", 3)] and names(plan) == [("b", 12)]
    carry(sched, plan, pool)
    assert sched.held == 3
    sched.validate()


def test_prefix_pages_several_sequences_matched_count_once() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=5)
    a, b = seq("a", 12, slots=[0, 1]), seq("b", 12, slots=[0, 1])
    sched.add(a)
    sched.add(b)
    assert sched.held == 2
    plan = sched.schedule()  # each needs one page for tokens 8..11: 2 + 1 + 1 <= 5
    assert ops(plan) == [("alloc", "a", 1), ("alloc", "b", 1)]
    carry(sched, plan, FakePool(5))
    sched.remove(a)
    sched.released("a")
    assert sched.held == 3  # b still pins the shared pages
    sched.validate()


def test_the_pool_refusing_what_the_budget_allowed_preempts_the_newer_then_fails() -> None:
    """A pool shared with other users refuses a sequence the budget let through: the newer
    sequence gives way and it asks again; refused once more, alone, it fails."""
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=5)
    a = seq("a", 9, slots=[0, 1])  # decoding, needs a third page
    b = seq("b", 16)  # four pages: more than the budget leaves, and a is older
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "a", 1), ("preempt", "b", 0)]
    assert plan.io.popleft().op is PageOp.ALLOC
    sched.refused(plan, a, "pool: 3 pages elsewhere")
    assert ops(plan) == [("preempt", "b", 0), ("alloc", "a", 1)]
    assert names(plan) == [("a", 1)] and plan.io[0].why == "pool: 3 pages elsewhere"
    sched.preempted(plan.io.popleft().seq)
    plan.io.popleft()
    sched.refused(plan, a, "pool: 3 pages elsewhere")
    assert ops(plan) == [("fail", "a", 0)] and plan.items == []


def test_a_refusal_gives_the_refused_pages_to_the_rest_of_the_step() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=7)
    p = seq("p", 16)  # older, prefilling: four pages
    d = seq("d", 9, slots=[0, 1])  # newer, decoding first: one page
    sched.add(p)
    sched.add(d)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "d", 1), ("alloc", "p", 4)]
    plan.io.popleft()
    sched.refused(plan, d, "pool: full")  # d is the newest: it waits itself
    assert ops(plan) == [("preempt", "d", 2), ("alloc", "p", 4)]
    assert names(plan) == [("p", 16)]


def test_without_a_budget_only_the_pools_refusals_preempt() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=64, page_tokens=PT)
    a, b = seq("a", 16), seq("b", 16)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "a", 4), ("alloc", "b", 4)]
    pool = FakePool(6)
    done = carry(sched, plan, pool)
    assert [(io.op.value, io.seq.request_id) for io in done] == [("alloc", "a"), ("preempt", "b")]
    assert names(plan) == [("a", 16)] and sched.waiting[0] is b


def test_a_lowered_budget_allows_no_new_page_until_pages_come_back() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=8)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    carry(sched, sched.schedule(), FakePool(8))
    a.num_computed = b.num_computed = 8
    a.tokens.append(5)
    b.tokens.append(5)
    sched.budget = 3  # below the 4 held
    plan = sched.schedule()
    # a (older) is short: b, newer, gives its 2 pages back: 3 - 4 + 2 = 1 free
    assert ops(plan) == [("preempt", "b", 2), ("alloc", "a", 1)]


def run_to_end(sched: Scheduler, pool: FakePool, bound: int) -> list[str]:
    """Steps (plan, I/O, compute, finish, release) until nothing is left; the failed ids."""
    failed = []
    for _ in range(bound):
        if not sched.holds():
            return failed
        plan = sched.schedule()
        ended = [io.seq for io in carry(sched, plan, pool) if io.op is PageOp.FAIL]
        failed += [s.request_id for s in ended]
        for s, n in plan.items:
            sample = plan.samples(s, n)
            s.num_computed += n
            if sample and s.append(7) is not None:
                sched.remove(s)
                ended.append(s)
        for s in ended:
            pool.release(s.request_id)
            sched.released(s.request_id)
        sched.validate()
    raise AssertionError(f"not done in {bound} steps: {sched.running} {list(sched.waiting)}")


def test_sequences_the_pool_can_never_fit_fail_instead_of_taking_turns() -> None:
    """Another user keeps 4 of the shared pool's 8 pages; each sequence needs 5. Preempting
    the one the pool refuses lets the two throw each other out forever (neither is ever alone);
    the refused older one preempts the newer, is refused alone and fails, then so does the
    other."""
    sched = Scheduler(max_batch=4, max_step_tokens=8, page_tokens=PT)
    pool = FakePool(8)
    pool.other = 4
    sched.add(seq("a", 12, new=8))
    sched.add(seq("b", 12, new=8))
    assert run_to_end(sched, pool, bound=60) == ["a", "b"]
    assert sched.held == 0 and not pool.pins


def test_a_sequence_past_the_budget_alone_fails_when_it_asks() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=8, page_tokens=PT, budget=4)
    sched.add(a := seq("a", 8, new=12))
    sched.add(b := seq("b", 8, new=12))
    sched.add(c := seq("c", 4, new=4))
    # each fails on asking for the fifth page of its 17th token; the other one waits meanwhile
    assert run_to_end(sched, FakePool(4), bound=60) == ["a", "b"]
    assert a.num_generated == b.num_generated == 9 and c.num_generated == 4


def test_an_aborted_sequence_is_not_requeued_by_its_preemption() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=2)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "a", 2), ("preempt", "b", 0)]
    sched.remove(b)  # aborted while a's pages were allocated
    carry(sched, plan, FakePool(2))
    assert b.status is SeqStatus.FINISHED and not sched.waiting
    sched.released("b")
    sched.validate()


def test_a_refusal_for_a_sequence_aborted_meanwhile_only_releases_it() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    plan.io.popleft()
    sched.remove(a)  # aborted while its pages were asked for
    sched.refused(plan, a, "pool: full")
    assert ops(plan) == [("preempt", "a", 0), ("alloc", "b", 2)]
    carry(sched, plan, FakePool(8))
    assert a.status is SeqStatus.FINISHED and list(sched.running) == [b] and not sched.waiting
    sched.released("a")
    sched.validate()


def test_validate_catches_pages_that_bypass_the_ledger() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=32, page_tokens=PT, budget=8)
    a = seq("a", 8)
    sched.add(a)
    a.slots.append(42)  # pinned behind the scheduler's back
    with pytest.raises(AssertionError, match="page ledger"):
        sched.validate()


def test_bad_budgets_are_rejected() -> None:
    with pytest.raises(ValueError):
        Scheduler(max_batch=1, max_step_tokens=4, budget=-1)
    with pytest.raises(ValueError):
        Scheduler(max_batch=1, max_step_tokens=4, page_tokens=0)


# ---- the state machine --------------------------------------------------------------------


class PagesMachine(Squeezed):
    """Arrivals (some matching published prefixes), steps, cancels, budget changes and another
    user squeezing the pool, carried out like the engine's shell: the ledger equals the pool's
    pins, pages held never pass the budget, the pool refuses only what the budget could not
    know, and once the squeeze ends everything finishes and every page comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = FakePool(12)
        self.sched = Scheduler(max_batch=3, max_step_tokens=12, page_tokens=PT, budget=12)
        self.n = 0
        self.live: dict[str, Sequence] = {}
        self.finishing: list[Sequence] = []  #: ended by length last step, pages still pinned
        self.to_release: list[Sequence] = []  #: drained before the next plan
        self.preempted: set[str] = set()
        self.failed: set[str] = set()
        self.done: set[str] = set()
        self.cancelled: set[str] = set()

    def _admit(self, s: Sequence) -> None:
        self.live[s.request_id] = s
        self.sched.add(s)

    @rule(length=st.integers(1, 20), new=st.integers(1, 4))
    def arrive(self, length: int, new: int) -> None:
        self._admit(seq(f"r{next_id(self)}", length, new))

    @precondition(lambda self: bool(self.pool.cached))
    @rule(data=st.data(), extra=st.integers(1, 8), new=st.integers(1, 4))
    def arrive_on_prefix(self, data: st.DataObject, extra: int, new: int) -> None:
        """A request whose prompt starts with a published chain: the pool pins what is left."""
        chain = data.draw(st.sampled_from(self.pool.cached))
        name = f"r{next_id(self)}"
        got = self.pool.match(name, chain)
        s = seq(name, len(got) * PT + extra, new, slots=got)
        self._admit(s)

    @precondition(lambda self: self.sched.has_work() or self.to_release or self.finishing)
    @rule()
    def step(self) -> None:
        """One turn of the engine's loop: drain releases, plan, carry out the I/O, then (as
        ``_emit`` does beside the forward) release what the last step finished, apply."""
        self._drain()
        pinned_before, refusals = len(self.pool.pinned()), self.pool.refusals
        plan = self.sched.schedule()
        for io in carry(self.sched, plan, self.pool):
            if io.op is PageOp.PREEMPT:
                self.preempted.add(io.seq.request_id)
            elif io.op is PageOp.FAIL:
                n = dict((s.request_id, n) for s, n in plan.scheduled)[io.seq.request_id]
                need = io.seq.pages_needed(n, PT)
                pinned = len(self.pool.pinned())
                assert pinned + self.pool.other + need > self.pool.capacity, "failed, yet fits"
                self.failed.add(io.seq.request_id)
                self.live.pop(io.seq.request_id)
                self.to_release.append(io.seq)
        assert self.sched.budget is None or len(self.pool.pinned()) <= max(
            self.sched.budget, pinned_before
        ), "an allocation took the pages held past the budget"
        # the budget is the pool's size: only pages another user holds surprise it
        assert self.pool.other > 0 or self.pool.refusals == refusals, "the budget let too much"
        self.to_release.extend(self.finishing)
        self.finishing = []
        for s, n in plan.items:
            if s.status is SeqStatus.FINISHED:
                continue  # cancelled while its pages were allocated
            sample = plan.samples(s, n)
            s.num_computed += n
            if sample and s.append(7) is not None:
                self.sched.remove(s)
                self.finishing.append(self.live.pop(s.request_id))
                self.done.add(s.request_id)

    def _drain(self) -> None:
        for s in self.to_release:
            full = min(s.num_computed // PT, len(s.slots))
            publish = s.slots[:full] if s.request_id in self.done else None
            self.pool.release(s.request_id, publish)
            self.sched.released(s.request_id)
        self.to_release = []

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        s = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.cancelled.add(s.request_id)
        self.sched.remove(s)
        self.to_release.append(s)

    @rule(size=st.integers(6, 16))
    def change_budget(self, size: int) -> None:
        """The engine's pool is resized (never below what is pinned in it)."""
        size = max(size, len(self.pool.pinned()) + self.pool.other)
        self.pool.capacity = self.sched.budget = size
        self.pool.trim()

    @invariant()
    def valid(self) -> None:
        sched, pool = self.sched, self.pool
        sched.validate()
        assert sched.budget is not None and sched.held <= sched.budget
        assert sched.held == len(pool.pinned()), "the ledger differs from the pool's pins"
        for s in [*self.live.values(), *self.finishing, *self.to_release]:
            assert set(s.slots) == pool.pins.get(s.request_id, set()), f"{s}: pins differ"
        queued = {s.request_id for s in [*sched.running, *sched.waiting]}
        assert queued == set(self.live)
        assert not {s.request_id for s in sched.running} & {s.request_id for s in sched.waiting}

    def teardown(self) -> None:
        # The squeeze ends and nothing arrives: every sequence runs to its end (the preempted
        # ones too) within a bounded number of steps, and every page comes back.
        self.pool.other = 0
        bound = 8 * sum(len(s.tokens) + s.max_new_tokens for s in self.live.values()) + 8
        for _ in range(bound):
            if not (self.sched.has_work() or self.to_release or self.finishing):
                break
            self.step()
            self.valid()
        assert not self.live and not self.sched.holds(), f"starved: {self.live}"
        assert self.preempted <= self.done | self.failed | self.cancelled
        assert self.sched.held == 0 and not self.pool.pins, "a page leaked"


def next_id(machine: PagesMachine) -> int:
    machine.n += 1
    return machine.n


TestPagesMachine = PagesMachine.TestCase
TestPagesMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
