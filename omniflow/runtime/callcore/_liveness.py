"""Liveness: which work of a call is still alive, per root entry and per node.

This is omniflow's ActivityTracker. Every piece of work of a call (an activation that is
pending or running, a bucket still gathering) is counted at its node under every entry of its
table (see ``_core``). From the counts two questions get answered without any message:

* is the call finished?  (no work at all)
* has a stream ended?    (no live work under an entry can still reach a given node)

The second question is what UNREACHABLE means in omniflow: a slot, a seq or a caller field
whose producers can no longer be reached by any live work derived from the same root frame has
ended. Zero-yields, exceptions, cancellation and missing fields all end streams this way, so no
UNREACHABLE message can be lost, duplicated or circle forever in a loop.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FRAME", "INPUT_ENTRY", "Entry", "Liveness", "Table", "Uncounted"]

#: A root/seq entry: (node that stamped it, stream id, index in that stream).
Entry = tuple[str, int, int]
#: The entries a piece of work descends from, oldest first; always starts with INPUT_ENTRY.
Table = tuple[Entry, ...]

#: The call itself: the root of everything a call does.
INPUT_ENTRY: Entry = ("<input>", 0, 0)

#: Pseudo-node of a stamped frame whose fields are still being dispatched, counted under that
#: frame's own entry only (the stamping node is counted under the older entries). Every
#: feeder set holds it: until the frame is out, anything may still come under its entry.
#: Counting the stamping node itself there would make its later activations (a loop that
#: comes back to it, each of which restamps) look like producers for the frame's buckets.
FRAME = "<frame>"


class Liveness:
    """Counts of live work per (entry, node), plus the set of entries that changed."""

    __slots__ = ("counts", "dirty", "watched")

    def __init__(self) -> None:
        #: entry -> node -> number of live work items at that node descending from the entry.
        self.counts: dict[Entry, dict[str, int]] = {}
        #: Entries somebody waits on (a bucket, an ordering queue).
        self.watched: dict[Entry, int] = {}
        #: Watched entries whose count at some node dropped to zero since the owner last
        #: looked, with those nodes (a waiter only cares if one of them could feed it).
        self.dirty: dict[Entry, list[str]] = {}

    def inc(self, table: Table, node: str) -> None:
        counts = self.counts
        for e in table:
            d = counts.get(e)
            if d is None:
                counts[e] = {node: 1}
            else:
                d[node] = d.get(node, 0) + 1

    def dec(self, table: Table, node: str) -> None:
        counts = self.counts
        for e in table:
            d = counts[e]
            c = d[node] - 1
            if c:
                d[node] = c
                continue
            del d[node]
            if not d:
                del counts[e]
            if e in self.watched:
                nodes = self.dirty.get(e)
                if nodes is None:
                    self.dirty[e] = [node]
                else:
                    nodes.append(node)

    def watch(self, e: Entry) -> None:
        self.watched[e] = self.watched.get(e, 0) + 1

    def unwatch(self, e: Entry) -> None:
        n = self.watched[e] - 1
        if n:
            self.watched[e] = n
        else:
            del self.watched[e]

    def reaches(
        self, e: Entry, sources: frozenset[str], discount: dict[str, int] | None = None
    ) -> bool:
        """True if live work under ``e`` sits at one of ``sources`` (nodes that can reach the
        target), after subtracting ``discount`` (work that must not count, e.g. the asker)."""
        d = self.counts.get(e)
        if not d:
            return False
        for node, c in d.items():
            if node in sources:
                if discount is not None:
                    c -= discount.get(node, 0)
                if c > 0:
                    return True
        return False

    def validate(self, expected: Iterable[tuple[Table, str]]) -> None:
        """Recount from the live work the owner knows about; raise on any difference."""
        fresh = Liveness()
        for table, node in expected:
            fresh.inc(table, node)
        if fresh.counts != self.counts:
            raise AssertionError(f"liveness drifted: have {self.counts}, expected {fresh.counts}")


class Uncounted(Liveness):
    """The liveness of a plan that never asks (no bucket, no SeqId stream, no latch: nothing
    waits for a stream to end, and a call ends when its last activation does): counts nothing,
    one dict update less per activation start and end."""

    __slots__ = ()

    def inc(self, table: Table, node: str) -> None:
        pass

    def dec(self, table: Table, node: str) -> None:
        pass
