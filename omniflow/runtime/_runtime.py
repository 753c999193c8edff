"""The Runtime: the async shell that carries out what the call cores decide.

>>> async with of.Runtime(graph) as rt:                         # doctest: +SKIP
...     out = await rt.run("t2i", {"request": req})

Concurrency model (docs/concurrency.md, "Concurrency"): one event loop, no locks. Every
scheduling decision is a synchronous call into a ``CallCore``; between two awaits nothing else
runs, so no decision can interleave with another. Every method runs inside one asyncio.Task
from its first step to its end: a call's ready methods run one after another in an eagerly
started *walker* task, and a method that suspends keeps its walker to its end while the rest
go on in another (``_shell.Shell._walk``; docs/concurrency.md, "Role methods run in tasks"). A
chain of cheap nodes therefore costs one task, while a slow node never holds anyone else back.

The parts: ``_shell`` (stimuli in, the core's answers carried out, methods run), ``_calls``
(each call's start, deadline, cancel and end), ``_sessions`` (session queues, GlobalParameters,
idle TTL) and ``_stats`` (what the runtime tells about itself); this module holds the lifecycle
and the entry points (``call``, ``run``).
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import itertools
import math
from collections import deque
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import (
    InputError,
    NodeError,
    OmniflowError,
    RuntimeClosedError,
)
from omniflow.data._plane import DEFAULT_THRESHOLD, DataPlane
from omniflow.dsl._graph import GlobalParameters, Graph, RoleRef
from omniflow.plan._parser import parse_graphs
from omniflow.plan._plan import StaticPlan
from omniflow.runtime._batcher import Batcher
from omniflow.runtime._call import Call
from omniflow.runtime._calls import Calls
from omniflow.runtime._executor import Remote, cluster
from omniflow.runtime._metrics import RuntimeMetrics
from omniflow.runtime._sessions import Sessions
from omniflow.runtime._setup import setup_role
from omniflow.runtime._shell import Shell
from omniflow.runtime._stats import RuntimeStatistics
from omniflow.runtime.callcore._compiled import Compiled, compile_plan
from omniflow.runtime.callcore._stimuli import render_story
from omniflow.transport._auth import resolve_key

if TYPE_CHECKING:
    from omniflow.runtime._tracing import Tracing

__all__ = ["Runtime", "RuntimeState"]


class RuntimeState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class Runtime(RuntimeStatistics):
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
        placed = cluster().place(placement, role_modules, self.plans, connectors)
        remote_roles = placed.remote_roles
        if registry is not None and not remote_roles:
            raise OmniflowError(
                "registry=... needs a multi-process placement (placement='process' or Deploy)"
            )
        key = resolve_key(cluster_key)[0] if remote_roles or cluster_key is not None else None
        #: This process's data plane (None when every role runs here: objects pass as is).
        self.plane: DataPlane | None = DataPlane(threshold=data_threshold) if remote_roles else None
        #: Counters for /metrics (None while metrics are off).
        self.metrics: RuntimeMetrics | None = RuntimeMetrics() if metrics else None
        #: Runs the calls: hands their cores stimuli and carries out the answers (``_shell``).
        self._shell = shell = Shell(plane=self.plane, metrics=self.metrics, validate=validate)
        #: Every task the runtime started and that has not ended.
        self._tasks = shell.tasks
        offload = {
            (gname, n): sorted(set(s.outputs) - set(p.outputs))
            for gname, p in self.plans.items()
            for n, s in p.specs.items()
            if s.role in remote_roles and set(s.outputs) - set(p.outputs)
        }
        #: Worker processes and their replicas (None for in-process placement).
        self.remote: Remote | None = (
            placed.remote(
                registry=registry,
                on_frame=shell.remote_frame,
                on_done=shell.ended,
                on_return=shell.remote_return,
                plane=self.plane,
                offload=offload,
                heartbeat_interval=heartbeat_interval,
                cluster_key=key,
                heartbeat_misses=heartbeat_misses,
                otlp_endpoint=_otlp_endpoint(tracer_provider),
            )
            if remote_roles
            else None
        )
        remote_nodes = frozenset(
            n for p in self.plans.values() for n, s in p.specs.items() if s.role in remote_roles
        )
        self._compiled: dict[str, Compiled] = {
            name: compile_plan(p) for name, p in self.plans.items()
        }
        #: node -> its batcher, for the batched nodes this process runs (``batch=``): one per
        #: node, shared by every graph and call that reaches it.
        self._batchers: dict[str, Batcher] = {
            n: Batcher(n, c.methods[n], s.batch, track=shell.track)
            for name, c in self._compiled.items()
            for n, s in self.plans[name].specs.items()
            if s.batch is not None and n not in remote_nodes
        }
        #: graph -> node -> bound method, for the coroutine methods this process runs (what
        #: ``Shell._launch`` starts inline; remote nodes and generators take the longer way).
        self._coros: dict[str, dict[str, Any]] = {
            name: {
                n: m
                for n, m in c.methods.items()
                if n not in remote_nodes and n not in c.generators and n not in self._batchers
            }
            for name, c in self._compiled.items()
        }
        #: Params Pools of every graph by name; pages a call allocates under its call id are
        #: released when the call ends (``Calls.finish``).
        self._pools: dict[str, Any] = {}
        for g in graphs:
            for pool in g.pools:
                if self._pools.setdefault(pool.name, pool) is not pool:
                    raise OmniflowError(f"two different ParamsPools are named '{pool.name}'")
        self._pool_view = MappingProxyType(self._pools)
        if key is not None:  # this process's pools pull with the deployment's key too
            for pool in self._pools.values():
                pool.set_cluster_key(key)
        if self.remote is not None and self.metrics is not None:  # bytes moved per edge
            self.remote.count_edge_bytes(self.metrics.edge_bytes, self.plans)
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
        shell.remote, shell.remote_nodes, shell.batchers = self.remote, remote_nodes, self._batchers
        #: Session queues, GlobalParameters and idle timers (``_sessions``).
        self._sessions = Sessions(session_ttl, self._factories, self._pools, shell.track)
        self._sessions.remote = self.remote
        #: Bounded log of stimuli and transitions: (call id, stimulus id, event, values), see
        #: ``_stimuli.STORY_FIELDS``; ``story(call_id)`` renders them.
        self.story_log: deque[tuple[Any, ...]] | None = (
            deque(maxlen=story_size) if story_size else None
        )
        #: Frames a reader may fall behind before stream producers wait (backpressure).
        self.stream_high_water = stream_high_water
        self._loop: asyncio.AbstractEventLoop | None = None
        self._set_up: list[Any] = []
        #: Spans of calls and activations (None while tracing is off, docs/contract.md §4).
        self.tracing: Tracing | None = None
        if tracer_provider is not None:
            from omniflow.runtime._tracing import Tracing

            self.tracing = Tracing(tracer_provider)
            if self.remote is not None:
                self.remote.traced = True
        #: Every call from its start to its end (``_calls``); ``_finish_call`` ends one.
        self._table = Calls(
            shell, self._sessions, self._compiled, self._coros, self._pools,
            story_log=self.story_log, tracing=self.tracing,
        )  # fmt: skip
        self._calls = self._table.calls
        shell.finish = self._table.finish

    @property
    def validate(self) -> bool:
        """Check every call core's invariants after each step, and run each batch of ready
        work in a shuffled order seeded by ``shuffle_seed`` and the call id, so that order
        bugs surface (tests switch this on)."""
        return self._shell.validate

    @validate.setter
    def validate(self, value: bool) -> None:
        self._shell.validate = value

    @property
    def shuffle_seed(self) -> int:
        return self._table.shuffle_seed

    @shuffle_seed.setter
    def shuffle_seed(self, value: int) -> None:
        self._table.shuffle_seed = value

    @property
    def session_ttl(self) -> float | None:
        """Seconds a session may stay idle (no running or queued call) before it is closed."""
        return self._sessions.ttl

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _front_colocation(self) -> Any:
        """The co-location facts of the roles this front hosts next to its workers (they fill
        slot 0 of the deployment on this node)."""
        assert self.remote is not None
        return self.remote.colocation(frozenset(self._role_names[id(r)] for r in self._roles))

    async def start(self) -> None:
        if self.state is not RuntimeState.NEW:
            raise RuntimeClosedError(f"Runtime is {self.state.value}; it can start only once")
        self._loop = self._table.loop = self._sessions.loop = asyncio.get_running_loop()
        self.state = RuntimeState.RUNNING
        self._sessions.running = True
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
        self._sessions.running = False
        calls = list(self._calls.values())
        for call in calls:
            self._table.cancel(call)
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
        self._sessions.clear()
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
            deadline = self._loop.time() + timeout
            call._timer = self._loop.call_at(deadline, self._table.time_out, call)
        if session is not None and not self._sessions.enqueue(call):
            return call  # (behind the session's earlier calls: started when they end)
        if now:
            self._table.start(call)
        else:
            self._loop.call_soon(self._table.start, call)
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

    def sessions(self) -> list[str]:
        """Sessions whose GlobalParameters are held (until ``close_session``)."""
        return sorted(self._sessions.params)

    def story(self, call_id: str) -> list[tuple[str, dict[str, Any]]]:
        """What happened to a call, oldest first (as far as the bounded log reaches back)."""
        if self.story_log is None:
            return []
        return render_story(self.story_log, call_id)

    async def close_session(self, session: str) -> None:
        """Wait for the session's queued and running calls, then release its
        GlobalParameters and its Params Pool run locks here and in every worker (a later call
        starts it afresh)."""
        await self._sessions.close(session)

    def _cancel_call(self, call: Call) -> None:
        """Cancel a call (``Call.cancel``); one still queued behind its session never starts."""
        self._table.cancel(call)


def _otlp_endpoint(provider: Any) -> str | None:
    """The collector of a provider ``otlp_provider`` built (its workers export there too)."""
    if provider is None:
        return None
    from omniflow.runtime._tracing import otlp_endpoint

    return otlp_endpoint(provider)
