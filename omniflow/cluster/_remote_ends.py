"""The end of a call on its workers: the replicas each call ran on, ``end_call`` to each, and
(with pool pages to release) the wait for each one's ``CallEnded`` before the call's end is
visible."""

from __future__ import annotations

import asyncio
import logging

from omniflow._exceptions import OmniflowError
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.transport._protocol import EndCall, encode_msg

#: Seconds the end of a call waits at most for its workers' ``CallEnded`` (their pool pages
#: released); a worker that neither answers nor is found lost by then is logged and let be.
END_CALL_TIMEOUT = 10.0


logger = logging.getLogger("omniflow.remote")


class _Ending:
    """A finished call whose workers have not all said ``CallEnded`` yet."""

    __slots__ = ("done", "reps", "timer")

    def __init__(self, reps: set[Replica], done: asyncio.Future[None]) -> None:
        #: The replicas still releasing what the call left there (alive when asked).
        self.reps = reps
        #: Resolved (never failed) when ``reps`` is empty, lost ones counted as released.
        self.done = done
        #: Gives up after ``END_CALL_TIMEOUT``.
        self.timer: asyncio.TimerHandle | None = None


class CallEnds:
    """The replicas each call ran on, and the calls whose end waits for their answers."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        #: call id -> the replicas it ran on (that may hold something of it).
        self.replicas: dict[str, set[Replica]] = {}
        #: call id -> its end_call's answers still awaited.
        self.ending: dict[str, _Ending] = {}

    def end(self, call_id: str, ack: bool) -> asyncio.Future[None] | None:
        """Tell each live replica call ``call_id`` ran on that it ended; with ``ack``, a future
        resolved once each has released what it left (or was lost, or ``END_CALL_TIMEOUT``
        passed), else None."""
        reps = self.replicas.pop(call_id, None)
        if not reps:
            return None
        frames = encode_msg(EndCall(call_id, ack))
        asked = set()
        for rep in reps:
            if rep.alive:
                rep.out.put_nowait(frames)
                asked.add(rep)
        if not (ack and asked):
            return None
        loop = asyncio.get_running_loop()
        ending = self.ending[call_id] = _Ending(asked, loop.create_future())
        ending.timer = loop.call_later(END_CALL_TIMEOUT, self.overdue, call_id)
        return ending.done

    def call_ended(self, rep: Replica, c: str) -> None:
        """``rep`` released what call ``c`` left there."""
        ending = self.ending.get(c)
        if ending is None:
            return  # (after the timeout, or after the front closed)
        if rep not in ending.reps:
            self.fleet.dropped(rep, "foreign", OmniflowError(f"an end of call {c!r:.40}, not its"))
            return
        ending.reps.discard(rep)
        if not ending.reps:
            self.ended(c)

    def ended(self, c: str) -> None:
        ending = self.ending.pop(c)
        if ending.timer is not None:
            ending.timer.cancel()
        if not ending.done.done():
            ending.done.set_result(None)

    def overdue(self, c: str) -> None:
        ending = self.ending.get(c)
        if ending is None:
            return
        logger.warning(
            "call %s: replica(s) %s did not confirm its end within %s s; its end is visible "
            "before they released its pool pages",
            c, sorted(r.replica_id for r in ending.reps), END_CALL_TIMEOUT,
        )  # fmt: skip
        self.ended(c)

    def lost(self, rep: Replica) -> None:
        """``rep`` was lost: its pages went with it (it released them all)."""
        for c in [c for c, e in self.ending.items() if rep in e.reps]:
            self.call_ended(rep, c)

    def close(self) -> None:
        """The workers are gone, with their pages: every end is visible."""
        for c in list(self.ending):
            self.ended(c)
