"""Latched fields of one call (``of.interface(latch=...)``): per-call constants.

The first frame of a latched field is its value for the whole call (later ones are ignored);
every activation of the node gets it as it is admitted. One admitted before the value came is
*parked* (live at its node, counted in ``n_acts`` and ``n_parked``); the value admits it. A
latch whose field no live work can still produce (parked activations discounted) has ended:
what is parked on it, and every later activation, is DEAD and reported in ``warnings``.
"""

from __future__ import annotations

from typing import Any

from omniflow.data._ref import DataRef
from omniflow.runtime.callcore._callstate import CallState
from omniflow.runtime.callcore._liveness import INPUT_ENTRY, Entry
from omniflow.runtime.callcore._stimuli import Activation, ActState

__all__ = ["Latches"]


class _Latch:
    """One latched field of one node within one call: its value once the first frame came,
    and the activations that wait for it."""

    __slots__ = ("ended", "feeders", "field", "has", "node", "parked", "value")

    def __init__(self, node: str, fld: str, feeders: frozenset[str]) -> None:
        self.node = node
        self.field = fld
        #: Nodes from which a producer of the field can still be reached.
        self.feeders = feeders
        #: The value came.
        self.has = False
        self.value: Any = None
        #: Ended with no frame: activations that need it are DEAD.
        self.ended = False
        #: Activations that wait for the value.
        self.parked: list[Activation] = []


class Latches:
    """The latches of one call, created on first use."""

    __slots__ = ("_by_field", "_st")

    def __init__(self, st: CallState) -> None:
        self._st = st
        #: Latches by (node, field).
        self._by_field: dict[tuple[str, str], _Latch] = {}

    def _latch(self, node: str, fld: str) -> _Latch:
        lt = self._by_field.get((node, fld))
        if lt is None:
            feeders = self._st.c.latch_feeders[(node, fld)]
            lt = self._by_field[(node, fld)] = _Latch(node, fld, feeders)
        return lt

    def value(self, node: str, fld: str, value: Any) -> list[Activation]:
        """A frame of a latched field: the first one of the call is the value, for good.
        Answers the activations it unparks (the caller admits each, then retires its park)."""
        st = self._st
        lt = self._latch(node, fld)
        if lt.has or lt.ended or st.closing:
            return []
        lt.has = True
        lt.value = value
        if type(value) is DataRef:
            st._hold(value)  # the latch's own hold, until the call ends
        parked, lt.parked = lt.parked, []
        st.n_parked -= len(parked)
        return parked

    def pair(self, act: Activation) -> bool:
        """Give ``act`` its latched values; False when it waits for one (parked, live) or is
        DEAD because one ended with no frame (reported in ``warnings``)."""
        st = self._st
        for fld in st.c.latch_of[(act.node, act.group)]:
            lt = self._latch(act.node, fld)
            if lt.has:
                if fld not in act.kwargs:
                    act.kwargs[fld] = lt.value
                    if type(lt.value) is DataRef:
                        if act.refs is None:
                            act.refs = []
                        act.refs.append(lt.value)
                        st._hold(lt.value)
                continue
            if lt.ended:
                self._dead(act, lt)
                return False
            lt.parked.append(act)
            st.n_parked += 1
            st.n_acts += 1
            st.live.inc(act.table, act.node)
            return False
        return True

    def parked_under(self, e: Entry, node: str) -> bool:
        """An activation of ``node`` waits for a latched value under ``e`` (its SeqId index
        has not settled: the activation still comes)."""
        return any(
            act.node == node and e in act.table
            for lt in self._by_field.values()
            for act in lt.parked
        )

    def _dead(self, act: Activation, lt: _Latch) -> None:
        self._st._let_go(act.refs)
        self._st._warn(
            act.node,
            lt.field,
            f"OR group {act.group} activation never ran: latched input '{lt.field}' ended "
            f"with no frame for this call; {', '.join(sorted(act.kwargs))} dropped",
        )

    def check(self) -> None:
        """Latches with parked activations whose field can no longer arrive end: every
        activation parked on them is DEAD."""
        st = self._st
        parked_at: dict[str, int] = {}
        for lt in self._by_field.values():
            if lt.parked:
                parked_at[lt.node] = parked_at.get(lt.node, 0) + len(lt.parked)
        for lt in self._by_field.values():
            if not lt.parked or st.live.reaches(INPUT_ENTRY, lt.feeders, parked_at):
                continue
            lt.ended = True
            parked, lt.parked = lt.parked, []
            for act in parked:
                st.n_parked -= 1
                st.n_acts -= 1
                st._move(act, ActState.DONE)
                st._dec(act.table, act.node)
                self._dead(act, lt)

    def drop_parked(self) -> None:
        """The call is closing: drop every parked activation."""
        st = self._st
        for lt in self._by_field.values():
            for act in lt.parked:
                st.n_parked -= 1
                st._drop_pending(act)
            lt.parked = []

    def let_go(self) -> None:
        """The call ended: the latches release their own holds."""
        for lt in self._by_field.values():
            if lt.has and type(lt.value) is DataRef:
                lt.has = False
                self._st._let_go([lt.value])

    def parked(self) -> list[Activation]:
        """Every parked activation (``validate``)."""
        return [a for lt in self._by_field.values() for a in lt.parked]

    def holds(self) -> list[list[DataRef] | None]:
        """The latches' own holds, one list per latch (``validate``)."""
        return [
            [lt.value] for lt in self._by_field.values() if lt.has and type(lt.value) is DataRef
        ]
