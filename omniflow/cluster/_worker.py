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
their worker (``Forward``), telling the front which it forwarded.

This module is the process shell (load, set up and tear down, bind, read and dispatch, write,
heartbeat, leave); ``Worker``'s parts: running activations (``_worker_runs``), forwards and
links (``_worker_links``), call-scoped state (``_worker_calls``), the state they share
(``_worker_state``), the records and batches that leave (``_worker_held``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from omniflow._exceptions import OmniflowError, RuntimeClosedError, TransportError
from omniflow._loader import load_graphs
from omniflow.cluster._launch import EDGES_KEY, OTLP_ENV
from omniflow.cluster._worker_calls import CallState
from omniflow.cluster._worker_held import envelopes
from omniflow.cluster._worker_links import ForwardLinks
from omniflow.cluster._worker_runs import Activations
from omniflow.cluster._worker_start import record_start_error, worker_colocation
from omniflow.data.kv._pool import opened_pool_statistics
from omniflow.plan._parser import parse_graphs
from omniflow.runtime._batcher import Batcher
from omniflow.runtime._setup import setup_role
from omniflow.runtime._tracing import global_otlp_provider
from omniflow.transport import bind, run_loop
from omniflow.transport._auth import opener_for, sealer_for
from omniflow.transport._base import MAX_DELIVERY, Packet
from omniflow.transport._protocol import (
    Batch,
    Bye,
    Cancel,
    Claim,
    CloseSession,
    EndCall,
    Forward,
    Forwards,
    Heartbeat,
    Hello,
    Message,
    MetaCall,
    MetaNotify,
    MetaReply,
    ProtocolError,
    Pull,
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
    encode_msg,
)

__all__ = ["Worker", "run_worker"]

logger = logging.getLogger("omniflow.worker")

_new = tuple.__new__


class Worker(Activations, ForwardLinks, CallState):
    """Serves the roles ``roles`` of the graphs in ``modules`` on ``address``."""

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
        from omniflow.cluster._launch import colocation_key

        # Methods run in copies of this context (taken before any setup() could add to it).
        self._ctx = contextvars.copy_context()
        try:
            self._load()
            facts = worker_colocation(self.role_names, colocation_key())
            for role in self._roles:
                await setup_role(self._role_names_of[id(role)], role.setup, facts)
        except Exception as exc:
            record_start_error(exc)  # the front that spawned this worker reads why
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
            if self._hosted is not None:  # its connection is closed: calls fail, leave is a no-op
                self._hosted.detach("the worker stopped")
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
        # (Not the fleet's: one writer for every front, and a failure forgets only that one.)
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
                        for m in msg.messages:
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
                for frames in batch(envelopes(items)):
                    self._link_send(address, frames)
        if self._held:
            held_peers, self._held = self._held, {}
            for peer, waiting in held_peers.items():
                for frames in batch(envelopes(waiting)):
                    self._put(peer, frames)

    async def _heartbeat(self) -> None:
        """Tell every front that said hello that this worker lives, as often as it asked."""
        plain = encode_msg(Heartbeat())
        said = 0  # the edge bytes the last beat said
        while True:
            interval = min(self._intervals.values(), default=self.heartbeat_interval)
            await asyncio.sleep(max(0.01, interval))
            # A worker with batched nodes says how its batchers do (the front's /metrics).
            st: dict[str, Any] | None = self.batch_statistics() if self._batchers else None
            eb = self._edge_bytes
            if eb:  # cumulative; when it changed since the last beat (or batch stats go)
                total = sum(eb.values())
                if total != said or st is not None:
                    said = total
                    st = st or {}
                    st[EDGES_KEY] = [[*k, n] for k, n in eb.items()]
            beat = encode_msg(Heartbeat(st)) if st is not None else plain
            for peer in self._peers:
                self._out.put_nowait((peer, beat))

    def _handle(self, peer: bytes | None, msg: Message) -> None:
        match msg:
            case Run():
                self._start(peer, _checked(msg))
            case Forwards():
                self._forwards(msg)
            case Forward(front=ft, replica=rid):
                if self._for_here(ft, rid):
                    self._start(self._front_peers[ft], _checked(_new(Run, msg[2:])))
            case Cancel(call_id=c, aid=a):
                task = self._running.get((peer, c, a))
                if task is not None:
                    task.cancel()
                elif type(a) is str:  # a forwarded run whose forward has not come (yet)
                    self._cancel_early((peer, c, a))
            case Claim(request=r, call_id=c, wire_ids=ws):
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
            case EndCall(call_id=c, ack=ack):
                self._end_call(peer, c, ack)
            case Release(refs=refs):
                self._release(peer, refs)
            case Pull(request=r, handle=h):
                self._serve_pull(peer, r, h)
            case StatsRequest(request=r):
                self._send(
                    peer,
                    StatsReply(
                        r,
                        self.replica_id,
                        os.getpid(),
                        self.plane.statistics(),
                        self.wire.statistics(),
                        {
                            "running": len(self._running),
                            "calls": len(self._call_owner),
                            "forwarding": len(self._fw),
                            "links": len(self._links),
                            "link_queued": sum(len(link.out) for link in self._links.values()),
                        },
                        opened_pool_statistics(self._pools.values()) or None,
                    ),
                )
            case SourceLost(address=addr, pid=pid):
                self._puller.lost(addr, pid)
                self._link_lost(addr)
            case CloseSession(session=session):
                self._close_session(session)
            case Stop():
                if self.owner is not None and self._fronts.get(peer) == self.owner:
                    self._stop.set()
                else:
                    self._dropped(
                        "foreign",
                        TransportError("stop from a front that did not spawn this worker"),
                    )
            case MetaNotify(pool=pool, session=session, keys=keys):
                self._meta_notify(peer, pool, session, keys)
            case MetaReply(request=r, value=v, error=e):
                self._meta_reply(peer, r, v, e)
            case Bye():
                self._unacked.discard(peer)
            case _:
                self._dropped(
                    "unknown_kind", TransportError(f"a worker does not take {type(msg).__name__}")
                )


def _checked(run: Run) -> Run:
    """``run``, whose argument names must be strs (else ProtocolError: the message is
    dropped and counted as malformed)."""
    for name in run.kwargs:
        if type(name) is not str:
            raise ProtocolError("malformed run: 'kwargs' must map argument names (str) to values",
                                "malformed")  # fmt: skip
    return run


def run_worker(make: Callable[[], Worker]) -> int:
    """Entry point of ``omniflow worker``: serve the Worker ``make()`` builds (in the event
    loop it will run in) until SIGTERM or a ``stop`` message."""

    async def main() -> None:
        await make().run()

    endpoint = os.environ.get(OTLP_ENV)  # the front exports traces: so do its methods
    provider = global_otlp_provider(endpoint) if endpoint else None
    try:
        run_loop(main())
    finally:
        if provider is not None:
            provider.shutdown()  # (flushes what is batched)
    return 0
