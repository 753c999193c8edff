"""A worker's call-scoped state and the front's messages about it: who owns a call here
(``_owns``: only that front may end it or release its blocks), per-call and per-session
params, ``end_call`` (params, data-plane blocks and Params Pool pages let go), releases,
pulls of this process's blocks, closed sessions, and the front-hosted pool metadata.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from omniflow._exceptions import TransportError
from omniflow.cluster._worker_state import WorkerState
from omniflow.data._handle import BlockHandle
from omniflow.data._ref import DataRef
from omniflow.runtime._params import SessionParams
from omniflow.transport._protocol import CallEnded, Pulled, PullFailed

logger = logging.getLogger("omniflow.worker")


class CallState(WorkerState):
    """Call ownership, params, ``end_call`` and pools (a part of ``Worker``: see
    ``_worker_state`` for why a mixin)."""

    def _end_call(self, peer: bytes | None, c: str, ack: bool) -> None:
        """The front ended call ``c``: drop what it left here (its owner only); then, if
        asked, say so once its pages are released."""
        held = []
        if self._owns(peer, c):
            del self._call_owner[c]
            self._call_params.pop(c, None)
            self.plane.cleanup(c)
            held = [p for p in self._pools.values() if p.holds(c)]  # pages pinned here
        if held:
            task = asyncio.get_running_loop().create_task(self._release_pools(peer, c, held, ack))
            self._pool_releases.add(task)
            task.add_done_callback(self._pool_releases.discard)
        elif ack:
            self._send(peer, CallEnded(c))

    def _release(self, peer: bytes | None, refs: list[Any]) -> None:
        """Free the blocks ``refs`` name (of calls ``peer`` owns)."""
        for ref in refs:
            if type(ref) is not DataRef:
                self._dropped("malformed", TransportError("release of a non-DataRef"))
            elif self._owns(peer, ref.key[1]):
                self.plane.release(ref)

    def _serve_pull(self, peer: bytes | None, r: int, h: Any) -> None:
        """Answer a pull of one of this process's blocks."""
        try:
            if type(h) is not BlockHandle:
                raise TransportError(f"a pull names a {type(h).__name__}, not a block")
            self._send(peer, Pulled(r, self.plane.serve_pull(h)))
        except Exception as exc:
            self._send(peer, PullFailed(r, str(exc)))

    def _close_session(self, session: str) -> None:
        """The session ended: its params and its pools' session state go."""
        self._session_params.pop(session, None)
        for pool in self._pools.values():
            task = asyncio.get_running_loop().create_task(pool.close_session(session))
            self._pool_releases.add(task)
            task.add_done_callback(self._pool_releases.discard)

    def _meta_notify(self, peer: bytes | None, pool: str, session: Any, keys: list[Any]) -> None:
        """The hosted metadata says pages appeared (only from the front that hosts it)."""
        if self._hosted is not None and peer == self._hosted_peer:
            if all(type(k) is str for k in keys):
                self._hosted.notify(pool, session, keys)
            else:
                self._dropped("malformed", TransportError("notify of non-str hashes"))
        else:
            self._dropped("foreign", TransportError("notify from another front"))

    def _meta_reply(self, peer: bytes | None, r: int, v: Any, e: Any) -> None:
        """The answer to one of this worker's calls on the hosted metadata."""
        if self._hosted is not None and self._hosted.attached and (peer == self._hosted_peer):
            self._hosted.reply(r, v, e)
        else:
            self._dropped("foreign", TransportError("metadata reply from another front"))

    async def _release_pools(
        self, peer: bytes | None, call_id: str, pools: list[Any], ack: bool
    ) -> None:
        """Unpin ``call_id``'s pages in ``pools`` (a failure is logged, the others go on);
        then, if ``peer`` asked, say so: its caller sees the end of the call only after."""
        try:
            for pool in pools:
                try:
                    await pool.release(call_id)
                except Exception:
                    logger.exception(
                        "releasing call %s's pages in pool %r failed", call_id, pool.name
                    )
        finally:
            if ack:
                self._send(peer, CallEnded(call_id))

    def _owns(self, peer: bytes | None, call_id: str) -> bool:
        """Whether ``peer`` made the call-scoped state of ``call_id`` here; a message about a
        call another front owns is dropped and counted (foreign), one about none is a no-op."""
        owner = self._call_owner.get(call_id, peer)
        if owner != peer:
            self._dropped(
                "foreign", TransportError(f"call {call_id!r:.40} belongs to another front")
            )
            return False
        return call_id in self._call_owner

    def _params(self, session: str | None, call_id: str, graph: str = "") -> SessionParams:
        if session is None and graph not in self._param_graphs:
            return self._no_params  # nothing per call to keep (and no end_call will come)
        table = self._session_params if session is not None else self._call_params
        key = session if session is not None else call_id
        p = table.get(key)
        if p is None:
            p = table[key] = SessionParams(self._factories)
        return p
