"""The pure denoising scheduler: every running picture steps together, FIFO admission to
max_batch, requeue at the head, each picture finishing after exactly its number of steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omniflow.compute._dit_sched import DenoiseScheduler, DitSeq, StepKind
from omniflow.compute._sequence import SeqStatus


def pic(name: str, steps: int, every: int = 0) -> DitSeq:
    return DitSeq(name, torch.zeros(4, 2), steps=steps, preview_every=every)


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
    assert sched.schedule() == [a, b]  # c waits: max_batch
    assert a.advance(a.latents) is StepKind.FINAL
    sched.remove(a)
    b.advance(b.latents)
    assert sched.schedule() == [b, c]  # c joined at once
    sched.requeue(c)  # e.g. no pages for it yet
    assert list(sched.waiting) == [c] and c.status is SeqStatus.WAITING
    assert sched.schedule() == [b, c]
    sched.validate()
    with pytest.raises(ValueError):
        DenoiseScheduler(max_batch=0)


class Pictures(RuleBasedStateMachine):
    """Random arrivals, steps, aborts and requeues against a model of who must run."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = DenoiseScheduler(max_batch=3)
        self.n = 0
        self.arrival: list[str] = []  #: ids in arrival order, still live
        self.taken: dict[str, int] = {}  #: steps each live picture was scheduled for

    @rule(steps=st.integers(1, 4), every=st.integers(0, 3))
    def arrive(self, steps: int, every: int) -> None:
        s = pic(f"p{self.n}", steps, every)
        self.n += 1
        self.sched.add(s)
        self.arrival.append(s.request_id)
        self.taken[s.request_id] = 0

    @precondition(lambda self: self.sched.has_work())
    @rule()
    def step(self) -> None:
        before = [s.request_id for s in self.sched.running]
        queued = [s.request_id for s in self.sched.waiting]
        plan = self.sched.schedule()
        # everyone already running steps; newcomers come from the queue's head, to max_batch
        assert [s.request_id for s in plan] == before + queued[: 3 - len(before)]
        for s in plan:
            self.taken[s.request_id] += 1
            if s.advance(s.latents) is StepKind.FINAL:
                assert self.taken[s.request_id] == s.steps  # exactly its steps, never more
                self.sched.remove(s)
                self.arrival.remove(s.request_id)

    @precondition(lambda self: self.sched.has_work())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [*self.sched.running, *self.sched.waiting]
        s = data.draw(st.sampled_from(live))
        self.sched.remove(s)
        assert s.status is SeqStatus.FINISHED
        self.arrival.remove(s.request_id)

    @precondition(lambda self: bool(self.sched.running))
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self.sched.running))
        self.sched.requeue(s)
        assert self.sched.waiting[0] is s

    @invariant()
    def valid(self) -> None:
        self.sched.validate()
        live = {s.request_id for s in [*self.sched.running, *self.sched.waiting]}
        assert live == set(self.arrival)


Pictures.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_pictures = Pictures.TestCase
