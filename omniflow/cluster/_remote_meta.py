"""The front's answers and questions to its workers outside calls: the Params Pools'
metadata the front hosts (``kv._hosted``: one truth for the front's pools and every worker it
spawned) and the ``stats`` requests (``worker_statistics``, ``data_plane_statistics``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

from omniflow._exceptions import OmniflowError
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.data.kv._hosted import serve as serve_meta
from omniflow.data.kv._meta import MemoryMetadata
from omniflow.transport._protocol import (
    MetaCall,
    MetaNotify,
    MetaReply,
    StatsReply,
    StatsRequest,
    encode_msg,
)


class WorkerQueries:
    """Hosted pool metadata and stats requests, over the fleet's connections."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        #: The Params Pools' metadata of pools with metadata=None.
        self.pool_meta = MemoryMetadata()
        self.tasks: set[asyncio.Task[None]] = set()
        #: Request id -> future of a worker's "stats" answer.
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)

    def on_call(self, rep: Replica, msg: MetaCall) -> None:
        """A worker's call on the hosted metadata: answered in order (each call is atomic, no
        await inside, and tasks start FIFO)."""
        self._track(self.call(rep, msg.request, msg.op, msg.args))

    def on_stats(self, msg: StatsReply) -> None:
        fut = self._waiting.pop(msg.request, None)
        if fut is not None and not fut.done():
            fut.set_result(msg._asdict())

    def lost(self, rep: Replica) -> None:
        """``rep`` was lost: its pools leave the hosted metadata."""
        if rep.pool_nodes:
            nodes, rep.pool_nodes = rep.pool_nodes, set()
            self._track(self.forget_pools(nodes))

    def _track(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task

    async def call(self, rep: Replica, r: int, op: str, args: list[Any]) -> None:
        """Answer one call of a worker's pool on the front-hosted metadata."""
        if not rep.alive:
            return
        try:
            value = await serve_meta(self.pool_meta, op, args)
        except OmniflowError as exc:
            self.fleet.dropped(rep, "malformed", exc)
            rep.out.put_nowait(encode_msg(MetaReply(r, None, str(exc))))
            return
        if op == "register":
            rep.pool_nodes.add((args[0], args[1]))
            out = rep.out

            def notify(pool: str, session: str | None, keys: list[str]) -> None:
                if rep.alive:
                    out.put_nowait(encode_msg(MetaNotify(pool, session, keys)))

            self.pool_meta.listen(args[0], args[1], notify)
        elif op == "leave":
            rep.pool_nodes.discard((args[0], args[1]))
        rep.out.put_nowait(encode_msg(MetaReply(r, value)))

    async def forget_pools(self, nodes: set[tuple[str, str]]) -> None:
        """A lost replica's pools leave the hosted metadata (their pages went with it)."""
        for pool, node in sorted(nodes):
            await self.pool_meta.leave(pool, node)

    async def data_plane_statistics(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """Each live replica's ``DataPlane.statistics()`` (plus its ``pid``), by replica id.

        A ``stats`` request rides the same connection as the replica's ``run``, ``release``
        and ``end_call`` messages, so the answer reflects every one sent before it. A replica
        that does not answer within ``timeout`` is left out.
        """
        return {
            name: {**body["plane"], "pid": body["pid"]}
            for name, body in (await self.worker_statistics(timeout)).items()
        }

    async def worker_statistics(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Each live replica's ``StatsReply`` as a dict (``pid``, ``plane``, ``wire``: what it
        accepted and dropped, ``work``: what it holds), by replica id; as ``data_plane_statistics``
        (which reads it), a replica that does not answer within ``timeout`` is left out."""
        loop = asyncio.get_running_loop()
        asked: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        for rep in self.fleet.replicas.values():
            if rep.alive and rep.endpoint is not None:
                rid = next(self._ids)
                fut: asyncio.Future[dict[str, Any]] = loop.create_future()
                asked[rid] = (rep.replica_id, fut)
                self._waiting[rid] = fut
                rep.out.put_nowait(encode_msg(StatsRequest(rid)))
        try:
            if asked:
                await asyncio.wait([f for _, f in asked.values()], timeout=timeout)
        finally:
            for rid in asked:
                self._waiting.pop(rid, None)
        return {name: fut.result() for name, fut in asked.values() if fut.done()}
