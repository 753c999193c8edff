"""The waiting/running queues shared by the LLM and DiT schedulers.

>>> from omniflow.compute._sequence import Sequence
>>> q: RunQueues[Sequence] = RunQueues(max_batch=1)
>>> q.add(Sequence("a", [1], max_new_tokens=1)); q.add(Sequence("b", [1], max_new_tokens=1))
>>> [s.request_id for s in q.admit()], [s.request_id for s in q.waiting]
(['a'], ['b'])

Both schedulers keep admitted work in a FIFO ``waiting`` queue and a ``running`` list of at most
``max_batch`` items, move items between them with the same status transitions, and check the
same invariants; what each runs per forward pass is theirs (``Scheduler.schedule`` shares a
token budget, ``DenoiseScheduler.schedule`` steps every running picture).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, TypeVar

from omniflow.compute._sequence import SeqStatus

__all__ = ["Queued", "RunQueues"]


class Queued(Protocol):
    """What the queues need of an item: an id and a lifecycle status."""

    request_id: str
    status: SeqStatus


T = TypeVar("T", bound=Queued)


class RunQueues(Generic[T]):
    """Waiting (FIFO) and running (admission order) items of one engine replica."""

    def __init__(self, *, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError("need max_batch >= 1")
        self.max_batch = max_batch  #: items running at once
        self.waiting: deque[T] = deque()  #: admitted, not yet running (FIFO)
        self.running: list[T] = []  #: holding pages, in admission order

    def add(self, seq: T) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def requeue(self, seq: T) -> None:
        """Back to the head of the queue (preempted, or the pool could not give it pages yet)."""
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: T) -> None:
        """Drop an item (finished or aborted) from whichever queue holds it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def holds(self) -> bool:
        """Whether any item is queued or running (work or not)."""
        return bool(self.running or self.waiting)

    def admit(self) -> list[T]:
        """Move waiting items to running while there is room; the running list after."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return self.running

    def validate_queues(self, noun: str) -> None:
        """Check the invariants both schedulers share (``noun`` names an item in messages)."""
        assert len(self.running) <= self.max_batch, "more running than max_batch"
        ids = [s.request_id for s in [*self.running, *self.waiting]]
        assert len(ids) == len(set(ids)), f"a {noun} is queued twice: {ids}"
        for s in self.running:
            assert s.status is SeqStatus.RUNNING, f"{s} in running"
        for s in self.waiting:
            assert s.status is SeqStatus.WAITING, f"{s} in waiting"
