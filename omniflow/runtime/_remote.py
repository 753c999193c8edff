"""Front side of the multi-process runtime: routing activations to worker replicas.

The front keeps every call core (all scheduling decisions); a role placed in a worker only
changes *where* its methods run. ``RemoteRoles.submit`` sends a ``run`` to the replicas the
node's load-balance policy (``registry._lb``) chooses; the replica's ``frame`` and ``done``
messages come back to the runtime shell exactly as a local method's would. A replica that dies
fails the activations it held with a NodeError saying so, at once when the front started the
process, and within the registry's time-to-live otherwise. Every message is sealed and checked
(``transport._auth``) and typed (``transport._protocol``); frames and dones are taken only from
the replica that runs the activation; ``readiness()`` names the roles with no live replica.

What lives elsewhere: which roles go to which processes (``_placement``, pure); each replica's
states and their legal changes, and the restart backoff (``_replica``, pure); the replicas'
connections, processes, heartbeat supervision, restarts and registry watch (``_fleet``); how a
replica process is started (``_launch``: a subprocess today, behind the ``Launcher`` seam).
This module assembles and answers the messages about calls: runs, frames, dones, cancels,
releases, stats and the front-hosted Params Pool metadata.

The fast path (``_forward``): a run may carry routes by which its worker starts the next node's
runs on their worker itself. When the frame that caused such a run arrives, the call core makes
the activation it always makes, and ``submit`` *binds* it to the forwarded run instead of
sending one; what the forwarded run reported before that first waits at the fleet for the end
of the loop turn (``_on_message``, ``Fleet._later``), and if still unbound then, waits in
``_early`` and is replayed then. A forwarded run the core did not make is an orphan:
cancelled, and what it sends dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import (
    NodeError,
    OmniflowError,
    RegistryError,
    RuntimeClosedError,
    TransportError,
)
from omniflow.data._plane import DEFAULT_THRESHOLD, DataPlane
from omniflow.data._ref import DataRef, refs_in
from omniflow.data.kv._hosted import serve as serve_meta
from omniflow.data.kv._meta import MemoryMetadata
from omniflow.registry._lb import (
    Broadcast,
    LoadBalance,
    RoundRobin,
    SessionLoadBalance,
    no_live_replica,
)
from omniflow.runtime._fleet import Fleet, Replica
from omniflow.runtime._forward import (
    Hop,
    Waiting,
    hops,
    parent_of,
)
from omniflow.runtime._launch import Launcher
from omniflow.runtime._placement import ProcessSpec
from omniflow.runtime._replica import ReplicaState
from omniflow.transport._auth import resolve_key
from omniflow.transport._fastpath import fast_path_enabled, front_spin, is_local
from omniflow.transport._protocol import (
    CallEnded,
    Cancel,
    Claim,
    Claimed,
    CloseSession,
    Done,
    Dones,
    EndCall,
    Frame,
    Frames,
    Message,
    MetaCall,
    MetaNotify,
    MetaReply,
    Release,
    Run,
    StatsReply,
    StatsRequest,
    encode_msg,
)

if TYPE_CHECKING:
    from omniflow.runtime._call import Call
    from omniflow.runtime._compiled import Compiled
    from omniflow.runtime._core import Activation, CallCore

__all__ = ["RemoteRoles"]

_new = tuple.__new__

#: Let another runnable process have this CPU first (a spin turn's courtesy; a no-op where
#: the platform has no ``sched_yield``).
_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: None)
#: The spin's clock (read once per message: the loop's ``time()`` is a method call more).
_monotonic = time.monotonic

logger = logging.getLogger("omniflow.remote")

#: Seconds the end of a call waits at most for its workers' ``CallEnded`` (their pool pages
#: released); a worker that neither answers nor is found lost by then is logged and let be.
END_CALL_TIMEOUT = 10.0

#: How the runtime shell is told about a remote activation's progress.
OnFrame = Callable[["Call", "CallCore", "Activation", Any], None]
OnDone = Callable[["Call", "CallCore", "Activation", BaseException | None], None]


#: A run's wire id: the front's activation id, or a forwarded run's str id (``_forward``).
Wid = int | str
#: The exact types of a wire activation id (front's int, forwarded run's str).
_WID = (int, str)
#: (call id, wire id): how the front knows a remote activation.
Key = tuple[str, Wid]


@dataclass(slots=True)
class _Plan:
    """A fast-path route as the front sent it: the edge, the replica it names, and the routes
    the downstream run itself was given."""

    hop: Hop
    rep: Replica
    sub: tuple[_Plan, ...]


class _Pending:
    """An activation running on one or more replicas; the shell's task for it (in
    ``call._tasks``): ``cancel()`` asks its replicas."""

    __slots__ = (
        "act", "call", "core", "error", "k", "key", "remote", "replicas", "routes", "via",
    )  # fmt: skip

    def __init__(
        self,
        remote: RemoteRoles,
        key: Key,
        call: Call,
        core: CallCore,
        act: Activation,
        replicas: list[Replica],
        routes: tuple[_Plan, ...] = (),
        via: Replica | None = None,
    ) -> None:
        self.remote = remote
        #: (call id, wire id): its entry in ``RemoteRoles._pending`` and in replicas' ``held``.
        self.key = key
        self.call = call
        self.core = core
        self.act = act
        #: The replicas running it (its done comes from each).
        self.replicas = replicas
        #: The error to end it with (the first a replica reported, or a lost replica's).
        self.error: BaseException | None = None
        #: The fast-path routes its run carried (index = route number in a frame's ``x``).
        self.routes = routes
        #: Frames it sent so far (a forwarded run's id names the frame by this index).
        self.k = 0
        #: A forwarded run's forwarder: the replica whose frame said it started it.
        self.via = via

    def cancel(self) -> None:
        self.remote._cancel(self.key)


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


class RemoteRoles:
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
        #: The Params Pools' metadata of pools with metadata=None, one truth for the front's
        #: pools and every worker it spawned (``kv._hosted``).
        self.pool_meta = MemoryMetadata()
        self._meta_tasks: set[asyncio.Task[None]] = set()
        #: Request id -> future of a worker's "stats" answer.
        self._stats_waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._stats_ids = itertools.count(1)
        self._on_frame = on_frame
        self._on_done = on_done
        #: A done with its coroutine's returned frame (the frame and the end in one).
        self._on_return = on_return
        self._pending: dict[Key, _Pending] = {}
        #: (graph, node) -> its fast-path edges (from the plan; ``_forward.hops``).
        self._hops: dict[tuple[str, str], tuple[Hop, ...]] = {}
        #: (graph, node) -> (fleet epoch, routes, their wire form) of its runs.
        self._routes: dict[tuple[str, str], tuple[int, tuple[_Plan, ...], list[Any] | None]] = {}
        #: While a frame that forwarded runs is in the core: node -> (wire id, route, SeqId
        #: index, the replica that forwarded it) expected.
        self._expect: dict[str, tuple[str, _Plan, int, Replica]] | None = None
        #: Claims sent to replicas about runs whose forwarder was lost: request id ->
        #: (the replica asked, call id, wire ids, the forwarder).
        self._claims: dict[int, tuple[Replica, str, list[str], Replica]] = {}
        self._claim_ids = itertools.count(1)
        #: Forwarded runs bound while the core handled a frame (their early messages replay).
        self._bound: list[tuple[str, str]] = []
        #: call id -> what its forwarded runs sent before their binding.
        self._early: dict[str, Waiting] = {}
        #: call id -> wire id -> replica of forwarded runs the core did not make (cancelled;
        #: what they send is dropped) until their done.
        self._orphans: dict[str, dict[str, Replica]] = {}
        #: call id -> activations with routes that ended with their replica lost: frames of
        #: theirs may never arrive, so a run they forwarded that turns up later is an orphan.
        self._cut: dict[str, set[Wid]] = {}
        #: Fast-path counts: runs bound to a forwarded run, and orphans.
        self.forwarded = 0
        self.orphaned = 0
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
        self._call_replicas: dict[str, set[Replica]] = {}
        #: Send ``end_call`` to every replica a call ran on (Params Pools release there), and
        #: wait for each one's ``CallEnded`` before the call's end is visible (``_ending``).
        self.track_calls = False
        #: call id -> its end_call's answers still awaited.
        self._ending: dict[str, _Ending] = {}

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
                await self._forget_pools(nodes)
        for c in list(self._ending):  # (the workers are gone, with their pages)
            self._ended(c)
        for task in list(self._meta_tasks):
            with contextlib.suppress(BaseException):
                await task
        await self.fleet.close()

    def readiness(self) -> list[str]:
        """Roles with no live replica to route to (sorted); [] when every role can serve."""
        return self.fleet.readiness()

    # ------------------------------------------------------------------ routing

    def submit(self, call: Call, core: CallCore, act: Activation) -> None:
        """Run ``act`` on a replica of its role (all replicas for lb="broadcast"), or bind it to
        the run a worker forwarded for it."""
        expect = self._expect
        if expect is not None:
            hit = expect.pop(act.node, None)
            if hit is not None and self._bind(call, core, act, *hit):
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
        p = self._pending[key] = _Pending(self, key, call, core, act, list(targets or ()))
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
            plans, fw = self._fast_routes(core.c, call.graph, act.node)
            p.routes = plans
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
        if not targets:  # the session's first run from here: settle its pin first
            assert call.session is not None
            self._defer(call.session, role, key, frames)
            return
        self._send_run(p, frames, targets)

    def _fast_routes(
        self, c: Compiled, graph: str, node: str
    ) -> tuple[tuple[_Plan, ...], list[Any] | None]:
        """The fast-path routes of a run of ``node``: each to the one routable replica of its
        target (an edge whose role has more, or none ready, is left to the front); the same
        until a replica changes state."""
        cached = self._routes.get((graph, node))
        if cached is not None and cached[0] == self.fleet.epoch:
            return cached[1], cached[2]
        plans, wire = self._make_routes(c, graph, node)
        self._routes[(graph, node)] = (self.fleet.epoch, plans, wire)
        return plans, wire

    def _make_routes(
        self, c: Compiled, graph: str, node: str
    ) -> tuple[tuple[_Plan, ...], list[Any] | None]:
        edges = self._hops.get((graph, node))
        if edges is None:
            edges = self._hops[(graph, node)] = hops(c, node, self.roles)
        if not edges:
            return (), None
        plans: list[_Plan] = []
        wire: list[Any] = []
        for hop in edges:
            live = self.fleet.routable(hop.role)
            if len(live) != 1 or live[0].life.state is not ReplicaState.READY:
                continue
            rep = live[0]
            sub, sub_wire = self._make_routes(c, graph, hop.node)
            off = self._offload.get((graph, hop.node)) or None
            plans.append(_Plan(hop, rep, sub))
            wire.append([
                hop.field, hop.node, hop.group, rep.address, rep.replica_id, off,
                self._threshold if off else None, self._connectors.get(hop.node) or None,
                hop.qk, sub_wire,
            ])  # fmt: skip
        return tuple(plans), wire or None

    def _bind(
        self,
        call: Call,
        core: CallCore,
        act: Activation,
        wid: str,
        plan: _Plan,
        q: int,
        via: Replica,
    ) -> bool:
        """``act`` is the activation a worker already started as ``wid``: take it as sent.
        False (``wid`` orphaned) if anything differs from what was forwarded."""
        rep = plan.rep
        hop = plan.hop
        kwargs = act.kwargs
        if (
            not rep.life.routable
            or act.group != hop.group
            or act.seq[2] != q
            or len(kwargs) != 1
            or hop.field not in kwargs
        ):
            self._orphan(rep, call.call_id, wid)
            return False
        key = (call.call_id, wid)
        p = self._pending[key] = _Pending(self, key, call, core, act, [rep], plan.sub, via)
        call._tasks[act] = p
        if core.c.plan.params or self.track_calls:
            self._call_replicas.setdefault(key[0], set()).add(rep)
        rep.held.add(key)
        self.forwarded += 1
        self._bound.append(key)
        self.fleet.known = True  # (what waits for it need not wait for the next loop turn)
        if self.traced:
            core.placed(act, rep.replica_id)  # type: ignore[attr-defined]
        return True

    def _orphan(self, rep: Replica, c: str, wid: str, done: bool = False) -> None:
        """A forwarded run the core did not make: cancel it (unless it is ``done``) and drop
        what it sends until its done."""
        self.orphaned += 1
        if done or not rep.alive:  # (a lost replica sends nothing more)
            return
        self._orphans.setdefault(c, {})[wid] = rep
        rep.out.put_nowait(encode_msg(Cancel(c, wid)))

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

    def _send_run(self, p: _Pending, frames: Any, targets: list[Replica]) -> None:
        self._kick()
        key = p.key
        if p.core.c.plan.params or self.track_calls:
            self._call_replicas.setdefault(key[0], set()).update(targets)
        for rep in targets:
            rep.held.add(key)
            # A run started by a caller goes out at once (no writer wake-up on the way: the
            # hop's latency); runs made while a batch of replies is handled are queued, so
            # the writer sends them back to back and the workers receive them in batches.
            if not self.fleet.in_batch and rep.out.empty() and rep.endpoint is not None:
                assert rep.sealer is not None
                try:
                    # A refused try used a counter the writer skips: gaps are allowed.
                    if rep.endpoint.try_send(rep.sealer.seal(frames)):
                        continue
                except (TransportError, RuntimeClosedError):
                    pass  # the writer meets the same error and declares the replica lost
            rep.out.put_nowait(frames)

    @staticmethod
    def _no_replica(call: Call, act: Activation, role: str) -> NodeError:
        return NodeError(act.node, no_live_replica(role), call_id=call.call_id, graph=call.graph)

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

    def _offload_inputs(self, key: Key, node: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Big inputs the front itself produced go to the worker through the front's pool."""
        assert self.plane is not None
        out = self.plane.offload(
            f"<front>->{node}", key[0], key[1], 0, kwargs,
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
        # Forwarded runs of the call still unaccounted for: nothing can bind them any more.
        waiting = self._early.pop(call_id, None)
        if waiting is not None:
            for wid, (rep, msgs) in waiting.early.items():
                self._drop_early(rep, call_id, wid, msgs)
        self._orphans.pop(call_id, None)  # (what they send later is dropped all the same)
        self._cut.pop(call_id, None)
        reps = self._call_replicas.pop(call_id, None)
        if not reps:
            return None
        ack = self.track_calls
        frames = encode_msg(EndCall(call_id, ack))
        asked = set()
        for rep in reps:
            if rep.alive:
                rep.out.put_nowait(frames)
                asked.add(rep)
        if not (ack and asked):
            return None
        loop = asyncio.get_running_loop()
        ending = self._ending[call_id] = _Ending(asked, loop.create_future())
        ending.timer = loop.call_later(END_CALL_TIMEOUT, self._end_overdue, call_id)
        return ending.done

    def _call_ended(self, rep: Replica, c: str) -> None:
        """``rep`` released what call ``c`` left there."""
        ending = self._ending.get(c)
        if ending is None:
            return  # (after the timeout, or after the front closed)
        if rep not in ending.reps:
            self.fleet.dropped(rep, "foreign", OmniflowError(f"an end of call {c!r:.40}, not its"))
            return
        ending.reps.discard(rep)
        if not ending.reps:
            self._ended(c)

    def _ended(self, c: str) -> None:
        ending = self._ending.pop(c)
        if ending.timer is not None:
            ending.timer.cancel()
        if not ending.done.done():
            ending.done.set_result(None)

    def _end_overdue(self, c: str) -> None:
        ending = self._ending.get(c)
        if ending is None:
            return
        logger.warning(
            "call %s: replica(s) %s did not confirm its end within %s s; its end is visible "
            "before they released its pool pages",
            c, sorted(r.replica_id for r in ending.reps), END_CALL_TIMEOUT,
        )  # fmt: skip
        self._ended(c)

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

    # ------------------------------------------------------------------ messages

    def _on_message(self, rep: Replica, msg: Message, may_wait: bool = False) -> Message | None:
        """A checked message about calls from ``rep`` (the fleet handles its own kinds).

        ``may_wait``: a message (or the rest of a ``Dones``) about a forwarded run the front
        has not bound yet, whose binding frame may still come this loop turn, is handed back
        instead, for the fleet to deliver at the end of the turn (``Fleet._later``): then it
        needs no keeping and replaying (``_stray``)."""
        self._kick()
        # By exact type, the commonest first (a decoded message is never a subclass).
        if type(msg) is Dones:
            return self._on_dones(rep, msg, may_wait)
        elif type(msg) is Done:
            c, a = msg.c, msg.a
            if may_wait and type(a) is str and (c, a) not in rep.held and not self._is_orphan(c, a):
                return msg
            self._on_done_msg(rep, msg)
        elif type(msg) is Frames:  # consecutive frames of one generator act
            c, a, fs, xs = msg
            if (c, a) not in rep.held and type(a) is str:
                if may_wait and not self._is_orphan(c, a):
                    return msg
                self._stray(rep, c, a, msg)
            elif xs is None:
                for frame in fs:
                    self._replica_frame(rep, c, a, frame)
            elif len(xs) != len(fs):
                self.fleet.dropped(rep, "malformed", OmniflowError("frames: len(xs) != len(fs)"))
            else:
                for frame, x in zip(fs, xs, strict=True):
                    self._replica_frame(rep, c, a, frame, x)
        elif type(msg) is Frame:
            c, a, f, x = msg
            if (c, a) not in rep.held and type(a) is str:
                if may_wait and not self._is_orphan(c, a):
                    return msg
                self._stray(rep, c, a, msg)
            else:
                self._replica_frame(rep, c, a, f, x)
        elif type(msg) is Claimed:
            self._on_claimed(rep, msg)
        elif type(msg) is CallEnded:
            self._call_ended(rep, msg.c)
        elif type(msg) is StatsReply:
            fut = self._stats_waiting.pop(msg.r, None)
            if fut is not None and not fut.done():
                fut.set_result(msg._asdict())
        elif type(msg) is MetaCall:
            # In order: each call is atomic (no await inside) and tasks start FIFO.
            task = asyncio.get_running_loop().create_task(
                self._meta_call(rep, msg.r, msg.op, msg.args)
            )
            self._meta_tasks.add(task)
            task.add_done_callback(self._meta_tasks.discard)
        else:
            self.fleet.dropped(
                rep,
                "unknown_kind",
                OmniflowError(f"a front does not take {type(msg).__name__}"),
            )
        return None

    def _on_dones(self, rep: Replica, msg: Dones, may_wait: bool = False) -> Dones | None:
        """Activations that ended well on ``rep``, one record at a time (a bad record is
        dropped alone); with ``may_wait``, from the first record of a forwarded run not bound
        yet on, the rest is handed back (``_on_message``)."""
        cs, as_, fs, xs = msg
        n = len(cs)
        if len(as_) != n or len(fs) != n or len(xs) != n:
            self.fleet.dropped(rep, "malformed", OmniflowError("dones: lists of unlike lengths"))
            return None
        for i, (c, a, f, x) in enumerate(zip(cs, as_, fs, xs, strict=True)):
            if type(c) is not str or type(a) not in _WID or (x is not None and type(x) is not list):
                bad = OmniflowError(f"dones: a record ({c!r:.40}, {a!r:.40}, x={x!r:.40})")
                self.fleet.dropped(rep, "malformed", bad)
                continue
            try:
                if self._good_end(rep, c, a, f, x, may_wait):
                    return msg if i == 0 else _new(Dones, (cs[i:], as_[i:], fs[i:], xs[i:]))
            except (KeyError, TypeError, ValueError) as exc:  # a malformed value
                self.fleet.dropped(rep, "malformed", exc)
        return None

    def _good_end(
        self, rep: Replica, c: str, a: Wid, f: Any, x: list[Any] | None, may_wait: bool = False
    ) -> bool:
        """An activation ended well on ``rep``, with its coroutine's returned frame ``f`` if
        it has one (not None). True, and nothing done, if it is a forwarded run not bound yet
        and ``may_wait`` (``_on_message``)."""
        key = (c, a)
        if key not in rep.held:
            if type(a) is str:
                if may_wait and not self._is_orphan(c, a):
                    return True
                self._stray(rep, c, a, _new(Done, (c, a, f, None, None, False, None, x)))
            else:
                self._foreign(rep, c, a, "done")
            return False
        if f is not None:  # a coroutine's returned frame rides in its done
            p = self._pending.get(key)
            if p is not None and p.error is None and len(p.replicas) == 1:
                self._returned(rep, p, f, x)
                return False
            self._replica_frame(rep, c, a, f, x)  # (first, then the done)
        self._replica_done(rep, key, None)
        return False

    def _on_done_msg(self, rep: Replica, msg: Done) -> None:
        """An activation ended on ``rep``, with its coroutine's returned frame if it has one."""
        c, a, f, et, _em, _cancel, _tb, x = msg
        if et is None:
            self._good_end(rep, c, a, f, x)
            return
        key = (c, a)
        if key not in rep.held:
            if type(a) is str:
                self._stray(rep, c, a, msg)
            else:
                self._foreign(rep, c, a, "done")
            return
        if f is not None:  # (a frame with a failure: first, then the done)
            self._replica_frame(rep, c, a, f, x)
        self._replica_done(rep, key, msg)

    async def _meta_call(self, rep: Replica, r: int, op: str, args: list[Any]) -> None:
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

    async def _forget_pools(self, nodes: set[tuple[str, str]]) -> None:
        """A lost replica's pools leave the hosted metadata (their pages went with it)."""
        for pool, node in sorted(nodes):
            await self.pool_meta.leave(pool, node)

    def _stray(self, rep: Replica, c: str, wid: str, msg: Message) -> None:
        """A message of forwarded run ``wid`` that is not bound: keep it until the frame that
        forwarded it arrives, or drop it (an orphan's)."""
        if self._is_orphan(c, wid):
            if wid not in self._orphans.get(c, {}) and type(msg) is not Done:
                self._orphan(rep, c, wid)  # (counted again: it was not known as one)
            self._drop(c, wid, msg)
            return
        waiting = self._early.get(c)
        if waiting is None:
            waiting = self._early[c] = Waiting()
        waiting.add(rep, wid, msg)

    def _is_orphan(self, c: str, wid: Wid) -> bool:
        """Whether nothing can bind forwarded run ``wid`` any more: its nearest ancestor the
        front knows of is an orphan, or is not running (an activation that ended had every
        frame handled, so each run it forwarded is bound or orphaned). An ancestor still
        waiting for its own binding decides nothing: look further up."""
        orphans = self._orphans.get(c, {})
        cut = self._cut.get(c, ())
        while type(wid) is str:
            if wid in orphans:
                return True
            wid = parent_of(wid)
            if (c, wid) in self._pending:
                return False
            if wid in cut:
                return True
        return True

    def _drop(self, c: str, wid: str, msg: Message) -> None:
        """Drop a message of orphan ``wid``: refs among its outputs are let go."""
        frames: list[Any] = []
        match msg:
            case Frame(f=f):
                frames = [f]
            case Frames(fs=fs):
                frames = fs
            case Done(f=f):
                if f is not None:
                    frames = [f]
                orphans = self._orphans.get(c)
                if orphans is not None:
                    orphans.pop(wid, None)
                    if not orphans:
                        del self._orphans[c]
        refs = [r for fr in frames if isinstance(fr, dict) for v in fr.values() for r in refs_in(v)]
        if refs:
            self.release(refs)

    def _drop_early(self, rep: Replica, c: str, wid: str, msgs: list[Message]) -> None:
        """Forwarded run ``wid`` can no longer be bound: an orphan; drop what it sent."""
        self._orphan(rep, c, wid, done=any(type(m) is Done for m in msgs))
        for m in msgs:
            self._drop(c, wid, m)

    def _orphan_early(self, c: str, a: Wid) -> None:
        """Activation ``a`` of call ``c`` ended: the runs forwarded below it that are still
        unbound can never be (its frames were all handled): orphans."""
        waiting = self._early.get(c)  # (never empty: emptied ones are deleted)
        if waiting is None or a not in waiting.kids:
            return
        for wid, rep, msgs in waiting.orphans_of(a):
            self._drop_early(rep, c, wid, msgs)
        if not waiting.early:
            del self._early[c]

    def _replay(self) -> None:
        """Deliver what bound forwarded runs sent before their binding, in order."""
        bound = self._bound
        while bound:
            c, wid = bound.pop()
            waiting = self._early.get(c)
            if waiting is None:
                continue
            entry = waiting.take(wid)
            if entry is None:
                continue
            if not waiting.early:  # (the one it held was taken)
                del self._early[c]
            rep, msgs = entry
            for m in msgs:
                self._on_message(rep, m)

    def _foreign(self, rep: Replica, c: str, a: Wid, what: str) -> None:
        """Only the replica that runs an activation speaks for it; anything else is dropped."""
        foreign = OmniflowError(f"a {what} of ({c!r:.40}, {a}), which it does not run")
        self.fleet.dropped(rep, "foreign", foreign)

    def _replica_frame(
        self, rep: Replica, c: str, a: Wid, frame: Any, x: list[Any] | None = None
    ) -> None:
        key = (c, a)
        if key not in rep.held:
            self._foreign(rep, c, a, "frame")
            return
        p = self._pending.get(key)
        if p is None:
            return
        if isinstance(frame, dict) and DataRef in map(type, frame.values()):
            self._call_replicas.setdefault(c, set()).add(rep)
        k = p.k
        p.k = k + 1
        if x is None:
            self._on_frame(p.call, p.core, p.act, frame)
            return
        expect = self._expecting(rep, p, k, x)
        self._expect = expect
        try:
            self._on_frame(p.call, p.core, p.act, frame)
        finally:
            self._expect = None
        self._settle_forwards(c, expect)

    def _returned(self, rep: Replica, p: _Pending, frame: Any, x: list[Any] | None) -> None:
        """The done of ``p``'s one replica with its coroutine's returned frame: one stimulus,
        as a local coroutine's return is (the core takes the frame and the end together and
        settles once)."""
        key = p.key
        rep.held.discard(key)
        del self._pending[key]
        call = p.call
        if isinstance(frame, dict) and DataRef in map(type, frame.values()):
            self._call_replicas.setdefault(key[0], set()).add(rep)
        front_refs = self._front_refs.pop(key, None)
        if front_refs and self.plane is not None:
            for ref in front_refs:
                self.plane.release(ref)
        if x is None:
            self._on_return(call, p.core, p.act, frame)
        else:
            expect = self._expecting(rep, p, p.k, x)
            self._expect = expect
            try:
                self._on_return(call, p.core, p.act, frame)
            finally:
                self._expect = None
            self._settle_forwards(key[0], expect)
        if p.routes:
            self._orphan_early(*key)

    def _expecting(
        self, rep: Replica, p: _Pending, k: int, x: list[Any]
    ) -> dict[str, tuple[str, _Plan, int, Replica]]:
        """What frame ``k`` of ``p`` forwarded (its ``x``): node -> (wire id, route, the SeqId
        index its activation must have, ``rep``), for ``submit`` to bind while the core
        handles it."""
        routes = p.routes
        a = p.key[1]
        expect: dict[str, tuple[str, _Plan, int, Replica]] = {}
        for item in x:
            if type(item) is list and len(item) == 2:
                r, wid = item
                # (``wire_id(a, k, r)``, inline: once per forwarded run)
                if type(r) is int and 0 <= r < len(routes) and wid == f"{a}.{k}.{r}":
                    plan = routes[r]
                    expect[plan.hop.node] = (wid, plan, k if plan.hop.qk else p.act.seq[2], rep)
                    continue
            self.fleet.dropped(rep, "malformed", OmniflowError(f"a forward note {item!r:.60}"))
        return expect

    def _settle_forwards(self, c: str, expect: dict[str, tuple[str, _Plan, int, Replica]]) -> None:
        """The core handled a frame that forwarded runs: those it did not make (still in
        ``expect``) are orphans, with what they sent and their unbound descendants; what the
        bound ones sent before their binding is replayed."""
        for wid, plan, _q, _via in expect.values():
            waiting = self._early.get(c)
            entry = waiting.take(wid) if waiting is not None else None
            if entry is None:
                self._orphan(plan.rep, c, wid)
            else:
                self._drop_early(plan.rep, c, wid, entry[1])
            if waiting is not None:
                for sub, rep, msgs in waiting.orphans_of(wid):  # (it will bind none of them)
                    self._drop_early(rep, c, sub, msgs)
                if not waiting.early:
                    del self._early[c]
        self._replay()

    def _replica_done(self, rep: Replica | None, key: Key, err: Done | None) -> None:
        if rep is not None:
            rep.held.discard(key)
        p = self._pending.get(key)
        if p is None:
            return
        if rep in p.replicas:
            p.replicas.remove(rep)
        if err is not None and err.et is not None and p.error is None:
            if err.cancel:
                p.error = asyncio.CancelledError()
            else:
                error = NodeError(
                    p.act.node,
                    f"{err.et}: {err.em}",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                    exc_type=err.et,
                )
                error.traceback = err.tb
                p.error = error
        if not p.replicas:
            del self._pending[key]
            front_refs = self._front_refs.pop(key, None)
            if front_refs and self.plane is not None:
                for ref in front_refs:
                    self.plane.release(ref)
            self._on_done(p.call, p.core, p.act, p.error)
            if p.routes:
                self._orphan_early(*key)

    def _on_lost(self, rep: Replica, why: str) -> None:
        """``rep`` was lost: its pools leave the hosted metadata, what it held fails."""
        if rep.pool_nodes:
            nodes, rep.pool_nodes = rep.pool_nodes, set()
            task = asyncio.get_running_loop().create_task(self._forget_pools(nodes))
            self._meta_tasks.add(task)
            task.add_done_callback(self._meta_tasks.discard)
        for c in [c for c, e in self._ending.items() if rep in e.reps]:  # (its pages are gone)
            self._call_ended(rep, c)
        for c in list(self._early):  # what it sent before binding goes with it
            waiting = self._early[c]
            waiting.drop_replica(rep)
            if not waiting:
                del self._early[c]
        for c in list(self._orphans):
            orphans = self._orphans[c]
            for wid in [w for w, r in orphans.items() if r is rep]:
                del orphans[wid]
            if not orphans:
                del self._orphans[c]
        for key in sorted(rep.held, key=str):
            p = self._pending.get(key)
            if p is None:
                continue
            if p.routes:
                self._cut.setdefault(key[0], set()).add(key[1])
            if p.error is None:
                p.error = NodeError(
                    p.act.node,
                    f"replica lost: replica '{rep.replica_id}' of role "
                    f"'{p.core.c.specs[p.act.node].role}' was lost while running it ({why})",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                )
            self._replica_done(rep, key, None)
        for r in [r for r, claim in self._claims.items() if claim[0] is rep]:
            del self._claims[r]  # (what it held failed above)
        self._claim(rep, why)

    def _claim(self, via: Replica, why: str) -> None:
        """``via`` was lost: runs it forwarded that the front bound may never have reached
        their replica (the frame that reported a forward may reach the front before the
        forward leaves the worker's queues). Ask each replica which of them it does not
        hold; those fail (``_on_claimed``). A run that got there runs on, and one that is
        still on its way is ended there as cancelled when it comes (the worker keeps what it
        said it lacks)."""
        asked: dict[tuple[Replica, str], list[str]] = {}
        for (c, wid), p in self._pending.items():
            if p.via is via and type(wid) is str:
                for target in p.replicas:  # (never ``via``: ``_on_lost`` failed its runs)
                    if target.alive:
                        asked.setdefault((target, c), []).append(wid)
        for (target, c), wids in asked.items():
            r = next(self._claim_ids)
            self._claims[r] = (target, c, wids, via)
            target.out.put_nowait(encode_msg(Claim(r, c, wids)))
            logger.info(
                "asked replica %s which of %d runs of call %s forwarded by lost replica %s "
                "it holds (%s)", target.replica_id, len(wids), c, via.replica_id, why,
            )  # fmt: skip

    def _on_claimed(self, rep: Replica, msg: Claimed) -> None:
        """``rep`` answered a claim: the runs it does not hold never will run; they fail as
        lost with their forwarder, and what they might still send is dropped (orphans)."""
        r, c, missing = msg
        claim = self._claims.get(r)
        if claim is None or claim[0] is not rep or claim[1] != c:
            self.fleet.dropped(rep, "foreign", OmniflowError(f"an answer to claim {r}, not its"))
            return
        del self._claims[r]
        asked, via = set(claim[2]), claim[3].replica_id
        for wid in missing:
            if type(wid) is not str or wid not in asked:
                self.fleet.dropped(rep, "malformed", OmniflowError(f"a claimed {wid!r:.40}"))
                continue
            key = (c, wid)
            p = self._pending.get(key)
            if p is None or rep not in p.replicas:
                continue  # (it ended meanwhile: its done came first)
            self._orphans.setdefault(c, {})[wid] = rep
            self.orphaned += 1
            if p.error is None:
                p.error = NodeError(
                    p.act.node,
                    f"replica lost: replica '{via}', which started this run on replica "
                    f"'{rep.replica_id}' of role '{p.core.c.specs[p.act.node].role}', was "
                    "lost before the run reached it",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                )
            self._replica_done(rep, key, None)

    def statistics(self) -> dict[str, int]:
        return {
            # Connected, not leaving: what calls can be routed to.
            "replicas": sum(1 for r in self.fleet.replicas.values() if r.life.routable),
            "remote_inflight": len(self._pending),
            # The fast path: runs bound to one a worker forwarded, orphans, and what waits.
            "forwarded": self.forwarded,
            "orphaned": self.orphaned,
            "forward_waiting": sum(len(e) for e in self._early.values())
            + sum(len(c) for c in self._cut.values())
            + sum(len(o) for o in self._orphans.values()),
        }

    def wire_statistics(self) -> dict[str, Any]:
        """The authenticated wire and supervision, as seen by this front: messages accepted and
        dropped by reason, forged registry records ignored, replicas respawned per role and
        live replicas per role."""
        registry = self.fleet.registry
        forged = registry.statistics().get("forged_records", 0) if registry else 0
        return {
            **self.fleet.wire.snapshot(),
            "forged_records": forged,
            "restarts": dict(sorted(self.fleet.restarts.items())),
            "live_replicas": {r: len(self.fleet.routable(r)) for r in sorted(self.roles)},
        }

    async def data_plane_stats(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """Each live replica's ``DataPlane.statistics()`` (plus its ``pid``), by replica id.

        A ``stats`` request rides the same connection as the replica's ``run``, ``release``
        and ``end_call`` messages, so the answer reflects every one sent before it. A replica
        that does not answer within ``timeout`` is left out.
        """
        return {
            name: {**body["plane"], "pid": body["pid"]}
            for name, body in (await self.worker_stats(timeout)).items()
        }

    async def worker_stats(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Each live replica's ``StatsReply`` as a dict (``pid``, ``plane``, ``wire``: what it
        accepted and dropped, ``work``: what it holds), by replica id; as ``data_plane_stats``
        (which reads it), a replica that does not answer within ``timeout`` is left out."""
        loop = asyncio.get_running_loop()
        asked: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        for rep in self.fleet.replicas.values():
            if rep.alive and rep.endpoint is not None:
                rid = next(self._stats_ids)
                fut: asyncio.Future[dict[str, Any]] = loop.create_future()
                asked[rid] = (rep.replica_id, fut)
                self._stats_waiting[rid] = fut
                rep.out.put_nowait(encode_msg(StatsRequest(rid)))
        try:
            if asked:
                await asyncio.wait([f for _, f in asked.values()], timeout=timeout)
        finally:
            for rid in asked:
                self._stats_waiting.pop(rid, None)
        return {name: fut.result() for name, fut in asked.values() if fut.done()}
