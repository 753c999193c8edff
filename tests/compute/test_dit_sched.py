"""The pure denoising scheduler: every running picture steps together, FIFO admission to
max_batch, each picture finishing after exactly its number of steps; its page budget (the exact
pool I/O for given states) and a state machine carrying the I/O out against a fake pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from omniflow.compute._dit_sched import DenoisePlan, DenoiseScheduler, DitSeq, StepKind
from omniflow.compute._pages import PageOp
from omniflow.compute._sequence import SeqStatus
from tests.compute.fake_pool import FakePool, Squeezed, carry

PT = 4  #: tokens per page in these tests


def pic(
    name: str, steps: int, every: int = 0, tokens: int = 4, context: list[int] | None = None
) -> DitSeq:
    s = DitSeq(name, torch.zeros(tokens, 2), steps=steps, preview_every=every)
    s.slots = list(context or [])
    s.context_len = len(s.slots) * PT
    return s


def ops(plan: DenoisePlan) -> list[tuple[str, str, int]]:
    return [(io.op.value, io.seq.request_id, io.pages) for io in plan.io]


def ids(seqs: object) -> list[str]:
    return [s.request_id for s in seqs]  # type: ignore[attr-defined]


def test_steps_previews_and_final() -> None:
    s = pic("a", 5, every=2)
    assert s.timesteps() == (1.0, 0.8)
    kinds = [s.advance(torch.full((4, 2), float(i))) for i in range(5)]
    assert kinds == [
        StepKind.STEP,
        StepKind.PREVIEW,
        StepKind.STEP,
        StepKind.PREVIEW,
        StepKind.FINAL,
    ]
    assert s.finish_reason == "length" and s.done == 5 and float(s.latents[0, 0]) == 4.0
    with pytest.raises(ValueError, match="past the last"):
        s.advance(s.latents)


def test_arrivals_join_at_the_next_step_and_the_finished_leave() -> None:
    sched = DenoiseScheduler(max_batch=2)
    a, b, c = pic("a", 1), pic("b", 3), pic("c", 2)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert plan.items == [a, b] and ops(plan) == [("alloc", "a", 1), ("alloc", "b", 1)]
    carry(sched, plan, FakePool(8))
    assert a.advance(a.latents) is StepKind.FINAL
    sched.remove(a)
    sched.released("a")
    b.advance(b.latents)
    plan = sched.schedule()
    assert plan.items == [b, c] and ops(plan) == [("alloc", "c", 1)]  # c joined at once
    sched.validate()
    with pytest.raises(ValueError):
        DenoiseScheduler(max_batch=0)
    with pytest.raises(ValueError, match="budget"):
        DenoiseScheduler(max_batch=1, budget=-1)


# ---- the exact plan for given states ------------------------------------------------------


def test_pictures_that_fit_the_budget_get_their_own_pages_once() -> None:
    sched = DenoiseScheduler(max_batch=4, page_tokens=PT, budget=4)
    a, b = pic("a", 2, tokens=8), pic("b", 2, tokens=5)  # 2 pages each (5 tokens: 2 pages)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.items == [a, b] and ops(plan) == [("alloc", "a", 2), ("alloc", "b", 2)]
    pool = FakePool(4)
    carry(sched, plan, pool)
    assert sched.held == 4 and a.slots == [100, 101] and b.own_pages
    plan = sched.schedule()
    assert plan.items == [a, b] and not plan.io  # own pages are allocated once, kept to the end
    sched.validate()


def test_a_picture_short_of_pages_waits_for_a_running_one_to_finish() -> None:
    """The budget serves a; b and c wait at the head of the queue (each requeue goes to the
    head, so c, sent back last, is first), holding no page of their own."""
    sched = DenoiseScheduler(max_batch=4, page_tokens=PT, budget=3)
    a, b, c = (pic(n, 1, tokens=8) for n in "abc")
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert plan.items == [a] and ops(plan) == [("alloc", "a", 2)]
    assert plan.waited == [b, c] and ids(sched.waiting) == ["c", "b"]
    pool = FakePool(3)
    carry(sched, plan, pool)
    sched.validate()
    plan = sched.schedule()  # c, then b (both waiting for a's pages) rejoin the batch
    assert plan.items == [a] and plan.waited == [c, b] and not plan.io
    a.advance(a.latents)
    sched.remove(a)
    pool.release("a")  # the shell drains releases before it plans again
    sched.released("a")
    plan = sched.schedule()
    assert plan.items == [b] and ops(plan) == [("alloc", "b", 2)] and plan.waited == [c]
    sched.validate()


def test_a_picture_alone_short_of_pages_fails() -> None:
    """Nothing running holds pages of its own (the other's context pins are not coming back
    by a step): the picture cannot fit even alone and fails."""
    sched = DenoiseScheduler(max_batch=1, page_tokens=PT, budget=4)
    a, b = pic("a", 1, tokens=8), pic("b", 1, context=[0, 1, 2])
    sched.add(a)
    sched.add(b)  # waits for room in the batch, its context pinned
    plan = sched.schedule()
    assert plan.items == [] and ops(plan) == [("fail", "a", 0)]
    assert plan.io[0].why == "needs 2 pages, 1 of the budget's 4 are free"


def test_a_picture_whose_pages_pass_the_budget_fails_at_once() -> None:
    """b's context and own pages together pass the budget: it could never run, so it does not
    wait for a (which fits beside b's context) to finish."""
    sched = DenoiseScheduler(max_batch=2, page_tokens=PT, budget=4)
    a, b = pic("a", 1, tokens=4), pic("b", 1, tokens=8, context=[0, 1, 2])
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.items == [a] and ops(plan) == [("alloc", "a", 1), ("fail", "b", 3)]
    assert plan.io[1].why == "needs 5 pages, the budget is 4"


def test_context_pages_several_pictures_share_count_once() -> None:
    sched = DenoiseScheduler(max_batch=2, page_tokens=PT, budget=4)
    a, b = pic("a", 1, context=[0, 1]), pic("b", 1, context=[0, 1])
    sched.add(a)
    sched.add(b)
    assert sched.held == 2
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "a", 1), ("alloc", "b", 1)]
    sched.released("a")
    assert sched.held == 2  # b still pins the context
    sched.remove(b)
    sched.released("b")
    assert sched.held == 0


def test_without_a_budget_the_pools_refusal_makes_a_picture_wait_or_fail() -> None:
    """A pool shared with the LLM: the plan asks for every picture; a refused one waits while
    another running picture got its own pages, and fails (next) when none did."""
    sched = DenoiseScheduler(max_batch=4, page_tokens=PT)
    a, b, c = (pic(n, 1, tokens=8) for n in "abc")
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "a", 2), ("alloc", "b", 2), ("alloc", "c", 2)]
    pool = FakePool(3)
    done = carry(sched, plan, pool)
    assert [(io.op, io.seq) for io in done] == [(PageOp.ALLOC, a)]
    assert plan.items == [a] and plan.waited == [b, c] and pool.refusals == 2
    sched.validate()
    lone = DenoiseScheduler(max_batch=4, page_tokens=PT)
    d = pic("d", 1, tokens=8)
    lone.add(d)
    plan = lone.schedule()
    done = carry(lone, plan, FakePool(1))
    assert [(io.op, io.seq) for io in done] == [(PageOp.FAIL, d)] and plan.items == []
    assert "1 elsewhere" not in done[0].why and done[0].why.startswith("2 pages")


def test_a_refused_picture_waits_for_one_given_pages_later_in_the_same_plan() -> None:
    """The first picture of a plan is refused (the pool is squeezed), a later one fits: the
    first waits for the later one's pages instead of failing as if it were alone (hypothesis
    found this order: the refusal is decided before the later ``ALLOC`` is carried out)."""
    sched = DenoiseScheduler(max_batch=4, page_tokens=PT)
    big, small = pic("big", 1, tokens=8), pic("small", 1, tokens=4)
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert ops(plan) == [("alloc", "big", 2), ("alloc", "small", 1)]
    done = carry(sched, plan, FakePool(1))
    assert [(io.op, io.seq) for io in done] == [(PageOp.ALLOC, small)]
    assert plan.items == [small] and plan.waited == [big]
    sched.validate()


def test_validate_catches_pages_that_bypass_the_ledger() -> None:
    sched = DenoiseScheduler(max_batch=1, page_tokens=PT, budget=4)
    a = pic("a", 2)
    sched.add(a)
    a.slots.append(9)  # a page the shell took without reporting ``allocated``
    with pytest.raises(AssertionError, match="page ledger"):
        sched.validate()


# ---- the state machine --------------------------------------------------------------------


class Pictures(Squeezed):
    """Arrivals (some on the LLM's published context), steps, aborts and another user
    squeezing the pool, carried out like the engine's shell: every running picture with its
    pages steps, newcomers join from the queue's head, a picture with its own pages is never
    held back, each takes exactly its steps, the ledger equals the pool's pins and stays within
    the budget, a failure happens only when the picture could not fit alone, and once the
    squeeze ends everything finishes and every page comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = FakePool(8)
        self.pool.resident = {0, 1, 2}
        self.pool.cached = [[0, 1], [2]]  #: the LLM's published prompts
        self.sched = DenoiseScheduler(max_batch=3, page_tokens=PT, budget=8)
        self.n = 0
        self.live: dict[str, DitSeq] = {}
        self.taken: dict[str, int] = {}  #: steps each live picture was scheduled for
        self.to_release: list[DitSeq] = []  #: finished, failed or aborted: drained next step
        self.failed: set[str] = set()

    @rule(
        steps=st.integers(1, 4),
        every=st.integers(0, 3),
        tokens=st.integers(1, 12),
        context=st.sampled_from([None, 0, 1]),
    )
    def arrive(self, steps: int, every: int, tokens: int, context: int | None) -> None:
        self.n += 1
        name = f"p{self.n}"
        slots = [] if context is None else self.pool.match(name, self.pool.cached[context])
        if context is not None and len(slots) < len(self.pool.cached[context]):
            self.pool.release(name)  # evicted before the DiT matched it: the request fails
            return
        s = pic(name, steps, every, tokens, slots)
        self.sched.add(s)
        self.live[name] = s
        self.taken[name] = 0

    @precondition(lambda self: self.sched.has_work() or self.to_release)
    @rule()
    def step(self) -> None:
        """One turn of the engine's loop: drain releases, plan, carry out, step, apply."""
        sched = self.sched
        for s in self.to_release:
            self.pool.release(s.request_id)
            sched.released(s.request_id)
        self.to_release = []
        before = list(sched.running)
        newcomers = list(sched.waiting)[: sched.max_batch - len(before)]
        holding = [s for s in before if s.own_pages]
        plan = sched.schedule()
        for io in carry(sched, plan, self.pool):
            if io.op is PageOp.FAIL:
                s = io.seq
                others = [o for o in sched.running if o.own_pages]
                alone = len(set(s.slots)) + sched.own_pages(s) > 8
                assert alone or not others, f"{s} failed while {others} hold pages"
                self.failed.add(s.request_id)
                self.to_release.append(self.live.pop(s.request_id))
        assert [s for s in [*before, *newcomers] if s in plan.items] == plan.items
        assert set(holding) <= set(plan.items), "a picture holding its pages was held back"
        for s in plan.waited:
            assert s.status is SeqStatus.WAITING and not s.own_pages
        for s in plan.items:
            assert s.own_pages and s.status is SeqStatus.RUNNING
            self.taken[s.request_id] += 1
            if s.advance(s.latents) is StepKind.FINAL:
                assert self.taken[s.request_id] == s.steps  # exactly its steps, never more
                sched.remove(s)
                self.to_release.append(self.live.pop(s.request_id))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        s = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.sched.remove(s)
        assert s.status is SeqStatus.FINISHED
        self.to_release.append(s)

    @invariant()
    def valid(self) -> None:
        sched, pool = self.sched, self.pool
        sched.validate()
        assert sched.held <= 8 and sched.held == len(pool.pinned()), "ledger != pool pins"
        for s in [*self.live.values(), *self.to_release]:
            assert set(s.slots) == pool.pins.get(s.request_id, set()), f"{s}: pins differ"
        assert {s.request_id for s in [*sched.running, *sched.waiting]} == set(self.live)

    def teardown(self) -> None:
        # The squeeze ends and nothing arrives: every picture that can fit finishes within a
        # bounded number of steps, and every page comes back.
        self.pool.other = 0
        bound = 4 * sum(s.steps for s in self.live.values()) + 4 * len(self.live) + 4
        for _ in range(bound):
            if not (self.sched.has_work() or self.to_release):
                break
            self.step()
            self.valid()
        assert not self.live and not self.sched.holds(), f"starved: {self.live}"
        assert self.sched.held == 0 and not self.pool.pins, "a page leaked"


Pictures.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_pictures = Pictures.TestCase
