"""Sessions of one Runtime: their call queues, their GlobalParameters and their idle TTL.

Calls of one session run in FIFO order: a call waits in its session's queue until the calls
before it ended. A session's GlobalParameters live from its first call until
``rt.close_session`` or until it stayed idle (no call queued or running) for ``ttl`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from omniflow.dsl._graph import GlobalParameters
from omniflow.runtime._call import Call
from omniflow.runtime._executor import Remote
from omniflow.runtime._params import SessionParams

__all__ = ["Sessions"]

logger = logging.getLogger("omniflow.runtime")


class Sessions:
    """The session table: ``enqueue`` a call, ``next_after`` its end, ``close`` a session."""

    def __init__(
        self,
        ttl: float | None,
        factories: dict[str, GlobalParameters],
        pools: dict[str, Any],
        track: Callable[[asyncio.Task[Any]], None],
    ) -> None:
        #: Seconds a session may stay idle (no running or queued call) before it is closed.
        self.ttl = ttl
        #: session -> its calls not yet ended, the running one first.
        self.queues: dict[str, deque[Call]] = {}
        #: session -> its GlobalParameters (held until the session closes).
        self.params: dict[str, SessionParams] = {}
        #: Idle sessions -> the timer that closes them after ``ttl``.
        self.idle: dict[str, asyncio.TimerHandle] = {}
        #: Worker processes to tell when a session closes (None for in-process placement).
        self.remote: Remote | None = None
        #: The runtime's loop (set at its start).
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Whether the runtime runs (idle timers are armed only then).
        self.running = False
        self._factories = factories
        self._pools = pools
        self._track = track

    def enqueue(self, call: Call) -> bool:
        """Queue a call of a session; True when it is first in its queue (it may start)."""
        session = call.session
        assert session is not None
        idle = self.idle.pop(session, None)
        if idle is not None:  # busy again: not closed while a call is queued or runs
            idle.cancel()
        q = self.queues.get(session)
        if q is None:
            q = self.queues[session] = deque()
        q.append(call)
        return len(q) == 1

    def held(self, session: str) -> SessionParams:
        """The session's GlobalParameters (made on its first call)."""
        held = self.params.get(session)
        if held is None:
            held = self.params[session] = SessionParams(self._factories)
        return held

    def next_after(self, call: Call) -> Call | None:
        """``call`` ended: the next call of its session that has yet to start, if any (an
        emptied session goes idle)."""
        session = call.session
        assert session is not None
        q = self.queues.get(session)
        if q is None:
            return None
        with contextlib.suppress(ValueError):
            q.remove(call)
        if q:
            return q[0] if q[0].core is None else None
        del self.queues[session]
        self._went_idle(session)
        return None

    async def close(self, session: str) -> None:
        """Wait for the session's queued and running calls, then drop it (``drop``)."""
        q = self.queues.get(session)
        while q:
            await q[-1]._done.wait()
            q = self.queues.get(session)
        self.drop(session)

    def drop(self, session: str) -> None:
        """Release the session's GlobalParameters and its Params Pool run locks here and in
        every worker (a later call starts it afresh)."""
        idle = self.idle.pop(session, None)
        if idle is not None:
            idle.cancel()
        self.params.pop(session, None)
        if self._pools and self.loop is not None:  # its chains' run locks in every pool
            for pool in self._pools.values():
                self._track(self.loop.create_task(pool.close_session(session)))
        if self.remote is not None:
            self.remote.close_session(session)

    def clear(self) -> None:
        """The runtime closed: forget every session and disarm every idle timer."""
        self.params.clear()
        for timer in self.idle.values():
            timer.cancel()
        self.idle.clear()

    def _went_idle(self, session: str) -> None:
        """The session's last call ended: close it after ``ttl`` unless a call comes first
        (one timer per idle session; nothing is kept past the TTL)."""
        if self.ttl is None or self.loop is None or not self.running:
            return
        old = self.idle.get(session)
        if old is not None:
            old.cancel()
        self.idle[session] = self.loop.call_at(self.loop.time() + self.ttl, self._expire, session)

    def _expire(self, session: str) -> None:
        self.idle.pop(session, None)
        if self.queues.get(session):  # a call arrived in between (its enqueue disarms us)
            return
        logger.debug("session %.80r idle for %ss: closed", session, self.ttl)
        self.drop(session)
