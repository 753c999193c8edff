"""A worker process: hosts replicas of roles and runs their methods for front processes.

    omniflow worker graphs/fig3.py --role llm --registry redis://127.0.0.1:6379/0

The worker imports the graph modules, rebuilds its roles (``setup()`` runs here), binds a
ROUTER endpoint, registers each role in the registry (when one is given) and then runs every
``run`` message it receives, streaming frames back to the front that asked. It takes no
scheduling decision: buckets, ordering and liveness stay in the front's call core, so
semantics are the same as in-process by construction.

Every message it takes must carry a valid MAC under the cluster key (``$OMNIFLOW_CLUSTER_KEY``
or ``--cluster-key-file``; checked before anything is decoded) and a fresh counter; control
messages act only on what the sending front owns (its activations, the calls whose state it
made here; ``stop`` only from the front that spawned this worker). Drops are counted by
reason and answered in ``StatsReply.wire``. It heartbeats every front that said hello.

The fast path (``_forward``): a run may name downstream nodes this worker starts itself on
their worker (``Forward``), frame by frame, telling the front which it forwarded; a forwarded
run is served like one from the front it names, whose peer gets its frames and done.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import os
import signal
import socket
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

from omniflow._exceptions import OmniflowError, RuntimeClosedError, TransportError
from omniflow._loader import load_graphs
from omniflow.data._handle import BlockHandle
from omniflow.data._plane import DataPlane, PullClient
from omniflow.data._ref import DataRef, refs_in
from omniflow.data.kv._hosted import HostedMetadata
from omniflow.dsl._context import ActivationContext, _current
from omniflow.dsl._graph import GlobalParameters
from omniflow.plan._parser import parse_graphs
from omniflow.runtime._batcher import BatchEntry, Batcher
from omniflow.runtime._drive import drive, eager_task, generator_end
from omniflow.runtime._forward import Route, parse_routes, wire_id
from omniflow.runtime._launch import START_ERROR_ENV
from omniflow.runtime._params import SessionParams
from omniflow.runtime._setup import setup_role
from omniflow.runtime._tracing import attach_traceparent
from omniflow.transport import bind, connect, run_loop
from omniflow.transport._auth import (
    Opener,
    PlainOpener,
    PlainSealer,
    Sealer,
    WireStats,
    opener_for,
    resolve_key,
    sealer_for,
)
from omniflow.transport._base import MAX_DELIVERY, Packet
from omniflow.transport._protocol import (
    MAX_BATCH,
    Batch,
    Bye,
    CallEnded,
    Cancel,
    Claim,
    Claimed,
    CloseSession,
    Done,
    Dones,
    EndCall,
    Forward,
    Forwards,
    Frame,
    Frames,
    Heartbeat,
    Hello,
    Message,
    MetaCall,
    MetaNotify,
    MetaReply,
    ProtocolError,
    Pull,
    Pulled,
    PullFailed,
    Ready,
    Release,
    Run,
    SourceLost,
    StatsReply,
    StatsRequest,
    Stop,
    batch,
    decode_inner,
    decode_msg,
    encode_fields,
    encode_msg,
)

__all__ = ["Worker", "run_worker"]

logger = logging.getLogger("omniflow.worker")

_Key = tuple[bytes | None, str, int | str]

_new = tuple.__new__

#: Values a forward may carry in a ``Forwards`` (encoded at the flush): immutable, so what
#: leaves is what the frame held when it was forwarded. Others are encoded at once, alone.
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


#: Most frames of one generator activation sent in one ``frames`` message.
FRAME_BATCH = 64

#: Most cancels kept for forwarded runs that had not arrived when their cancel did (the
#: oldest is forgotten first: a cancel whose forward never comes costs one entry a while).
CANCELLED_EARLY = 4096


class _Fw:
    """The fast-path routes of one running activation, and its next frame index."""

    __slots__ = ("a", "c", "ft", "gr", "k", "q", "routes", "s", "tp")

    def __init__(self, routes: tuple[Route, ...], run: Run, ft: str) -> None:
        self.routes = routes
        #: The run's traceparent: its forwards carry it on (None: not traced).
        self.tp = run.tp
        self.c = run.c
        self.a = run.a
        self.s = run.s
        self.gr = run.gr
        self.q = run.q
        self.ft = ft
        self.k = 0


class _Link:
    """This worker's connection to another worker it forwards runs to (one per address)."""

    __slots__ = ("endpoint", "out", "sealer", "writer")

    def __init__(self, endpoint: Any, sealer: Sealer | PlainSealer) -> None:
        self.endpoint = endpoint
        self.sealer = sealer
        #: Messages that could not go out at once, in order (the writer sends them).
        self.out: deque[list[Any]] = deque()
        self.writer: asyncio.Task[None] | None = None


class _Unsendable(OmniflowError):
    """A frame the codec cannot carry; the activation fails with this error."""

    @classmethod
    def sending(cls, exc: Exception) -> _Unsendable:
        return cls(f"a frame could not be sent to the front: {exc}")


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
        cluster_key: bytes | None = None,
        owner: str | None = None,
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
        self._pools: dict[str, Any] = {}
        self._pool_view = MappingProxyType(self._pools)
        self._pool_releases: set[asyncio.Task[Any]] = set()
        self._role_names_of: dict[int, str] = {}
        self._factories: dict[str, GlobalParameters] = {}
        self._session_params: dict[str, SessionParams] = {}
        self._call_params: dict[str, SessionParams] = {}
        self._running: dict[_Key, Any] = {}
        #: node -> its batcher, for the batched nodes hosted here (``batch=``): one per node,
        #: shared by every front, call and session this replica serves.
        self._batchers: dict[str, Batcher] = {}
        #: Cancels of forwarded runs that were not here yet: the front's cancel and the
        #: upstream worker's forward come on different connections, so the cancel can be
        #: read first. Such a run, when it comes, ends cancelled without running.
        self._cancelled_early: dict[_Key, None] = {}
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
        key = cluster_key if cluster_key is not None else resolve_key(generate=False)[0]
        #: Accepted and dropped messages (bad MAC, replay, malformed, unknown, foreign).
        self.wire = WireStats()
        self._key = key
        #: Under the key, or plain once the endpoint is bound if its connections are
        #: authenticated (``uds://``: each proved the key when it was made).
        self._sealer: Sealer | PlainSealer = Sealer(key)
        self._opener: Opener | PlainOpener = Opener(key, self.wire)
        #: The front that spawned this worker (its Hello says so); only it may ``stop`` it.
        self.owner = owner
        #: Peer -> the front token its Hello carried, and back.
        self._fronts: dict[bytes | None, str] = {}
        self._front_peers: dict[str, bytes | None] = {}
        #: Running activation -> its fast-path routes (only runs that have some).
        self._fw: dict[_Key, _Fw] = {}
        #: Hosted node -> the fast-path routes last parsed for its runs (raw, parsed).
        self._routes_seen: dict[str, tuple[list[Any], tuple[Route, ...]]] = {}
        #: Address -> connection to the worker there (fast-path forwards).
        self._links: dict[str, _Link] = {}
        #: Addresses of workers a front said are lost (``SourceLost``): nothing is forwarded
        #: there (the front runs those runs the slow way) until a front's run routes there again.
        self._gone: set[str] = set()
        #: The bound endpoint (sends to fronts go straight out when nothing waits before them).
        self._endpoint: Any = None
        #: The writer holds a message it has not sent yet.
        self._writing = False
        #: Handling a batch of received messages: what they make waits here, per peer or
        #: link address, and leaves as few messages as possible when the batch is handled
        #: (consecutive good ends to one peer gather in a ``_DoneBatch``: one ``Dones``).
        self._reading = False
        #: The context each method's runs in a copy of (``run`` takes it again, before setup).
        self._ctx = contextvars.copy_context()
        for batcher in self._batchers.values():
            batcher.base = self._ctx
        #: Handling a batch of one run (a chain's hop): nothing to gather, so its end leaves
        #: as it is made and its forwards right after it (``_take``), here meanwhile.
        self._direct = False
        self._after_end: list[tuple[str, list[Any]]] = []
        self._held: dict[bytes | None, list[list[Any] | _DoneBatch]] = {}
        #: (consecutive forwards to one link that differ only in id, value and SeqId index
        #: gather in a ``_FwdBatch``: one ``Forwards``).
        self._held_links: dict[str, list[list[Any] | _FwdBatch]] = {}
        #: Peer -> heartbeat interval it asked for.
        self._intervals: dict[bytes | None, float] = {}
        #: Call id -> the peer whose runs made call-scoped state here (params, pool blocks):
        #: only it may end the call or release its blocks.
        self._call_owner: dict[str, bytes | None] = {}
        #: Graphs with GlobalParameters (only their calls get per-call params here).
        self._param_graphs: set[str] = set()
        self._no_params = SessionParams({})
        #: The Params Pools' metadata hosted by the front that spawned this worker (pools
        #: with metadata=None use it; attached when that front says hello).
        self._hosted: HostedMetadata | None = HostedMetadata() if owner is not None else None
        self._hosted_peer: bytes | None = None
        self._puller = PullClient(key, self.wire)
        #: This process's data plane (its pool is created on first offload).
        self.plane = DataPlane(pull=self._puller.pull)

    def _load(self) -> None:
        graphs = []
        for module in self.modules:
            graphs.extend(load_graphs(module))
        plans = parse_graphs(graphs)
        for g in graphs:  # Params Pools: this process's own instances (metadata shares them)
            for pool in g.pools:
                if self._pools.setdefault(pool.name, pool) is pool and self._hosted is not None:
                    pool.use_metadata(self._hosted)
                pool.set_cluster_key(self._key)  # pulls between pools use the cluster key too
        found: dict[str, Any] = {}
        for gname, plan in plans.items():
            self._factories.update(plan.params)
            if plan.params:
                self._param_graphs.add(gname)
            for node, spec in plan.specs.items():
                if spec.role in self.role_names:
                    role = plan.roles[spec.role]
                    found.setdefault(spec.role, role)
                    self._methods[node] = getattr(role, spec.method)
                    if spec.is_generator:
                        self._generators.add(node)
                    if spec.batch is not None and node not in self._batchers:
                        self._batchers[node] = Batcher(node, self._methods[node], spec.batch)
        missing = [r for r in self.role_names if r not in found]
        if missing:
            raise OmniflowError(
                f"worker: no graph in {self.modules} declares role(s) {missing}; roles there: "
                f"{sorted({s.role for p in plans.values() for s in p.specs.values()})}"
            )
        seen: set[int] = set()
        for rname, role in found.items():
            if id(role) not in seen:
                seen.add(id(role))
                self._roles.append(role)
                if self._pools:
                    role.pools = self._pool_view
                self._role_names_of[id(role)] = rname

    async def run(self) -> None:
        """Load, set up, serve until ``stop`` (or SIGTERM), tear down."""
        from omniflow.dsl._context import Colocation
        from omniflow.runtime._launch import colocation_key

        # Methods run in copies of this context (taken before any setup() could add to it).
        self._ctx = contextvars.copy_context()
        try:
            self._load()
            facts = Colocation(frozenset(self.role_names), colocation_key())
            for role in self._roles:
                await setup_role(self._role_names_of[id(role)], role.setup, facts)
        except Exception as exc:
            # The front that spawned this worker reads why it did not start from here.
            path = os.environ.get(START_ERROR_ENV)
            if path:
                with contextlib.suppress(OSError), open(path, "w") as f:
                    f.write(str(exc))
            raise
        endpoint = self._endpoint = bind(self.address, key=self._key)
        self._sealer = sealer_for(endpoint, self._key)
        self._opener = opener_for(endpoint, self._key, self.wire)
        self.plane.shm.source = endpoint.url
        registry = None
        try:
            if self.registry_url:
                from omniflow.registry import create_registry

                registry = create_registry(
                    self.registry_url, heartbeat_interval=self.heartbeat_interval, key=self._key
                )
                await registry.start()
                for name in self.role_names:
                    await registry.register(
                        name, self.replica_id, endpoint.url, {"pid": os.getpid()}
                    )
            loop = asyncio.get_running_loop()
            # Not in a Ray actor's thread: asyncio says RuntimeError, uvloop (which Ray's
            # workers use when it is installed) ValueError.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signal.SIGTERM, self._stop.set)
            writer = loop.create_task(self._write(endpoint))
            # Messages are handled in the loop's reader callback where the transport can
            # (uds://: no task wakes up per burst), else by a task that receives them.
            reader = None
            if not endpoint.set_receiver(self._take):
                reader = loop.create_task(self._read(endpoint))
            orphaned = loop.create_task(self._watch_parent()) if self.parent_pid else None
            beating = loop.create_task(self._heartbeat())
            await self._stop.wait()
            beating.cancel()
            if orphaned is not None:
                orphaned.cancel()
            await self._leave(registry)
            if reader is not None:
                reader.cancel()
            else:
                endpoint.set_receiver(None)
            for task in list(self._running.values()):
                task.cancel()
            for batcher in self._batchers.values():
                batcher.close()
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
            for link in self._links.values():
                if link.writer is not None:
                    link.writer.cancel()
                link.endpoint.close()
            self._links.clear()
            self._puller.close()
            self.plane.close()
            for role in reversed(self._roles):
                try:
                    await role.teardown()
                except Exception:
                    logger.exception("teardown of %s failed", type(role).__name__)

    async def _watch_parent(self) -> None:
        """Leave when the front that started this worker is gone (killed, crashed). Where
        pidfds exist (Linux) its pidfd says so, with no polling; a worker forked by a fork
        server (``_forkserver``) is not the front's child, so the parent cannot tell. Else
        the front is the parent, and the parent changes when it dies."""
        assert self.parent_pid is not None
        try:
            pidfd = os.pidfd_open(self.parent_pid)
        except ProcessLookupError:
            pidfd = None  # gone already
        except (AttributeError, OSError):  # no pidfds here
            while os.getppid() == self.parent_pid:
                await asyncio.sleep(0.25)
            pidfd = None
        if pidfd is not None:
            loop = asyncio.get_running_loop()
            gone: asyncio.Future[None] = loop.create_future()

            def exited() -> None:  # (readable once it exited, and from then on each turn)
                if not gone.done():
                    gone.set_result(None)

            loop.add_reader(pidfd, exited)
            try:
                await gone
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
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
            self._send(peer, Bye())
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
                    self._send(peer, Bye())
            await asyncio.sleep(0.01)
        logger.warning(
            "worker %s: %d activations still running after %ss; cancelling them",
            self.replica_id,
            len(self._running),
            self.drain_timeout,
        )

    async def _write(self, endpoint: Any) -> None:
        while True:
            self._writing = False
            item = await self._out.get()
            if item is None:
                return
            self._writing = True
            peer, frames = item
            try:
                await endpoint.send(self._sealer.seal(frames), peer=peer)
            except TransportError:
                logger.warning("worker %s: a front went away", self.replica_id)
                if self._hosted is not None and peer == self._hosted_peer:
                    self._hosted.detach("the front that hosts the pools' metadata went away")
                self._peers.discard(peer)
                self._unacked.discard(peer)

    async def _read(self, endpoint: Any) -> None:
        while True:
            try:
                batch = await endpoint.recv_batch()
            except (RuntimeClosedError, asyncio.CancelledError):
                return
            for i in range(0, len(batch), MAX_DELIVERY):
                if i:
                    await asyncio.sleep(0)  # a flood must not starve heartbeats and runs
                self._take(batch[i : i + MAX_DELIVERY])

    def _take(self, batch: list[Packet]) -> None:
        """Handle received messages; what they make leaves once all are handled, batched.
        A batch of one ``Run`` or ``Forward`` (each hop of a chain) has nothing to batch
        with: what it makes leaves at once (``_direct``), the same messages as from the
        flush, but its end first and its forwards right after (docs/fast-path.md, *A batch
        of one run*): the front accounts for the hop while the next worker runs."""
        self._reading = True
        try:
            for peer, frames in batch:
                inner = self._opener.open(frames)
                if inner is None:
                    self._dropped(None)
                    continue
                try:
                    msg = decode_msg(inner)
                    if type(msg) is Batch:
                        for m in msg.ms:
                            self._handle_one(peer, decode_inner, m)
                    else:
                        if (
                            (type(msg) is Run or type(msg) is Forward)
                            and len(batch) == 1
                            and not self._held
                            and not self._held_links  # (a generator's, due at turn's end)
                        ):
                            self._reading, self._direct = False, True
                        self._handle(peer, msg)
                except ProtocolError as exc:
                    self._dropped(exc.reason, exc)
                except Exception as exc:  # a bad message never kills the worker
                    self._dropped("malformed", exc)
        finally:
            self._reading = self._direct = False
            if self._after_end:
                after, self._after_end = self._after_end, []
                for address, envelope in after:
                    self._link_send(address, envelope)
            self._flush_held()

    def _handle_one(self, peer: bytes | None, decode: Callable[[Any], Message], m: Any) -> None:
        """Decode and handle one message of a batch (a bad one is dropped alone)."""
        try:
            self._handle(peer, decode(m))
        except ProtocolError as exc:
            self._dropped(exc.reason, exc)
        except Exception as exc:  # a bad message never kills the worker
            self._dropped("malformed", exc)

    def _flush_held(self) -> None:
        """Send what the handled messages made: per peer and link, batched, in order."""
        # Forwards first: they are the next hop's critical path; the fronts only account.
        if self._held_links:
            held_links, self._held_links = self._held_links, {}
            for address, items in held_links.items():
                for frames in batch(_envelopes(items)):
                    self._link_send(address, frames)
        if self._held:
            held_peers, self._held = self._held, {}
            for peer, waiting in held_peers.items():
                for frames in batch(_envelopes(waiting)):
                    self._put(peer, frames)

    def _dropped(self, reason: str | None, exc: BaseException | None = None) -> None:
        """A message was dropped (counted, and logged now and then)."""
        self.wire.dropped_message(logger, f"worker {self.replica_id}", reason, exc)

    async def _heartbeat(self) -> None:
        """Tell every front that said hello that this worker lives, as often as it asked."""
        plain = encode_msg(Heartbeat())
        while True:
            interval = min(self._intervals.values(), default=self.heartbeat_interval)
            await asyncio.sleep(max(0.01, interval))
            # A worker with batched nodes says how its batchers do (the front's /metrics).
            beat = encode_msg(Heartbeat(self.batch_stats())) if self._batchers else plain
            for peer in self._peers:
                self._out.put_nowait((peer, beat))

    def _send(self, peer: bytes | None, msg: Message) -> None:
        self._put(peer, encode_msg(msg))

    def _put(self, peer: bytes | None, frames: list[Any]) -> None:
        """Send ``frames`` to ``peer``: at once when nothing waits before it (no writer
        wake-up on a hop's critical path), else behind what waits, in order."""
        if self._reading or self._held_links:
            # (Forwards held to the end of this loop turn, whose flush is due, leave first:
            # a front that had this message first could cancel a run not sent yet.)
            self._held.setdefault(peer, []).append(frames)
            return
        endpoint = self._endpoint
        if not self._writing and self._out.empty() and endpoint is not None:
            try:
                # A refused try used a counter the writer skips: gaps are allowed.
                if endpoint.try_send(self._sealer.seal(frames), peer=peer):
                    return
            except (TransportError, RuntimeClosedError):
                pass  # the writer meets the same error and forgets the peer
        self._out.put_nowait((peer, frames))

    def _handle(self, peer: bytes | None, msg: Message) -> None:
        match msg:
            case Run():
                self._start(peer, _checked(msg))
            case Forwards():
                self._forwards(msg)
            case Forward(ft=ft, rid=rid):
                if self._for_here(ft, rid):
                    self._start(self._front_peers[ft], _checked(_new(Run, msg[2:])))
            case Cancel(c=c, a=a):
                task = self._running.get((peer, c, a))
                if task is not None:
                    task.cancel()
                elif type(a) is str:  # a forwarded run whose forward has not come (yet)
                    self._cancel_early((peer, c, a))
            case Claim(r=r, c=c, ws=ws):
                # Answered outside this batch: what the lost forwarder wrote to this worker
                # before it went is read (and started) first (``_claimed``).
                asyncio.get_running_loop().call_soon(self._claimed, peer, r, c, ws)
            case Hello(front=front, interval=interval):
                self._peers.add(peer)
                self._fronts[peer] = front
                self._front_peers[front] = peer
                if 0 < interval < 3600:  # (NaN and inf are not)
                    self._intervals[peer] = interval
                self._send(peer, Ready(self.replica_id, self.role_names, os.getpid()))
                if self._hosted is not None and front == self.owner:
                    self._hosted_peer = peer
                    self._hosted.attach(lambda r, op, args: self._send(peer, MetaCall(r, op, args)))
                if self._leaving:
                    self._send(peer, Bye())
            case EndCall(c=c, ack=ack):
                held = []
                if self._owns(peer, c):
                    del self._call_owner[c]
                    self._call_params.pop(c, None)
                    self.plane.cleanup(c)
                    held = [p for p in self._pools.values() if p.holds(c)]  # pages pinned here
                if held:
                    task = asyncio.get_running_loop().create_task(
                        self._release_pools(peer, c, held, ack)
                    )
                    self._pool_releases.add(task)
                    task.add_done_callback(self._pool_releases.discard)
                elif ack:
                    self._send(peer, CallEnded(c))
            case Release(refs=refs):
                for ref in refs:
                    if type(ref) is not DataRef:
                        self._dropped("malformed", TransportError("release of a non-DataRef"))
                    elif self._owns(peer, ref.key[1]):
                        self.plane.release(ref)
            case Pull(r=r, h=h):
                try:
                    if type(h) is not BlockHandle:
                        raise TransportError(f"a pull names a {type(h).__name__}, not a block")
                    self._send(peer, Pulled(r, self.plane.serve_pull(h)))
                except Exception as exc:
                    self._send(peer, PullFailed(r, str(exc)))
            case StatsRequest(r=r):
                self._send(
                    peer,
                    StatsReply(
                        r,
                        self.replica_id,
                        os.getpid(),
                        self.plane.statistics(),
                        self.wire.snapshot(),
                        {
                            "running": len(self._running),
                            "calls": len(self._call_owner),
                            "forwarding": len(self._fw),
                            "links": len(self._links),
                            "link_queued": sum(len(link.out) for link in self._links.values()),
                        },
                    ),
                )
            case SourceLost(addr=addr, pid=pid):
                self._puller.lost(addr, pid)
                self._link_lost(addr)
            case CloseSession(s=session):
                self._session_params.pop(session, None)
                for pool in self._pools.values():
                    task = asyncio.get_running_loop().create_task(pool.close_session(session))
                    self._pool_releases.add(task)
                    task.add_done_callback(self._pool_releases.discard)
            case Stop():
                if self.owner is not None and self._fronts.get(peer) == self.owner:
                    self._stop.set()
                else:
                    self._dropped(
                        "foreign",
                        TransportError("stop from a front that did not spawn this worker"),
                    )
            case MetaNotify(p=pool, s=session, keys=keys):
                if self._hosted is not None and peer == self._hosted_peer:
                    if all(type(k) is str for k in keys):
                        self._hosted.notify(pool, session, keys)
                    else:
                        self._dropped("malformed", TransportError("notify of non-str hashes"))
                else:
                    self._dropped("foreign", TransportError("notify from another front"))
            case MetaReply(r=r, v=v, e=e):
                if (
                    self._hosted is not None
                    and self._hosted.attached
                    and (peer == self._hosted_peer)
                ):
                    self._hosted.reply(r, v, e)
                else:
                    self._dropped("foreign", TransportError("metadata reply from another front"))
            case Bye():
                self._unacked.discard(peer)
            case _:
                self._dropped(
                    "unknown_kind", TransportError(f"a worker does not take {type(msg).__name__}")
                )

    def _claimed(self, peer: bytes | None, r: int, c: str, ws: list[Any]) -> None:
        """Answer ``peer``'s claim ``r``: which forwarded runs ``ws`` of call ``c`` are not
        here (neither running nor pulling their inputs). Each of those is then kept as
        cancelled early: should its forward still come, it ends at once without running,
        so the front may fail it now (its forwarder was lost) and no method runs for it."""
        if self._endpoint is not None:
            self._endpoint.drain()  # (the runs already here start first)
        missing = []
        for wid in ws:
            if type(wid) is not str:
                self._dropped("malformed", TransportError(f"a claim of {wid!r:.40}"))
                continue
            key = (peer, c, wid)
            if key not in self._running:
                missing.append(wid)
                self._cancel_early(key)
        self._send(peer, Claimed(r, c, missing))

    def _cancel_early(self, key: _Key) -> None:
        """Forwarded run ``key`` is cancelled before it came: if it comes, it ends at once as
        cancelled (CANCELLED_EARLY kept at most, the oldest forgotten first)."""
        early = self._cancelled_early
        early[key] = None
        if len(early) > CANCELLED_EARLY:
            del early[next(iter(early))]

    def _for_here(self, ft: str, rid: str) -> bool:
        """Whether a forward for replica ``rid`` on behalf of front ``ft`` is this replica's
        to serve (else it is dropped and counted as foreign)."""
        if rid != self.replica_id:
            self._dropped("foreign", TransportError(
                f"a forward for replica {rid!r:.60}, which this one ({self.replica_id}) "
                "is not"))  # fmt: skip
            return False
        if ft not in self._front_peers:
            self._dropped(
                "foreign",
                TransportError(f"a forward on behalf of front {ft!r:.40}, which never said hello"),
            )
            return False
        return True

    def _forwards(self, msg: Forwards) -> None:
        """Serve each record of ``msg`` as the ``Forward`` it stands for, in order (a bad
        record is dropped alone)."""
        ft, rid, c, n, f, s, g, gr, as_, vs, qs, off, th, conn, fw, tp = msg
        if len(vs) != len(as_) or len(qs) != len(as_):
            self._dropped("malformed", TransportError("forwards: lists of unlike lengths"))
            return
        if not self._for_here(ft, rid):
            return
        front = self._front_peers[ft]
        for a, v, q in zip(as_, vs, qs, strict=True):
            if type(a) is not str or type(q) is not int:
                bad = TransportError(f"forwards: a record ({a!r:.40}, q={q!r:.20})")
                self._dropped("malformed", bad)
                continue
            try:
                # (``tuple.__new__``: the NamedTuple's own constructor is Python code.)
                self._start(front, _new(Run, (c, a, n, {f: v}, s, g, q, gr, off, th, conn, fw, tp)))
            except Exception as exc:  # one that fails stops none of the others (``_handle_one``)
                self._dropped("malformed", exc)

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

    def _start(self, peer: bytes | None, run: Run) -> None:
        """Resolve data-plane refs among the inputs (waiting only for pulls), then run."""
        if self._cancelled_early and (peer, run.c, run.a) in self._cancelled_early:
            del self._cancelled_early[(peer, run.c, run.a)]
            self._done(peer, run.c, run.a, asyncio.CancelledError())
            return
        kwargs = run.k
        for v in kwargs.values():  # (most runs: no value that can hold a ref, nothing to do)
            if type(v) is DataRef or type(v) is list or type(v) is tuple:
                break
        else:
            self._run(peer, run)
            return
        refs = [r for v in kwargs.values() for r in refs_in(v)]
        if refs:
            conn = run.conn or {}
            key = (peer, run.c, run.a)
            if any(self.plane.needs_pull(r, conn.get(r.key[0], "auto")) for r in refs):
                task = asyncio.get_running_loop().create_task(self._pull_then_run(peer, run))
                self._running[key] = task
                task.add_done_callback(lambda t: self._unreported(key, t))
                return
            try:
                run = run._replace(k={f: self._resolve_now(v, conn) for f, v in kwargs.items()})
            except Exception as exc:
                self._done(peer, run.c, run.a, exc)
                return
        self._run(peer, run)

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

    async def _pull_then_run(self, peer: bytes | None, run: Run) -> None:
        key = (peer, run.c, run.a)
        conn = run.conn or {}
        try:
            run = run._replace(k={f: await self._resolve(v, conn) for f, v in run.k.items()})
        except BaseException as exc:
            self._running.pop(key, None)
            self._done(peer, run.c, run.a, exc)
            return
        self._running.pop(key, None)
        self._run(peer, run)

    async def _resolve(self, value: Any, conn: dict[str, str]) -> Any:
        if type(value) is DataRef:
            return await self.plane.get(value, conn.get(value.key[0], "auto"))
        if type(value) is list or type(value) is tuple:
            items = [await self._resolve(x, conn) for x in value]
            return items if type(value) is list else tuple(items)
        return value

    def _run(self, peer: bytes | None, run: Run) -> None:
        c, a, node, kwargs, session, group, q, graph, off, th, _conn, fw, tp = run
        # The front will send end_call (it tracks this worker for the call) when the call may
        # leave state here: per-call params, pages in a Params Pool, or offloaded outputs
        # (``_placed``: only once one was, as the front learns only from a frame that has one).
        if (self._pools or graph in self._param_graphs) and c not in self._call_owner:
            self._call_owner[c] = peer
        if off:
            self._offload[(peer, c, a)] = (node, off, th)
        if fw:
            ft = self._fronts.get(peer)
            routes = self._routes_of(node, fw)
            if routes is not None and ft is not None:
                self._fw[(peer, c, a)] = _Fw(routes, run, ft)
        method = self._methods.get(node)
        if method is None:
            self._done(peer, c, a, OmniflowError(f"node '{node}' is not hosted by this worker"))
            return
        key = (peer, c, a)
        if self._batchers and node in self._batchers:
            self._batched(key, node, kwargs, (
                ActivationContext, graph, session, c, node, group, self._params(session, c, graph),
                q, a, self._pool_view,
            ))  # fmt: skip
            return
        # Its own context, a copy of the worker's, with what of.context() builds on asking.
        ctx = self._ctx.copy()
        ctx.run(_current.set, (
            ActivationContext, graph, session, c, node, group, self._params(session, c, graph),
            q, a, self._pool_view,
        ))  # fmt: skip
        if tp is not None:  # traced: the method runs under its activation's span
            ctx.run(attach_traceparent, tp)
        try:
            call = method(**kwargs)
        except Exception as exc:
            self._done(peer, c, a, exc)
            return
        if node in self._generators:
            gtask = asyncio.get_running_loop().create_task(self._drive(key, call), context=ctx)
            self._running[key] = gtask
            gtask.add_done_callback(lambda t: self._unreported(key, t))
            return
        # The method's own task, its first step run now (most methods end in it).
        task = eager_task(call, ctx)
        if task.done():
            self._finished(key, task)
            return
        self._running[key] = task
        task.add_done_callback(lambda t: self._finished(key, t))

    def _routes_of(self, node: str, raw: list[Any]) -> tuple[Route, ...] | None:
        """The parsed fast-path routes of a run of ``node`` (None: malformed, dropped). A
        front sends the same routes for a node until a replica changes, so the last ones
        parsed for each hosted node are kept and reused while the raw list is equal."""
        seen = self._routes_seen.get(node)
        if seen is not None and seen[0] == raw:
            routes = seen[1]
        else:
            try:
                routes = parse_routes(raw)
            except ValueError as exc:
                self._dropped("malformed", TransportError(f"fast-path routes of a run: {exc}"))
                return None
            if node in self._methods:
                self._routes_seen[node] = (raw, routes)
        if self._gone:  # a front that routes there again: the worker there is back
            self._gone.difference_update(r.address for r in routes)
        return routes

    def _forward(self, key: _Key, frame: Any) -> list[Any] | None:
        """Start this frame's fast-path runs on their workers; ``[route, wire id]`` of each
        (None: none). A value on the data plane is not forwarded (the front holds refs)."""
        fw = self._fw.get(key)
        if fw is None:
            return None
        k = fw.k  # every frame counts (the front counts them the same way)
        fw.k = k + 1
        if type(frame) is not dict:
            return None
        x = None
        for r, route in enumerate(fw.routes):
            f = route.field
            if f not in frame or route.address in self._gone:
                continue
            value = frame[f]
            scalar = type(value) in _SCALARS
            if not scalar and refs_in(value):
                continue
            wid = wire_id(fw.a, k, r)
            q = k if route.qk else fw.q
            try:
                self._link(route.address)  # (a link that cannot be made: not forwarded)
                if scalar and not self._direct:  # with the alike forwards held before it
                    items = self._held_for(route.address)
                    last = items[-1] if items else None
                    if isinstance(last, _FwdBatch) and last.takes(fw, route):
                        last.as_.append(wid)
                        last.vs.append(value)
                        last.qs.append(q)
                    else:
                        items.append(_FwdBatch(fw, route, wid, value, q))
                else:  # encoded now: what the value is now (or a batch of one's run: it goes)
                    envelope = encode_fields(
                        Forward, fw.ft, route.rid, fw.c, wid, route.node, {f: value}, fw.s,
                        route.group, q, fw.gr, route.off, route.th, route.conn, route.sub, fw.tp,
                    )  # fmt: skip
                    if self._direct:  # (sent right after the run's end: ``_take``)
                        self._after_end.append((route.address, envelope))
                    else:
                        self._held_for(route.address).append(envelope)
            except Exception as exc:  # not forwarded: the front runs it the slow way
                logger.debug("worker %s: forward to %s failed: %s", self.replica_id,
                             route.address, exc)  # fmt: skip
                continue
            if x is None:
                x = []
            x.append([r, wid])
        return x

    def _held_for(self, address: str) -> list[list[Any] | _FwdBatch]:
        """The forwards held for ``address``: until the received batch is handled, or to the
        end of this loop turn (a generator's frames of one turn leave together, as its frames
        to the front)."""
        held = self._held_links
        if not held and not self._reading:
            asyncio.get_running_loop().call_soon(self._flush_held)
        items = held.get(address)
        if items is None:
            items = held[address] = []
        return items

    def _link(self, address: str) -> _Link:
        """The connection to the worker at ``address`` (made on first use)."""
        link = self._links.get(address)
        if link is None:
            endpoint = connect(address, key=self._key)
            link = self._links[address] = _Link(endpoint, sealer_for(endpoint, self._key))
        return link

    def _link_send(self, address: str, frames: list[Any]) -> None:
        """Send a batch of forwards down its link, in order behind what waits there; a link
        that fails is logged by its writer (its worker is lost: the front fails what it held).
        Forwards held for a worker a front has since said is lost (``SourceLost`` handled in
        the same batch) are dropped, not sent down a new link: the front orphans them, and a
        link to a dead address would hold them for good."""
        if address in self._gone:
            return
        link = self._link(address)
        if link.writer is None and not link.out:
            with contextlib.suppress(TransportError, RuntimeClosedError):
                if link.endpoint.try_send(link.sealer.seal(frames)):
                    return
        link.out.append(frames)
        if link.writer is None:
            link.writer = asyncio.get_running_loop().create_task(self._link_write(link))

    def _link_lost(self, address: str) -> None:
        """The worker at ``address`` is lost: forward nothing more there, and drop what waits
        for it (its link would hold it forever: nothing listens there any more)."""
        self._gone.add(address)
        link = self._links.pop(address, None)
        if link is not None:
            if link.writer is not None:
                link.writer.cancel()
            link.endpoint.close()

    async def _link_write(self, link: _Link) -> None:
        """Send what queued for a link, in order; done when the queue is empty."""
        try:
            while link.out:
                frames = link.out.popleft()
                await link.endpoint.send(link.sealer.seal(frames))
        except (TransportError, RuntimeClosedError) as exc:
            logger.warning("worker %s: a forward link failed: %s", self.replica_id, exc)
        finally:
            link.writer = None

    def _batched(self, key: _Key, node: str, kwargs: dict[str, Any], cur: Any) -> None:
        """Hand a run of a batched node to its batcher: its entry stands in ``_running``
        where a task would (``Cancel`` cancels it) until its batch reports it."""
        batcher = self._batchers[node]

        def done(frame: Any) -> None:
            if self._running.pop(key, None) is entry:
                self._done(key[0], key[1], key[2], None, frame)

        def failed(exc: BaseException) -> None:
            if self._running.pop(key, None) is entry:
                self._done(key[0], key[1], key[2], exc)

        entry = BatchEntry(batcher, kwargs, cur, (key[0], key[1]), done, failed)
        self._running[key] = entry
        batcher.add(entry)

    def batch_stats(self) -> dict[str, dict[str, Any]]:
        """Per batched node hosted here, its batcher's ``statistics()``."""
        return {n: b.statistics() for n, b in sorted(self._batchers.items())}

    def _finished(self, key: _Key, task: asyncio.Task[Any]) -> None:
        """A coroutine method's task ended: report its frame, or what it raised."""
        self._running.pop(key, None)
        if task.cancelled():
            self._done(key[0], key[1], key[2], asyncio.CancelledError())
            return
        exc = task.exception()
        self._done(key[0], key[1], key[2], exc, None if exc is not None else task.result())

    def _unreported(self, key: _Key, task: asyncio.Task[Any]) -> None:
        """A ``_drive`` / ``_pull_then_run`` task ended. Its body reports the end itself (and
        leaves ``_running``); a task cancelled before its first step never ran its body, so
        its end is reported here, or the front would wait for the activation forever."""
        if self._running.get(key) is not task:
            return
        del self._running[key]
        self._done(key[0], key[1], key[2], generator_end(task))

    async def _drive(self, key: _Key, agen: Any) -> None:
        """Run a generator method (``_drive.drive``). Frames yielded within one event-loop
        turn leave as one ``frames`` message (at most FRAME_BATCH each): a stream that does not
        pause costs the front one message per batch, and one that pauses still sends each
        frame at once."""
        peer, c, a = key
        out = _FrameBatch(self, peer, c, a)
        exc = await drive(agen, out.push)
        self._running.pop(key, None)
        out.flush()  # frames yielded before a failure still reach the front, in order
        self._fw.pop(key, None)
        self._done(peer, c, a, exc or out.error)

    def _placed(self, peer: bytes | None, c: str, a: int | str, frame: Any) -> Any:
        """``frame`` with the outputs this activation offloads put in the data plane."""
        off = self._offload.get((peer, c, a))
        if off is not None and isinstance(frame, dict):
            try:
                placed = self.plane.offload(
                    off[0], c, a, next(self._payloads), frame, off[1], off[2]
                )
            except Exception as exc:
                raise _Unsendable(f"a frame could not be placed in the data plane: {exc}") from exc
            if placed is not frame and c not in self._call_owner:
                self._call_owner[c] = peer  # its blocks are released, and the call ended, by it
            return placed
        return frame

    def _done(
        self,
        peer: bytes | None,
        c: str,
        a: int | str,
        exc: BaseException | None,
        frame: Any = None,
    ) -> None:
        """Say the activation ended; a coroutine's returned ``frame`` (not None) rides along,
        one message instead of ``frame`` + ``done`` (the front applies it first). A failure
        carries its type, message and formatted traceback (the front's NodeError gets it)."""
        key = (peer, c, a)
        if exc is None and frame is not None:
            try:
                placed = self._placed(peer, c, a, frame) if self._offload else frame
                x = self._forward(key, placed) if self._fw else None
                if self._reading:  # encoded with the others at the flush (``_DoneBatch``)
                    self._hold_done(peer, c, a, placed, x)
                elif x is None:
                    self._put(peer, encode_fields(Done, c, a, placed))
                else:  # (what it forwarded, if this cannot be sent, the front orphans)
                    self._put(peer, encode_fields(Done, c, a, placed, None, None, False, None, x))
            except _Unsendable as e:
                exc = e
            except Exception as e:  # a value the wire cannot carry fails the activation
                exc = _Unsendable.sending(e)
            else:
                if self._offload:
                    self._offload.pop(key, None)
                if self._fw:
                    self._fw.pop(key, None)
                return
        self._offload.pop(key, None)
        self._fw.pop(key, None)
        if exc is None:
            if self._reading:
                self._hold_done(peer, c, a, None, None)
            else:
                self._send(peer, Done(c, a))
        else:
            self._send(peer, _failed(c, a, exc))

    def _hold_done(
        self, peer: bytes | None, c: str, a: int | str, frame: Any, x: list[Any] | None
    ) -> None:
        """Hold a good end for the flush: with the good ends held for ``peer`` just before
        it, it leaves as one ``Dones`` (in its place among what is held)."""
        items = self._held.setdefault(peer, [])
        last = items[-1] if items else None
        if type(last) is _DoneBatch and len(last.cs) < MAX_BATCH:
            last.cs.append(c)
            last.as_.append(a)
            last.fs.append(frame)
            last.xs.append(x)
        else:
            items.append(_DoneBatch(c, a, frame, x))


def _failed(c: str, a: int | str, exc: BaseException) -> Done:
    """The done of an activation that failed with ``exc`` (a cancellation says so)."""
    if isinstance(exc, asyncio.CancelledError):
        return Done(c, a, None, type(exc).__name__, str(exc), True)
    tb = "".join(traceback.format_exception(exc))
    return Done(c, a, None, type(exc).__name__, str(exc), False, tb)


class _DoneBatch:
    """Good ends held for one peer, in order: encoded together when the held messages leave."""

    __slots__ = ("as_", "cs", "fs", "xs")

    def __init__(self, c: str, a: int | str, frame: Any, x: list[Any] | None) -> None:
        self.cs = [c]
        self.as_ = [a]
        self.fs = [frame]
        self.xs = [x]

    def encoded(self) -> list[list[Any]]:
        """The envelopes: one ``Dones`` (a ``Done`` for one end). A frame the wire cannot
        carry fails its activation alone: then each end is encoded on its own (what such a
        one forwarded, the front orphans, as for a ``Done``)."""
        if len(self.cs) > 1:
            try:
                return [encode_fields(Dones, self.cs, self.as_, self.fs, self.xs)]
            except Exception:  # (rare: find the one that cannot be sent)
                pass
        return [
            _encoded_done(*end) for end in zip(self.cs, self.as_, self.fs, self.xs, strict=True)
        ]


def _encoded_done(c: str, a: int | str, frame: Any, x: list[Any] | None) -> list[Any]:
    """The envelope of one good end; a failed one if the wire cannot carry ``frame``."""
    try:
        if x is not None:
            return encode_fields(Done, c, a, frame, None, None, False, None, x)
        return encode_fields(Done, c, a, frame) if frame is not None else encode_fields(Done, c, a)
    except Exception as e:
        return encode_msg(_failed(c, a, _Unsendable.sending(e)))


def _envelopes(held: list[list[Any] | _FwdBatch] | list[list[Any] | _DoneBatch]) -> list[list[Any]]:
    """Held messages in order, a gathered batch (``_FwdBatch``, ``_DoneBatch``) as the
    envelopes it encodes to."""
    out: list[list[Any]] = []
    for item in held:
        if isinstance(item, list):
            out.append(item)
        else:
            out.extend(item.encoded())
    return out


class _FwdBatch:
    """Forwards held for one link, in order, that share their front, replica, call, node,
    field, session, group, graph and routes (one route of runs with equal ``_Fw`` fields):
    encoded together when the held messages leave."""

    __slots__ = ("as_", "c", "ft", "gr", "qs", "route", "s", "tp", "vs")

    def __init__(self, fw: _Fw, route: Route, wid: str, value: Any, q: int) -> None:
        self.ft, self.c, self.s, self.gr, self.tp = fw.ft, fw.c, fw.s, fw.gr, fw.tp
        self.route = route
        self.as_ = [wid]
        self.vs = [value]
        self.qs = [q]

    def takes(self, fw: _Fw, route: Route) -> bool:
        """Whether a forward of ``fw`` by ``route`` shares everything but its id, value, q."""
        return (
            route is self.route
            and fw.c == self.c
            and fw.ft == self.ft
            and fw.s == self.s
            and fw.gr == self.gr
            and fw.tp == self.tp
            and len(self.as_) < MAX_BATCH
        )

    def encoded(self) -> list[list[Any]]:
        """The envelopes: one ``Forwards`` (a ``Forward`` for one). A value the wire cannot
        carry (a str with a lone surrogate) is not forwarded: its frame cannot reach the
        front either, so its activation fails there, and the front never expects this run."""
        r = self.route
        if len(self.as_) > 1:
            try:
                return [encode_fields(
                    Forwards, self.ft, r.rid, self.c, r.node, r.field, self.s, r.group, self.gr,
                    self.as_, self.vs, self.qs, r.off, r.th, r.conn, r.sub, self.tp,
                )]  # fmt: skip
            except Exception:  # (rare: find the ones that cannot be sent)
                pass
        out = []
        for wid, value, q in zip(self.as_, self.vs, self.qs, strict=True):
            try:
                out.append(encode_fields(
                    Forward, self.ft, r.rid, self.c, wid, r.node, {r.field: value}, self.s,
                    r.group, q, self.gr, r.off, r.th, r.conn, r.sub, self.tp,
                ))  # fmt: skip
            except Exception as exc:
                logger.debug("forward %s not sent: %s", wid, exc)
        return out


class _FrameBatch:
    """The frames of one generator activation on their way to the front, batched per turn."""

    __slots__ = ("a", "batch", "c", "error", "key", "peer", "scheduled", "worker", "xs")

    def __init__(self, worker: Worker, peer: bytes | None, c: str, a: int | str) -> None:
        self.worker = worker
        self.peer, self.c, self.a = peer, c, a
        self.key = (peer, c, a)
        #: Frames placed (offloaded outputs in the data plane) and not sent yet.
        self.batch: list[Any] = []
        #: Per frame of ``batch``: the runs forwarded for it (None when no frame had any).
        self.xs: list[Any] | None = None
        #: A flush is due at the end of this loop turn.
        self.scheduled = False
        #: Why a flush failed (a value the wire cannot carry fails the activation).
        self.error: _Unsendable | None = None

    def push(self, frame: Any) -> bool:
        """``drive``'s push: place and queue the frame (forwarding its fast-path runs);
        raises once a send failed."""
        worker = self.worker
        placed = worker._placed(self.peer, self.c, self.a, frame)
        if worker._fw:
            x = worker._forward(self.key, placed)
            if x is not None and self.xs is None:
                self.xs = [None] * len(self.batch)
            if self.xs is not None:
                self.xs.append(x)
        self.batch.append(placed)
        if len(self.batch) >= FRAME_BATCH:
            self.flush()
        elif not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)
        if self.error is not None:
            raise self.error
        return True

    def flush(self) -> None:
        self.scheduled = False
        if not self.batch:
            return
        frames, self.batch = self.batch, []
        xs, self.xs = self.xs, None
        try:
            if len(frames) == 1:
                if xs is None or xs[0] is None:
                    msg = encode_fields(Frame, self.c, self.a, frames[0])
                else:
                    msg = encode_fields(Frame, self.c, self.a, frames[0], xs[0])
            elif xs is None:
                msg = encode_fields(Frames, self.c, self.a, frames)
            else:
                msg = encode_fields(Frames, self.c, self.a, frames, xs)
            self.worker._put(self.peer, msg)
        except Exception as e:  # a value the wire cannot carry fails the activation
            self.error = _Unsendable.sending(e)


def _checked(run: Run) -> Run:
    """``run``, whose argument names must be strs (else ProtocolError: the message is
    dropped and counted as malformed)."""
    for name in run.k:
        if type(name) is not str:
            raise ProtocolError("malformed run: 'k' must map argument names (str) to values",
                                "malformed")  # fmt: skip
    return run


def run_worker(make: Callable[[], Worker]) -> int:
    """Entry point of ``omniflow worker``: serve the Worker ``make()`` builds (in the event
    loop it will run in) until SIGTERM or a ``stop`` message."""

    async def main() -> None:
        await make().run()

    run_loop(main())
    return 0
