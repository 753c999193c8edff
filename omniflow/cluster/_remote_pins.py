"""Sessions pinned to a replica per role (a part of ``RemoteRoles``): a session's first run of
a role waits while the registry pins the session to one replica, then every run that waited
goes there, in order; a registry that is down pins locally (``SessionLoadBalance``)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import NodeError, OmniflowError
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.cluster._remote_pending import Key, Pending
from omniflow.registry._lb import SessionLoadBalance
from omniflow.transport._protocol import Done

if TYPE_CHECKING:
    from omniflow.runtime._call import Call
    from omniflow.runtime.callcore._core import Activation

__all__ = ["Pins"]

logger = logging.getLogger("omniflow.remote")


class Pins:
    """Runs that wait for their session's pin (a mixin of ``RemoteRoles``, like ``Replies``:
    it ends the router's pending runs through the router's own methods)."""

    fleet: Fleet
    _session: SessionLoadBalance
    _pending: dict[Key, Pending]
    #: (session, role) -> the runs waiting for the pin, in order.
    _pinning: dict[tuple[str, str], list[tuple[Key, Any]]]

    if TYPE_CHECKING:

        def _replica_done(self, rep: Replica | None, key: Key, err: Done | None) -> None: ...
        def _send_run(self, p: Pending, frames: Any, targets: list[Replica]) -> None: ...
        @staticmethod
        def _no_replica(call: Call, act: Activation, role: str) -> NodeError: ...

    def _defer(self, session: str, role: str, key: Key, frames: Any) -> None:
        waiting = self._pinning.get((session, role))
        if waiting is None:
            waiting = self._pinning[(session, role)] = []
            self.fleet.in_background(self._settle_pin(session, role))
        waiting.append((key, frames))

    async def _settle_pin(self, session: str, role: str) -> None:
        """Pin ``session`` for ``role`` in the registry, then send the runs that waited."""
        rep: Replica | None
        try:
            rep = await self._session.route(
                session, role, functools.partial(self.fleet.routable, role),
                find=functools.partial(self.fleet.find, role),
            )  # fmt: skip
        except (OmniflowError, OSError) as exc:  # registry down: pin locally for now
            live = self.fleet.routable(role)
            rep = self._session.pin_here(session, role, live) if live else None
            if rep is not None:
                logger.warning("session %r: registry pin failed, routing locally: %s", session, exc)
        waiting = self._pinning.pop((session, role), [])
        for key, frames in waiting:
            p = self._pending.get(key)
            if p is None or isinstance(p.error, asyncio.CancelledError):
                continue  # cancelled while it waited; _cancel finishes it
            if rep is None or not rep.life.routable:
                p.error = self._no_replica(p.call, p.act, role)
                self._replica_done(None, key, None)
                continue
            p.replicas.append(rep)
            self._send_run(p, frames, [rep])
