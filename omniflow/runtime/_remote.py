"""Front side of the multi-process runtime: worker processes, replicas, load balancing.

The front keeps every call core (all scheduling decisions); a role placed in a worker only
changes *where* its methods run. ``RemoteRoles.submit`` sends a ``run`` to a replica chosen by
the node's load balancer; the replica's ``frame`` and ``done`` messages come back to the
runtime shell exactly as a local method's would. A replica that dies fails the activations it
held with a NodeError saying so, at once when the front spawned the process, and within the
registry's time-to-live otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import NodeError, OmniflowError, RuntimeClosedError, TransportError
from omniflow.data._plane import DEFAULT_THRESHOLD, DataPlane, DataRef
from omniflow.runtime._protocol import decode_msg, encode_msg
from omniflow.transport import connect

if TYPE_CHECKING:
    from omniflow.registry import ServiceRegistry
    from omniflow.runtime._call import Call
    from omniflow.runtime._core import Activation, CallCore

__all__ = ["Deploy", "ProcessSpec", "RemoteRoles", "plan_processes"]

logger = logging.getLogger("omniflow.remote")

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


class _RemoteHandle:
    """What ``act.task`` holds for a remote activation: ``cancel()`` asks its replicas."""

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
    ) -> None:
        self.processes = processes
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
        self._registry: ServiceRegistry | None = None
        self._watchers: list[asyncio.Task[Any]] = []
        self._tmp = tempfile.mkdtemp(prefix="omniflow-")
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.registry_url:
            from omniflow.registry import create_registry

            self._registry = create_registry(
                self.registry_url, heartbeat_interval=self.heartbeat_interval
            )
            await self._registry.start()
        n = itertools.count()
        starts = []
        for spec in self.processes:
            for i in range(spec.replicas):
                rid = f"{spec.name}-{i}-{self._token}"
                address = f"ipc://{self._tmp}/w{next(n)}.sock"
                starts.append(self._spawn(spec, rid, address))
        try:
            await asyncio.wait_for(asyncio.gather(*starts), self.start_timeout)
        except BaseException:
            await self.close()
            raise
        if self._registry is not None:
            loop = asyncio.get_running_loop()
            for role in sorted(self.roles):
                self._watchers.append(loop.create_task(self._watch(role)))

    async def _spawn(self, spec: ProcessSpec, rid: str, address: str) -> None:
        cmd = [sys.executable, "-m", "omniflow", "worker", *spec.modules]
        for role in spec.roles:
            cmd += ["--role", role]
        # --parent-pid: the worker leaves when this process is gone (it runs in a session
        # of its own, so nothing else would stop it after a crash of the front).
        cmd += ["--bind", address, "--replica-id", rid, "--parent-pid", str(os.getpid())]
        if self.registry_url:
            cmd += ["--registry", self.registry_url, "--heartbeat", str(self.heartbeat_interval)]
        # A session of its own: Ctrl-C in the front's terminal must not kill the workers
        # before the front drains; the front stops them itself.
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, start_new_session=True
        )
        rep = _Replica(rid, list(spec.roles), address, process=proc)
        self._replicas[rid] = rep
        rep.tasks.append(asyncio.get_running_loop().create_task(self._reap(rep)))
        await self._connect(rep)

    async def _connect(self, rep: _Replica) -> None:
        loop = asyncio.get_running_loop()
        rep.endpoint = connect(rep.address)
        if rep.ready is None:
            rep.ready = loop.create_future()
        rep.tasks.append(loop.create_task(self._write(rep)))
        rep.tasks.append(loop.create_task(self._read(rep)))
        rep.out.put_nowait(encode_msg("hello", {}))
        await rep.ready
        if rep.alive and not rep.leaving:  # a worker that is leaving says bye at once
            for role in rep.roles:
                self._by_role.setdefault(role, []).append(rep)

    async def close(self) -> None:
        self._closing = True
        for task in self._watchers:
            task.cancel()
        for task in list(self._background):
            task.cancel()
        for rep in list(self._replicas.values()):
            if rep.alive and rep.endpoint is not None and rep.process is not None:
                rep.out.put_nowait(encode_msg("stop", {}))
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
        self._replicas.clear()
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
        act.task = _RemoteHandle(self, key)
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
        body = {
            "c": call.call_id,
            "a": act.aid,
            "n": act.node,
            "k": kwargs,
            "s": call.session,
            "g": act.group,
            "q": act.seq[2],
            "gr": call.graph,
        }
        off = self._offload.get((call.graph, act.node))
        if off:
            body["off"] = off
            if self._threshold is not None:
                body["th"] = self._threshold
        conn = self._connectors.get(act.node)
        if conn:
            body["conn"] = conn
        try:
            frames = encode_msg("run", body)
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
        if self._pending[key].core.c.plan.params:
            self._call_replicas.setdefault(key[0], set()).update(targets)
        for rep in targets:
            rep.held.add(key)
            # A run started by a caller goes out at once (no writer wake-up on the way: the
            # hop's latency); runs made while a batch of replies is handled are queued, so
            # the writer sends them back to back and the workers receive them in batches.
            if not self._in_batch and rep.out.empty() and rep.endpoint is not None:
                try:
                    if rep.endpoint.try_send(frames):
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
                    rep.out.put_nowait(encode_msg("release", {"refs": owned}))
                    break

    def end_call(self, call_id: str) -> None:
        """Let the workers drop what a finished call left: params and data-plane blocks."""
        reps = self._call_replicas.pop(call_id, None)
        if reps:
            frames = encode_msg("end_call", {"c": call_id})
            for rep in reps:
                if rep.alive:
                    rep.out.put_nowait(frames)

    def close_session(self, session: str) -> None:
        frames = encode_msg("close_session", {"s": session})
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
        frames = encode_msg("cancel", {"c": key[0], "a": key[1]})
        for rep in p.replicas:
            if rep.alive:
                rep.out.put_nowait(frames)

    # ------------------------------------------------------------------ I/O

    async def _write(self, rep: _Replica) -> None:
        while True:
            frames = await rep.out.get()
            if frames is None:
                return
            try:
                await rep.endpoint.send(frames)
            except (TransportError, RuntimeClosedError) as exc:
                self._lost(rep, f"sending to it failed ({exc})")
                return

    async def _read(self, rep: _Replica) -> None:
        while True:
            try:
                batch = await rep.endpoint.recv_batch()
            except (RuntimeClosedError, TransportError, asyncio.CancelledError):
                return
            self._in_batch = True
            try:
                for _peer, frames in batch:
                    try:
                        self._on_message(rep, frames)
                    except (KeyError, TypeError, ValueError) as exc:  # a malformed body
                        logger.warning("replica %s sent a bad message: %r", rep.replica_id, exc)
            finally:
                self._in_batch = False

    def _on_message(self, rep: _Replica, frames: list[Any]) -> None:
        try:
            kind, body = decode_msg(frames)
        except Exception as exc:
            logger.warning("replica %s sent a bad message: %s", rep.replica_id, exc)
            return
        if kind == "frame":
            self._replica_frame(rep, body)
        elif kind == "frames":  # consecutive frames of one generator activation
            for frame in body["fs"]:
                self._replica_frame(rep, {"c": body["c"], "a": body["a"], "f": frame})
        elif kind == "done":
            if "f" in body:  # a coroutine's returned frame rides in its done
                self._replica_frame(rep, body)
            self._replica_done(rep, (body["c"], body["a"]), body["e"])
        elif kind == "bye":
            self._on_bye(rep)
        elif kind == "ready" and rep.ready is not None and not rep.ready.done():
            rep.pid = body.get("pid")
            rep.ready.set_result(None)
        elif kind == "stats":
            fut = self._stats_waiting.pop(body["r"], None)
            if fut is not None and not fut.done():
                fut.set_result(body)

    def _replica_frame(self, rep: _Replica, body: dict[str, Any]) -> None:
        p = self._pending.get((body["c"], body["a"]))
        if p is not None:
            frame = body["f"]
            if isinstance(frame, dict) and any(type(v) is DataRef for v in frame.values()):
                self._call_replicas.setdefault(p.call.call_id, set()).add(rep)
            self._on_frame(p.call, p.core, p.act, frame)

    def _replica_done(
        self, rep: _Replica | None, key: tuple[str, int], err: dict[str, Any] | None
    ) -> None:
        if rep is not None:
            rep.held.discard(key)
        p = self._pending.get(key)
        if p is None:
            return
        if rep in p.replicas:
            p.replicas.remove(rep)
        if err is not None and p.error is None:
            if err.get("cancel"):
                p.error = asyncio.CancelledError()
            else:
                p.error = NodeError(
                    p.act.node,
                    f"{err['t']}: {err['m']}",
                    call_id=p.call.call_id,
                    graph=p.call.graph,
                    exc_type=err["t"],
                )
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
            rep.out.put_nowait(encode_msg("bye", {}))

    async def _reap(self, rep: _Replica) -> None:
        assert rep.process is not None
        code = await rep.process.wait()
        rep.exit_code = code
        if not self._closing:
            self._lost(rep, f"its process exited with code {code}")

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
        for reps in self._by_role.values():
            if rep in reps:
                reps.remove(rep)
        if rep.ready is not None and not rep.ready.done():
            rep.ready.set_exception(OmniflowError(f"worker {rep.replica_id} died before ready"))
            rep.ready.exception()  # retrieved: nobody may be waiting any more
        if rep.leaving and not rep.held:
            logger.info("replica %s left (%s)", rep.replica_id, why)
        else:
            logger.warning("replica %s lost: %s", rep.replica_id, why)
        if rep.pid is not None:
            # Its pool is gone: consumers pulling from it over ZMQ would wait forever.
            lost = encode_msg("source_lost", {"addr": rep.address, "pid": rep.pid})
            for other in self._replicas.values():
                if other.alive:
                    other.out.put_nowait(lost)
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
                rep.out.put_nowait(encode_msg("stats", {"r": rid}))
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
