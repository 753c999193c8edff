"""The pure scheduler: continuous batching and chunked prefill, checked step by step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omniflow.compute._scheduler import Scheduler, StepPlan
from omniflow.compute._sequence import SeqStatus, Sequence


def seq(name: str, n: int, new: int = 4) -> Sequence:
    return Sequence(name, list(range(1, n + 1)), max_new_tokens=new)


def apply(plan: StepPlan, sched: Scheduler, token: int = 7) -> list[Sequence]:
    """What the engine does after a step: advance, sample, drop the finished."""
    done = []
    for s, n in plan.items:
        sample = plan.samples(s, n)
        s.num_computed += n
        if sample and s.append(token) is not None:
            sched.remove(s)
            done.append(s)
    return done


def test_decoding_streams_are_not_stalled_by_a_long_prompt() -> None:
    sched = Scheduler(max_batch=4, max_step_tokens=10)
    a = seq("a", 3, new=50)
    sched.add(a)
    apply(sched.schedule(), sched)  # a prefilled, one token sampled
    sched.add(seq("long", 95))
    for _ in range(5):
        plan = sched.schedule()
        assert (a, 1) in plan.items  # a decodes every step ...
        assert sum(n for _, n in plan.items) <= 10  # ... while long is prefilled in chunks of 9
        assert dict((s.request_id, n) for s, n in plan.items)["long"] == 9
        apply(plan, sched)
        sched.validate()


def test_new_requests_join_at_the_next_step_and_finished_ones_leave() -> None:
    sched = Scheduler(max_batch=2, max_step_tokens=16)
    a, b, c = seq("a", 2, new=1), seq("b", 2, new=3), seq("c", 2, new=1)
    sched.add(a)
    sched.add(b)
    sched.add(c)
    plan = sched.schedule()
    assert [s.request_id for s, _ in plan.items] == ["a", "b"]  # c waits: max_batch
    assert apply(plan, sched) == [a]  # a finished after one token
    plan = sched.schedule()
    assert {s.request_id for s, _ in plan.items} == {"b", "c"}  # c joined at once
    sched.validate()


def test_requeued_sequence_goes_first_and_recomputes() -> None:
    sched = Scheduler(max_batch=1, max_step_tokens=8)
    a, b = seq("a", 4), seq("b", 4)
    sched.add(a)
    sched.add(b)
    apply(sched.schedule(), sched)
    a.num_computed = 0
    sched.requeue(a)
    assert sched.waiting[0] is a and a.status is SeqStatus.WAITING
    plan = sched.schedule()
    assert plan.items == [(a, 5)]  # prompt + the sampled token recomputed
    sched.validate()


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError):
        Scheduler(max_batch=0, max_step_tokens=4)
    with pytest.raises(ValueError):
        Scheduler(max_batch=8, max_step_tokens=4)


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps and aborts; every invariant holds after each, nothing starves."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler(max_batch=3, max_step_tokens=7)
        self.n = 0
        self.live: dict[str, Sequence] = {}
        self.finished: set[str] = set()
        self.steps_since_progress = 0

    @rule(length=st.integers(1, 30), new=st.integers(1, 5))
    def arrive(self, length: int, new: int) -> None:
        s = seq(f"r{self.n}", length, new)
        self.n += 1
        self.live[s.request_id] = s
        self.sched.add(s)

    @precondition(lambda self: self.sched.has_work())
    @rule()
    def step(self) -> None:
        plan = self.sched.schedule()
        if not plan.items:  # only admissions of open inputs with nothing ready yet; no spin
            assert not self.sched.has_work(), "has_work() stays true with an empty plan"
            assert all(s.input_open for s in self.sched.running)
            return
        assert sum(n for _, n in plan.items) <= self.sched.max_step_tokens
        names = [s.request_id for s, _ in plan.items]
        assert len(names) == len(set(names))
        decoding = {s.request_id for s in self.sched.running if s.decoding}
        assert decoding <= set(names), "a decoding stream was left out of a step"
        for s, n in plan.items:
            assert 1 <= n <= s.ready_prefill
            if s.input_open:  # an open input never reaches its last token, never samples
                assert not plan.samples(s, n) and s.num_computed + n < len(s.tokens)
        for s in apply(plan, self.sched):
            self.finished.add(s.request_id)
            del self.live[s.request_id]

    @rule(length=st.integers(1, 30), new=st.integers(1, 5))
    def arrive_open(self, length: int, new: int) -> None:
        """A request whose input comes in segments (segmented emission)."""
        s = seq(f"r{self.n}", length, new)
        s.input_open = True
        self.n += 1
        self.live[s.request_id] = s
        self.sched.add(s)

    @precondition(lambda self: any(s.input_open for s in self.live.values()))
    @rule(data=st.data(), length=st.integers(1, 20), last=st.booleans())
    def feed(self, data: st.DataObject, length: int, last: bool) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, s in self.live.items() if s.input_open)))
        s = self.live[name]
        generated = s.num_generated
        s.extend(list(range(1, length + 1)), {})
        assert generated == 0 and s.num_generated == 0  # nothing was sampled while open
        s.input_open = not last

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.remove(self.live.pop(name))

    @invariant()
    def valid(self) -> None:
        self.sched.validate()
        queued = {s.request_id for s in [*self.sched.running, *self.sched.waiting]}
        assert queued == set(self.live)

    def teardown(self) -> None:
        # drain: with no new arrivals (every open input closed) everything finishes within a
        # bounded number of steps
        for s in self.live.values():
            s.input_open = False
        bound = sum(len(s.tokens) + s.max_new_tokens for s in self.live.values()) + 1
        for _ in range(bound):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.holds()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(6, 20))
def test_prefill_chunks_share_the_budget_in_arrival_order(lengths: list[int], budget: int) -> None:
    sched = Scheduler(max_batch=6, max_step_tokens=budget)
    seqs = [seq(f"s{i}", n) for i, n in enumerate(lengths)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    got = [n for _, n in plan.items]
    # a one-token prompt is like a decode step (it goes first); the rest in arrival order
    ones = [s for s in seqs if len(s.tokens) == 1]
    left, want = budget - len(ones), [1] * len(ones)
    for s in (s for s in seqs if len(s.tokens) > 1):
        if left == 0:
            break
        take = min(len(s.tokens), left)
        want.append(take)
        left -= take
    assert got == want
