"""Which activations of a batched node run together, and when: the pure part of batching.

>>> q = BatchQueue("vit.encode", max_size=2, max_wait=0.005)
>>> q.add("a1", group="call-a", now=0.0)
>>> q.take(now=0.001) is None                 # one waiting, not due yet
True
>>> q.deadline()
0.005
>>> q.add("b1", group="call-b", now=0.002)
>>> q.take(now=0.002)                          # full: the batch, in arrival order
['a1', 'b1']

No clock, no tasks, no I/O: the shell (``_batcher.Batcher``) passes ``now`` in, arms a timer
for ``deadline()`` and runs what ``take`` returns. One queue per node and replica; ``group``
is the call an activation belongs to.

**Bounded.** ``take`` returns a batch once ``max_size`` activations wait, or once the oldest has
waited ``max_wait``; the oldest waiting activation is always in the batch taken, so no
activation waits longer than ``max_wait`` past its arrival for a batch to be taken.

**Fair.** A batch is filled round-robin across calls: each round takes the oldest waiting
activation of every call (calls ordered by that activation's arrival) until the batch is full.
One call's burst of a hundred activations therefore cannot hold back another call's one: it
goes into the next batch taken after it arrived. Within a batch, activations keep their
arrival order (the order the method's lists follow).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["BatchQueue", "BatchStats"]


@dataclass(slots=True)
class BatchStats:
    """What one queue counts (``statistics()``)."""

    #: Batches taken.
    batches: int = 0
    #: Activations in those batches.
    activations: int = 0
    #: Activations removed before their batch was taken (cancelled calls).
    removed: int = 0
    #: Sum and maximum of the time each batch's oldest activation waited (seconds).
    wait_sum: float = 0.0
    wait_max: float = 0.0
    #: Batches taken because they were full (the rest: their deadline came).
    full: int = 0

    def as_dict(self, queued: int) -> dict[str, Any]:
        n = self.batches
        return {
            "batches": n,
            "activations": self.activations,
            "mean_size": self.activations / n if n else 0.0,
            "full": self.full,
            "removed": self.removed,
            "queued": queued,
            "mean_wait_s": self.wait_sum / n if n else 0.0,
            "max_wait_s": self.wait_max,
        }


class BatchQueue:
    """The waiting activations of one batched node (keys are the shell's, any hashable)."""

    __slots__ = (
        "_groups",
        "_head",
        "_n",
        "_seq",
        "_where",
        "max_size",
        "max_wait",
        "node",
        "stats",
    )

    def __init__(self, node: str, max_size: int, max_wait: float) -> None:
        #: Node name (for messages).
        self.node = node
        #: Most activations per batch.
        self.max_size = max_size
        #: Seconds the oldest waiting activation may wait before its batch is taken.
        self.max_wait = max_wait
        #: Call -> its waiting activations, oldest first: (arrival number, key, arrival time).
        self._groups: dict[Hashable, deque[tuple[int, Hashable, float]]] = {}
        #: Key -> its call (every waiting activation, once).
        self._where: dict[Hashable, Hashable] = {}
        #: Activations waiting (the sum of the groups' lengths).
        self._n = 0
        #: Arrival counter (orders activations that arrive at the same ``now``).
        self._seq = 0
        #: The oldest waiting activation (the least arrival number of the groups' heads), kept
        #: so that ``add``, ``due`` and ``deadline`` cost O(1); None when nothing waits.
        self._head: tuple[int, Hashable, float] | None = None
        #: Counters for ``statistics()``.
        self.stats = BatchStats()

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: Hashable) -> bool:
        return key in self._where

    def add(self, key: Hashable, group: Hashable, now: float) -> None:
        """Activation ``key`` of call ``group`` is ready at ``now``."""
        if key in self._where:
            raise ValueError(f"node '{self.node}': activation {key!r} is already queued")
        self._seq += 1
        self._where[key] = group
        q = self._groups.get(group)
        if q is None:
            q = self._groups[group] = deque()
        item = (self._seq, key, now)
        q.append(item)
        self._n += 1
        if self._head is None:  # (an arrival is never older than what already waits)
            self._head = item

    def remove(self, key: Hashable) -> bool:
        """Take ``key`` out (its call was cancelled); False when it is not waiting."""
        group = self._where.pop(key, None)
        if group is None:
            return False
        q = self._groups[group]
        for i, item in enumerate(q):
            if item[1] == key:
                del q[i]
                break
        if not q:
            del self._groups[group]
        self._n -= 1
        self.stats.removed += 1
        head = self._head
        if head is not None and head[1] == key:
            self._head = self._oldest()
        return True

    def _oldest(self) -> tuple[int, Hashable, float] | None:
        """The least arrival number among the groups' heads (O(calls waiting))."""
        heads = [q[0] for q in self._groups.values()]
        return min(heads) if heads else None

    def deadline(self) -> float | None:
        """When the oldest waiting activation's batch is due (None: nothing waits)."""
        head = self._head
        return None if head is None else head[2] + self.max_wait

    def due(self, now: float) -> bool:
        """True when ``take(now)`` would return a batch."""
        if self._n >= self.max_size:
            return True
        head = self._head
        return head is not None and now >= head[2] + self.max_wait

    def take(self, now: float) -> list[Any] | None:
        """The next batch when one is due (full, or its oldest activation waited
        ``max_wait``), else None: up to ``max_size`` keys, round-robin across calls, in
        arrival order."""
        if not self.due(now):
            return None
        picked: list[tuple[int, Hashable, float]] = []
        groups = self._groups
        while len(picked) < self.max_size and groups:
            # One round: the oldest activation of every call, the calls in that order.
            for group in sorted(groups, key=lambda g: groups[g][0][0]):
                q = groups[group]
                item = q.popleft()
                picked.append(item)
                del self._where[item[1]]
                if not q:
                    del groups[group]
                if len(picked) == self.max_size:
                    break
        picked.sort()
        self._n -= len(picked)
        self._head = self._oldest()
        st = self.stats
        st.batches += 1
        st.activations += len(picked)
        if len(picked) == self.max_size:
            st.full += 1
        waited = max(0.0, now - picked[0][2])
        st.wait_sum += waited
        st.wait_max = max(st.wait_max, waited)
        return [item[1] for item in picked]

    def statistics(self) -> dict[str, Any]:
        """``{"batches", "activations", "mean_size", "full", "removed", "queued",
        "mean_wait_s", "max_wait_s"}``."""
        return self.stats.as_dict(self._n)

    def validate(self) -> None:
        """Check the invariants (tests call it after every step)."""
        total = 0
        seen: set[Hashable] = set()
        for group, q in self._groups.items():
            assert q, f"node '{self.node}': call {group!r} holds an empty queue"
            last = 0
            for seq, key, _t in q:
                assert seq > last, f"node '{self.node}': call {group!r} is out of arrival order"
                last = seq
                assert key not in seen, f"node '{self.node}': {key!r} is queued twice"
                assert self._where.get(key, _MISSING) == group, (
                    f"node '{self.node}': {key!r} is queued under {group!r} but indexed under "
                    f"{self._where.get(key)!r}"
                )
                seen.add(key)
            total += len(q)
        assert total == self._n == len(self._where), (
            f"node '{self.node}': {total} queued, counted {self._n}, indexed {len(self._where)}"
        )
        assert self._head == self._oldest(), (
            f"node '{self.node}': the kept oldest {self._head!r} is not {self._oldest()!r}"
        )
        st = self.stats
        assert st.activations >= st.batches >= st.full >= 0 and st.removed >= 0
        assert st.activations <= st.batches * self.max_size


_MISSING = object()
