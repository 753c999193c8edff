"""Front side of the multi-process runtime: worker processes, replicas, load balancing.

The front keeps every call core (all scheduling decisions); a role placed in a worker only
changes *where* its methods run. ``RemoteRoles.submit`` sends a ``run`` to a replica chosen by
the node's load balancer; the replica's ``frame`` and ``done`` messages come back to the
runtime shell exactly as a local method's would. A replica that dies fails the activations it
held with a NodeError saying so, at once when the front spawned the process, and within the
registry's time-to-live otherwise. Every message is sealed and checked (``transport._auth``)
and typed (``transport._protocol``); frames and dones are taken only from the replica that
runs the activation. Supervision: a replica silent for ``heartbeat_misses`` intervals is lost
(a spawned one is SIGKILLed), spawned replicas that die are respawned with backoff (0.1 s
doubling, at most 30 s), and ``readiness()`` names the roles with no live replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import signal
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import NodeError, OmniflowError, RuntimeClosedError, TransportError
from omniflow.data._plane import DEFAULT_THRESHOLD, DataPlane, DataRef
from omniflow.data.kv._hosted import serve as serve_meta
from omniflow.data.kv._meta import MemoryMetadata
from omniflow.transport import connect
from omniflow.transport._auth import KEY_ENV, Opener, Sealer, WireStats
from omniflow.transport._protocol import (
    Bye,
    Cancel,
    CloseSession,
    Done,
    EndCall,
    Frame,
    Frames,
    Heartbeat,
    Hello,
    Message,
    MetaCall,
    MetaNotify,
    MetaReply,
    ProtocolError,
    Ready,
    Release,
    Run,
    SourceLost,
    StatsReply,
    StatsRequest,
    Stop,
    decode_msg,
    encode_msg,
)

if TYPE_CHECKING:
    from omniflow.registry import ServiceRegistry
    from omniflow.runtime._call import Call
    from omniflow.runtime._core import Activation, CallCore

__all__ = ["Deploy", "ProcessSpec", "RemoteRoles", "plan_processes"]

logger = logging.getLogger("omniflow.remote")

#: Respawn backoff: the first delay, the cap, and how long a replica must have lived for its
#: slot's backoff to start over.
RESPAWN_BASE = 0.1
RESPAWN_CAP = 30.0
RESPAWN_RESET = 60.0

#: How the runtime shell is told about a remote activation's progress.
OnFrame = Callable[["Call", "CallCore", "Activation", Any], None]
OnDone = Callable[["Call", "CallCore", "Activation", BaseException | None], None]


class Deploy:
    """Group roles into named worker processes and replicate them.

    >>> Deploy({"llm": {"replicas": 2, "process": "gpu0"}, "vit": {"process": "gpu0"}})
    Deploy({'llm': {'replicas': 2, 'process': 'gpu0'}, 'vit': {'process': 'gpu0'}})

    Roles that share a ``process`` name run in one process (each replica of the group is one
    process); roles not named stay in the front process.
    """

    _KEYS = frozenset({"replicas", "process"})

    def __init__(self, roles: dict[str, dict[str, Any]]) -> None:
        if not isinstance(roles, dict):
            raise OmniflowError(
                "Deploy takes a dict: {role name: {'replicas': n, 'process': name}}"
            )
        for name, opts in roles.items():
            if not isinstance(opts, dict):
                raise OmniflowError(f"Deploy: options of role '{name}' must be a dict")
            unknown = set(opts) - self._KEYS
            if unknown:
                raise OmniflowError(
                    f"Deploy: role '{name}' has unknown option(s) {sorted(unknown)}; "
                    f"use {sorted(self._KEYS)}"
                )
            n = opts.get("replicas", 1)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise OmniflowError(f"Deploy: role '{name}' replicas must be an int >= 1")
        self.roles = {k: dict(v) for k, v in roles.items()}

    def __repr__(self) -> str:
        return f"Deploy({self.roles!r})"


def _rendezvous(session: str, live: list[_Replica]) -> _Replica:
    """Highest-random-weight choice: every front that sees the same replicas picks the same
    one, whatever the order it learnt them in (fewer pin conflicts to settle)."""
    return max(live, key=lambda r: zlib.crc32(f"{session}\0{r.replica_id}".encode()))


@dataclass
class ProcessSpec:
    """One group of roles that runs as ``replicas`` worker processes."""

    name: str
    roles: list[str]
    replicas: int
    modules: list[str]


def plan_processes(placement: Any, role_modules: dict[str, str | None]) -> list[ProcessSpec]:
    """Which roles go to which worker processes; [] for in-process placement."""
    if placement == "inproc":
        return []
    wanted: dict[str, dict[str, Any]]
    if placement == "process":
        wanted = {r: {"process": r, "replicas": 1} for r in role_modules}
    elif isinstance(placement, Deploy):
        wanted = placement.roles
    else:
        raise OmniflowError(
            f"placement={placement!r} is not understood; use 'inproc', 'process' or "
            "omniflow.Deploy({...})"
        )
    groups: dict[str, ProcessSpec] = {}
    #: process name -> the role whose options gave the group its replica count.
    stated: dict[str, str] = {}
    for role, opts in wanted.items():
        if role not in role_modules:
            raise OmniflowError(
                f"Deploy names role '{role}', which no graph of this runtime declares; roles: "
                f"{sorted(role_modules)}"
            )
        module = role_modules[role]
        if module is None:
            raise OmniflowError(
                f"role '{role}' must run in a worker process, but its graph was built in "
                "__main__; define the graph at module level in an importable module or .py file"
            )
        pname = str(opts.get("process", role))
        n = opts.get("replicas")
        spec = groups.get(pname)
        if spec is None:
            spec = groups[pname] = ProcessSpec(pname, [], 1, [])
        if n is not None:
            # A role that does not say how many replicas joins its group's count, whatever
            # the order of the Deploy dict; two roles that say different counts disagree.
            if pname in stated and spec.replicas != n:
                raise OmniflowError(
                    f"Deploy: roles of process '{pname}' disagree on replicas "
                    f"({spec.replicas} vs {n}: roles '{stated[pname]}' and '{role}'); a "
                    "process group is replicated as a whole, so state it on one role"
                )
            spec.replicas = int(n)
            stated[pname] = role
        spec.roles.append(role)
        if module not in spec.modules:
            spec.modules.append(module)
    return list(groups.values())


@dataclass(slots=True)
class _Pending:
    """An activation running on one or more replicas."""

    call: Call
    core: CallCore
    act: Activation
    replicas: list[_Replica]
    error: BaseException | None = None


@dataclass(eq=False)
class _Replica:
    replica_id: str
    roles: list[str]
    address: str
    endpoint: Any = None
    process: asyncio.subprocess.Process | None = None
    alive: bool = True
    ready: asyncio.Future[None] | None = None
    out: asyncio.Queue[list[Any] | None] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    #: (call id, aid) of activations it runs.
    held: set[tuple[str, int]] = field(default_factory=set)
    exit_code: int | None = None
    #: Absent from the last registry snapshot (a registry-found replica on probation).
    missing: bool = False
    #: Said ``bye``: it gets nothing new and finishes what it holds, then exits.
    leaving: bool = False
    #: Loop time of its last ``bye`` (a leaving replica repeats it while it drains).
    last_bye: float = 0.0
    #: Process id the worker reported in "ready" (its data-plane refs carry it).
    pid: int | None = None
    #: Seals what this front sends on this connection (one sender, one counter).
    sealer: Sealer | None = None
    #: Loop time of the last authentic message from it (heartbeats included).
    last_seen: float = 0.0
    #: The process group it was spawned for and its slot there (None: found in the registry).
    spec: ProcessSpec | None = None
    slot: int = 0
    #: Loop time it was spawned at (a replica that lived long resets its slot's backoff).
    born: float = 0.0
    #: (pool, node) of the Params Pools it registered in the front-hosted metadata.
    pool_nodes: set[tuple[str, str]] = field(default_factory=set)


class _RemoteHandle:
    """The shell's task for a remote activation (in ``call._tasks``): ``cancel()`` asks its
    replicas."""

    __slots__ = ("key", "remote")

    def __init__(self, remote: RemoteRoles, key: tuple[str, int]) -> None:
        self.remote = remote
        self.key = key

    def cancel(self) -> None:
        self.remote._cancel(self.key)


class RemoteRoles:
    """The worker processes of one Runtime and the replicas it routes to."""

    def __init__(
        self,
        processes: list[ProcessSpec],
        *,
        registry: str | None,
        on_frame: OnFrame,
        on_done: OnDone,
        heartbeat_interval: float = 1.0,
        start_timeout: float = 60.0,
        plane: DataPlane | None = None,
        offload: dict[tuple[str, str], list[str]] | None = None,
        connectors: dict[str, dict[str, str]] | None = None,
        cluster_key: bytes | None = None,
        heartbeat_misses: int = 10,
        respawn: bool = True,
    ) -> None:
        from omniflow.transport._auth import resolve_key

        self.processes = processes
        #: The deployment's key (workers spawned here get it in their environment).
        self.cluster_key = cluster_key if cluster_key is not None else resolve_key()[0]
        #: Accepted and dropped messages from replicas, by reason.
        self.wire = WireStats()
        self._opener = Opener(self.cluster_key, self.wire)
        #: Heartbeats a replica may miss before it counts as lost (and, if spawned, is killed).
        self.heartbeat_misses = heartbeat_misses
        #: Respawn spawned replicas that die (with backoff).
        self.respawn = respawn
        #: Role -> replicas of it respawned so far.
        self.restarts: dict[str, int] = {r: 0 for p in processes for r in p.roles}
        #: (process group, slot) -> consecutive quick deaths (the backoff exponent).
        self._backoff: dict[tuple[str, int], int] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._addresses = itertools.count()
        #: The front's data plane (inputs it produced for remote methods go through its pool).
        self.plane = plane
        #: (graph, node) -> outputs a worker puts in its data plane (never the caller's fields).
        self._offload = offload or {}
        #: node -> {source node: connector} for edges configured away from "auto".
        self._connectors = connectors or {}
        #: (call id, aid) -> refs the front put in its own pool for that remote activation.
        self._front_refs: dict[tuple[str, int], list[DataRef]] = {}
        #: True while a batch of replica messages is handled (runs made then are queued).
        self._in_batch = False
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
        self.registry_url = registry
        self.heartbeat_interval = heartbeat_interval
        self.start_timeout = start_timeout
        self._on_frame = on_frame
        self._on_done = on_done
        #: Roles served by workers.
        self.roles = frozenset(r for p in processes for r in p.roles)
        self._replicas: dict[str, _Replica] = {}
        self._by_role: dict[str, list[_Replica]] = {r: [] for r in self.roles}
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._rr: dict[str, itertools.count[int]] = {r: itertools.count() for r in self.roles}
        self._affinity: dict[tuple[str, str], str] = {}
        #: (session, role) -> runs waiting for the registry to settle the session's pin.
        self._pinning: dict[tuple[str, str], list[tuple[tuple[str, int], Any]]] = {}
        #: Pin settlements and adoptions under way (cancelled at close).
        self._background: set[asyncio.Task[Any]] = set()
        #: Makes this front's replica ids unique in a shared registry: two fronts on one
        #: host, or in one process, or on two hosts whose pids collide.
        self._token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self._call_replicas: dict[str, set[_Replica]] = {}
        #: Send ``end_call`` to every replica a call ran on (Params Pools release there).
        self.track_calls = False
        self._registry: ServiceRegistry | None = None
        self._watchers: list[asyncio.Task[Any]] = []
        self._tmp = tempfile.mkdtemp(prefix="omniflow-")
        self._closing = False
        #: Replicas spawned at start (later spawns are respawns and get a new replica id).
        self._initial = sum(p.replicas for p in processes)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.registry_url:
            from omniflow.registry import create_registry

            self._registry = create_registry(
                self.registry_url, heartbeat_interval=self.heartbeat_interval, key=self.cluster_key
            )
            await self._registry.start()
        starts = []
        for spec in self.processes:
            for i in range(spec.replicas):
                starts.append(self._spawn(spec, i))
        try:
            await asyncio.wait_for(asyncio.gather(*starts), self.start_timeout)
        except BaseException:
            await self.close()
            raise
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        if self._registry is not None:
            loop = asyncio.get_running_loop()
            for role in sorted(self.roles):
                self._watchers.append(loop.create_task(self._watch(role)))

    async def _spawn(self, spec: ProcessSpec, slot: int) -> None:
        n = next(self._addresses)
        rid = f"{spec.name}-{slot}-{self._token}" + (f"-r{n}" if n >= self._initial else "")
        address = f"ipc://{self._tmp}/w{n}.sock"
        cmd = [sys.executable, "-m", "omniflow", "worker", *spec.modules]
        for role in spec.roles:
            cmd += ["--role", role]
        # --parent-pid: the worker leaves when this process is gone (it runs in a session
        # of its own, so nothing else would stop it after a crash of the front). --owner:
        # only this front may stop it. The key goes in the environment, never in argv.
        cmd += ["--bind", address, "--replica-id", rid, "--parent-pid", str(os.getpid())]
        cmd += ["--owner", self._token, "--heartbeat", str(self.heartbeat_interval)]
        if self.registry_url:
            cmd += ["--registry", self.registry_url]
        # The cluster key travels in the environment (never argv), with the file where the
        # worker writes why it could not start (a failed setup(), a bad module).
        env = {
            **os.environ,
            KEY_ENV: self.cluster_key.decode(),
            "OMNIFLOW_START_ERROR_FILE": os.path.join(self._tmp, f"{rid}.err"),
        }
        # A session of its own: Ctrl-C in the front's terminal must not kill the workers
        # before the front drains; the front stops them itself.
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, start_new_session=True, env=env
        )
        rep = _Replica(rid, list(spec.roles), address, process=proc, spec=spec, slot=slot)
        rep.born = asyncio.get_running_loop().time()
        self._replicas[rid] = rep
        rep.tasks.append(asyncio.get_running_loop().create_task(self._reap(rep)))
        await self._connect(rep)

    async def _connect(self, rep: _Replica) -> None:
        loop = asyncio.get_running_loop()
        rep.endpoint = connect(rep.address)
        rep.sealer = Sealer(self.cluster_key)
        if rep.ready is None:
            rep.ready = loop.create_future()
        rep.tasks.append(loop.create_task(self._write(rep)))
        rep.tasks.append(loop.create_task(self._read(rep)))
        rep.out.put_nowait(encode_msg(Hello(self._token, self.heartbeat_interval)))
        await rep.ready
        rep.last_seen = loop.time()
        if rep.alive and not rep.leaving:  # a worker that is leaving says bye at once
            for role in rep.roles:
                self._by_role.setdefault(role, []).append(rep)

    async def close(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        for task in self._watchers:
            task.cancel()
        for task in list(self._background):
            task.cancel()
        for rep in list(self._replicas.values()):
            if rep.alive and rep.endpoint is not None and rep.process is not None:
                rep.out.put_nowait(encode_msg(Stop()))
        for rep in list(self._replicas.values()):
            proc = rep.process
            if proc is not None and proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            rep.alive = False
            for task in rep.tasks:
                task.cancel()
            for task in rep.tasks:
                with contextlib.suppress(BaseException):
                    await task
            if rep.endpoint is not None:
                rep.endpoint.close()
            if rep.pool_nodes:  # its pools are gone with it
                nodes, rep.pool_nodes = rep.pool_nodes, set()
                await self._forget_pools(nodes)
        self._replicas.clear()
        for task in list(self._meta_tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._registry is not None:
            with contextlib.suppress(Exception):
                await self._registry.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._tmp):
                os.unlink(os.path.join(self._tmp, name))
            os.rmdir(self._tmp)

    # ------------------------------------------------------------------ routing

    def submit(self, call: Call, core: CallCore, act: Activation) -> None:
        """Run ``act`` on a replica of its role (all replicas for lb="broadcast")."""
        spec = core.c.specs[act.node]
        role = spec.role
        live = [r for r in self._by_role.get(role, ()) if r.alive]
        if not live:
            self._on_done(
                call,
                core,
                act,
                NodeError(
                    act.node,
                    f"no live replica of role '{role}' (every worker of it is gone)",
                    call_id=call.call_id,
                    graph=call.graph,
                ),
            )
            return
        if spec.lb == "broadcast":
            targets = live
        elif spec.lb == "session" and call.session is not None:
            picked = self._pick_session(call.session, role, live)
            targets = [] if picked is None else [picked]
        else:
            targets = [live[next(self._rr[role]) % len(live)]]
        key = (call.call_id, act.aid)
        self._pending[key] = _Pending(call, core, act, list(targets))
        call._tasks[act] = _RemoteHandle(self, key)
        kwargs = act.kwargs
        plane = self.plane
        # Big inputs go through the front's pool when every replica it may reach (a run
        # waiting for its session's pin may go to any live one) shares this host.
        if (
            plane is not None
            and any(plane.is_big(v) for v in kwargs.values())
            and all(r.address.startswith("ipc://") for r in (targets or live))
        ):
            kwargs = self._offload_inputs(key, act.node, kwargs)
        off = self._offload.get((call.graph, act.node)) or None
        run = Run(
            call.call_id, act.aid, act.node, kwargs, call.session, act.group, act.seq[2],
            call.graph, off, self._threshold if off else None,
            self._connectors.get(act.node) or None,
        )  # fmt: skip
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
        self._send_run(key, frames, targets)

    def _send_run(self, key: tuple[str, int], frames: Any, targets: list[_Replica]) -> None:
        if self._pending[key].core.c.plan.params or self.track_calls:
            self._call_replicas.setdefault(key[0], set()).update(targets)
        for rep in targets:
            rep.held.add(key)
            # A run started by a caller goes out at once (no writer wake-up on the way: the
            # hop's latency); runs made while a batch of replies is handled are queued, so
            # the writer sends them back to back and the workers receive them in batches.
            if not self._in_batch and rep.out.empty() and rep.endpoint is not None:
                assert rep.sealer is not None
                try:
                    # A refused try used a counter the writer skips: gaps are allowed.
                    if rep.endpoint.try_send(rep.sealer.seal(frames)):
                        continue
                except (TransportError, RuntimeClosedError):
                    pass  # the writer meets the same error and declares the replica lost
            rep.out.put_nowait(frames)

    def _routable(self, role: str) -> list[_Replica]:
        return [r for r in self._by_role.get(role, ()) if r.alive]

    def _pick_session(self, session: str, role: str, live: list[_Replica]) -> _Replica | None:
        """Session affinity: the replica ``session`` is pinned to, or None while the pin must
        first be settled through the shared registry.

        With a registry every front routes a session the same way: the first run of a session
        from this front (or the first after its replica went away) waits for
        ``pin_affinity``, an atomic compare-and-set in the registry, and goes where it says;
        later runs use the local copy of the pin without a round trip. Without a registry
        (one front) the pin is local.
        """
        rid = self._affinity.get((session, role))
        if rid is not None:
            for rep in live:
                if rep.replica_id == rid:
                    return rep
        if self._registry is not None:
            return None
        rep = _rendezvous(session, live)
        self._affinity[(session, role)] = rep.replica_id
        return rep

    def _defer(self, session: str, role: str, key: tuple[str, int], frames: Any) -> None:
        waiting = self._pinning.get((session, role))
        if waiting is None:
            waiting = self._pinning[(session, role)] = []
            self._in_background(self._settle_pin(session, role))
        waiting.append((key, frames))

    async def _settle_pin(self, session: str, role: str) -> None:
        """Pin ``session`` for ``role`` in the registry, then send the runs that waited."""
        rep: _Replica | None
        try:
            rep = await self._resolve_pin(session, role)
        except (OmniflowError, OSError) as exc:  # registry down: pin locally for now
            logger.warning("session %r: registry pin failed, routing locally: %s", session, exc)
            live = self._routable(role)
            rep = _rendezvous(session, live) if live else None
        waiting = self._pinning.pop((session, role), [])
        if rep is not None:
            self._affinity[(session, role)] = rep.replica_id
        for key, frames in waiting:
            p = self._pending.get(key)
            if p is None or isinstance(p.error, asyncio.CancelledError):
                continue  # cancelled while it waited; _cancel finishes it
            if rep is None or not rep.alive:
                p.error = NodeError(
                    p.act.node,
                    f"no live replica of role '{role}' (every worker of it is gone)",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                )
                self._replica_done(None, key, None)
                continue
            p.replicas.append(rep)
            self._send_run(key, frames, [rep])

    async def _resolve_pin(self, session: str, role: str) -> _Replica | None:
        """The replica the registry pins ``session`` to: this front's choice unless another
        front pinned it first; a pin to a replica that is gone is replaced (compare-and-set,
        so two fronts that both find it gone still agree)."""
        assert self._registry is not None
        old = self._affinity.get((session, role))
        for _ in range(3):
            live = self._routable(role)
            if not live:
                return None
            mine = _rendezvous(session, live).replica_id
            winner = await self._registry.pin_affinity(session, role, mine, replace=old)
            rep = self._replicas.get(winner)
            if rep is None:  # registered, perhaps not adopted here yet
                listed = {r.replica_id: r for r in await self._registry.replicas(role)}
                if winner in listed:
                    rep = self._adopt(role, winner, listed[winner].address)
            if rep is not None and rep.ready is not None and not rep.ready.done():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(rep.ready), self.start_timeout)
            if rep is not None and rep.alive and rep in self._by_role.get(role, ()):
                return rep
            old = winner  # pinned to a replica that is gone or leaving: move the session
        return None

    def _in_background(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _offload_inputs(
        self, key: tuple[str, int], node: str, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
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
            for rep in self._replicas.values():
                if rep.alive and rep.address == source:
                    rep.out.put_nowait(encode_msg(Release(owned)))
                    break

    def end_call(self, call_id: str) -> None:
        """Let the workers drop what a finished call left: params and data-plane blocks."""
        reps = self._call_replicas.pop(call_id, None)
        if reps:
            frames = encode_msg(EndCall(call_id))
            for rep in reps:
                if rep.alive:
                    rep.out.put_nowait(frames)

    def close_session(self, session: str) -> None:
        frames = encode_msg(CloseSession(session))
        for rep in self._replicas.values():
            if rep.alive:
                rep.out.put_nowait(frames)
        for key in [k for k in self._affinity if k[0] == session]:
            del self._affinity[key]

    def _cancel(self, key: tuple[str, int]) -> None:
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

    # ------------------------------------------------------------------ I/O

    async def _write(self, rep: _Replica) -> None:
        while True:
            frames = await rep.out.get()
            if frames is None:
                return
            assert rep.sealer is not None
            try:
                await rep.endpoint.send(rep.sealer.seal(frames))
            except (TransportError, RuntimeClosedError) as exc:
                self._lost(rep, f"sending to it failed ({exc})")
                return

    async def _read(self, rep: _Replica) -> None:
        loop = asyncio.get_running_loop()
        opener = self._opener
        while True:
            try:
                batch = await rep.endpoint.recv_batch()
            except (RuntimeClosedError, TransportError, asyncio.CancelledError):
                return
            self._in_batch = True
            try:
                for _peer, frames in batch:
                    inner = opener.open(frames)
                    if inner is None:
                        self._dropped(rep, None)
                        continue
                    rep.last_seen = loop.time()
                    try:
                        self._on_message(rep, decode_msg(inner))
                    except ProtocolError as exc:
                        self._dropped(rep, exc.reason, exc)
                    except (KeyError, TypeError, ValueError) as exc:  # a malformed body
                        self._dropped(rep, "malformed", exc)
            finally:
                self._in_batch = False

    def _dropped(self, rep: _Replica, reason: str | None, exc: BaseException | None = None) -> None:
        """Count a dropped message (the opener counted its own); log the first and then every
        1000th, so a flood cannot flood the log too."""
        if reason is not None:
            self.wire.drop(reason)
        total = sum(self.wire.dropped.values())
        if total == 1 or total % 1000 == 0:
            logger.warning(
                "dropped %d messages from replicas so far (%s); last from %s: %s",
                total,
                self.wire.dropped,
                rep.replica_id,
                exc or "not authentic",
            )

    def _on_message(self, rep: _Replica, msg: Message) -> None:
        match msg:
            case Frame(c=c, a=a, f=f):
                self._replica_frame(rep, c, a, f)
            case Frames(c=c, a=a, fs=fs):  # consecutive frames of one generator activation
                for frame in fs:
                    self._replica_frame(rep, c, a, frame)
            case Done(c=c, a=a, f=f):
                if (c, a) not in rep.held:
                    self._dropped(
                        rep,
                        "foreign",
                        OmniflowError(f"done of ({c!r:.40}, {a}), which it does not run"),
                    )
                    return
                if f is not None:  # a coroutine's returned frame rides in its done
                    self._replica_frame(rep, c, a, f)
                self._replica_done(rep, (c, a), msg)
            case Heartbeat():
                pass  # last_seen is updated for every authentic message
            case Bye():
                self._on_bye(rep)
            case Ready(pid=pid):
                if rep.ready is not None and not rep.ready.done():
                    rep.pid = pid
                    rep.ready.set_result(None)
            case StatsReply(r=r):
                fut = self._stats_waiting.pop(r, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg._asdict())
            case MetaCall(r=r, op=op, args=args):
                # In order: each call is atomic (no await inside) and tasks start FIFO.
                task = asyncio.get_running_loop().create_task(self._meta_call(rep, r, op, args))
                self._meta_tasks.add(task)
                task.add_done_callback(self._meta_tasks.discard)
            case _:
                self._dropped(
                    rep,
                    "unknown_kind",
                    OmniflowError(f"a front does not take {type(msg).__name__}"),
                )

    async def _meta_call(self, rep: _Replica, r: int, op: str, args: list[Any]) -> None:
        """Answer one call of a worker's pool on the front-hosted metadata."""
        if not rep.alive:
            return
        try:
            value = await serve_meta(self.pool_meta, op, args)
        except OmniflowError as exc:
            self._dropped(rep, "malformed", exc)
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

    def _replica_frame(self, rep: _Replica, c: str, a: int, frame: Any) -> None:
        if (c, a) not in rep.held:  # only the replica that runs an activation speaks for it
            self._dropped(
                rep, "foreign", OmniflowError(f"a frame of ({c!r:.40}, {a}), which it does not run")
            )
            return
        p = self._pending.get((c, a))
        if p is not None:
            if isinstance(frame, dict) and any(type(v) is DataRef for v in frame.values()):
                self._call_replicas.setdefault(p.call.call_id, set()).add(rep)
            self._on_frame(p.call, p.core, p.act, frame)

    def _replica_done(self, rep: _Replica | None, key: tuple[str, int], err: Done | None) -> None:
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

    def _on_bye(self, rep: _Replica) -> None:
        """The replica is leaving (scale-down): route nothing new to it and let it finish what
        it holds. The first ``bye`` is answered with ``bye``: it follows every run this front
        sent there on the same connection, so after it the worker knows nothing more comes."""
        rep.last_bye = asyncio.get_running_loop().time()
        if rep.leaving:
            return  # a repeat while it drains: it is alive
        rep.leaving = True
        for reps in self._by_role.values():
            if rep in reps:
                reps.remove(rep)
        logger.info("replica %s is leaving, finishing %d runs", rep.replica_id, len(rep.held))
        if rep.alive:
            rep.out.put_nowait(encode_msg(Bye()))

    async def _reap(self, rep: _Replica) -> None:
        assert rep.process is not None
        code = await rep.process.wait()
        rep.exit_code = code
        if self._closing:
            return
        self._lost(rep, f"its process exited with code {code}")
        # One that never became ready is retried by the _respawn (or start) that spawned it.
        if self.respawn and rep.spec is not None and not rep.leaving and rep.pid is not None:
            self._in_background(self._respawn(rep))

    async def _respawn(self, dead: _Replica) -> None:
        """Start a new replica in the dead one's slot after a backoff: 0.1 s, doubling with
        each death that came within a minute of its spawn, at most 30 s."""
        assert dead.spec is not None
        loop = asyncio.get_running_loop()
        slot = (dead.spec.name, dead.slot)
        if loop.time() - dead.born > RESPAWN_RESET:
            self._backoff[slot] = 0
        n = self._backoff.get(slot, 0)
        self._backoff[slot] = n + 1
        delay = min(RESPAWN_CAP, RESPAWN_BASE * 2**n)
        if self._replicas.get(dead.replica_id) is dead:
            del self._replicas[dead.replica_id]
        for task in dead.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if dead.endpoint is not None:
            dead.endpoint.close()
        logger.warning(
            "respawning a replica of %s in %.1f s (restart %d of this slot)",
            dead.spec.name,
            delay,
            n + 1,
        )
        await asyncio.sleep(delay)
        while not self._closing:
            try:
                await asyncio.wait_for(self._spawn(dead.spec, dead.slot), self.start_timeout)
            except (OmniflowError, OSError, TimeoutError) as exc:
                n = self._backoff[slot] = self._backoff.get(slot, 0) + 1
                delay = min(RESPAWN_CAP, RESPAWN_BASE * 2**n)
                logger.warning(
                    "respawning %s failed (%s); next try in %.1f s", dead.spec.name, exc, delay
                )
                await asyncio.sleep(delay)
                continue
            for role in dead.spec.roles:
                self.restarts[role] = self.restarts.get(role, 0) + 1
            logger.warning("respawned a replica of %s (roles %s)", dead.spec.name, dead.spec.roles)
            return

    async def _supervise(self) -> None:
        """Every quarter interval: a replica silent for ``heartbeat_misses`` intervals is lost
        (a spawned one is killed first: SIGKILL, so it cannot come back half-alive). A front
        whose own loop was stalled judges nobody on that tick: it has not read what waits."""
        loop = asyncio.get_running_loop()
        tick = self.heartbeat_interval / 4
        limit = self.heartbeat_misses * self.heartbeat_interval
        last = loop.time()
        while not self._closing:
            await asyncio.sleep(tick)
            now = loop.time()
            stalled, last = now - last > tick + self.heartbeat_interval / 2, now
            for rep in list(self._replicas.values()):
                if not rep.alive or rep.ready is None or not rep.ready.done():
                    continue
                if stalled:
                    rep.last_seen = max(rep.last_seen, now - tick)
                    continue
                if now - rep.last_seen <= limit:
                    continue
                silent = now - rep.last_seen
                self._lost(
                    rep,
                    f"it missed {self.heartbeat_misses} heartbeats ({silent:.2f} s "
                    "without a word; a spawned replica is killed)",
                )

    def readiness(self) -> list[str]:
        """Roles with no live replica to route to (sorted); [] when every role can serve."""
        return sorted(r for r in self.roles if not self._routable(r))

    async def _watch(self, role: str) -> None:
        """Follow the registry: connect to replicas that appear, drop the ones that vanish.

        Replicas this front spawned are watched through their processes, not the registry, so
        a Redis restart (an empty registry until workers re-register, within one heartbeat
        interval) cannot fail their calls. A replica found elsewhere that vanishes gets two
        heartbeat intervals of grace (one to re-register after a restart, one for this watch
        to see it) before it counts as lost: with the default ttl of three intervals, a killed
        worker is lost within ``ttl + watch interval + grace`` = 6 intervals, under two ttls
        plus one watch interval. New replicas are connected in the background, so one that
        does not answer never holds up the watch.
        """
        assert self._registry is not None
        from omniflow._exceptions import RegistryError

        loop = asyncio.get_running_loop()
        while not self._closing:
            try:
                async with self._registry.watch(role) as watch:
                    async for snapshot in watch:
                        present = {r.replica_id: r for r in snapshot.replicas}
                        for rep in list(self._replicas.values()):
                            if rep.process is not None or not rep.alive or role not in rep.roles:
                                continue
                            missing = rep.replica_id not in present
                            if missing and not rep.missing:
                                grace = 2 * self.heartbeat_interval
                                loop.call_later(grace, self._check_missing, rep)
                            rep.missing = missing
                        for rid, replica in present.items():
                            if rid not in self._replicas:
                                self._adopt(role, rid, replica.address)
                            elif role not in self._replicas[rid].roles:
                                self._replicas[rid].roles.append(role)
            except RegistryError as exc:
                logger.warning("registry unreachable while watching %s: %s", role, exc)
                await asyncio.sleep(self.heartbeat_interval)

    def _adopt(self, role: str, rid: str, address: str) -> _Replica:
        """Start connecting to a replica found in the registry (in the background)."""
        rep = _Replica(rid, [role], address)
        rep.ready = asyncio.get_running_loop().create_future()
        self._replicas[rid] = rep
        self._in_background(self._connect_adopted(rep))
        return rep

    async def _connect_adopted(self, rep: _Replica) -> None:
        try:
            await asyncio.wait_for(self._connect(rep), self.start_timeout)
        except (TimeoutError, TransportError, OmniflowError) as exc:
            self._lost(rep, f"it did not answer ({exc!r})")

    def _check_missing(self, rep: _Replica) -> None:
        if not rep.alive or not rep.missing or self._closing:
            return
        loop = asyncio.get_running_loop()
        if rep.leaving and rep.held and loop.time() - rep.last_bye < 3 * self.heartbeat_interval:
            # Deregistered on purpose and still finishing runs (its repeated byes say it lives).
            loop.call_later(self.heartbeat_interval, self._check_missing, rep)
            return
        self._lost(rep, "it stopped heartbeating (gone from the registry)")

    def _discard(self, rep: _Replica) -> None:
        """Forget a lost registry-found replica: stop its tasks, close its socket."""
        if self._replicas.get(rep.replica_id) is rep:
            del self._replicas[rep.replica_id]
        for task in rep.tasks:
            task.cancel()
        if rep.endpoint is not None:
            rep.endpoint.close()

    def _lost(self, rep: _Replica, why: str) -> None:
        if not rep.alive:
            return
        rep.alive = False
        proc = rep.process
        if proc is not None and proc.returncode is None and not self._closing:
            # Lost but running (a send failed, heartbeats missed): kill it, so it is reaped
            # and respawned, and cannot come back half-alive.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        for reps in self._by_role.values():
            if rep in reps:
                reps.remove(rep)
        if rep.ready is not None and not rep.ready.done():
            reason = why
            err_file = os.path.join(self._tmp, f"{rep.replica_id}.err")
            with contextlib.suppress(OSError), open(err_file) as f:
                reason = f.read(4000).strip() or why
            rep.ready.set_exception(
                OmniflowError(
                    f"worker {rep.replica_id} (role(s) {rep.roles}) died before ready: {reason}"
                )
            )
            rep.ready.exception()  # retrieved: nobody may be waiting any more
        if rep.leaving and not rep.held:
            logger.info("replica %s left (%s)", rep.replica_id, why)
        else:
            logger.warning("replica %s lost: %s", rep.replica_id, why)
        if rep.pid is not None:
            # Its pool is gone: consumers pulling from it over ZMQ would wait forever.
            lost = encode_msg(SourceLost(rep.address, rep.pid))
            for other in self._replicas.values():
                if other.alive:
                    other.out.put_nowait(lost)
        if rep.pool_nodes:
            nodes, rep.pool_nodes = rep.pool_nodes, set()
            task = asyncio.get_running_loop().create_task(self._forget_pools(nodes))
            self._meta_tasks.add(task)
            task.add_done_callback(self._meta_tasks.discard)
        for key in sorted(rep.held):
            p = self._pending.get(key)
            if p is None:
                continue
            if p.error is None:
                p.error = NodeError(
                    p.act.node,
                    f"replica lost: replica '{rep.replica_id}' of role "
                    f"'{p.core.c.specs[p.act.node].role}' was lost while running it ({why})",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                )
            self._replica_done(rep, key, None)
        rep.held.clear()
        if rep.process is None:  # nothing else would close a registry-found replica
            asyncio.get_running_loop().call_soon(self._discard, rep)

    def statistics(self) -> dict[str, int]:
        return {
            # Connected, not leaving: what calls can be routed to.
            "replicas": len({id(r) for reps in self._by_role.values() for r in reps if r.alive}),
            "remote_inflight": len(self._pending),
        }

    def wire_statistics(self) -> dict[str, Any]:
        """The authenticated wire and supervision, as seen by this front: messages accepted and
        dropped by reason, forged registry records ignored, replicas respawned per role and
        live replicas per role."""
        forged = self._registry.statistics().get("forged_records", 0) if self._registry else 0
        return {
            **self.wire.snapshot(),
            "forged_records": forged,
            "restarts": dict(sorted(self.restarts.items())),
            "live_replicas": {r: len(self._routable(r)) for r in sorted(self.roles)},
        }

    async def data_plane_stats(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """Each live replica's ``DataPlane.statistics()`` (plus its ``pid``), by replica id.

        A ``stats`` request rides the same connection as the replica's ``run``, ``release``
        and ``end_call`` messages, so the answer reflects every one sent before it. A replica
        that does not answer within ``timeout`` is left out.
        """
        loop = asyncio.get_running_loop()
        asked: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        for rep in self._replicas.values():
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
        out: dict[str, dict[str, int]] = {}
        for name, fut in asked.values():
            if fut.done():
                body = fut.result()
                out[name] = {**body["plane"], "pid": body["pid"]}
        return out


def resolve_connectors(
    plans: dict[str, Any],
    config: dict[Any, str] | None,
    remote_roles: frozenset[str],
    processes: list[ProcessSpec],
) -> dict[str, dict[str, str]]:
    """Per-edge connector choice, checked now: ``{dst node: {src node: connector}}``.

    ``config`` maps ``(src, dst)`` (or ``"src->dst"``) to one of CONNECTORS, plus an optional
    ``"default"``. An edge that its connector cannot carry is a GraphError: ``inproc`` needs
    both ends in one process (the front, or a process group with a single replica).
    """
    from omniflow._exceptions import GraphError
    from omniflow.data._plane import CONNECTORS

    if not config:
        return {}
    home: dict[str, str | None] = {}
    for spec in processes:
        for role in spec.roles:
            home[role] = spec.name if spec.replicas == 1 else None
    roles_of: dict[str, str] = {}
    edges: set[tuple[str, str]] = set()
    for plan in plans.values():
        for n, s in plan.specs.items():
            roles_of[n] = s.role
        edges.update((src, dst) for src, _f, dst, _g in plan.edges if src != "<input>")

    def place(node: str) -> str | None:
        role = roles_of[node]
        return home[role] if role in remote_roles else "<front>"

    def check(src: str, dst: str, conn: str) -> None:
        if conn not in CONNECTORS:
            raise GraphError(
                f"connector {conn!r} for edge {src} -> {dst} is unknown; use one of {CONNECTORS}",
                node=dst,
            )
        if conn == "inproc" and (place(src) is None or place(src) != place(dst)):
            raise GraphError(
                f"edge {src} -> {dst} crosses processes (placement puts them in different or "
                "replicated processes), so connector 'inproc' cannot carry it; use 'shm' "
                "(same host) or 'zmq'",
                node=dst,
            )

    out: dict[str, dict[str, str]] = {}
    default = config.get("default", "auto")
    explicit: dict[tuple[str, str], str] = {}
    for key, conn in config.items():
        if key == "default":
            continue
        if isinstance(key, str) and "->" in key:
            src, dst = (part.strip() for part in key.split("->", 1))
        elif isinstance(key, tuple) and len(key) == 2:
            src, dst = key
        else:
            raise GraphError(
                f"connectors key {key!r} is not an edge; write ('src.node', 'dst.node') or "
                "'src.node->dst.node'"
            )
        if (src, dst) not in edges:
            raise GraphError(
                f"connectors names edge {src} -> {dst}, which no graph of this runtime has",
                node=dst,
            )
        explicit[(src, dst)] = conn
    for src, dst in sorted(edges):
        conn = explicit.get((src, dst), default)
        if conn == "auto":
            continue
        check(src, dst, conn)
        out.setdefault(dst, {})[src] = conn
    return out
