"""Settling one call: what ended since the last settle, to a fixpoint, and the call's end.

A settle decides the buckets an arrival may have completed, wakes the waiters (buckets,
orders) of entries whose liveness dropped, pumps the session nodes that asked for it, ends
latches no live work can still feed, and releases held-back session work when nothing else
runs (the group wait never deadlocks a call). A call with nothing live finishes: a quiescent
one with buckets still gathering (buckets waiting on each other through a cycle) first
settles them one by one (``Buckets.settle_quiescent``).
"""

from __future__ import annotations

from typing import Any

from omniflow.runtime.callcore._buckets import Bucket
from omniflow.runtime.callcore._callstate import CallLife, CallState
from omniflow.runtime.callcore._gather import Buckets
from omniflow.runtime.callcore._latches import Latches
from omniflow.runtime.callcore._orders import Orders

__all__ = ["Settler"]


class Settler:
    """Settles one call and ends it."""

    __slots__ = ("_buckets", "_latches", "_orders", "_st")

    def __init__(self, st: CallState, buckets: Buckets, orders: Orders, latches: Latches) -> None:
        self._st = st
        self._buckets = buckets
        self._orders = orders
        self._latches = latches

    def settle(self) -> None:
        """Evaluate touched buckets and waiters of entries whose liveness dropped, to a fixpoint;
        then finish the call if nothing of it is left."""
        st = self._st
        st.unsettled = False
        self._pass()
        while True:
            while st._pump_later:
                for node in sorted(st._pump_later):
                    st._pump_later.discard(node)
                    self._orders.pump(node, settled=True)
                self._pass()
            if not st._held or st.running or st.closing:
                return
            # Nothing runs and only held-back session work is left: the buckets it waits for
            # can complete only through it, whatever the path (docs/contract.md §1: the wait
            # never deadlocks a call). The earliest node in plan order goes first.
            order = st.c.order
            self._orders.pump(min(st._held, key=order.__getitem__), settled=True, force=True)
            self._pass()

    def _pass(self) -> None:
        st = self._st
        if st.n_parked:
            self._latches.check()
        live = st.live
        if not (st._touched or live.dirty):
            if not st.n_acts:
                self.maybe_finish()
            return
        evaluate = self._buckets.evaluate
        while st._touched or live.dirty:
            while st._touched:
                evaluate(st._touched.pop())
            if live.dirty:
                dirty = live.dirty
                live.dirty = {}
                for e, dropped in dirty.items():
                    ws = st._waiters.get(e)
                    if not ws:
                        continue
                    for w in sorted(ws, key=_waiter_order) if len(ws) > 1 else list(ws):
                        if isinstance(w, Bucket):
                            # Only a node that feeds a still-open slot can have ended one.
                            if w.wakes_on(dropped):
                                evaluate(w, dropped)
                        else:
                            self._orders.wake(w, e, dropped)
            if st.n_parked:
                self._latches.check()
        if not st.n_acts:
            self.maybe_finish()

    def maybe_finish(self) -> None:
        """End the call if nothing of it is left."""
        st = self._st
        if st.finished:
            return
        buckets = self._buckets
        while st.n_acts == 0 and buckets.gathering and not st.closing:
            if buckets.settle_quiescent():  # it fired: new work
                self.settle()
                return
        if st.n_acts == 0 and not buckets.gathering and not st.running:
            self._latches.let_go()
            self._orders.flush()
            st._become(CallLife.CLOSED if st.closing else CallLife.FINISHED)
            st._log("finish", st.status)


def _waiter_order(w: Any) -> tuple[int, Any]:
    if isinstance(w, Bucket):
        return (0, (w.spec.node, w.spec.group))
    return (1, (w[0].node, w[0].sid, w[1] or "", w[2]))
