"""SeqId order preservation (the paper's Algorithm 1), for session nodes and for the caller.

A stream is named by its stamping node and stream id; each item carries its index in that
stream. ``StreamOrder`` releases items strictly in index order and moves past an index once
the owner says that index has *settled* (no live work derived from it can still bring an item
here). Stateless nodes between the producer and this queue may finish in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["StreamOrder"]


class StreamOrder:
    """Expected index and pending items of one stream at one ordering point."""

    __slots__ = ("exp", "node", "pending", "sid", "watching")

    def __init__(self, node: str, sid: int) -> None:
        #: Node that stamped the stream.
        self.node = node
        #: Stream id (an activation id, or 0 for a session node's per-call stream).
        self.sid = sid
        #: Next index to release (Algorithm 1's ``exp``).
        self.exp = 0
        #: index -> items waiting for their turn, in arrival order.
        self.pending: dict[int, list[Any]] = {}
        #: The index whose settling the owner currently watches, or -1.
        self.watching = -1

    def push(self, idx: int, item: Any) -> None:
        if idx < self.exp:
            raise AssertionError(
                f"stream {self.node}#{self.sid}: index {idx} arrived after {self.exp} settled"
            )
        lst = self.pending.get(idx)
        if lst is None:
            self.pending[idx] = [item]
        else:
            lst.append(item)

    def take_current(self) -> list[Any]:
        """All items at the expected index (removed)."""
        return self.pending.pop(self.exp, [])

    def peek_current(self, key: Callable[[Any], Any] | None = None) -> Any | None:
        """What ``pop_current`` would take next, left in place."""
        lst = self.pending.get(self.exp)
        if not lst:
            return None
        return lst[0] if key is None or len(lst) == 1 else min(lst, key=key)

    def pop_current(self, key: Callable[[Any], Any] | None = None) -> Any | None:
        """One item at the expected index (removed), or None: the first pushed, or the
        smallest by ``key`` (the first pushed among equals)."""
        lst = self.pending.get(self.exp)
        if not lst:
            return None
        item = lst.pop(0 if key is None or len(lst) == 1 else lst.index(min(lst, key=key)))
        if not lst:
            del self.pending[self.exp]
        return item

    def advance(self) -> None:
        self.exp += 1

    def entry(self) -> tuple[str, int, int]:
        """The liveness entry of the expected index."""
        return (self.node, self.sid, self.exp)

    def validate(self) -> None:
        for idx, items in self.pending.items():
            if idx < self.exp or not items:
                raise AssertionError(
                    f"stream {self.node}#{self.sid}: pending index {idx} (exp {self.exp}) "
                    f"holds {len(items)} items"
                )
