"""Front side of the multi-process runtime: routing activations to worker replicas.

The front keeps every call core (all scheduling decisions); a role placed in a worker only
changes *where* its methods run. ``RemoteRoles.submit`` sends a ``run`` to the replicas the
node's load-balance policy (``registry._lb``) chooses; the replica's ``frame`` and ``done``
messages come back to the runtime shell exactly as a local method's would. A replica that dies
fails the activations it held with a NodeError saying so, at once when the front started the
process, and within the registry's time-to-live otherwise. Every message is sealed and checked
(``transport._auth``) and typed (``transport._protocol``); frames and dones are taken only from
the replica that runs the activation; ``readiness()`` names the roles with no live replica.

What lives elsewhere: placement (``_placement``, pure), replica states and backoff
(``_replica``, pure), the replicas' connections, processes, supervision and registry watch
(``_fleet``), starting a replica (``_launch``). This module routes: runs (``submit``), session
pins, cancels, releases, ``end_call``, the front's spin; its parts: what replicas report
(``_remote_replies``), per-run records (``_remote_pending``), the ends of calls on their
workers (``_remote_ends``), hosted pool metadata and stats (``_remote_meta``).

The fast path (``_forward``): a run may carry routes (``_remote_routes``) by which its worker
starts the next node's runs on their worker itself. When the frame that caused such a run
arrives, the call core makes the activation it always makes, and ``submit`` *binds* it to the
forwarded run instead of sending one. Every such decision (bind, keep what came early and
replay it, orphan, cut, claim) is the pure machine's (``fastpath.FastPathCore``);
``_remote_fast.FastPath`` carries its instructions out. What a forwarded run reported before
its binding first waits at the fleet for the end of the loop turn (the machine says ``WAIT``;
``_fleet_intake.Intake._later``), and if still unbound then, the machine keeps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import NodeError, RegistryError
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.cluster._launch import Launcher
from omniflow.cluster._placement import ProcessSpec
from omniflow.cluster._remote_edges import Consumers, count_run, counting, totals
from omniflow.cluster._remote_ends import CallEnds
from omniflow.cluster._remote_fast import FastPath
from omniflow.cluster._remote_meta import WorkerQueries
from omniflow.cluster._remote_pending import Key, Pending
from omniflow.cluster._remote_pins import Pins
from omniflow.cluster._remote_replies import Replies
from omniflow.cluster._remote_routes import RouteTable
from omniflow.cluster.fastpath._events import Bind
from omniflow.data._plane import DEFAULT_THRESHOLD, DataPlane
from omniflow.data._ref import DataRef
from omniflow.data.kv._meta import MemoryMetadata
from omniflow.dsl._context import Colocation
from omniflow.registry._lb import (
    Broadcast,
    LoadBalance,
    RoundRobin,
    SessionLoadBalance,
    no_live_replica,
)
from omniflow.runtime._executor import OnDone, OnFrame
from omniflow.runtime._metrics import FRONT_REF
from omniflow.transport._auth import resolve_key, send_sealed_now
from omniflow.transport._fastpath import fast_path_enabled, front_spin, is_local
from omniflow.transport._protocol import Cancel, CloseSession, Release, Run, encode_msg

if TYPE_CHECKING:
    from omniflow.plan._plan import StaticPlan
    from omniflow.runtime._call import Call
    from omniflow.runtime.callcore._core import Activation, CallCore

__all__ = ["RemoteRoles"]

_new = tuple.__new__

#: Let another runnable process have this CPU first (a spin turn's courtesy; a no-op where
#: the platform has no ``sched_yield``).
_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: None)
#: The spin's clock (read once per message: the loop's ``time()`` is a method call more).
_monotonic = time.monotonic

logger = logging.getLogger("omniflow.remote")


class RemoteRoles(Replies, Pins):
    """The worker processes of one Runtime and the replicas it routes to."""

    def __init__(
        self,
        processes: list[ProcessSpec],
        *,
        registry: str | None,
        on_frame: OnFrame,
        on_done: OnDone,
        on_return: OnFrame,
        heartbeat_interval: float = 1.0,
        start_timeout: float = 60.0,
        plane: DataPlane | None = None,
        offload: dict[tuple[str, str], list[str]] | None = None,
        connectors: dict[str, dict[str, str]] | None = None,
        cluster_key: bytes | None = None,
        heartbeat_misses: int = 10,
        respawn: bool = True,
        launcher: Launcher | None = None,
        fast_path: bool | None = None,
        spin: float | None = None,
    ) -> None:
        self.processes = processes
        #: Workers start direct-fire runs on each other (``_forward``); None: from
        #: ``$OMNIFLOW_FAST_PATH`` (on unless it says 0/false/off/no).
        self.fast_path = fast_path_enabled() if fast_path is None else fast_path
        #: The front traces (``Runtime(tracer_provider=)``): runs carry their span's context.
        self.traced = False
        #: The deployment's key (workers started here get it in their environment).
        self.cluster_key = cluster_key if cluster_key is not None else resolve_key()[0]
        #: The replicas: connections, processes, supervision (``_fleet``).
        self.fleet = Fleet(
            processes,
            on_message=self._on_message,
            on_lost=self._on_lost,
            cluster_key=self.cluster_key,
            registry=registry,
            heartbeat_interval=heartbeat_interval,
            start_timeout=start_timeout,
            heartbeat_misses=heartbeat_misses,
            respawn=respawn,
            launcher=launcher,
        )
        #: Roles served by workers.
        self.roles = self.fleet.roles
        #: Seconds the front polls without sleeping after its last message while remote work
        #: is in flight (``_kick``); None: ``$OMNIFLOW_SPIN_US`` (0 with the fast path off).
        self.spin = spin if spin is not None else (front_spin() if self.fast_path else 0.0)
        self._spinner: asyncio.Task[None] | None = None
        self._last_message = 0.0  #: ``time.monotonic()`` of the last run sent or message read
        self.spins = 0  #: loop turns spent polling (observability)
        #: The front's data plane (inputs it produced for remote methods go through its pool).
        self.plane = plane
        #: (graph, node) -> outputs a worker puts in its data plane (never the caller's fields).
        self._offload = offload or {}
        #: node -> {source node: connector} for edges configured away from "auto".
        self._connectors = connectors or {}
        #: (call id, aid) -> refs the front put in its own pool for that remote activation.
        self._front_refs: dict[Key, list[DataRef]] = {}
        #: The front's offload threshold, sent with each run that offloads (None: the default).
        self._threshold = (
            plane.threshold if plane is not None and plane.threshold != DEFAULT_THRESHOLD else None
        )
        #: Hosted pool metadata and stats requests (``_remote_meta``).
        self._queries = WorkerQueries(self.fleet)
        self._on_frame = on_frame
        self._on_done = on_done
        #: A done with its coroutine's returned frame (the frame and the end in one).
        self._on_return = on_return
        self._pending: dict[Key, Pending] = {}
        #: The fast-path routes each node's runs carry (``_remote_routes``).
        self._route_table = RouteTable(
            self.fleet, self.roles, self._offload, self._connectors, self._threshold
        )
        #: Forwarded runs around their binding: expected, early, orphans, claims.
        self._fast = FastPath(
            self.fleet,
            self._pending,
            release=self.release,
            deliver=self._on_message,
            fail=self._replica_done,
        )
        rr = RoundRobin()
        #: Session pins: in the registry once it is started, else in this front only.
        self._session = SessionLoadBalance(fallback=rr)
        #: ``lb=`` name -> policy (one family for every placement: ``registry._lb``).
        self._policies: dict[str, LoadBalance] = {
            rr.name: rr,
            Broadcast.name: Broadcast(),
            self._session.name: self._session,
        }
        #: (session, role) -> runs waiting for the registry to settle the session's pin.
        self._pinning: dict[tuple[str, str], list[tuple[Key, Any]]] = {}
        #: The replicas each call ran on, and the ends that wait for their answers.
        self._ends = CallEnds(self.fleet)
        #: Send ``end_call`` to every replica a call ran on (Params Pools release there), and
        #: wait for each one's ``CallEnded`` before the call's end is visible (``_ending``).
        self.track_calls = False
        #: Encoded bytes of the runs sent, per edge (``RuntimeMetrics.edge_bytes``; None:
        #: metrics off, nothing counted).
        self.edge_bytes: dict[tuple[str, str, str, str], int] | None = None
        #: The plans, by graph (the producers of the inputs workers read from the front).
        self._plans: Mapping[str, StaticPlan] = {}

    @property
    def heartbeat_interval(self) -> float:
        """How often replicas heartbeat (read at ``start``)."""
        return self.fleet.heartbeat_interval

    @heartbeat_interval.setter
    def heartbeat_interval(self, value: float) -> None:
        self.fleet.heartbeat_interval = value

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            await self.fleet.start()
        except BaseException:
            await self.close()
            raise
        self._session.store = self.fleet.registry

    async def close(self) -> None:
        self.spin = 0.0  # no more spins; one under way ends at its next turn
        spinner = self._spinner
        if spinner is not None:
            spinner.cancel()
            with contextlib.suppress(BaseException):
                await spinner
        for rep in await self.fleet.stop_all():
            if rep.pool_nodes:  # its pools are gone with it
                nodes, rep.pool_nodes = rep.pool_nodes, set()
                await self._queries.forget_pools(nodes)
        self._ends.close()  # (the workers are gone, with their pages)
        await self._queries.close()
        await self.fleet.close()

    def colocation(self, local: frozenset[str]) -> Colocation:
        """Where the front's own roles (``local``) sit: slot 0 of the deployment on this node."""
        return self.fleet.colocation(local)

    def replica_batch_statistics(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Each live replica's batchers' ``statistics()``, as its last heartbeat said."""
        return self.fleet.batch_statistics()

    def readiness(self) -> list[str]:
        """Roles with no live replica to route to (sorted); [] when every role can serve."""
        return self.fleet.readiness()

    # ------------------------------------------------------------------ routing

    def submit(self, call: Call, core: CallCore, act: Activation) -> None:
        """Run ``act`` on a replica of its role (all replicas for lb="broadcast"), or bind it to
        the run a worker forwarded for it."""
        if self._fast.core.expect is not None:  # (a frame that forwarded runs is in the core)
            bind = self._fast.made(call.call_id, act.node, act.group, act.seq[2], act.kwargs)
            if bind is not None:
                self._bind(call, core, act, bind)
                return
        spec = core.c.specs[act.node]
        role = spec.role
        live = self.fleet.routable(role)
        try:
            # None: the session's first run from here waits for its pin to be settled.
            targets = self._policies[spec.lb].select_now(role, live, session=call.session)
        except RegistryError:  # no live replica
            self._on_done(call, core, act, self._no_replica(call, act, role))
            return
        key = (call.call_id, act.aid)
        p = self._pending[key] = Pending(self, key, call, core, act, list(targets or ()))
        call._tasks[act] = p
        kwargs = act.kwargs
        plane = self.plane
        # Big inputs go through the front's pool when every replica it may reach (a run
        # waiting for its session's pin may go to any live one) shares this host.
        if (
            plane is not None
            and any(plane.is_big(v) for v in kwargs.values())
            and all(is_local(r.address) for r in (targets or live))
        ):
            kwargs = self._offload_inputs(key, act.node, kwargs)
        off = self._offload.get((call.graph, act.node)) or None
        fw = None
        if self.fast_path and targets is not None and len(targets) == 1:
            plans, fw = self._route_table.of(core.c, call.graph, act.node)
            if plans:
                p.routes = plans
                self._fast.started(key[0], key[1])
        # (``tuple.__new__``: the NamedTuple's own constructor is Python code.)
        run: Run = _new(Run, (
            call.call_id, act.aid, act.node, kwargs, call.session, act.group, act.seq[2],
            call.graph, off, self._threshold if off else None,
            self._connectors.get(act.node) or None, fw,
        ))  # fmt: skip
        if self.traced:  # its span's context rides along (``_observe.ObservedCore.placed``)
            where = targets[0].replica_id if targets is not None and len(targets) == 1 else ""
            run = _new(Run, (*run, core.placed(act, where)))  # type: ignore[attr-defined]
        try:
            frames = encode_msg(run)
        except Exception as exc:
            del self._pending[key]
            if p.routes:
                self._fast.ended(key[0], key[1])
            self._on_done(
                call,
                core,
                act,
                NodeError(
                    act.node,
                    f"its inputs cannot be sent to a worker process: {exc}",
                    call_id=call.call_id,
                    graph=call.graph,
                ),
            )
            return
        if self.edge_bytes is not None:
            count_run(self.edge_bytes, call.graph, core, act.node, kwargs, len(targets or ()) or 1)
        if not targets:  # the session's first run from here: settle its pin first
            assert call.session is not None
            self._defer(call.session, role, key, frames)
            return
        self._send_run(p, frames, targets)

    def count_edge_bytes(
        self, into: dict[tuple[str, str, str, str], int], plans: Mapping[str, StaticPlan]
    ) -> None:
        """Count ``into`` (the runtime's metrics) the bytes per edge of the runs sent and of
        the frames and dones received, and have the workers this front starts count what
        they forward and read (reported in heartbeats; ``_remote_edges``)."""
        self.edge_bytes = into
        self._plans = plans
        labels = Consumers()  # (both callbacks count: a returned frame rides in a done)
        self._on_frame = counting(into, labels, self._on_frame)
        self._on_return = counting(into, labels, self._on_return)
        self.fleet.launcher.edge_bytes = True

    def edge_byte_totals(self) -> dict[tuple[str, str, str, str], int]:
        """Bytes per edge: what this front counted plus what each live worker's last
        heartbeat said it counted (``_remote_edges.totals``)."""
        return totals(self.edge_bytes, self.fleet.replicas.values(), self._plans)

    def _bind(self, call: Call, core: CallCore, act: Activation, bind: Bind) -> None:
        """``act`` is the activation a worker already started as ``bind.wid`` (the fast-path
        machine checked it is the one forwarded): take it as sent."""
        plan = bind.plan
        rep = plan.rep
        key = (call.call_id, bind.wid)
        p = self._pending[key] = Pending(self, key, call, core, act, [rep], plan.sub, bind.via)
        call._tasks[act] = p
        if core.c.plan.params or self.track_calls:
            self._ends.replicas.setdefault(key[0], set()).add(rep)
        rep.held.add(key)
        self.fleet.intake.known = True  # (what waits for it need not wait for the next loop turn)
        if self.traced:
            core.placed(act, rep.replica_id)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ the spin

    def _kick(self) -> None:
        """A run went out or a message came in: poll on for ``spin`` after it.

        A sleeping process is woken by the kernel when a reply lands, which costs tens of µs
        per hop here; while the front polls, the reply is read in its next loop turn. The spin
        ends ``spin`` after the last message or as soon as nothing is in flight, so an idle
        front sleeps, and a slow role costs the front one spin, not its whole run.
        """
        if self.spin:
            self._last_message = _monotonic()
            if self._spinner is None:
                self._spinner = asyncio.get_running_loop().create_task(self._spin())

    async def _spin(self) -> None:
        """Keep the loop polling (each turn: its sockets without a timeout, then whatever they
        made ready) while remote work is in flight and the last message is recent. Each turn
        first yields the CPU to any process waiting for it (a worker on this core runs first)."""
        try:
            while self._pending and _monotonic() - self._last_message < self.spin:
                _yield_cpu()
                self.spins += 1
                await asyncio.sleep(0)
        finally:
            self._spinner = None

    def _send_run(self, p: Pending, frames: Any, targets: list[Replica]) -> None:
        self._kick()
        key = p.key
        if p.core.c.plan.params or self.track_calls:
            self._ends.replicas.setdefault(key[0], set()).update(targets)
        for rep in targets:
            rep.held.add(key)
            # A run started by a caller goes out at once (no writer wake-up on the way: the
            # hop's latency); runs made while a batch of replies is handled are queued, so
            # the writer sends them back to back and the workers receive them in batches.
            if not self.fleet.intake.in_batch and rep.out.empty() and rep.endpoint is not None:
                assert rep.sealer is not None
                if send_sealed_now(rep.endpoint, rep.sealer, frames):
                    continue
            rep.out.put_nowait(frames)

    @staticmethod
    def _no_replica(call: Call, act: Activation, role: str) -> NodeError:
        return NodeError(act.node, no_live_replica(role), call_id=call.call_id, graph=call.graph)

    def _offload_inputs(self, key: Key, node: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Big inputs the front itself produced go to the worker through the front's pool."""
        assert self.plane is not None
        out = self.plane.offload(
            FRONT_REF + node, key[0], key[1], 0, kwargs,
            [f for f, v in kwargs.items() if type(v) is not DataRef],
        )  # fmt: skip
        if out is not kwargs:
            self._front_refs[key] = [out[f] for f in out if out[f] is not kwargs[f]]
        return out

    def release(self, refs: list[DataRef]) -> None:
        """The last consumer edge of each ref finished: tell the owner to free the block."""
        by_owner: dict[str, list[DataRef]] = {}
        for ref in refs:
            by_owner.setdefault(ref.source, []).append(ref)
        for source, owned in by_owner.items():
            for rep in self.fleet.replicas.values():
                if rep.alive and rep.address == source:
                    rep.out.put_nowait(encode_msg(Release(owned)))
                    break

    def end_call(self, call_id: str) -> asyncio.Future[None] | None:
        """Let the workers drop what a finished call left: params, data-plane blocks and,
        with ``track_calls``, pool pages; then a future resolved once each worker asked has
        released them (or was lost, or ``END_CALL_TIMEOUT`` passed), else None."""
        self._fast.end_call(call_id)
        return self._ends.end(call_id, self.track_calls)

    def close_session(self, session: str) -> None:
        frames = encode_msg(CloseSession(session))
        for rep in self.fleet.replicas.values():
            if rep.alive:
                rep.out.put_nowait(frames)
        self._session.forget(session)

    def _cancel(self, key: Key) -> None:
        p = self._pending.get(key)
        if p is None:
            return
        if not p.replicas:  # still waiting for its session's pin: it was never sent
            if not isinstance(p.error, asyncio.CancelledError):
                p.error = asyncio.CancelledError()
                asyncio.get_running_loop().call_soon(self._replica_done, None, key, None)
            return
        frames = encode_msg(Cancel(key[0], key[1]))
        for rep in p.replicas:
            if rep.alive:
                rep.out.put_nowait(frames)

    def statistics(self) -> dict[str, int]:
        return {
            # Connected, not leaving: what calls can be routed to.
            "replicas": sum(1 for r in self.fleet.replicas.values() if r.life.routable),
            "remote_inflight": len(self._pending),
            # The fast path: runs bound to one a worker forwarded, orphans, and what waits.
            "forwarded": self._fast.forwarded,
            "orphaned": self._fast.orphaned,
            "forward_waiting": self._fast.waiting(),
        }

    def fast_path_story(self, call_id: str) -> list[dict[str, Any]]:
        """The moves of call ``call_id``'s forwarded runs, oldest first, as far as the fast-path
        machine's bounded log reaches back (``FastPathCore.story``)."""
        return self._fast.core.story(call_id)

    def wire_statistics(self) -> dict[str, Any]:
        """The authenticated wire and supervision as this front sees them (``Fleet``)."""
        return self.fleet.wire_statistics()

    @property
    def pool_meta(self) -> MemoryMetadata:
        """The Params Pools' metadata of pools with metadata=None, one truth for the front's
        pools and every worker it spawned (``kv._hosted``)."""
        return self._queries.pool_meta

    async def data_plane_statistics(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """Each live replica's ``DataPlane.statistics()`` (``WorkerQueries``)."""
        return await self._queries.data_plane_statistics(timeout)

    async def worker_statistics(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Each live replica's ``StatsReply`` as a dict (``WorkerQueries.worker_statistics``)."""
        return await self._queries.worker_statistics(timeout)
