"""``CallCore.validate``: every invariant of one call's state, checked between stimuli.

Tests switch it on (``Runtime(validate=True)``, the property machine after every stimulus);
production leaves it off. Each part checks its own tables (``Orders.validate``,
``Buckets.validate``); this checks what they share: the activations known against ``n_acts``
and ``n_parked``, the liveness counts against the work, the data-plane holds against their
holders, and a finished call against "nothing left".
"""

from __future__ import annotations

from collections import deque

from omniflow.data._ref import DataRef
from omniflow.runtime.callcore._callstate import CallState
from omniflow.runtime.callcore._gather import Buckets
from omniflow.runtime.callcore._latches import Latches
from omniflow.runtime.callcore._liveness import Table
from omniflow.runtime.callcore._orders import Orders
from omniflow.runtime.callcore._stimuli import Activation

__all__ = ["validate_call"]


def validate_call(
    st: CallState,
    blocked: dict[str, deque[Activation]],
    latches: Latches,
    orders: Orders,
    gather: Buckets,
) -> None:
    """Raise AssertionError naming the first breach of an invariant of ``st``'s call
    (``blocked``: activations waiting for a throttled node's max_concurrency)."""
    if st.crashed:
        return  # a crashed call's state is whatever the bug left
    if not st.finished and (st._touched or st.live.dirty or st._pump_later or st.unsettled):
        # (A finished call has nothing left to settle: what it still notes about drops
        # or touched buckets wakes nobody; the checks below hold it to "nothing left".)
        raise AssertionError(
            f"call {st.call_id}: left unsettled (touched {len(st._touched)} buckets, "
            f"liveness drops under {sorted(st.live.dirty)}); the shell must send SETTLE "
            "after starting a batch of ready work"
        )
    group_ordered = st.c.group_ordered
    orders.validate([b for b in gather.gathering.values() if b.spec.node in group_ordered])
    acts = set(st.running)
    acts.update(orders.pending())
    for waiting in blocked.values():
        acts.update(waiting)
    parked = latches.parked()
    if len(parked) != st.n_parked:
        raise AssertionError(f"{len(parked)} activations parked on latches, {st.n_parked} counted")
    acts.update(parked)
    work: list[tuple[Table, str]] = [(a.table, a.node) for a in acts]
    work.extend((b.table, node) for (node, _g, _k), b in gather.gathering.items())
    gather.validate()
    if st._counted:
        st.live.validate(work)
    elif st.live.counts or st.live.dirty:
        raise AssertionError(f"an uncounted call counted liveness: {st.live.counts}")
    st.blive.validate((b.table, node) for (node, _g, _k), b in gather.gathering.items())
    held: dict[DataRef, int] = {}
    holders: list[list[DataRef] | None] = [a.refs for a in acts]
    holders.extend(b.refs for b in gather.gathering.values())
    holders.extend(latches.holds())
    for refs in holders:
        for ref in refs or ():
            held[ref] = held.get(ref, 0) + 1
    if held != st.refcounts:
        raise AssertionError(f"data-plane refcounts drifted: {st.refcounts} vs {held}")
    if len(acts) != st.n_acts:
        raise AssertionError(f"n_acts={st.n_acts} but {len(acts)} activations are known")
    if st.finished and (st.n_acts or gather.gathering or st.live.counts):
        raise AssertionError(f"call {st.call_id} finished with work left: {st.live.counts}")
