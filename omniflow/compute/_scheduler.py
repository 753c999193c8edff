"""Continuous batching: which sequences compute how many tokens in the next step.

>>> sched = Scheduler(max_batch=2, max_step_tokens=8)
>>> sched.add(Sequence("a", [1] * 20, max_new_tokens=4))
>>> [(s.request_id, n) for s, n in sched.schedule().items]
[('a', 8)]

``schedule()`` is a pure function of the scheduler's state: it admits waiting sequences while
there is room (``max_batch``), gives every decoding sequence its one token, and shares the rest
of the step's token budget among prefilling sequences in arrival order, in chunks, so a long
prompt never stalls the streams already decoding. A sequence whose input is still open
(segmented emission: more segments are on their way) prefills what it has except its last
token, and samples nothing until the input is closed. The async shell carries the plan out
(allocates pages, runs the model) and reports back with ``finish_step``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omniflow.compute._sequence import SeqStatus, Sequence

__all__ = ["Scheduler", "StepPlan"]


@dataclass(slots=True)
class StepPlan:
    """What one forward pass computes."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)  #: (sequence, new tokens)

    def samples(self, seq: Sequence, n: int) -> bool:
        """Whether this chunk reaches the end of a complete input (so a token is sampled)."""
        return not seq.input_open and seq.num_computed + n == len(seq.tokens)


class Scheduler:
    """Waiting and running sequences of one engine replica."""

    def __init__(self, *, max_batch: int, max_step_tokens: int) -> None:
        if max_batch < 1 or max_step_tokens < max_batch:
            raise ValueError("need max_batch >= 1 and max_step_tokens >= max_batch")
        self.max_batch = max_batch  #: sequences running at once
        self.max_step_tokens = max_step_tokens  #: tokens per forward pass (chunked prefill)
        self.waiting: deque[Sequence] = deque()  #: admitted, not yet running (FIFO)
        self.running: list[Sequence] = []  #: holding pages, in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Put a preempted sequence back at the head of the queue (its KV must be recomputed)."""
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) from whichever queue holds it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        """Whether ``schedule()`` has something to do: admit a sequence, or compute a token of a
        running one (an open one may be waiting for its next segment). False means the loop
        may sleep until a request arrives or a segment is fed."""
        if self.waiting and len(self.running) < self.max_batch:
            return True
        return any(s.decoding or s.ready_prefill > 0 for s in self.running)

    def holds(self) -> bool:
        """Whether any sequence is queued or running (work or not)."""
        return bool(self.running or self.waiting)

    def schedule(self) -> StepPlan:
        """The next step's plan; empty when there is nothing to do."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        plan = StepPlan()
        budget = self.max_step_tokens
        decoding = [s for s in self.running if s.decoding]
        for seq in decoding:
            plan.items.append((seq, 1))
        budget -= len(decoding)
        for seq in self.running:
            need = seq.ready_prefill
            if need > 0 and not seq.decoding and budget > 0:
                n = min(need, budget)
                plan.items.append((seq, n))
                budget -= n
        return plan

    def validate(self) -> None:
        """Check the invariants (tests call this after every transition)."""
        assert len(self.running) <= self.max_batch, "more running than max_batch"
        ids = [s.request_id for s in [*self.running, *self.waiting]]
        assert len(ids) == len(set(ids)), f"a sequence is queued twice: {ids}"
        for s in self.running:
            assert s.status is SeqStatus.RUNNING, f"{s} in running"
            assert 0 <= s.num_computed < len(s.tokens), f"{s}: computed out of range"
        for s in self.waiting:
            assert s.status is SeqStatus.WAITING, f"{s} in waiting"
