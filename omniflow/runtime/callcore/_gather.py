"""The life of one call's buckets: created by a frame, decided, fired or DEAD, remembered.

A frame for a convergence node arrives at the bucket keyed by its diamond root's entry in the
frame's table (Rule C); the bucket is decided (``Bucket.refresh``/``decide``) when it was
created, when an arrival may complete it, and when liveness under its key drops at a node
that feeds one of its open fields. A fired bucket's activation takes over its frames and their
holds; a DEAD one drops them, says so in ``warnings`` when frames had arrived, and keeps its
input rules for stragglers. Keys of spent buckets are remembered: a frame for a bucket that
already fired is a NodeError naming the rule, never paired or dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from omniflow.data._ref import DataRef
from omniflow.runtime.callcore._buckets import (
    Bucket,
    BucketSpec,
    Dead,
    Fire,
    quiescent_pick,
    rule_error,
)
from omniflow.runtime.callcore._callstate import CallState
from omniflow.runtime.callcore._compiled import Compiled
from omniflow.runtime.callcore._liveness import INPUT_ENTRY, Entry, Table
from omniflow.runtime.callcore._orders import Orders
from omniflow.runtime.callcore._stimuli import Activation

__all__ = ["BucketId", "Buckets"]

#: A bucket's identity: (node, OR group, key entry).
BucketId = tuple[str, int, Entry]


class Buckets:
    """The gathering buckets of one call, and the keys of those already spent."""

    __slots__ = ("_admit", "_dead_seen", "_orders", "_st", "gathering", "spent")

    def __init__(self, st: CallState, orders: Orders, admit: Callable[[Activation], None]) -> None:
        self._st = st
        self._orders = orders
        #: Admits a fired bucket's activation (``CallCore._admit``).
        self._admit = admit
        #: Gathering buckets by id.
        self.gathering: dict[BucketId, Bucket] = {}
        #: Ids of buckets that already fired or died, and how ("fired" or "dead").
        self.spent: dict[BucketId, str] = {}
        #: DEAD buckets whose input rules can still be broken by a straggler: frames seen per
        #: plain or counted field (a second frame is an error even after the bucket died).
        self._dead_seen: dict[BucketId, dict[str, int]] = {}

    def arrive(
        self, bspec: BucketSpec, src: str, f: str, value: Any, table: Table, seq: Entry
    ) -> None:
        """A frame of field ``f`` for ``bspec``'s node."""
        st = self._st
        if bspec.by_call:
            pos = 0
        else:
            root = bspec.root
            pos = len(table) - 1
            while pos > 0 and table[pos][0] != root:
                pos -= 1
        key = table[pos]
        bid = (bspec.node, bspec.group, key)
        b = self.gathering.get(bid)
        if b is None:
            spent = self.spent.get(bid)
            if spent is not None:
                if spent == "fired":
                    st._node_error(bspec.node, _late_frame_message(bspec, f), field=f)
                    return
                # A DEAD bucket's outputs are already ended, but its input rules still hold:
                # whether a call errs must not depend on when the bucket was found DEAD.
                seen = self._dead_seen.get(bid)
                if seen is not None:
                    n = seen.get(f, 0)
                    err = rule_error(bspec.by_field[f], n)
                    if err is not None:
                        del self._dead_seen[bid]
                        st._node_error(bspec.node, err, field=f)
                    else:
                        seen[f] = n + 1
                return
            # The bucket keeps every entry its frames share (so far: all of this frame's), not
            # only those up to its key: a frame that descends from one frame of another root
            # still carries that root's entry when it leaves, and meets its siblings there.
            b = Bucket(bspec, key, table)
            b.seq = _seq_in(table[: pos + 1], st.c)
            self.gathering[bid] = b
            if bspec.node in st.c.group_ordered:
                self._orders.bucket_born(b)
            st.live.inc(table, bspec.node)
            st.blive.inc(table, bspec.node)
            st._watch(key, b)
            if st._story is not None:
                st._log("bucket", bspec.node, bspec.group, key, b.seq)
            # Slots may have ended before the bucket existed (no drop will announce them):
            # learn them now, while this frame's producer still holds its own slots open.
            fresh = True
        else:
            fresh = False
            if table is not b.table and len(b.table) > pos + 1:
                self._share(b, table, pos)
        fs = bspec.by_field[f]
        # Frames of a plain field are never sorted: skip building their sort key.
        if fs.mode == "plain":
            sort_key: Any = None
        elif st._stamp_no is None:
            sort_key = (table[pos + 1 :], b.arrivals)
        else:
            stamped = st._stamp_no
            sort_key = (tuple(stamped.get(e, -1) for e in table[pos + 1 :]), b.arrivals)
        err = b.add(f, value, sort_key)
        if type(value) is DataRef and err is None:
            b.refs.append(value)
            st._hold(value)
        if err is not None:
            st._node_error(bspec.node, err, field=f)
            self.kill(bid, b, "input rule broken")
            return
        # Otherwise the bucket is re-evaluated when liveness under its key drops: its own
        # producer's activation (or dispatch hold) always ends after this arrival.
        if fresh:
            self.evaluate(b, None)
        elif b.could_fire_now(fs):
            st._touched.append(b)
        elif bspec.node in st._held:
            st._pump_later.add(bspec.node)  # fewer open fields: perhaps only a loop's left

    def _share(self, b: Bucket, table: Table, pos: int) -> None:
        """Keep in ``b.table`` only the entries ``table`` (a new frame's) shares with it; the
        bucket stops being live under the others."""
        gone = tuple(e for e in b.table[pos + 1 :] if e not in table)
        if gone:
            st = self._st
            b.table = tuple(e for e in b.table if e not in gone)
            node = b.spec.node
            st.live.dec(gone, node)
            st.blive.dec(gone, node)
            st._only_buckets(gone, node)

    def evaluate(self, b: Bucket, dropped: Sequence[str] | None = ()) -> None:
        """Decide a bucket. ``dropped``: nodes whose live work under its key just ended (only
        fields they feed can have ended); None: check every open field; (): arrivals only."""
        if b.retired:
            return
        st = self._st
        reason = b.refresh(st.live.counts.get(b.key), dropped)
        if reason is None:
            if b.open:
                if b.spec.node in st._held:
                    # Still gathering, but what can feed it shrank: perhaps to the held-back
                    # activations alone (a loop), which then run first.
                    st._pump_later.add(b.spec.node)
                return  # still waiting for a field
            verdict = b.decide()  # nothing open: Fire or Dead, never Wait
        else:
            verdict = Dead(reason)
        spec = b.spec
        bid = (spec.node, spec.group, b.key)
        if type(verdict) is Fire:
            self.fire(bid, b, verdict.kwargs)
        else:
            assert type(verdict) is Dead
            self.kill(bid, b, verdict.reason)
            self.keep_rules(bid, b)

    def fire(self, bid: BucketId, b: Bucket, kwargs: dict[str, Any]) -> None:
        """The bucket is complete: its activation takes over its inputs and their holds."""
        st = self._st
        node, group, key = bid
        self._retire(bid, b, "fired")
        seq = b.seq if b.seq is not None else INPUT_ENTRY
        act = Activation(next(st._aids), node, group, kwargs, b.table, seq)
        if st._story is not None:
            st._log("fire", node, group, key, act.aid)
        act.refs = b.refs or None  # the bucket's holds pass to its activation
        self._admit(act)
        st.live.dec(b.table, node)
        st.blive.dec(b.table, node)
        st._only_buckets(b.table, node)

    def kill(self, bid: BucketId, b: Bucket, reason: str) -> None:
        """The bucket is DEAD: its frames are dropped."""
        st = self._st
        self._retire(bid, b, "dead")
        st._log("dead", bid[0], bid[1], bid[2], reason)
        if b.arrivals and b.dead_field is not None and not st.closing:
            # Frames arrived and are lost with the bucket: say so (docs/contract.md §3, warnings).
            got = sorted(b.frames)
            st._warn(
                bid[0],
                b.dead_field,
                f"OR group {bid[1]} never fired: {reason}, after {', '.join(got)} arrived; "
                f"those frames are dropped (list '{b.dead_field}' in optional=... to run "
                "without it)",
            )
        self._forget(bid, b)

    def keep_rules(self, bid: BucketId, b: Bucket) -> None:
        """Remember what a DEAD bucket saw, for the fields a straggler could still break."""
        seen = {
            fs.name: len(b.frames.get(fs.name, ()))
            for fs in b.spec.fields
            if fs.mode == "plain" or (fs.mode == "count" and fs.threshold is not None)
        }
        if seen:
            self._dead_seen[bid] = seen

    def _retire(self, bid: BucketId, b: Bucket, how: str) -> None:
        st = self._st
        b.retired = True
        del self.gathering[bid]
        self.spent[bid] = how
        if bid[0] in st.c.group_ordered:
            self._orders.bucket_gone(b)
        # A gathering bucket is always watched under its key (``validate`` checks it).
        ws = st._waiters[b.key]
        ws.remove(b)
        st.live.unwatch(b.key)
        if not ws:
            del st._waiters[b.key]

    def _forget(self, bid: BucketId, b: Bucket) -> None:
        """A retired bucket that did not fire stops being live and lets go of its frames."""
        st = self._st
        st.live.dec(b.table, bid[0])
        st.blive.dec(b.table, bid[0])
        st._only_buckets(b.table, bid[0])
        st._let_go(b.refs)

    def drop_all(self) -> None:
        """The call is closing: every gathering bucket dies silently."""
        for bid, b in list(self.gathering.items()):
            self._retire(bid, b, "dead")
            self._forget(bid, b)

    def settle_quiescent(self) -> bool:
        """The call is quiescent but buckets still gather: only buckets wait on buckets (a
        cycle of convergence nodes). Settle the earliest in plan order that waits only on
        buckets waiting back on it (``quiescent_pick``) as if its open slots had ended; True
        when it fired (new work), False when it died."""
        order = self._st.c.order
        items = sorted(self.gathering.items(), key=lambda kv: (order[kv[0][0]], kv[0]))
        bid, b = items[quiescent_pick([b for _bid, b in items])]
        verdict = b.evaluate(None)  # as if every open slot had ended
        if type(verdict) is Fire:
            self.fire(bid, b, verdict.kwargs)
            return True
        self.kill(bid, b, verdict.reason if type(verdict) is Dead else "quiescent")
        # Settled as if its open slots had ended, but a straggler may still come (a frame of
        # a field the cycle was holding back): the input rules hold for it exactly as for a
        # bucket found DEAD by liveness (docs/contract.md §1, "never silently dropped").
        self.keep_rules(bid, b)
        return False

    def validate(self) -> None:
        """Every gathering bucket is woken by its key and is not also spent."""
        waiters = self._st._waiters
        for (node, _g, _k), b in self.gathering.items():
            if b not in waiters.get(b.key, ()):
                raise AssertionError(f"bucket {node}/{b.key} gathers but nobody wakes it")
        for bid in self.gathering:
            if bid in self.spent:
                raise AssertionError(f"bucket {bid} is both gathering and spent")


def _late_frame_message(bspec: BucketSpec, f: str) -> str:
    fs = bspec.by_field[f]
    if fs.mode == "count" and fs.threshold is not None:
        return (
            f"field '{f}' received more than activate_by_count={fs.threshold} frames in one "
            "call; use omniflow.ALL to take every frame, or a larger count"
        )
    if fs.ends_only:
        how = "activate_by_count=ALL" if fs.mode == "count" else "collect"
        return (
            f"field '{f}' ({how}) received a frame after its bucket already fired: every "
            f"stream of '{f}' had ended for it, and then a stream was re-entered (a loop "
            "came back through a producer of it). Keep the loop's own frames out of the "
            f"collected field (give them another name), or move the {how} node after "
            "the loop"
        )
    return (
        f"field '{f}' received a frame after its activation already fired; two streams "
        f"meet here frame by frame. Declare collect=['{f}'] to receive all frames as a list, "
        "or make the streams share a fork source"
    )


def _seq_in(table: Table, c: Compiled) -> Entry:
    """The nearest SeqId entry of ``table``. Every table starts with the call's own entry
    (``INPUT_ENTRY``; "<input>" counts among ``seq_nodes``), so the search stops there."""
    i = len(table) - 1
    while table[i][0] not in c.seq_nodes:
        i -= 1
    return table[i]
