"""The Runtime: the async shell that carries out what the call cores decide.

>>> async with of.Runtime(graph) as rt:                         # doctest: +SKIP
...     out = await rt.run("t2i", {"request": req})

Concurrency model (docs/concurrency.md, "Concurrency"): one event loop, no locks. Every
scheduling decision is a synchronous call into a ``CallCore``; between two awaits nothing else
runs, so no decision can interleave with another. Every method runs inside one asyncio.Task
from its first step to its end: a call's ready methods run one after another in an eagerly
started *walker* task, and a method that suspends keeps its walker to its end while the rest
go on in another (``_walk``; docs/concurrency.md, "Role methods run in tasks"). A chain of
cheap nodes therefore costs one task, while a slow node never holds anyone else back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import itertools
import logging
import math
import operator
import os
import random
import time
from collections import deque
from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import (
    InputError,
    NodeError,
    OmniflowError,
    RuntimeClosedError,
)
from omniflow.data._plane import DEFAULT_THRESHOLD, STATISTICS_KEYS, DataPlane, DataRef
from omniflow.dsl._context import ActivationContext, _current
from omniflow.dsl._graph import GlobalParameters, Graph, RoleRef
from omniflow.plan._parser import parse_graphs
from omniflow.plan._plan import StaticPlan
from omniflow.runtime._batcher import BatchEntry, Batcher
from omniflow.runtime._call import Call
from omniflow.runtime._compiled import Compiled, compile_plan
from omniflow.runtime._core import RUNNING, Activation, CallCore
from omniflow.runtime._drive import Continue, drive, eager_task, generator_end
from omniflow.runtime._launch import Launcher
from omniflow.runtime._metrics import RuntimeMetrics
from omniflow.runtime._observe import ObservedCore
from omniflow.runtime._params import SessionParams
from omniflow.runtime._placement import plan_processes, resolve_connectors
from omniflow.runtime._ray_plan import Ray
from omniflow.runtime._remote import RemoteRoles
from omniflow.runtime._setup import setup_role
from omniflow.runtime._stimuli import (
    NOTHING,
    SETTLE,
    Cancel,
    CancelKind,
    Crash,
    Ended,
    Instructions,
    Produced,
    Returned,
    Start,
    Stimulus,
    render_story,
)
from omniflow.transport._auth import WireStats, resolve_key

if TYPE_CHECKING:
    from omniflow.runtime._tracing import Tracing

__all__ = ["Runtime", "RuntimeState"]

logger = logging.getLogger("omniflow.runtime")


class RuntimeState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


_new = tuple.__new__
#: A caller frame's value (``Emit`` is (field, value, node, seq index)).
_value = operator.itemgetter(1)


def _context_of(call: Call, act: Activation) -> ActivationContext:
    """Build the context of a local activation (only when its method calls of.context())."""
    params = call._params
    if params is None:  # a call without a session: its parameters live as long as it does
        params = call._params = SessionParams(call._rt._factories)
    return ActivationContext(
        graph=call.graph,
        session=call.session,
        call_id=call.call_id,
        node=act.node,
        or_group=act.group,
        params=params,
        seq=act.seq[2],
        aid=act.aid,
        pools=call._rt._pool_view,
    )


class Runtime:
    """Runs graphs in-process (the embedded default).

    >>> async with Runtime(graph_a, graph_b) as rt:            # doctest: +SKIP
    ...     async for frame in rt.call("a", {"x": 1}):
    ...         ...

    ``placement`` selects where roles run (docs/contract.md §5): ``"inproc"`` (every role in this
    event loop), ``"process"`` (every role in a worker process of its own) or
    ``omniflow.Deploy({...})`` (named process groups with replicas; other roles stay here) or
    ``omniflow.Ray({...})`` (every role's replicas on Ray actors, docs/contract.md §6).
    ``registry`` is a ``redis://`` URL for a shared ServiceRegistry (None: kept in memory);
    workers heartbeat every ``heartbeat_interval`` seconds from their event loop and count as
    lost (a spawned one is killed, then respawned with backoff) ``heartbeat_misses`` intervals
    (default 10) after their last one; a method that blocks its worker's loop that long is
    taken for a hung worker.
    Every message between processes is authenticated with ``cluster_key`` (default
    ``$OMNIFLOW_CLUSTER_KEY``, else one generated here and handed to the spawned workers); the
    Params Pools of the graphs seal their page pulls with the same key (``set_cluster_key``).
    Scheduling always stays in this process, so semantics do not depend on placement.
    ``tracer_provider``: an OpenTelemetry TracerProvider; each call is then an
    ``omniflow.call`` span (a child of the span current at ``rt.call``) with one span per
    activation, in every placement (docs/contract.md §4; ``_observe``, ``_tracing``).
    """

    def __init__(
        self,
        *graphs: Graph,
        placement: Any = "inproc",
        registry: str | None = None,
        story_size: int = 10_000,
        validate: bool = False,
        metrics: bool = False,
        connectors: dict[Any, str] | None = None,
        data_threshold: int = DEFAULT_THRESHOLD,
        stream_high_water: int = 1024,
        heartbeat_interval: float = 1.0,
        cluster_key: str | bytes | None = None,
        heartbeat_misses: int = 10,
        session_ttl: float | None = 3600.0,
        tracer_provider: Any = None,
    ) -> None:
        if not graphs:
            raise OmniflowError("Runtime needs at least one Graph")
        if session_ttl is not None and (
            isinstance(session_ttl, bool)
            or not isinstance(session_ttl, int | float)
            or not session_ttl > 0
        ):
            raise OmniflowError(
                f"session_ttl must be a positive number of seconds or None, got {session_ttl!r}"
            )
        #: Seconds a session may stay idle (no running or queued call) before it is closed.
        self.session_ttl = session_ttl
        self.plans: dict[str, StaticPlan] = parse_graphs(graphs)
        role_modules: dict[str, str | None] = {}
        instances: dict[str, object] = {}
        for g in graphs:
            for rname, role in g.roles.items():
                if not isinstance(role, RoleRef):
                    if instances.setdefault(rname, role) is not role and placement != "inproc":
                        raise OmniflowError(
                            f"role name '{rname}' names different roles in modules "
                            f"{role_modules[rname]} and {g.module}; that works in-process, "
                            "but worker processes are found by role name: rename one of them "
                            "to use this placement"
                        )
                    role_modules[rname] = g.module
        processes = plan_processes(placement, role_modules)
        if registry is not None and not processes:
            raise OmniflowError(
                "registry=... needs a multi-process placement (placement='process' or Deploy)"
            )
        remote_roles = frozenset(r for p in processes for r in p.roles)
        edge_conns = resolve_connectors(self.plans, connectors, remote_roles, processes)
        key = resolve_key(cluster_key)[0] if processes or cluster_key is not None else None
        #: This process's data plane (None when every role runs here: objects pass as is).
        self.plane: DataPlane | None = DataPlane(threshold=data_threshold) if processes else None
        offload = {
            (gname, n): sorted(set(s.outputs) - set(p.outputs))
            for gname, p in self.plans.items()
            for n, s in p.specs.items()
            if s.role in remote_roles and set(s.outputs) - set(p.outputs)
        }
        #: Worker processes and their replicas (None for in-process placement).
        self.remote: RemoteRoles | None = (
            RemoteRoles(
                processes,
                registry=registry,
                on_frame=self._remote_frame,
                on_done=self._ended,
                on_return=self._remote_return,
                plane=self.plane,
                offload=offload,
                connectors=edge_conns,
                heartbeat_interval=heartbeat_interval,
                cluster_key=key,
                heartbeat_misses=heartbeat_misses,
                launcher=_launcher(placement, role_modules, self.plane),
            )
            if processes
            else None
        )
        self._remote_nodes = frozenset(
            n for p in self.plans.values() for n, s in p.specs.items() if s.role in remote_roles
        )
        self._compiled: dict[str, Compiled] = {
            name: compile_plan(p) for name, p in self.plans.items()
        }
        #: graph -> node -> bound method, for the coroutine methods this process runs (what
        #: ``_launch`` starts inline; remote nodes and generators take the longer way).
        #: node -> its batcher, for the batched nodes this process runs (``batch=``): one per
        #: node, shared by every graph and call that reaches it.
        self._batchers: dict[str, Batcher] = {
            n: Batcher(n, c.methods[n], s.batch, track=self._track)
            for name, c in self._compiled.items()
            for n, s in self.plans[name].specs.items()
            if s.batch is not None and n not in self._remote_nodes
        }
        self._coros: dict[str, dict[str, Any]] = {
            name: {
                n: m
                for n, m in c.methods.items()
                if n not in self._remote_nodes and n not in c.generators and n not in self._batchers
            }
            for name, c in self._compiled.items()
        }
        #: Params Pools of every graph by name; pages a call allocates under its call id are
        #: released when the call ends (``_finish_call``).
        self._pools: dict[str, Any] = {}
        for g in graphs:
            for pool in g.pools:
                if self._pools.setdefault(pool.name, pool) is not pool:
                    raise OmniflowError(f"two different ParamsPools are named '{pool.name}'")
        self._pool_view = MappingProxyType(self._pools)
        if key is not None:  # this process's pools pull with the deployment's key too
            for pool in self._pools.values():
                pool.set_cluster_key(key)
        if self.remote is not None and self._pools:
            self.remote.track_calls = True
            for pool in self._pools.values():  # metadata=None: the one the front hosts
                pool.use_metadata(self.remote.pool_meta)
        self._factories: dict[str, GlobalParameters] = {}
        for p in self.plans.values():
            self._factories.update(p.params)
        roles: dict[int, Any] = {}
        #: id(role instance) -> its role name (for messages such as a failed setup()).
        self._role_names: dict[int, str] = {}
        for p in self.plans.values():
            for rname, r in p.roles.items():
                if rname not in remote_roles:
                    roles.setdefault(id(r), r)
                    self._role_names.setdefault(id(r), rname)
        self._roles = list(roles.values())
        if self._pools:
            for role in self._roles:
                role.pools = self._pool_view
        self.state = RuntimeState.NEW
        self._ids = itertools.count(1)
        self._calls: dict[str, Call] = {}
        self._queues: dict[str, deque[Call]] = {}
        self._params: dict[str, SessionParams] = {}
        #: Idle sessions -> the timer that closes them after ``session_ttl``.
        self._idle: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The walker task now between two methods (``_walk``: ready coroutine methods run
        #: inline in it), else None.
        self._walker: asyncio.Task[Any] | None = None
        #: The method that just suspended in the walker (activation, coroutine, what it
        #: awaits): the walker carries it on.
        self._parked: tuple[Activation, Any, Any] | None = None
        #: Set by ``_spawn`` while a walker's first step may run; the walker clears it.
        self._spawning = False
        #: Bounded log of stimuli and transitions: (call id, stimulus id, event, values), see
        #: ``_stimuli.STORY_FIELDS``; ``story(call_id)`` renders them.
        self.story_log: deque[tuple[Any, ...]] | None = (
            deque(maxlen=story_size) if story_size else None
        )
        #: Check every call core's invariants after each step, and run each batch of ready
        #: work in a shuffled order seeded by ``shuffle_seed`` and the call id, so that order
        #: bugs surface (tests switch this on).
        self.validate = validate
        self.shuffle_seed = 0
        #: Frames a reader may fall behind before stream producers wait (backpressure).
        self.stream_high_water = stream_high_water
        self._loop: asyncio.AbstractEventLoop | None = None
        self._set_up: list[Any] = []
        #: Counters for /metrics (None while metrics are off).
        self.metrics: RuntimeMetrics | None = RuntimeMetrics() if metrics else None
        #: Spans of calls and activations (None while tracing is off, docs/contract.md §4).
        self.tracing: Tracing | None = None
        if tracer_provider is not None:
            from omniflow.runtime._tracing import Tracing

            self.tracing = Tracing(tracer_provider)
            if self.remote is not None:
                self.remote.traced = True

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _front_colocation(self) -> Any:
        """The co-location facts of the roles this front hosts next to its workers (they fill
        slot 0 of the deployment on this node)."""
        from omniflow.dsl._context import Colocation
        from omniflow.runtime._launch import colocation_group

        assert self.remote is not None
        local = frozenset(self._role_names[id(r)] for r in self._roles)
        return Colocation(local, colocation_group(self.remote.fleet.token, "slot0"))

    async def start(self) -> None:
        if self.state is not RuntimeState.NEW:
            raise RuntimeClosedError(f"Runtime is {self.state.value}; it can start only once")
        self._loop = asyncio.get_running_loop()
        self.state = RuntimeState.RUNNING
        for batcher in self._batchers.values():  # batches run in the starter's context
            batcher.base = contextvars.copy_context()
        try:
            facts = None
            if self.remote is not None:
                await self.remote.start()
                facts = self._front_colocation()
            for role in self._roles:
                setup = getattr(role, "setup", None)
                if setup is not None:
                    await setup_role(self._role_names[id(role)], setup, facts)
                self._set_up.append(role)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self.state is RuntimeState.CLOSED:
            return
        self.state = RuntimeState.CLOSED
        calls = list(self._calls.values())
        for call in calls:
            self._cancel_call(call)
        for call in calls:
            await call._done.wait()
        for batcher in self._batchers.values():
            batcher.close()
        if self.remote is not None:
            await self.remote.close()
        if self.plane is not None:
            self.plane.close()
        errors: list[BaseException] = []
        for role in reversed(self._set_up):
            teardown = getattr(role, "teardown", None)
            if teardown is not None:
                try:
                    await teardown()
                except Exception as exc:
                    errors.append(exc)
        self._set_up.clear()
        self._params.clear()
        for timer in self._idle.values():
            timer.cancel()
        self._idle.clear()
        if errors:
            raise OmniflowError(f"role teardown failed: {errors[0]!r}") from errors[0]

    # ------------------------------------------------------------------ public API

    def call(
        self,
        graph: str,
        inputs: dict[str, Any],
        session: str | None = None,
        *,
        timeout: float | None = None,
    ) -> Call:
        """Start a call of ``graph``; returns at once. Calls of one session run in FIFO order.

        ``timeout``: seconds from now; past them the call is cancelled and ends "error" with
        a NodeError of kind "timeout" naming a node still running (time spent queued behind
        the session's earlier calls counts).
        """
        return self._submit(graph, inputs, session, now=False, timeout=timeout)

    def _submit(
        self,
        graph: str,
        inputs: dict[str, Any],
        session: str | None,
        *,
        now: bool,
        timeout: float | None = None,
    ) -> Call:
        """Check and enqueue a call; ``now``: start it in this step when it need not queue
        (``run`` does, being awaited already; ``call`` never runs user code before returning)."""
        if self.state is not RuntimeState.RUNNING:
            raise RuntimeClosedError(
                f"Runtime is {self.state.value}; use 'async with omniflow.Runtime(...) as rt'"
            )
        compiled = self._compiled.get(graph)
        if compiled is None:
            raise InputError(
                f"unknown graph '{graph}'; this runtime serves {sorted(self._compiled)}",
                graph=graph,
            )
        if not isinstance(inputs, dict):
            raise InputError(f"graph '{graph}': inputs must be a dict of Placeholder -> value")
        plan = compiled.plan
        for name in plan.inputs:
            if name not in inputs:
                raise InputError(
                    f"graph '{graph}': missing input '{name}' (its Placeholders are "
                    f"{list(plan.inputs)})",
                    graph=graph,
                    field=name,
                )
        for name in inputs:
            if name not in plan.inputs:
                raise InputError(
                    f"graph '{graph}': unknown input '{name}'; its Placeholders are "
                    f"{list(plan.inputs)}",
                    graph=graph,
                    field=name,
                )
        if session is not None and not isinstance(session, str):
            raise InputError(f"session must be a str or None, got {session!r}")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise InputError(
                f"graph '{graph}': timeout must be a positive number of seconds or None, "
                f"got {timeout!r}",
                graph=graph,
            )
        call_id = f"c{next(self._ids)}"
        call = Call(self, graph, call_id, dict(inputs), session)
        self._calls[call_id] = call
        assert self._loop is not None
        if timeout is not None:
            call._timeout = float(timeout)
            call._timer = self._loop.call_at(self._loop.time() + timeout, self._time_out, call)
        if session is not None:
            idle = self._idle.pop(session, None)
            if idle is not None:  # busy again: not closed while a call is queued or runs
                idle.cancel()
            q = self._queues.get(session)
            if q is None:
                q = self._queues[session] = deque()
            q.append(call)
            if len(q) > 1:
                return call
        if now:
            self._start_call(call)
        else:
            self._loop.call_soon(self._start_call, call)
        return call

    async def run(
        self,
        graph: str,
        inputs: dict[str, Any],
        session: str | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, list[Any]]:
        """Run a call to its end; frames by field. Raises the first NodeError of the call
        (a ``kind="timeout"`` one when ``timeout`` seconds passed first)."""
        call = self._submit(graph, inputs, session, now=True, timeout=timeout)
        if call.done:  # finished within its first step: no need to wait on anything
            out: dict[str, list[Any]] = {}
            for frame in call._frames:
                out.setdefault(frame.field, []).append(frame.value)
            call._frames.clear()
            await call._settled()  # (its pool pages, if it pinned any)
        else:
            out = await call.collect()
        for err in call.errors:
            if err.kind == "error" or err.kind == "timeout":
                raise err
        if call.status == "cancelled":
            raise call.errors[0] if call.errors else NodeError("<call>", "cancelled", kind="cancel")
        return out

    def stats(self) -> dict[str, int]:
        """Open buckets, in-flight activations and active calls, over the whole runtime."""
        buckets = inflight = 0
        for call in self._calls.values():
            core = call.core
            if core is not None:
                buckets += len(core.buckets)
                inflight += core.n_acts
        held = 0
        for call in self._calls.values():
            if call.core is not None and call.core.refcounts:
                held += sum(ref.nbytes for ref in call.core.refcounts)
        return {
            "open_buckets": buckets,
            "inflight": inflight,
            "active_calls": len(self._calls),
            "data_plane_bytes": held,
        }

    def calls_in_flight(self) -> dict[str, int]:
        """Calls started or queued and not finished, per graph (graphs with none left out)."""
        out: dict[str, int] = {}
        for call in self._calls.values():
            out[call.graph] = out.get(call.graph, 0) + 1
        return out

    def batch_stats(self) -> dict[str, dict[str, Any]]:
        """Per batched node that runs in this process, its batcher's ``statistics()``:
        ``{"batches", "activations", "mean_size", "full", "removed", "queued", "running",
        "mean_wait_s", "max_wait_s"}``."""
        return {n: b.statistics() for n, b in sorted(self._batchers.items())}

    def replica_batch_stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``batch_stats()`` of this process (``"<front>"``) and of each live worker replica
        with batched nodes, as its last heartbeat said, by replica id."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        mine = self.batch_stats()
        if mine:
            out["<front>"] = mine
        if self.remote is not None:
            for rep in self.remote.fleet.replicas.values():
                if rep.alive and rep.batches:
                    out[rep.replica_id] = rep.batches
        return out

    def readiness(self) -> list[str]:
        """Roles that have no live replica right now (sorted); [] when every role can serve.

        In-process roles are always ready; a role placed in workers is missing while every
        replica of it is dead, respawning or leaving (``/readyz`` answers 503 naming them).
        """
        return [] if self.remote is None else self.remote.readiness()

    def wire_stats(self) -> dict[str, Any]:
        """The authenticated wire and worker supervision (all zeros in-process).

        ``accepted`` and ``dropped_<reason>`` count the messages from replicas that this front
        took and refused (reasons: ``bad_mac``, ``replay``, ``malformed``, ``unknown_kind``,
        ``foreign``); ``forged_records`` the registry records ignored for a bad signature;
        ``restarts`` the replicas respawned per role; ``live_replicas`` per role.
        """
        if self.remote is None:
            return {**WireStats().snapshot(), "forged_records": 0, "restarts": {},
                    "live_replicas": {}}  # fmt: skip
        return self.remote.wire_statistics()

    def data_plane_stats(self) -> dict[str, int]:
        """This process's buffer pool (all zeros while no role runs in a worker process)."""
        if self.plane is None:
            return dict.fromkeys(STATISTICS_KEYS, 0)
        return self.plane.statistics()

    async def pool_stats(self) -> dict[str, dict[str, int]]:
        """The data plane of every process: ``{"<front>": ..., replica id: ...}``.

        >>> stats = await rt.pool_stats()                                # doctest: +SKIP
        >>> [s["pool_live_blocks"] for s in stats.values()]              # after every call
        [0, 0, 0]

        Each value is ``DataPlane.statistics()`` (pool gauges and data-plane counters); a
        worker's also carries its ``pid``. A worker's answer reflects every message the front
        sent it before (releases, ends of calls); one that does not answer in 5 s is left out.
        """
        out = {"<front>": self.data_plane_stats()}
        if self.remote is not None:
            out.update(await self.remote.data_plane_stats())
        return out

    def sessions(self) -> list[str]:
        """Sessions whose GlobalParameters are held (until ``close_session``)."""
        return sorted(self._params)

    def story(self, call_id: str) -> list[tuple[str, dict[str, Any]]]:
        """What happened to a call, oldest first (as far as the bounded log reaches back)."""
        if self.story_log is None:
            return []
        return render_story(self.story_log, call_id)

    async def close_session(self, session: str) -> None:
        """Wait for the session's queued and running calls, then release its
        GlobalParameters and its Params Pool run locks here and in every worker (a later call
        starts it afresh)."""
        q = self._queues.get(session)
        while q:
            await q[-1]._done.wait()
            q = self._queues.get(session)
        self._drop_session(session)

    def _drop_session(self, session: str) -> None:
        idle = self._idle.pop(session, None)
        if idle is not None:
            idle.cancel()
        self._params.pop(session, None)
        if self._pools and self._loop is not None:  # its chains' run locks in every pool
            for pool in self._pools.values():
                self._track(self._loop.create_task(pool.close_session(session)))
        if self.remote is not None:
            self.remote.close_session(session)

    def _session_idle(self, session: str) -> None:
        """The session's last call ended: close it after ``session_ttl`` unless a call
        comes first (one timer per idle session; nothing is kept past the TTL)."""
        if self.session_ttl is None or self._loop is None or self.state is not RuntimeState.RUNNING:
            return
        old = self._idle.get(session)
        if old is not None:
            old.cancel()
        self._idle[session] = self._loop.call_at(
            self._loop.time() + self.session_ttl, self._expire_session, session
        )

    def _expire_session(self, session: str) -> None:
        self._idle.pop(session, None)
        if self._queues.get(session):  # a call arrived in between (its submit disarms us)
            return
        logger.debug("session %.80r idle for %ss: closed", session, self.session_ttl)
        self._drop_session(session)

    # ------------------------------------------------------------------ shell

    def _start_call(self, call: Call) -> None:
        if call.done or call.core is not None:
            return
        compiled = self._compiled[call.graph]
        shuffle = random.Random(f"{self.shuffle_seed}:{call.call_id}") if self.validate else None
        if self.metrics is None and self.tracing is None:
            core = CallCore(compiled, call.call_id, story=self.story_log, shuffle=shuffle)
        else:  # the same core, observed: stage metrics and spans (``_observe``)
            core = ObservedCore(
                compiled, call.call_id, story=self.story_log, shuffle=shuffle,
                metrics=self.metrics, tracing=self.tracing,
                parent=call._ctx.run(_otel_current) if self.tracing is not None else None,
                session=call.session,
            )  # fmt: skip
        call.core = core
        if self.metrics is not None:
            self.metrics.calls_started += 1
        call.status = "running"
        call._coros = self._coros[call.graph]
        if call.session is not None:
            held = self._params.get(call.session)
            if held is None:
                held = self._params[call.session] = SessionParams(self._factories)
            call._params = held
        inputs = call._inputs or {}
        call._inputs = None
        try:
            self._step(call, core, _new(Start, (inputs,)))
        except Exception as exc:
            self._crash(call, exc)

    # The shell's whole contract with the core: hand it a stimulus, carry out the answer.
    # What runs where (tasks, remote handles, start times) is the shell's own business and
    # lives on the Call (``_ready``, ``_tasks``, ``_t0``); the core's state is only read.

    def _step(self, call: Call, core: CallCore, stimulus: Stimulus) -> bool:
        """One stimulus from outside the pump: handle it, carry out the answer, then start
        the ready work it made. Returns ``Instructions.accepted``."""
        ins = core.handle(stimulus)
        if ins is not NOTHING:
            run, emit, release, cancel, finished, accepted = ins
            if emit or release or cancel or finished:
                self._apply(call, core, ins)
            else:  # ``_apply``'s common case, inlined: work to start
                call._ready.extend(run)
                self._pump(call, core)
                return accepted
        self._pump(call, core)
        return ins.accepted

    def _apply(self, call: Call, core: CallCore, ins: Instructions) -> None:
        """Carry out one answer of the core (``Instructions`` says in which order)."""
        if ins is NOTHING:
            return
        run, emit, release, cancel, finished, _accepted = ins
        if release:
            self._release(release)
        if emit:
            if self.plane is not None and DataRef in map(type, map(_value, emit)):
                emit = tuple(map(self._materialize, emit))
            call._push(emit)
            if self.metrics is not None:
                out = self.metrics.frames_out
                for f, *_ in emit:
                    out[(call.graph, f)] = out.get((call.graph, f), 0) + 1
        if run:
            call._ready.extend(run)
        if cancel:
            current = asyncio.current_task()
            tasks = call._tasks
            for act in cancel:
                task = tasks.get(act)
                if task is not None and task is not current:
                    task.cancel()
        if finished:
            call._ready.clear()
            self._finish_call(call, core)

    def _pump(self, call: Call, core: CallCore) -> None:
        """Start the ready work, batch by batch; after each batch let the core settle what
        the batch's returns left behind (once, not after every return).

        Local coroutine methods run inside a walker task (``_walk``): here, inline, when this
        is a walker between methods; else a new walker is started eagerly and runs the ready
        work itself until it empties or a method suspends in it (then this loop goes on with
        what is left). A method that suspends in this walker makes it that method's task:
        the pump stops here and the walker's caller goes on with the rest."""
        ready = call._ready
        while True:
            while ready:
                if self._walker is None and ready[0].node in call._coros:
                    if not self._spawn(call, core):
                        return  # (it starts next turn and pumps everything itself)
                    continue
                self._launch(call, core, ready.popleft())
                if self._parked is not None:
                    return
            if not core.unsettled or call.done:
                break
            self._apply(call, core, core.handle(SETTLE))
        if self.validate:
            core.validate()

    def _spawn(self, call: Call, core: CallCore) -> bool:
        """Start a walker for the call's ready work; True when its first step ran now."""
        self._spawning = True
        eager_task(self._walk(call, core), call._ctx.copy())
        ran = not self._spawning  # the walker took the flag: its first step ran
        self._spawning = False
        return ran

    async def _walk(self, call: Call, core: CallCore) -> None:
        """A walker: the task that the call's ready coroutine methods run in, one after
        another, until one suspends; that one keeps this task to its end (``Continue``),
        then this walker reports it and runs what became ready, as before. The rest of the
        ready work, when a method suspends, goes on in the caller of this walker's first step
        (the pump that started it) or, on later steps, in new walkers started here. A walker
        serves one call, in its task's own copy of the caller's context: what a method sets
        in a contextvar no other call's method sees."""
        me = asyncio.current_task()
        # Started by ``_spawn`` (eagerly): the pump that started it goes on after it.
        eager, self._spawning = self._spawning, False
        while True:
            outer = self._walker
            self._walker = me
            try:
                self._pump(call, core)
            except Exception as exc:
                self._crash(call, exc)
            finally:
                self._walker = outer
            parked = self._parked
            if parked is None:
                return
            self._parked = None
            act, coro, fut = parked
            call._tasks[act] = me
            if me not in self._tasks:
                self._track(me)  # type: ignore[arg-type]
            if not eager and call._ready:
                self._pump(call, core)  # (walker off: the rest in walkers of their own)
            eager = False
            try:
                value = await Continue(coro, fut)
            except (Exception, asyncio.CancelledError) as exc:
                error: BaseException | None = exc
            else:
                error = None
            if call.done:
                return
            try:
                if error is not None:
                    self._done(call, core, act, error)
                else:
                    del call._tasks[act]
                    if self.metrics is not None:
                        self._observe(call, act, None)
                    self._apply(call, core, core.handle(_new(Returned, (act, value, True))))
                if error is not None or me.cancelling():  # type: ignore[union-attr]
                    # A cancelled task runs no other method: the rest in new walkers.
                    self._pump(call, core)
                    return
            except Exception as exc:
                self._crash(call, exc)
                return

    def _launch(self, call: Call, core: CallCore, act: Activation) -> None:
        metrics = self.metrics
        while True:  # one turn per activation of a chain of inline returns
            if metrics is not None:
                call._t0[act] = time.perf_counter()
            method = call._coros.get(act.node)
            kwargs = act.kwargs
            if method is None or act.refs:
                got = self._launch_other(call, core, act)
                if got is None:
                    return
                method, kwargs = got
            # In the walker's context (its task's own copy of the caller's at ``rt.call``):
            # of.context() reads this activation.
            _current.set((_context_of, call, act))
            walker, self._walker = self._walker, None  # (a nested call starts its own)
            try:
                coro = method(**kwargs)
                fut = coro.send(None)
            except StopIteration as stop:
                out = stop.value
            except (Exception, asyncio.CancelledError) as exc:
                self._done(call, core, act, exc, not call._ready)
                return
            else:  # suspended: this walker is the method's task from now on
                self._parked = (act, coro, fut)
                return
            finally:
                self._walker = walker
            # Returned within its first step; more of the batch waiting: settle later.
            if metrics is not None:
                self._observe(call, act, None)
            # (``tuple.__new__``: the NamedTuple's own constructor is Python code.)
            ins = core.handle(_new(Returned, (act, out, not call._ready)))
            if ins is NOTHING:
                return
            run, emit, release, cancel, done, _ = ins
            if emit or release or cancel or done:
                self._apply(call, core, ins)
                return
            if len(run) == 1 and not call._ready:
                # The pump would start it next: start it now (a chain's next hop).
                act = run[0]
                continue
            call._ready.extend(run)  # ``_apply``'s common case, inlined
            return

    def _launch_other(
        self, call: Call, core: CallCore, act: Activation
    ) -> tuple[Any, dict[str, Any]] | None:
        """``_launch`` for a remote node, a generator, or inputs on the data plane: start it
        here, or return the coroutine method and its inputs to start the common way (None:
        started, or already failed)."""
        node = act.node
        if node in self._remote_nodes:
            assert self.remote is not None
            self.remote.submit(call, core, act)
            return None
        kwargs = self._resolve_inputs(call, core, act) if act.refs else act.kwargs
        if kwargs is None:
            return None
        batcher = self._batchers.get(node)
        if batcher is not None:  # (the batch ends it: ``on_done`` / ``on_fail``)
            entry = BatchEntry(
                batcher,
                kwargs,
                (_context_of, call, act),
                call,
                lambda frame: self._remote_return(call, core, act, frame),
                lambda exc: self._ended(call, core, act, exc),
            )
            call._tasks[act] = entry
            batcher.add(entry)
            return None
        method = core.c.methods[node]
        if node not in core.c.generators:
            return method, kwargs
        ctx = call._ctx.copy()
        ctx.run(_current.set, (_context_of, call, act))
        try:
            agen = method(**kwargs)
        except Exception as exc:
            self._done(call, core, act, exc, not call._ready)
            return None
        # The generator's own task, in its own context, from its first step to its end.
        task = asyncio.get_running_loop().create_task(
            self._drive(call, core, act, agen), context=ctx
        )
        call._tasks[act] = task
        self._track(task)
        task.add_done_callback(lambda t: self._drive_ended(call, core, act, t))
        return None

    def _drive_ended(
        self, call: Call, core: CallCore, act: Activation, task: asyncio.Task[Any]
    ) -> None:
        """A generator task ended. ``_drive`` reports the end itself; a task cancelled before
        its first step never ran its body, so its end is reported here (else the call would
        wait for it forever)."""
        if call._tasks.get(act) is task and act.state is RUNNING and not call.done:
            self._ended(call, core, act, generator_end(task))

    async def _drive(self, call: Call, core: CallCore, act: Activation, agen: Any) -> None:
        """Run a generator method here (``_drive.drive``): its frames go to the call core at
        once; the work they make starts in a walker at each ``flush`` (a frame the generator
        yields without suspending is handed over with the others of its burst)."""

        def push(frame: Any) -> bool:
            if call.done:
                return False
            try:
                # (``tuple.__new__``: the NamedTuple's own constructor is Python code.)
                ins = core.handle(_new(Produced, (act, frame)))
                self._apply(call, core, ins)
                return ins.accepted
            except Exception as internal:
                self._crash(call, internal)
                return False

        def flush() -> None:
            if call.done:
                return
            try:
                self._pump(call, core)
            except Exception as internal:
                self._crash(call, internal)

        def space() -> Any:
            return call._wait_space() if call._congested() else None

        self._ended(call, core, act, await drive(agen, push, space, flush))

    def _observe(self, call: Call, act: Activation, exc: BaseException | None) -> None:
        """Per-node metrics of an ended activation (only while metrics are on)."""
        assert self.metrics is not None
        nm = self.metrics.node(call.graph, act.node)
        nm.activations += 1
        if exc is not None:
            if isinstance(exc, asyncio.CancelledError):
                nm.cancelled += 1
            else:
                nm.errors += 1
        t0 = call._t0.pop(act, None)
        if t0 is not None:
            nm.observe(time.perf_counter() - t0)

    def _done(
        self,
        call: Call,
        core: CallCore,
        act: Activation,
        exc: BaseException | None,
        settle: bool = True,
    ) -> None:
        """The method ended with no frame of its own left to deliver (its stream ended, it
        raised, it was cancelled, it never started): tell the core."""
        call._tasks.pop(act, None)
        if self.metrics is not None:
            self._observe(call, act, exc)
        self._apply(call, core, core.handle(Ended(act, exc, settle)))

    def _remote_frame(self, call: Call, core: CallCore, act: Activation, frame: Any) -> None:
        if call.done:
            return
        try:
            ins = core.handle(_new(Produced, (act, frame)))
            self._apply(call, core, ins)
            if not ins.accepted and not core.closing:
                handle = call._tasks.get(act)
                if handle is not None:
                    handle.cancel()  # the core rejected the frame: stop the remote method
            self._pump(call, core)
        except Exception as exc:
            self._crash(call, exc)

    def _remote_return(self, call: Call, core: CallCore, act: Activation, frame: Any) -> None:
        """A remote coroutine returned ``frame``: the frame and the end in one stimulus, as
        for a local one (``_launch``)."""
        if call.done:
            return
        try:
            call._tasks.pop(act, None)
            if self.metrics is not None:
                self._observe(call, act, None)
            self._step(call, core, _new(Returned, (act, frame, True)))
        except Exception as exc:
            self._crash(call, exc)

    def _ended(
        self, call: Call, core: CallCore, act: Activation, exc: BaseException | None
    ) -> None:
        """A method ended outside the pump (a generator task, a worker's ``done``): record it
        and carry on; an internal error ends only this call."""
        if call.done:
            return
        try:
            self._done(call, core, act, exc)
            self._pump(call, core)
        except Exception as internal:
            self._crash(call, internal)

    def _crash(self, call: Call, exc: BaseException) -> None:
        """A bug in omniflow surfaced while running ``call``: the core ends it with an error
        and names what runs, which is cancelled; the runtime keeps serving (the call's story
        tells what led here)."""
        logger.error("internal error in call %s", call.call_id, exc_info=exc)
        core = call.core
        if core is None or call.done:
            return
        call._ready.clear()
        self._apply(call, core, core.handle(Crash(exc)))

    def _release(self, refs: Sequence[DataRef]) -> None:
        mine = [r for r in refs if r.source == "" and r.pid == os.getpid()]
        if self.plane is not None:
            for ref in mine:
                self.plane.release(ref)
        if self.remote is not None and len(mine) < len(refs):
            self.remote.release([r for r in refs if r.source != ""])

    def _materialize(self, frame: tuple[str, Any, str, int]) -> tuple[str, Any, str, int]:
        """A frame for the caller must outlive the call: copy a data-plane value out."""
        value = frame[1]
        if type(value) is DataRef and self.plane is not None:
            try:
                value = self.plane.read_now(value, copy=True)
            except OmniflowError as exc:
                value = f"<data-plane value lost: {exc}>"
            return (frame[0], value, frame[2], frame[3])
        return frame

    def _resolve_inputs(self, call: Call, core: CallCore, act: Activation) -> dict[str, Any] | None:
        """A local activation's inputs with data-plane refs swapped for their values
        (zero-copy views where the producer is on this host). None: the activation already
        failed."""
        plane = self.plane
        if plane is None:
            return act.kwargs
        try:
            return {f: _read_refs(plane, v) for f, v in act.kwargs.items()}
        except OmniflowError as exc:
            self._done(call, core, act, exc, not call._ready)
            return None

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _time_out(self, call: Call) -> None:
        """The call's deadline passed: cancel it; it ends "error" with a "timeout" NodeError
        naming the earliest activation still running (or the session queue it waits in)."""
        call._timer = None
        if call.done:
            return
        after = f"the call exceeded its timeout of {call._timeout:g}s"
        core = call.core
        if core is None:
            err = NodeError(
                "<session queue>",
                f"{after} while queued behind earlier calls of session {call.session!r}",
                kind="timeout",
                call_id=call.call_id,
                graph=call.graph,
            )
            call._timed_out = True
            self._finish_call(call, None, status="error", errors=[err])
            return
        running = sorted(core.running, key=lambda a: a.aid)
        node = running[0].node if running else "<call>"
        err = NodeError(
            node,
            f"{after} while this node was still running; raise timeout= or make it faster",
            kind="timeout",
            call_id=call.call_id,
            graph=call.graph,
        )
        call._timed_out = True
        try:
            reason = f"timeout after {call._timeout:g}s"
            self._step(call, core, Cancel(CancelKind.TIMEOUT, reason, err))
        except Exception as exc:
            self._crash(call, exc)

    def _cancel_call(self, call: Call) -> None:
        if call.done:
            return
        core = call.core
        if core is None:
            # Still queued behind its session: it never started.
            self._finish_call(call, None, status="cancelled")
            return
        try:
            self._step(call, core, Cancel())
        except Exception as exc:
            self._crash(call, exc)

    def _release_pools(self, call: Call) -> None:
        """Unpin the pages the call holds in any Params Pool (ok, error or cancelled); the
        caller's view of the end (``wait``, the iterator's end, ``run``) waits for it."""
        held = [p for p in self._pools.values() if p.holds(call.call_id)]
        if held and self._loop is not None:
            task = self._loop.create_task(_release(held, call.call_id))
            self._track(task)
            call._releasing = task

    def _finish_call(
        self,
        call: Call,
        core: CallCore | None,
        status: str | None = None,
        errors: list[NodeError] | None = None,
    ) -> None:
        if call.done:
            return
        timer = call._timer
        if timer is not None:
            call._timer = None
            timer.cancel()
        self._calls.pop(call.call_id, None)
        if self._pools:
            self._release_pools(call)
        if self.remote is not None:
            ended = self.remote.end_call(call.call_id)
            if ended is not None:  # (the workers' releases of its pool pages: waited for too)
                releasing = call._releasing
                call._releasing = ended if releasing is None else asyncio.gather(releasing, ended)
        if self.plane is not None:
            self.plane.cleanup(call.call_id)
        if core is not None:
            # A call cut by its deadline ends "error" (its cancelled methods say "cancel").
            call._finish("error" if call._timed_out else core.status, core.errors)
        else:
            call._finish(status or "cancelled", errors or [])
        if self.metrics is not None:
            done = self.metrics.calls_finished
            done[call.status] = done.get(call.status, 0) + 1
        if call.session is not None:
            q = self._queues.get(call.session)
            if q is not None:
                with contextlib.suppress(ValueError):
                    q.remove(call)
                if q:
                    nxt = q[0]
                    if nxt.core is None and self._loop is not None:
                        self._loop.call_soon(self._start_call, nxt)
                else:
                    del self._queues[call.session]
                    self._session_idle(call.session)


def _otel_current() -> Any:
    """The OpenTelemetry context current where the call was made (the server span)."""
    from opentelemetry import context

    return context.get_current()


def _launcher(
    placement: Any, role_modules: dict[str, str | None], plane: DataPlane | None
) -> Launcher | None:
    """What starts the replicas (``_launch``): None (subprocesses) unless Ray places them."""
    if not isinstance(placement, Ray):
        return None
    from omniflow.runtime._ray import RayLauncher

    return RayLauncher(placement, placement.plan(role_modules), plane=plane)


async def _release(pools: list[Any], call_id: str) -> None:
    """Release ``call_id``'s pages in each pool; a failure is logged, the others go on."""
    for pool in pools:
        try:
            await pool.release(call_id)
        except Exception:
            logger.exception("releasing call %s's pages in pool %r failed", call_id, pool.name)


def _read_refs(plane: DataPlane, value: Any) -> Any:
    if type(value) is DataRef:
        return plane.read_now(value)
    if type(value) is list or type(value) is tuple:
        items = [plane.read_now(v) if type(v) is DataRef else v for v in value]
        return items if type(value) is list else tuple(items)
    return value
