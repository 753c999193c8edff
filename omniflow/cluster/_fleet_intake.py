"""What replicas send the front, taken in: checked, decoded, handed on, and reordered where a
message is about a run the front has not learned of yet.

>>> intake = Intake(opener, wire, on_message=route, on_own=fleet_kinds)  # doctest: +SKIP
>>> endpoint.set_receiver(functools.partial(intake.receive, rep))     # doctest: +SKIP

The fleet (``_fleet``) owns one ``Intake``; it answers the messages about the replica itself
(``Heartbeat``, ``Bye``, ``Ready``: ``on_own``), and every other kind, about calls, goes to
``on_message`` (``_remote.RemoteRoles``). ``on_message`` may hand a message back, or what is
left of it: it is about a run that another connection has not told the front of yet. What is
left of that connection's batch then waits for the end of the loop turn, after the other
connections read in it (``Intake._later``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from omniflow._exceptions import RuntimeClosedError, TransportError
from omniflow.cluster._fleet_replica import OnMessage, Replica
from omniflow.transport import EndpointState
from omniflow.transport._auth import Opener, WireStats
from omniflow.transport._protocol import (
    Batch,
    Bye,
    Heartbeat,
    Message,
    ProtocolError,
    Ready,
    decode_inner,
    decode_msg,
)

__all__ = ["FLEET_KINDS", "LATE_TURNS", "Intake", "Late"]

logger = logging.getLogger("omniflow.remote")

#: Loop turns in a row that what a replica sent may wait for the front to learn of the runs it
#: is about (``Intake._later``); then it is handled whatever it says.
LATE_TURNS = 64

#: The messages the fleet answers itself (``on_own``); every other kind is about calls
#: (``on_message``).
FLEET_KINDS = frozenset({Heartbeat, Bye, Ready})

#: One item of what waits (``Replica.late``): a decoded message, a batch's encoded messages,
#: packets, handled in that order.
Late = tuple[Message | None, list[Any], list[Any]]


class Intake:
    """Every replica's incoming messages, in order per connection; see the module docstring."""

    def __init__(
        self,
        opener: Opener,
        wire: WireStats,
        *,
        on_message: OnMessage,
        on_own: Callable[[Replica, Message], None],
    ) -> None:
        #: Checks each sealed message (and replays) where a connection is not authenticated.
        self._opener = opener
        #: Accepted and dropped messages from replicas, by reason.
        self.wire = wire
        self._on_message = on_message
        self._on_own = on_own
        #: True while a batch of replica messages is handled (runs made then are queued).
        self.in_batch = False
        #: Set by ``on_message``'s side when it bound a forwarded run (the router carrying out
        #: the fast-path machine's ``Bind``): what waits may be about it (``_take_known``).
        self.known = False
        #: Replicas with messages waiting for the end of the loop turn (``_later``), in order.
        self._waiting: dict[Replica, None] = {}

    async def read(self, rep: Replica) -> None:
        """Receive ``rep``'s batches (a transport that cannot call ``receive`` itself)."""
        while True:
            try:
                batch = await rep.endpoint.recv_batch()
            except (RuntimeClosedError, TransportError, asyncio.CancelledError):
                return
            self.receive(rep, batch)

    def receive(self, rep: Replica, batch: list[Any]) -> None:
        """A batch from ``rep``'s connection: handled now, or behind what of ``rep``'s waits
        for the end of this loop turn."""
        late = rep.late
        if late is None:
            self._take(rep, batch, True)
        else:
            late.append((None, [], batch))
        if self.known:
            self._take_known()

    def dropped(self, rep: Replica, reason: str | None, exc: BaseException | None = None) -> None:
        """A message from ``rep`` was dropped (counted, and logged now and then)."""
        self.wire.dropped_message(logger, f"front, last from {rep.replica_id}", reason, exc)

    def _take_known(self) -> None:
        """The front learned of forwarded runs (``known``): what waits for the end of the loop
        turn (``_later``) may be about them, so it is tried now, in order, rather than a
        loop turn later. Nothing changes but when: what still waits waits on; each try here
        follows a run being learned of, so these tries end (they do not count as turns)."""
        while self.known and self._waiting:
            self.known = False
            for rep in list(self._waiting):
                if rep in self._waiting:
                    self._take_late(rep, turn=False)
        self.known = False

    def _take_late(self, rep: Replica, turn: bool = True) -> None:
        """Handle what ``rep`` sent that waited for the end of the last loop turn (``turn``;
        else tried again within it: ``_take_known``), in order (none once its connection is
        closed: it would deliver nothing more either). What is still about runs the front
        does not know may wait again, ``LATE_TURNS`` turns in a row at most; then it is
        handled whatever it says."""
        self._waiting.pop(rep, None)
        late, rep.late = rep.late, None
        if late is None or rep.endpoint is None or rep.endpoint.state is EndpointState.CLOSED:
            return
        if turn:
            rep.waited += 1
        may_wait = rep.waited < LATE_TURNS
        was, self.in_batch = self.in_batch, True
        try:
            for n, item in enumerate(late):
                if self._take_waiting(rep, item, may_wait):
                    self._behind(rep, late[n + 1 :])  # (it waits again: what came after it too)
                    return
            rep.waited = 0
        finally:
            self.in_batch = was
            if turn and self.known:
                self._take_known()

    def _take_waiting(self, rep: Replica, item: Late, may_wait: bool) -> bool:
        """Handle one waiting item of ``rep.late``; True if some of it waits again."""
        msg, inner, packets = item
        if msg is not None:
            rest = self._handle_decoded(rep, msg, may_wait)
            if rest is not None:
                self._later(rep, rest, inner, packets)
                return True
        if self._take_inner(rep, inner, packets, may_wait):
            return True
        return bool(packets) and self._take(rep, packets, may_wait)

    def _take_inner(self, rep: Replica, ms: list[Any], packets: list[Any], may_wait: bool) -> bool:
        """Handle a batch's encoded messages ``ms`` in order; at one that should wait, it and
        the rest of ``ms``, then ``packets``, go to ``_later`` (then True)."""
        for j, m in enumerate(ms):
            rest = self._handle_inner(rep, m, may_wait)
            if rest is not None:
                self._later(rep, rest, ms[j + 1 :], packets)
                return True
        return False

    def _behind(self, rep: Replica, items: list[Late]) -> None:
        """``items`` go behind what of ``rep``'s waits now (a method: in ``_take_late`` the
        type checker holds ``rep.late`` to the None it set before ``_later`` set it again)."""
        assert rep.late is not None
        rep.late.extend(items)

    def _later(self, rep: Replica, rest: Message, inner: list[Any], packets: list[Any]) -> None:
        """``rest``, then ``inner`` (a batch's encoded messages), then ``packets``, all from
        ``rep``, wait for the end of this loop turn: behind the other connections read in it.

        Why this changes no outcome: it is as if these bytes came a moment later, which the
        front takes anyway (nothing orders two connections; a ``Dones`` cut in two is what
        the worker sends when its ends fall in two of its loop turns). What one connection
        delivers keeps its order: what it delivers meanwhile goes behind (``receive``), and
        what waited is handled first in the next loop turn (``call_soon`` is FIFO and runs
        before that turn's I/O callbacks), where it may wait again, ``LATE_TURNS`` turns in a
        row at most (``_take_late``)."""
        assert rep.late is None
        rep.late = [(rest, inner, packets)]
        self._waiting[rep] = None
        asyncio.get_running_loop().call_soon(self._take_late, rep)

    def _take(self, rep: Replica, batch: list[Any], may_wait: bool) -> bool:
        """Handle what ``rep`` sent: check, decode, dispatch each message. ``may_wait``: a
        message about a run the front does not know yet may send the rest to ``_later``
        (then True)."""
        opener = rep.opener or self._opener
        time = asyncio.get_running_loop().time
        was, self.in_batch = self.in_batch, True
        try:
            for i, (_peer, frames) in enumerate(batch):
                inner = opener.open(frames)
                if inner is None:
                    self.dropped(rep, None)
                    continue
                rep.last_seen = time()
                try:
                    msg = decode_msg(inner)
                    if type(msg) is Batch:
                        if self._take_inner(rep, msg.messages, batch[i + 1 :], may_wait):
                            return True
                    else:
                        rest = self._handle(rep, msg, may_wait)
                        if rest is not None:
                            self._later(rep, rest, [], batch[i + 1 :])
                            return True
                except ProtocolError as exc:
                    self.dropped(rep, exc.reason, exc)
                except (KeyError, TypeError, ValueError) as exc:  # a malformed body
                    self.dropped(rep, "malformed", exc)
        finally:
            self.in_batch = was
        return False

    def _handle_inner(self, rep: Replica, m: Any, may_wait: bool) -> Message | None:
        """One message of a batch (a bad one is dropped alone); what should wait, if any."""
        try:
            return self._handle(rep, decode_inner(m), may_wait)
        except ProtocolError as exc:
            self.dropped(rep, exc.reason, exc)
        except (KeyError, TypeError, ValueError) as exc:  # a malformed body
            self.dropped(rep, "malformed", exc)
        return None

    def _handle_decoded(self, rep: Replica, msg: Message, may_wait: bool) -> Message | None:
        """A message decoded before it waited (a bad value in it is dropped alone)."""
        try:
            return self._handle(rep, msg, may_wait)
        except (KeyError, TypeError, ValueError) as exc:  # a malformed body
            self.dropped(rep, "malformed", exc)
        return None

    def _handle(self, rep: Replica, msg: Message, may_wait: bool) -> Message | None:
        """One checked message; what of it should wait for the end of the loop turn (only
        if ``may_wait``), if any."""
        if type(msg) not in FLEET_KINDS:  # about calls: the commonest, straight on
            return self._on_message(rep, msg, may_wait)
        self._on_own(rep, msg)
        return None
