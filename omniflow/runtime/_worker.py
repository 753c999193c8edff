"""A worker process: hosts replicas of roles and runs their methods for front processes.

    omniflow worker graphs/fig3.py --role llm --registry redis://127.0.0.1:6379/0

The worker imports the graph modules, rebuilds its roles (``setup()`` runs here), binds a
ROUTER endpoint, registers each role in the registry (when one is given) and then runs every
``run`` message it receives, streaming frames back to the front that asked. It takes no
scheduling decision: buckets, ordering and liveness stay in the front's call core, so
semantics are the same as in-process by construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
from collections.abc import Iterable
from typing import Any

from omniflow._exceptions import OmniflowError, RuntimeClosedError, TransportError
from omniflow.data._plane import DataPlane, DataRef, PullClient, refs_in
from omniflow.dsl._context import ActivationContext, _current
from omniflow.dsl._graph import GlobalParameters
from omniflow.plan._parser import load_graphs, parse_graphs
from omniflow.runtime._params import SessionParams
from omniflow.runtime._protocol import decode_msg, encode_msg
from omniflow.transport import bind

__all__ = ["Worker", "run_worker"]

logger = logging.getLogger("omniflow.worker")

_Key = tuple[bytes | None, str, int]


#: Most frames of one generator activation sent in one ``frames`` message.
FRAME_BATCH = 64


class _Unsendable(OmniflowError):
    """A frame the codec cannot carry; the activation fails with this error."""


class Worker:
    """Serves the roles ``roles`` of the graphs in ``modules`` on ``address``."""

    def __init__(
        self,
        modules: Iterable[str],
        roles: Iterable[str],
        address: str,
        *,
        replica_id: str | None = None,
        registry: str | None = None,
        heartbeat_interval: float = 1.0,
        drain_timeout: float = 30.0,
        parent_pid: int | None = None,
    ) -> None:
        self.modules = list(modules)
        self.role_names = list(roles)
        self.address = address
        # The host name too: two containers each running a worker as pid 1 must not share
        # a replica id in the registry.
        self.replica_id = (
            replica_id or f"{'+'.join(self.role_names)}-{socket.gethostname()}-{os.getpid()}"
        )
        self.registry_url = registry
        self.heartbeat_interval = heartbeat_interval
        #: Longest wait, when leaving, for running activations to finish.
        self.drain_timeout = drain_timeout
        #: The front that spawned this worker (None: started by hand); gone -> leave.
        self.parent_pid = parent_pid
        self._methods: dict[str, Any] = {}
        self._generators: set[str] = set()
        self._roles: list[Any] = []
        self._factories: dict[str, GlobalParameters] = {}
        self._session_params: dict[str, SessionParams] = {}
        self._call_params: dict[str, SessionParams] = {}
        self._running: dict[_Key, Any] = {}
        self._out: asyncio.Queue[tuple[bytes | None, list[Any]] | None] = asyncio.Queue()
        self._stop = asyncio.Event()
        #: Fronts that said hello (they get a bye when this worker leaves).
        self._peers: set[bytes | None] = set()
        #: Fronts that have not answered our bye yet.
        self._unacked: set[bytes | None] = set()
        self._leaving = False
        #: Fields each running activation offloads to the data plane.
        self._offload: dict[_Key, Any] = {}
        self._payloads = itertools.count()
        self._puller = PullClient()
        #: This process's data plane (its pool is created on first offload).
        self.plane = DataPlane(pull=self._puller.pull)

    def _load(self) -> None:
        graphs = []
        for module in self.modules:
            graphs.extend(load_graphs(module))
        plans = parse_graphs(graphs)
        found: dict[str, Any] = {}
        for plan in plans.values():
            self._factories.update(plan.params)
            for node, spec in plan.specs.items():
                if spec.role in self.role_names:
                    role = plan.roles[spec.role]
                    found.setdefault(spec.role, role)
                    self._methods[node] = getattr(role, spec.method)
                    if spec.is_generator:
                        self._generators.add(node)
        missing = [r for r in self.role_names if r not in found]
        if missing:
            raise OmniflowError(
                f"worker: no graph in {self.modules} declares role(s) {missing}; roles there: "
                f"{sorted({s.role for p in plans.values() for s in p.specs.values()})}"
            )
        seen: set[int] = set()
        for role in found.values():
            if id(role) not in seen:
                seen.add(id(role))
                self._roles.append(role)

    async def run(self) -> None:
        """Load, set up, serve until ``stop`` (or SIGTERM), tear down."""
        self._load()
        for role in self._roles:
            await role.setup()
        endpoint = bind(self.address)
        self.plane.shm.source = endpoint.url
        registry = None
        try:
            if self.registry_url:
                from omniflow.registry import create_registry

                registry = create_registry(
                    self.registry_url, heartbeat_interval=self.heartbeat_interval
                )
                await registry.start()
                for name in self.role_names:
                    await registry.register(
                        name, self.replica_id, endpoint.url, {"pid": os.getpid()}
                    )
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGTERM, self._stop.set)
            writer = loop.create_task(self._write(endpoint))
            reader = loop.create_task(self._read(endpoint))
            orphaned = loop.create_task(self._watch_parent()) if self.parent_pid else None
            await self._stop.wait()
            if orphaned is not None:
                orphaned.cancel()
            await self._leave(registry)
            reader.cancel()
            for task in list(self._running.values()):
                task.cancel()
            for _ in range(100):
                if not self._running:
                    break
                await asyncio.sleep(0.01)
            await self._out.put(None)
            with contextlib.suppress(asyncio.CancelledError, TransportError):
                await asyncio.wait_for(writer, 2)
        finally:
            if registry is not None:
                with contextlib.suppress(Exception):
                    await registry.close()
            endpoint.close()
            self._puller.close()
            self.plane.close()
            for role in reversed(self._roles):
                try:
                    await role.teardown()
                except Exception:
                    logger.exception("teardown of %s failed", type(role).__name__)

    async def _watch_parent(self) -> None:
        """Leave when the front that spawned this worker is gone (killed, crashed)."""
        while os.getppid() == self.parent_pid:
            await asyncio.sleep(0.25)
        logger.warning("worker %s: its front (pid %s) is gone; leaving", self.replica_id,
                       self.parent_pid)  # fmt: skip
        self._stop.set()

    async def _leave(self, registry: Any) -> None:
        """Leave without failing anyone's work (SIGTERM, or ``stop`` from the front).

        Deregister first, so no front picks this worker any more; then say ``bye`` to every
        front: each stops routing here and answers ``bye``, which travels behind every run it
        sent, so after it nothing new comes from that front. Serve on until every front
        answered (at most a second: one that does not answer is gone) and every running
        activation ended (at most ``drain_timeout``), repeating ``bye`` every heartbeat
        interval to fronts that wait for work here, so they know it is alive.
        """
        if registry is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(registry.close(), 5)
        self._leaving = True
        self._unacked = set(self._peers)
        for peer in self._unacked:
            self._send(peer, "bye", {})
        loop = asyncio.get_running_loop()
        start = last_bye = loop.time()
        while loop.time() - start < self.drain_timeout:
            if loop.time() - start > 1.0:
                self._unacked.clear()
            if not self._unacked and not self._running:
                return
            if loop.time() - last_bye >= self.heartbeat_interval:
                last_bye = loop.time()
                for peer in {key[0] for key in self._running}:
                    self._send(peer, "bye", {})
            await asyncio.sleep(0.01)
        logger.warning(
            "worker %s: %d activations still running after %ss; cancelling them",
            self.replica_id,
            len(self._running),
            self.drain_timeout,
        )

    async def _write(self, endpoint: Any) -> None:
        while True:
            item = await self._out.get()
            if item is None:
                return
            peer, frames = item
            try:
                await endpoint.send(frames, peer=peer)
            except TransportError:
                logger.warning("worker %s: a front went away", self.replica_id)
                self._peers.discard(peer)
                self._unacked.discard(peer)

    async def _read(self, endpoint: Any) -> None:
        while True:
            try:
                batch = await endpoint.recv_batch()
            except (RuntimeClosedError, asyncio.CancelledError):
                return
            for peer, frames in batch:
                try:
                    kind, body = decode_msg(frames)
                    self._handle(peer, kind, body)
                except Exception as exc:  # malformed input never kills the worker
                    logger.warning("worker %s: dropped a bad message: %s", self.replica_id, exc)

    def _send(self, peer: bytes | None, kind: str, body: dict[str, Any]) -> None:
        self._out.put_nowait((peer, encode_msg(kind, body)))

    def _handle(self, peer: bytes | None, kind: str, body: Any) -> None:
        if kind == "run":
            self._start(peer, _checked_run(body))
        elif kind == "cancel":
            task = self._running.get((peer, body["c"], body["a"]))
            if task is not None:
                task.cancel()
        elif kind == "hello":
            self._peers.add(peer)
            self._send(
                peer,
                "ready",
                {"replica": self.replica_id, "roles": self.role_names, "pid": os.getpid()},
            )
            if self._leaving:
                self._send(peer, "bye", {})
        elif kind == "end_call":
            self._call_params.pop(body["c"], None)
            self.plane.cleanup(body["c"])
        elif kind == "release":
            for ref in body["refs"]:
                self.plane.release(ref)
        elif kind == "pull":
            try:
                data: Any = self.plane.serve_pull(body["h"])
                self._send(peer, "pulled", {"r": body["r"], "data": data})
            except Exception as exc:
                self._send(peer, "pull_failed", {"r": body["r"], "error": str(exc)})
        elif kind == "stats":
            self._send(
                peer,
                "stats",
                {"r": body["r"], "replica": self.replica_id, "pid": os.getpid(),
                 "plane": self.plane.statistics()},
            )  # fmt: skip
        elif kind == "source_lost":
            self._puller.lost(body["addr"], body["pid"])
        elif kind == "close_session":
            self._session_params.pop(body["s"], None)
        elif kind == "stop":
            self._stop.set()
        elif kind == "bye":
            self._unacked.discard(peer)
        else:
            raise TransportError(f"unknown message kind {kind!r}")

    def _params(self, session: str | None, call_id: str) -> SessionParams:
        table = self._session_params if session is not None else self._call_params
        key = session if session is not None else call_id
        p = table.get(key)
        if p is None:
            p = table[key] = SessionParams(self._factories)
        return p

    def _start(self, peer: bytes | None, body: dict[str, Any]) -> None:
        """Resolve data-plane refs among the inputs (waiting only for pulls), then run."""
        kwargs = body["k"]
        refs = [r for v in kwargs.values() for r in refs_in(v)]
        if refs:
            conn = body.get("conn") or {}
            key = (peer, body["c"], body["a"])
            if any(self.plane.needs_pull(r, conn.get(r.key[0], "auto")) for r in refs):
                task = asyncio.get_running_loop().create_task(self._pull_then_run(peer, body))
                self._running[key] = task
                return
            try:
                body["k"] = {f: self._resolve_now(v, conn) for f, v in kwargs.items()}
            except Exception as exc:
                self._done(peer, body["c"], body["a"], exc)
                return
        self._run(peer, body)

    def _resolve_now(self, value: Any, conn: dict[str, str]) -> Any:
        refs = refs_in(value)
        if not refs:
            return value
        if type(value) is list or type(value) is tuple:
            out = [
                self.plane.read_now(v, conn.get(v.key[0], "auto")) if v in refs else v
                for v in value
            ]
            return out if type(value) is list else tuple(out)
        return self.plane.read_now(value, conn.get(value.key[0], "auto"))

    async def _pull_then_run(self, peer: bytes | None, body: dict[str, Any]) -> None:
        key = (peer, body["c"], body["a"])
        conn = body.get("conn") or {}
        try:
            body["k"] = {f: await self._resolve(v, conn) for f, v in body["k"].items()}
        except BaseException as exc:
            self._running.pop(key, None)
            self._done(peer, body["c"], body["a"], exc)
            return
        self._running.pop(key, None)
        self._run(peer, body)

    async def _resolve(self, value: Any, conn: dict[str, str]) -> Any:
        if type(value) is DataRef:
            return await self.plane.get(value, conn.get(value.key[0], "auto"))
        if type(value) is list or type(value) is tuple:
            items = [await self._resolve(x, conn) for x in value]
            return items if type(value) is list else tuple(items)
        return value

    def _run(self, peer: bytes | None, body: dict[str, Any]) -> None:
        c, a, node = body["c"], body["a"], body["n"]
        off = body.get("off")
        if off:
            self._offload[(peer, c, a)] = (node, off, body.get("th"))
        method = self._methods.get(node)
        if method is None:
            self._done(peer, c, a, OmniflowError(f"node '{node}' is not hosted by this worker"))
            return
        ctx = ActivationContext(
            graph=body["gr"],
            session=body["s"],
            call_id=c,
            node=node,
            or_group=body["g"],
            params=self._params(body["s"], c),
            seq=body["q"],
            aid=a,
        )
        token = _current.set(ctx)
        loop = asyncio.get_running_loop()
        try:
            key = (peer, c, a)
            if node in self._generators:
                try:
                    agen = method(**body["k"])
                except Exception as exc:
                    self._done(peer, c, a, exc)
                    return
                self._running[key] = loop.create_task(self._drive(key, agen))
                return
            try:
                coro = method(**body["k"])
                fut = coro.send(None)
            except StopIteration as stop:
                self._done(peer, c, a, None, stop.value)
                return
            except (Exception, asyncio.CancelledError) as exc:
                self._done(peer, c, a, exc)
                return
            from omniflow.runtime._runtime import _await_continue, _Continue

            task = loop.create_task(_await_continue(_Continue(coro, fut)))
            self._running[key] = task
            task.add_done_callback(lambda t: self._finished(key, coro, t))
        finally:
            _current.reset(token)

    def _finished(self, key: _Key, coro: Any, task: asyncio.Task[Any]) -> None:
        self._running.pop(key, None)
        peer, c, a = key
        if task.cancelled():
            coro.close()
            self._done(peer, c, a, asyncio.CancelledError())
            return
        exc = task.exception()
        self._done(peer, c, a, exc, None if exc is not None else task.result())

    async def _drive(self, key: _Key, agen: Any) -> None:
        """Run a generator method. Frames yielded within one event-loop turn leave as one
        ``frames`` message (at most FRAME_BATCH each): a stream that does not pause costs the
        front one message per batch, and one that pauses still sends each frame at once."""
        peer, c, a = key
        exc: BaseException | None = None
        batch: list[Any] = []
        state: dict[str, Any] = {"scheduled": False, "error": None}

        def flush() -> None:
            state["scheduled"] = False
            if not batch:
                return
            frames = batch[:]
            batch.clear()
            try:
                if len(frames) == 1:
                    self._send(peer, "frame", {"c": c, "a": a, "f": frames[0]})
                else:
                    self._send(peer, "frames", {"c": c, "a": a, "fs": frames})
            except Exception as e:  # a value the wire cannot carry fails the activation
                state["error"] = _Unsendable(f"a frame could not be sent to the front: {e}")

        loop = asyncio.get_running_loop()
        try:
            async for frame in agen:
                batch.append(self._placed(peer, c, a, frame))
                if len(batch) >= FRAME_BATCH:
                    flush()
                elif not state["scheduled"]:
                    state["scheduled"] = True
                    loop.call_soon(flush)
                if state["error"] is not None:
                    raise state["error"]
            flush()
            if state["error"] is not None:
                raise state["error"]
        except _Unsendable as e:
            exc = e
            with contextlib.suppress(BaseException):
                await agen.aclose()
        except asyncio.CancelledError as e:
            exc = e
        except Exception as e:
            exc = e
        finally:
            self._running.pop(key, None)
            if exc is not None:
                flush()  # frames yielded before the failure still reach the front, in order
        self._done(peer, c, a, exc)

    def _placed(self, peer: bytes | None, c: str, a: int, frame: Any) -> Any:
        """``frame`` with the outputs this activation offloads put in the data plane."""
        off = self._offload.get((peer, c, a))
        if off is not None and isinstance(frame, dict):
            try:
                return self.plane.offload(off[0], c, a, next(self._payloads), frame, off[1], off[2])
            except Exception as exc:
                raise _Unsendable(f"a frame could not be placed in the data plane: {exc}") from exc
        return frame

    def _frame(self, peer: bytes | None, c: str, a: int, frame: Any) -> None:
        frame = self._placed(peer, c, a, frame)
        try:
            self._send(peer, "frame", {"c": c, "a": a, "f": frame})
        except Exception as exc:  # a value the wire cannot carry fails the activation
            raise _Unsendable(f"a frame could not be sent to the front: {exc}") from exc

    def _done(
        self,
        peer: bytes | None,
        c: str,
        a: int,
        exc: BaseException | None,
        frame: Any = None,
    ) -> None:
        """Say the activation ended; a coroutine's returned ``frame`` (not None) rides along,
        one message instead of ``frame`` + ``done`` (the front applies it first)."""
        if exc is None and frame is not None:
            try:
                body = {"c": c, "a": a, "e": None, "f": self._placed(peer, c, a, frame)}
                self._out.put_nowait((peer, encode_msg("done", body)))
            except _Unsendable as e:
                exc = e
            except Exception as e:  # a value the wire cannot carry fails the activation
                exc = _Unsendable(f"a frame could not be sent to the front: {e}")
            else:
                self._offload.pop((peer, c, a), None)
                return
        self._offload.pop((peer, c, a), None)
        err = None
        if exc is not None:
            err = {
                "t": type(exc).__name__,
                "m": str(exc),
                "cancel": isinstance(exc, asyncio.CancelledError),
            }
        self._send(peer, "done", {"c": c, "a": a, "e": err})


#: Field -> type of a ``run`` body (``s``, the session, is a str or None).
_RUN_FIELDS: dict[str, type] = {
    "c": str, "a": int, "n": str, "k": dict, "g": int, "q": int, "gr": str,
}  # fmt: skip


def _checked_run(body: Any) -> dict[str, Any]:
    """``body`` if it is a well-formed ``run``; else TransportError (the message is dropped)."""
    if not isinstance(body, dict):
        raise TransportError(f"malformed run: a {type(body).__name__} body, not a dict")
    for name, typ in _RUN_FIELDS.items():
        value = body.get(name)
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise TransportError(f"malformed run: {name!r} must be a {typ.__name__}: {value!r:.80}")
    if body.get("s") is not None and not isinstance(body["s"], str):
        raise TransportError(f"malformed run: 's' must be a str or None: {body['s']!r:.80}")
    if not all(isinstance(k, str) for k in body["k"]):
        raise TransportError("malformed run: 'k' must map argument names (str) to values")
    return body


def run_worker(
    modules: list[str],
    roles: list[str],
    address: str,
    *,
    replica_id: str | None = None,
    registry: str | None = None,
    heartbeat_interval: float = 1.0,
    drain_timeout: float = 30.0,
    parent_pid: int | None = None,
) -> int:
    """Entry point of ``omniflow worker``: serve until SIGTERM or a ``stop`` message."""

    async def main() -> None:
        worker = Worker(
            modules,
            roles,
            address,
            replica_id=replica_id,
            registry=registry,
            heartbeat_interval=heartbeat_interval,
            drain_timeout=drain_timeout,
            parent_pid=parent_pid,
        )
        await worker.run()

    asyncio.run(main())
    return 0
