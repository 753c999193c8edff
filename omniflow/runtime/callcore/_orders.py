"""Every SeqId order of one call (Algorithm 1): session nodes and the caller.

A session node keeps one ``StreamOrder`` per input stream and runs one activation at a time
(``busy``), releasing indices in order and skipping an index once it settled; the caller
gets the same per (field, stream). Within one index a session node runs its OR groups in
declaration order: a later group's activation waits while an earlier group's bucket of its
index still gathers (``Compiled.group_ordered`` nodes, whose buckets are indexed here by
SeqId entry), unless only the node's own queued work can still feed that bucket (a loop:
"loop"), or nothing runs but held-back work (the earliest held node goes first: "stuck").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omniflow.runtime.callcore._buckets import Bucket
from omniflow.runtime.callcore._callstate import CallState
from omniflow.runtime.callcore._latches import Latches
from omniflow.runtime.callcore._liveness import Entry
from omniflow.runtime.callcore._ordering import StreamOrder
from omniflow.runtime.callcore._stimuli import Activation

__all__ = ["Orders"]


class _SessionQueue:
    """Algorithm 1 state of one lb="session" node within one call."""

    __slots__ = ("busy", "streams")

    def __init__(self) -> None:
        #: One of its activations runs.
        self.busy = False
        #: One order per input stream (node, stream id).
        self.streams: dict[tuple[str, int], StreamOrder] = {}


#: A waiter of an order on an entry: (its order, caller field or None, session node or "").
OrderWaiter = tuple[StreamOrder, "str | None", str]


class Orders:
    """The session queues and caller orders of one call."""

    __slots__ = ("_caller", "_latches", "_queues", "_seq", "_st", "seq_buckets")

    def __init__(self, st: CallState, latches: Latches) -> None:
        self._st = st
        self._latches = latches
        #: Session queues by node.
        self._queues: dict[str, _SessionQueue] = {}
        #: Per stamping session node: frames stamped so far (the next frame's index).
        self._seq: dict[str, int] = {}
        #: Caller orders by (field, stream node, stream id).
        self._caller: dict[tuple[str, str, int], StreamOrder] = {}
        #: Gathering buckets of group-ordered session nodes by (node, SeqId entry): an
        #: earlier group's bucket of an index holds back later groups' activations of it.
        self.seq_buckets: dict[tuple[str, Entry | None], list[Bucket]] = {}

    def next_index(self, node: str) -> int:
        """The SeqId index of a session node's next stamped frame."""
        n = self._seq.get(node, 0)
        self._seq[node] = n + 1
        return n

    # ------------------------------------------------------------------ session nodes

    def push(self, act: Activation) -> None:
        """Queue an admitted activation of a session node."""
        node = act.node
        sq = self._queues.get(node)
        if sq is None:
            sq = self._queues[node] = _SessionQueue()
        skey = (act.seq[0], act.seq[1])
        so = sq.streams.get(skey)
        if so is None:
            so = sq.streams[skey] = StreamOrder(act.seq[0], act.seq[1])
        so.push(act.seq[2], act)
        if len(self._st.c.specs[node].groups) > 1:
            # Activations of one SeqId index run in OR-group declaration order: wait for
            # the rest of this step's arrivals before picking (settle pumps it).
            self._st._pump_later.add(node)
        else:
            self.pump(node)

    def idle(self, node: str) -> None:
        """An activation of session node ``node`` ended: release its next one."""
        self._queues[node].busy = False
        self.pump(node)

    def pump(self, node: str, settled: bool = False, force: bool = False) -> None:
        """Release the next activation of a session node in SeqId order (Algorithm 1); within
        one index, in OR-group order (docs/contract.md §1). ``settled``: called by the settle
        with every bucket decided that can be, so a bucket still gathering is waiting on work
        that is live now; ``force``: the call is stuck, release the first held-back one."""
        st = self._st
        sq = self._queues[node]
        if sq.busy or st.closing:
            return
        feeders = st.c.seq_feeders[node]
        own = frozenset((node,))
        ordered = node in st.c.group_ordered
        if ordered:
            st._held.discard(node)
        for so in sq.streams.values():
            while so.pending:
                act = so.peek_current(_group_of)
                if act is not None:
                    why = "order"
                    if ordered and act.group:
                        why = self.group_wait(node, act, settled)
                        if why == "wait" and force:
                            why, force = "stuck", False
                        if why == "wait":
                            # An earlier group's bucket of this index may still fire: its
                            # activation goes first (retiring it, or settling, pumps again).
                            st._held.add(node)
                            self._unwatch(so)
                            if not settled:
                                st._pump_later.add(node)
                            break
                    so.pop_current(_group_of)
                    sq.busy = True
                    self._unwatch(so)
                    if st._story is not None and ordered:
                        st._log("session", node, act.group, act.aid, act.seq, why)
                    st._run(act)
                    return
                e = so.entry()
                if (
                    st.live.reaches(e, feeders)
                    or st.blive.reaches(e, own)
                    or (st.n_parked and self._latches.parked_under(e, node))
                ):
                    self._watch(so, None, node)
                    break
                so.advance()

    def group_wait(self, node: str, act: Activation, settled: bool) -> str:
        """Must ``act`` (a later OR group's) wait for an earlier group's bucket of its index?
        "wait" while such a bucket can still fire without the node's own queued work, "loop"
        when the node's queued work alone can still complete every such bucket (waiting would
        deadlock the call: the later activation runs first), "order" when there is none."""
        group = act.group
        earlier = [b for b in self.seq_buckets.get((node, act.seq), ()) if b.spec.group < group]
        if not earlier:
            return "order"
        counts = self._st.live.counts
        if settled and all(b.fed_only_at(counts.get(b.key), node) for b in earlier):
            return "loop"
        return "wait"

    def bucket_born(self, b: Bucket) -> None:
        """A bucket of a group-ordered session node began to gather."""
        self.seq_buckets.setdefault((b.spec.node, b.seq), []).append(b)

    def bucket_gone(self, b: Bucket) -> None:
        """A bucket of a group-ordered session node fired or died."""
        node = b.spec.node
        sk = (node, b.seq)
        lst = self.seq_buckets[sk]
        lst.remove(b)
        if not lst:
            del self.seq_buckets[sk]
        if node in self._st._held:
            self._st._pump_later.add(node)  # what it held back may run now

    def drop_pending(self) -> None:
        """The call is closing: drop every queued activation."""
        for sq in self._queues.values():
            for so in sq.streams.values():
                for items in so.pending.values():
                    for act in items:
                        self._st._drop_pending(act)
                so.pending.clear()

    # ------------------------------------------------------------------ the caller

    def emit(self, node: str, f: str, value: Any, seq: Entry) -> None:
        """A frame of the caller's field ``f``: out now, or held until its index's turn."""
        st = self._st
        key = (f, seq[0], seq[1])
        so = self._caller.get(key)
        if so is None:
            so = self._caller[key] = StreamOrder(seq[0], seq[1])
        idx = seq[2]
        if idx != so.exp and not so.pending:
            # The common streaming case: earlier indices have settled; skip over them.
            feeders = st.c.seq_out_feeders[f]
            reaches = st.live.reaches
            while so.exp < idx and not reaches((so.node, so.sid, so.exp), feeders):
                so.exp += 1
        if idx == so.exp:
            st._out_emit.append((f, value, node, idx))
            return
        so.push(idx, (f, value, node, idx))
        self._release_caller(f, so)

    def _release_caller(self, f: str, so: StreamOrder) -> None:
        st = self._st
        feeders = st.c.seq_out_feeders[f]
        while so.pending:
            items = so.take_current()
            if items:
                st._out_emit.extend(items)
                if not so.pending:
                    break
            if st.live.reaches(so.entry(), feeders):
                self._watch(so, f, "")
                return
            so.advance()
        self._unwatch(so)

    def flush(self) -> None:
        """The call ended: every caller frame still held goes out, in order."""
        for so in self._caller.values():
            while so.pending:
                self._st._out_emit.extend(so.take_current())
                so.advance()

    # ------------------------------------------------------------------ waking

    def wake(self, w: OrderWaiter, e: Entry, dropped: Sequence[str]) -> None:
        """Liveness under ``e`` (``w``'s expected index) dropped at ``dropped``."""
        so, f, node = w
        if so.watching != e[2]:
            return
        c = self._st.c
        feeders = c.seq_feeders[node] if f is None else c.seq_out_feeders[f]
        if not any(n in feeders for n in dropped) and not (
            f is None and any(n == node for n in dropped)
        ):
            return
        if f is None:
            self._unwatch(so)
            self.pump(node)
        else:
            self._release_caller(f, so)

    def _watch(self, so: StreamOrder, f: str | None, node: str) -> None:
        """Wake ``so`` when its expected index may have settled (f: caller field, or None for
        the session node ``node``)."""
        if so.watching == so.exp:
            return
        self._unwatch(so)
        e = so.entry()
        so.watching = so.exp
        self._st._watch(e, (so, f, node))

    def _unwatch(self, so: StreamOrder) -> None:
        if so.watching < 0:
            return
        st = self._st
        e = (so.node, so.sid, so.watching)
        so.watching = -1
        ws = st._waiters[e]  # registered by _watch until now (validate checks it)
        for w in list(ws):
            if isinstance(w, tuple) and w[0] is so:
                ws.discard(w)
                st.live.unwatch(e)
        if not ws:
            del st._waiters[e]

    # ------------------------------------------------------------------ invariants

    def pending(self) -> list[Activation]:
        """Every queued activation (``validate``)."""
        return [
            a
            for sq in self._queues.values()
            for so in sq.streams.values()
            for items in so.pending.values()
            for a in items
        ]

    def validate(self, gathering: list[Bucket]) -> None:
        """Every order is consistent and woken when it watches; every gathering bucket of a
        group-ordered session node (``gathering``) is indexed by its SeqId, and an idle session
        node with an activation at its expected index is held back by an earlier group's
        bucket that can still fire without it (never stuck: something runs)."""
        st = self._st
        orders = [*self._caller.values()]
        orders.extend(so for sq in self._queues.values() for so in sq.streams.values())
        for so in orders:
            so.validate()
            e = (so.node, so.sid, so.watching)
            if so.watching >= 0 and not any(
                type(w) is tuple and w[0] is so for w in st._waiters.get(e, ())
            ):
                raise AssertionError(f"stream order watches {e} but nobody wakes it")
        indexed = [b for bs in self.seq_buckets.values() for b in bs]
        if len(indexed) != len(gathering) or any(
            b not in self.seq_buckets.get((b.spec.node, b.seq), ()) for b in gathering
        ):
            raise AssertionError(
                f"session buckets by SeqId drifted: {len(indexed)} indexed, "
                f"{len(gathering)} gathering"
            )
        if st.closing:
            return
        for node, sq in self._queues.items():
            if sq.busy:
                continue
            for so in sq.streams.values():
                act = so.peek_current(_group_of)
                if act is None:
                    continue
                if node not in st._held or self.group_wait(node, act, True) != "wait":
                    raise AssertionError(
                        f"session node {node}: {act} waits at index {so.exp} for nothing"
                    )
                if not st.running:
                    raise AssertionError(
                        f"session node {node}: {act} waits for a bucket of an earlier group "
                        "while nothing runs (the call is stuck)"
                    )


def _group_of(act: Activation) -> int:
    return act.group
