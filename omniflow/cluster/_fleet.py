"""The replicas of one front: started or found, connected, supervised, restarted.

>>> fleet = Fleet(processes, on_message=route, on_lost=fail_held, cluster_key=key)  # doctest: +SKIP
>>> await fleet.start()                                        # doctest: +SKIP
>>> fleet.routable("llm")                                      # doctest: +SKIP
[Replica('llm-0-4242-a1b2c3', ready)]

I/O only: each replica's connection (a sealed writer queue and a reader that checks every
message first), its process (through a ``_launch.Launcher``), the registry watch that finds
replicas other fronts or operators started, the heartbeat supervisor and restarts. What these
see becomes a ``_replica.ReplicaEvent``; the legal state changes and the restart backoff are
decided in ``_replica`` (pure). Messages about calls (frames, dones, stats, metadata calls) go
to ``on_message``; a lost replica's activations are failed by ``on_lost`` (``_remote_replies``).

The parts, each a module of its own: the ``Replica`` record (``_fleet_replica``), what
replicas send taken in and reordered (``_fleet_intake.Intake``), exits, heartbeats and the
registry watched (``_fleet_watch.Supervision``). The fleet keeps the replicas, starts,
connects and stops them, writes to them, answers the messages about a replica itself and
changes its state (``event``, ``lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import secrets
import tempfile
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import OmniflowError, RuntimeClosedError, StartError, TransportError
from omniflow.cluster._fleet_intake import Intake
from omniflow.cluster._fleet_replica import OnLost, OnMessage, Replica
from omniflow.cluster._fleet_watch import Supervision
from omniflow.cluster._launch import (
    EDGES_KEY,
    Launcher,
    LaunchSpec,
    SubprocessLauncher,
    colocation_group,
)
from omniflow.cluster._placement import ProcessSpec
from omniflow.cluster._replica import ReplicaEvent, ReplicaState
from omniflow.dsl._context import Colocation
from omniflow.transport import connect
from omniflow.transport._auth import Opener, PlainOpener, WireStats, sealer_for
from omniflow.transport._protocol import (
    MAX_BATCH,
    Bye,
    Heartbeat,
    Hello,
    Message,
    Ready,
    SourceLost,
    Stop,
    batch,
    encode_msg,
)

if TYPE_CHECKING:
    from omniflow.registry import ServiceRegistry

__all__ = ["Fleet", "OnLost", "OnMessage", "Replica"]

logger = logging.getLogger("omniflow.remote")


class Fleet:
    """Every replica of one front; see the module docstring."""

    def __init__(
        self,
        processes: list[ProcessSpec],
        *,
        on_message: OnMessage,
        on_lost: OnLost,
        cluster_key: bytes,
        registry: str | None = None,
        heartbeat_interval: float = 1.0,
        start_timeout: float = 60.0,
        heartbeat_misses: int = 10,
        respawn: bool = True,
        launcher: Launcher | None = None,
    ) -> None:
        self.processes = processes
        #: How replica processes are started (a subprocess of this front by default).
        self.launcher = launcher if launcher is not None else SubprocessLauncher()
        #: The deployment's key (workers started here get it in their environment).
        self.cluster_key = cluster_key
        #: Accepted and dropped messages from replicas, by reason.
        self.wire = WireStats()
        #: What replicas send, checked, handed on and reordered (``_fleet_intake``).
        self.intake = Intake(
            Opener(cluster_key, self.wire), self.wire, on_message=on_message, on_own=self._own
        )
        self.registry_url = registry
        self.heartbeat_interval = heartbeat_interval
        self.start_timeout = start_timeout
        #: Heartbeats a replica may miss before it counts as lost (and, if started, is killed).
        self.heartbeat_misses = heartbeat_misses
        #: Restart started replicas that die (with backoff).
        self.respawn = respawn
        #: Role -> replicas of it restarted so far.
        self.restarts: dict[str, int] = {r: 0 for p in processes for r in p.roles}
        #: Roles served by workers.
        self.roles = frozenset(r for p in processes for r in p.roles)
        #: Every replica known, in the order it was started or found (the routing order).
        self.replicas: dict[str, Replica] = {}
        #: Grows with every replica state change (what routes were computed from is stale).
        self.epoch = 0
        self.registry: ServiceRegistry | None = None
        self._on_lost = on_lost
        #: Exits reaped, heartbeats judged, the registry watched (``_fleet_watch``).
        self.supervision = Supervision(self)
        #: Restarts and adoptions under way (cancelled at close).
        self._background: set[asyncio.Task[Any]] = set()
        self._addresses = itertools.count()
        #: Makes this front's replica ids unique in a shared registry: two fronts on one
        #: host, or in one process, or on two hosts whose pids collide.
        self.token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self._tmp = tempfile.mkdtemp(prefix="omniflow-")
        self.closing = False
        #: Replicas started at start (later starts are restarts and get a new replica id).
        self._initial = sum(p.replicas for p in processes)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.registry_url:
            from omniflow.registry import create_registry

            self.registry = create_registry(
                self.registry_url, heartbeat_interval=self.heartbeat_interval, key=self.cluster_key
            )
            await self.registry.start()
        starts = [self.spawn(spec, i) for spec in self.processes for i in range(spec.replicas)]
        await asyncio.wait_for(asyncio.gather(*starts), self.start_timeout)
        self.supervision.start(sorted(self.roles))

    async def spawn(self, spec: ProcessSpec, slot: int) -> None:
        """Start a replica of ``spec`` in ``slot`` and connect to it (until it is ready)."""
        n = next(self._addresses)
        rid = f"{spec.name}-{slot}-{self.token}" + (f"-r{n}" if n >= self._initial else "")
        launch = LaunchSpec(
            rid, spec.name, tuple(spec.roles), tuple(spec.modules), n, self._tmp, self.token,
            self.heartbeat_interval, self.registry_url, self.cluster_key, slot,
        )  # fmt: skip
        handle = await self.launcher.start(launch)
        rep = Replica(rid, list(spec.roles), handle.address, handle, spec=spec, slot=slot)
        rep.born = asyncio.get_running_loop().time()
        self.replicas[rid] = rep
        rep.tasks.append(asyncio.get_running_loop().create_task(self.supervision.reap(rep)))
        await self._connect(rep)

    async def _connect(self, rep: Replica) -> None:
        loop = asyncio.get_running_loop()
        rep.endpoint = connect(rep.address, key=self.cluster_key)
        rep.sealer = sealer_for(rep.endpoint, self.cluster_key)
        # (Sealed messages go through the fleet's one opener, which also checks replays.)
        rep.opener = PlainOpener(self.wire) if rep.endpoint.authenticated else None
        if rep.ready is None:
            rep.ready = loop.create_future()
        rep.tasks.append(loop.create_task(self._write(rep)))
        # Replies are handled in the loop's reader callback where the transport can (uds://:
        # no task wakes up per burst), else by a task that receives them.
        if not rep.endpoint.set_receiver(functools.partial(self.intake.receive, rep)):
            rep.tasks.append(loop.create_task(self.intake.read(rep)))
        rep.out.put_nowait(encode_msg(Hello(self.token, self.heartbeat_interval)))
        await rep.ready
        rep.last_seen = loop.time()

    async def stop_all(self) -> list[Replica]:
        """Stop supervising, ask the started replicas to stop (killed after 5 s), close every
        connection; the replicas that were known, for the caller to tidy after."""
        self.closing = True
        self.supervision.stop()
        for task in self._background:
            task.cancel()
        reps = list(self.replicas.values())
        for rep in reps:
            if rep.alive and rep.endpoint is not None and rep.process is not None:
                rep.out.put_nowait(encode_msg(Stop()))
        for rep in reps:
            if rep.process is not None:
                await self.launcher.stop(rep.process, 5)
            if rep.alive:
                self.event(rep, ReplicaEvent.LOST, "the front closed")
            for task in rep.tasks:
                task.cancel()
            for task in rep.tasks:
                with contextlib.suppress(BaseException):
                    await task
            if rep.endpoint is not None:
                rep.endpoint.close()
        self.replicas.clear()
        return reps

    async def close(self) -> None:
        """After ``stop_all``: leave the registry, close the launcher, remove the private
        directory."""
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await self.registry.close()
        await self.launcher.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._tmp):
                os.unlink(os.path.join(self._tmp, name))
            os.rmdir(self._tmp)

    def in_background(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------------ routing view

    def routable(self, role: str) -> list[Replica]:
        """The replicas of ``role`` that may be sent new work, in routing order."""
        return [r for r in self.replicas.values() if r.life.routable and role in r.roles]

    def readiness(self) -> list[str]:
        """Roles with no live replica to route to (sorted); [] when every role can serve."""
        return sorted(r for r in self.roles if not self.routable(r))

    async def find(self, role: str, rid: str) -> Replica | None:
        """A replica another front pinned a session to, once it can take work here: adopted
        from the registry if this front has not connected to it yet."""
        assert self.registry is not None
        rep = self.replicas.get(rid)
        if rep is None:  # registered, perhaps not adopted here yet
            listed = {r.replica_id: r for r in await self.registry.replicas(role)}
            if rid in listed:
                rep = self.adopt(role, rid, listed[rid].address)
        if rep is not None and rep.ready is not None and not rep.ready.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(rep.ready), self.start_timeout)
        return rep

    # ------------------------------------------------------------------ I/O

    async def _write(self, rep: Replica) -> None:
        """Send what is queued for ``rep``, in order; what queued together leaves batched."""
        # (Not the worker's ``_write``: one replica per writer, and a failure loses it.)
        out = rep.out
        while True:
            items = [await out.get()]
            while items[-1] is not None and not out.empty() and len(items) < MAX_BATCH:
                items.append(out.get_nowait())
            stop = items[-1] is None
            if stop:
                items.pop()
            assert rep.sealer is not None
            try:
                for frames in batch(items):  # type: ignore[arg-type]
                    await rep.endpoint.send(rep.sealer.seal(frames))
            except (TransportError, RuntimeClosedError) as exc:
                self.lost(rep, f"sending to it failed ({exc})")
                return
            if stop:
                return

    def _own(self, rep: Replica, msg: Message) -> None:
        """A message about ``rep`` itself (``_fleet_intake.FLEET_KINDS``)."""
        if type(msg) is Bye:
            self._on_bye(rep)
        elif type(msg) is Ready and rep.ready is not None and not rep.ready.done():
            rep.pid = msg.pid
            self.event(rep, ReplicaEvent.READY, f"pid {msg.pid}")
            if rep.probation is not None:  # went missing while it connected
                self.event(rep, ReplicaEvent.MISSING, "gone from the registry")
            rep.ready.set_result(None)
        elif type(msg) is Heartbeat and msg.batching is not None:
            rep.batches = msg.batching
        # (a Heartbeat: last_seen is updated for every authentic message)

    def dropped(self, rep: Replica, reason: str | None, exc: BaseException | None = None) -> None:
        """A message from ``rep`` was dropped (counted, and logged now and then)."""
        self.intake.dropped(rep, reason, exc)

    def _on_bye(self, rep: Replica) -> None:
        """The replica is leaving (scale-down): route nothing new to it and let it finish what
        it holds. The first ``bye`` is answered with ``bye``: it follows every run this front
        sent there on the same connection, so after it the worker knows nothing more comes."""
        rep.last_bye = asyncio.get_running_loop().time()
        if rep.life.state is ReplicaState.LEAVING or not rep.alive:
            return  # a repeat while it drains (it is alive), or too late to matter
        self.event(rep, ReplicaEvent.BYE, "it said bye")
        logger.info("replica %s is leaving, finishing %d runs", rep.replica_id, len(rep.held))
        rep.out.put_nowait(encode_msg(Bye()))

    # ------------------------------------------------------------------ registry

    def adopt(self, role: str, rid: str, address: str) -> Replica:
        """Start connecting to a replica found in the registry (in the background)."""
        rep = Replica(rid, [role], address)
        rep.ready = asyncio.get_running_loop().create_future()
        self.replicas[rid] = rep
        self.in_background(self._connect_adopted(rep))
        return rep

    async def _connect_adopted(self, rep: Replica) -> None:
        try:
            await asyncio.wait_for(self._connect(rep), self.start_timeout)
        except (TimeoutError, TransportError, OmniflowError) as exc:
            self.lost(rep, f"it did not answer ({exc!r})")

    def _discard(self, rep: Replica) -> None:
        """Forget a lost registry-found replica: stop its tasks, close its socket."""
        if self.replicas.get(rep.replica_id) is rep:
            del self.replicas[rep.replica_id]
        for task in rep.tasks:
            task.cancel()
        if rep.endpoint is not None:
            rep.endpoint.close()

    # ------------------------------------------------------------------ state changes

    def event(self, rep: Replica, event: ReplicaEvent, why: str = "") -> None:
        """The one way a replica's state changes (``_replica.transition`` checks it)."""
        rep.life.apply(event, why)
        self.epoch += 1

    def lost(self, rep: Replica, why: str) -> None:
        """``rep`` is gone: kill its process if it still runs, fail its start, tell the
        others its pool is gone, and have ``on_lost`` fail what it held."""
        if not rep.alive:
            return
        self.event(rep, ReplicaEvent.LOST, why)
        if rep.probation is not None:
            rep.probation.cancel()
            rep.probation = None
        proc = rep.process
        if proc is not None and self.launcher.alive(proc) and not self.closing:
            # Lost but running (a send failed, heartbeats missed): kill it, so it is reaped
            # and respawned, and cannot come back half-alive.
            proc.kill()
        if rep.ready is not None and not rep.ready.done():
            # What the worker wrote (why it raised, or what it was doing when it died).
            said = proc.start_error() if proc is not None else None
            reason = f"{said}; {why}" if said else why
            rep.ready.set_exception(
                StartError(
                    f"worker {rep.replica_id} (role(s) {rep.roles}) died before ready: {reason}",
                    roles=rep.roles,
                    replica=rep.replica_id,
                )
            )
            rep.ready.exception()  # retrieved: nobody may be waiting any more
        if rep.life.state is ReplicaState.LEFT and not rep.held:
            logger.info("replica %s left (%s)", rep.replica_id, why)
        else:
            logger.warning("replica %s lost: %s", rep.replica_id, why)
        if rep.pid is not None:
            # Its pool is gone: consumers pulling from it over ZMQ would wait forever.
            gone = encode_msg(SourceLost(rep.address, rep.pid))
            for other in self.replicas.values():
                if other.alive:
                    other.out.put_nowait(gone)
        self._on_lost(rep, why)
        rep.held.clear()
        if rep.process is None:  # nothing else would close a registry-found replica
            asyncio.get_running_loop().call_soon(self._discard, rep)

    def wire_statistics(self) -> dict[str, Any]:
        """The authenticated wire and supervision, as seen by this front: messages accepted and
        dropped by reason, forged registry records ignored, replicas respawned per role and
        live replicas per role."""
        registry = self.registry
        forged = registry.statistics().get("forged_records", 0) if registry else 0
        return {
            **self.wire.statistics(),
            "forged_records": forged,
            "restarts": dict(sorted(self.restarts.items())),
            "live_replicas": {r: len(self.routable(r)) for r in sorted(self.roles)},
        }

    def batch_statistics(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Each live replica's batchers' ``statistics()`` as its last heartbeat said, by
        replica id (replicas without batched nodes left out)."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for rep in self.replicas.values():
            st = rep.batches
            if rep.alive and st:
                if EDGES_KEY in st:  # (the edge bytes ride along: ``_remote_edges``)
                    st = {n: v for n, v in st.items() if n != EDGES_KEY}
                if st:
                    out[rep.replica_id] = st
        return out

    def colocation(self, local: frozenset[str]) -> Colocation:
        """The co-location facts of the roles the front hosts (``local``) next to its workers:
        they fill slot 0 of the deployment on this node."""
        return Colocation(local, colocation_group(self.token, "slot0"))
