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

from dataclasses import dataclass, field

from omniflow.compute._queues import RunQueues
from omniflow.compute._sequence import Sequence

__all__ = ["Scheduler", "StepPlan"]


@dataclass(slots=True)
class StepPlan:
    """What one forward pass computes."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)  #: (sequence, new tokens)

    def samples(self, seq: Sequence, n: int) -> bool:
        """Whether this chunk reaches the end of a complete input (so a token is sampled)."""
        return not seq.input_open and seq.num_computed + n == len(seq.tokens)


class Scheduler(RunQueues[Sequence]):
    """Waiting and running sequences of one engine replica."""

    def __init__(self, *, max_batch: int, max_step_tokens: int) -> None:
        if max_batch < 1 or max_step_tokens < max_batch:
            raise ValueError("need max_batch >= 1 and max_step_tokens >= max_batch")
        super().__init__(max_batch=max_batch)
        self.max_step_tokens = max_step_tokens  #: tokens per forward pass (chunked prefill)

    def has_work(self) -> bool:
        """Whether ``schedule()`` has something to do: admit a sequence, or compute a token of a
        running one (an open one may be waiting for its next segment). False means the loop
        may sleep until a request arrives or a segment is fed."""
        if self.waiting and len(self.running) < self.max_batch:
            return True
        return any(s.decoding or s.ready_prefill > 0 for s in self.running)

    def schedule(self) -> StepPlan:
        """The next step's plan; empty when there is nothing to do."""
        self.admit()
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
        self.validate_queues("sequence")
        for s in self.running:
            assert 0 <= s.num_computed < len(s.tokens), f"{s}: computed out of range"
