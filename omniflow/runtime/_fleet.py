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

``on_message`` may hand a message back, or what is left of it: it is about a run that another
connection has not told the front of yet. What is left of that connection's batch then waits
for the end of the loop turn, after the other connections read in it (``Fleet._later``).
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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import OmniflowError, RegistryError, RuntimeClosedError, TransportError
from omniflow.runtime._launch import Launcher, LaunchSpec, ReplicaHandle, SubprocessLauncher
from omniflow.runtime._placement import ProcessSpec
from omniflow.runtime._replica import Backoff, Lifecycle, ReplicaEvent, ReplicaState
from omniflow.transport import EndpointState, connect
from omniflow.transport._auth import (
    Opener,
    PlainOpener,
    PlainSealer,
    Sealer,
    WireStats,
    sealer_for,
)
from omniflow.transport._protocol import (
    MAX_BATCH,
    Batch,
    Bye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Ready,
    SourceLost,
    Stop,
    batch,
    decode_inner,
    decode_msg,
    encode_msg,
)

if TYPE_CHECKING:
    from omniflow.registry import ServiceRegistry

__all__ = ["Fleet", "Replica"]

logger = logging.getLogger("omniflow.remote")


@dataclass(eq=False)
class Replica:
    """One replica as this front knows it: its connection and what it runs. Its state is
    ``life`` (``_replica.Lifecycle``), changed only through ``Fleet.event``."""

    replica_id: str
    roles: list[str]
    address: str
    #: The started process, as its launcher handed it back (None: found in the registry).
    process: ReplicaHandle | None = None
    life: Lifecycle = field(init=False)
    endpoint: Any = None
    #: Resolved by its ``ready`` (failed if it is lost first).
    ready: asyncio.Future[None] | None = None
    out: asyncio.Queue[list[Any] | None] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    #: (call id, aid) of activations it runs.
    held: set[tuple[str, int | str]] = field(default_factory=set)
    exit_code: int | None = None
    #: Pending judgement of a replica absent from the registry (cancelled if it comes back).
    probation: asyncio.TimerHandle | None = None
    #: Loop time of its last ``bye`` (a leaving replica repeats it while it drains).
    last_bye: float = 0.0
    #: Process id the worker reported in "ready" (its data-plane refs carry it).
    pid: int | None = None
    #: Seals what this front sends on this connection (one sender, one counter).
    sealer: Sealer | PlainSealer | None = None
    #: Checks what it sends where its connection is authenticated (None: the fleet's opener,
    #: which checks each message's seal).
    opener: PlainOpener | None = None
    #: Loop time of the last authentic message from it (heartbeats included).
    last_seen: float = 0.0
    #: The process group it was started for and its slot there (None: found in the registry).
    spec: ProcessSpec | None = None
    slot: int = 0
    #: Loop time it was started at (a replica that lived long resets its slot's backoff).
    born: float = 0.0
    #: (pool, node) of the Params Pools it registered in the front-hosted metadata.
    pool_nodes: set[tuple[str, str]] = field(default_factory=set)
    #: What it sent that waits for the end of this loop turn, in arrival order (None: none):
    #: each (a decoded message, a batch's encoded messages, packets), handled in that order.
    late: list[tuple[Message | None, list[Any], list[Any]]] | None = None
    #: Loop turns in a row that what it sent waited (``Fleet._later``).
    waited: int = 0
    #: Its batchers' ``statistics()`` by node, as its last heartbeat said (None: none).
    batches: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.life = Lifecycle(self.replica_id)

    @property
    def alive(self) -> bool:
        """Not gone (it may still be starting or leaving)."""
        return self.life.alive

    def __repr__(self) -> str:
        return f"Replica({self.replica_id!r}, {self.life.state.value})"


#: Loop turns in a row that what a replica sent may wait for the front to learn of the runs it
#: is about (``Fleet._later``); then it is handled whatever it says.
LATE_TURNS = 64

#: The messages the fleet answers itself; every other kind is about calls (``on_message``).
_FLEET_KINDS = frozenset({Heartbeat, Bye, Ready})

#: Where the fleet hands a checked message about calls (with whether it may hand back what
#: should wait: ``Fleet._later``), and a lost replica's activations.
OnMessage = Callable[[Replica, Message, bool], "Message | None"]
OnLost = Callable[[Replica, str], None]


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
        self._opener = Opener(cluster_key, self.wire)
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
        #: True while a batch of replica messages is handled (runs made then are queued).
        self.in_batch = False
        #: Set by ``on_message``'s side when it learned of a forwarded run (``_take_known``).
        self.known = False
        #: Replicas with messages waiting for the end of the loop turn (``_later``), in order.
        self._waiting: dict[Replica, None] = {}
        #: Grows with every replica state change (what routes were computed from is stale).
        self.epoch = 0
        self.registry: ServiceRegistry | None = None
        self._on_message = on_message
        self._on_lost = on_lost
        #: Restart delays per (process group, slot).
        self._backoff = Backoff()
        self._supervisor: asyncio.Task[None] | None = None
        self._watchers: list[asyncio.Task[Any]] = []
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
        starts = [self._spawn(spec, i) for spec in self.processes for i in range(spec.replicas)]
        await asyncio.wait_for(asyncio.gather(*starts), self.start_timeout)
        loop = asyncio.get_running_loop()
        self._supervisor = loop.create_task(self._supervise())
        if self.registry is not None:
            for role in sorted(self.roles):
                self._watchers.append(loop.create_task(self._watch(role)))

    async def _spawn(self, spec: ProcessSpec, slot: int) -> None:
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
        rep.tasks.append(asyncio.get_running_loop().create_task(self._reap(rep)))
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
        if not rep.endpoint.set_receiver(functools.partial(self._receive, rep)):
            rep.tasks.append(loop.create_task(self._read(rep)))
        rep.out.put_nowait(encode_msg(Hello(self.token, self.heartbeat_interval)))
        await rep.ready
        rep.last_seen = loop.time()

    async def stop_all(self) -> list[Replica]:
        """Stop supervising, ask the started replicas to stop (killed after 5 s), close every
        connection; the replicas that were known, for the caller to tidy after."""
        self.closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        for task in [*self._watchers, *self._background]:
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
                rep = self._adopt(role, rid, listed[rid].address)
        if rep is not None and rep.ready is not None and not rep.ready.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(rep.ready), self.start_timeout)
        return rep

    # ------------------------------------------------------------------ I/O

    async def _write(self, rep: Replica) -> None:
        """Send what is queued for ``rep``, in order; what queued together leaves batched."""
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

    async def _read(self, rep: Replica) -> None:
        while True:
            try:
                batch = await rep.endpoint.recv_batch()
            except (RuntimeClosedError, TransportError, asyncio.CancelledError):
                return
            self._receive(rep, batch)

    def _receive(self, rep: Replica, batch: list[Any]) -> None:
        """A batch from ``rep``'s connection: handled now, or behind what of ``rep``'s waits
        for the end of this loop turn."""
        late = rep.late
        if late is None:
            self._take(rep, batch, True)
        else:
            late.append((None, [], batch))
        if self.known:
            self._take_known()

    def _take_known(self) -> None:
        """The front learned of forwarded runs (``known``): what waits for the end of the loop
        turn (``_later``) may be about them, so it is tried now, in order, rather than a
        loop turn later. Nothing changes but when: what still waits waits on; each try here
        follows a run being learned of, so these tries end (they do not count as turns)."""
        while self.known and self._waiting:
            self.known = False
            for rep in list(self._waiting):
                if rep in self._waiting:
                    self._take_late(rep, turn=False)
        self.known = False

    def _take_late(self, rep: Replica, turn: bool = True) -> None:
        """Handle what ``rep`` sent that waited for the end of the last loop turn (``turn``;
        else tried again within it: ``_take_known``), in order (none once its connection is
        closed: it would deliver nothing more either). What is still about runs the front
        does not know may wait again, ``LATE_TURNS`` turns in a row at most; then it is
        handled whatever it says."""
        self._waiting.pop(rep, None)
        late, rep.late = rep.late, None
        if late is None or rep.endpoint is None or rep.endpoint.state is EndpointState.CLOSED:
            return
        if turn:
            rep.waited += 1
        may_wait = rep.waited < LATE_TURNS
        was, self.in_batch = self.in_batch, True
        try:
            for n, item in enumerate(late):
                if self._take_waiting(rep, item, may_wait):
                    self._behind(rep, late[n + 1 :])  # (it waits again: what came after it too)
                    return
            rep.waited = 0
        finally:
            self.in_batch = was
            if turn and self.known:
                self._take_known()

    def _take_waiting(
        self, rep: Replica, item: tuple[Message | None, list[Any], list[Any]], may_wait: bool
    ) -> bool:
        """Handle one waiting item of ``rep.late``; True if some of it waits again."""
        msg, inner, packets = item
        if msg is not None:
            rest = self._handle_decoded(rep, msg, may_wait)
            if rest is not None:
                self._later(rep, rest, inner, packets)
                return True
        if self._take_inner(rep, inner, packets, may_wait):
            return True
        return bool(packets) and self._take(rep, packets, may_wait)

    def _take_inner(self, rep: Replica, ms: list[Any], packets: list[Any], may_wait: bool) -> bool:
        """Handle a batch's encoded messages ``ms`` in order; at one that should wait, it and
        the rest of ``ms``, then ``packets``, go to ``_later`` (then True)."""
        for j, m in enumerate(ms):
            rest = self._handle_inner(rep, m, may_wait)
            if rest is not None:
                self._later(rep, rest, ms[j + 1 :], packets)
                return True
        return False

    def _behind(
        self, rep: Replica, items: list[tuple[Message | None, list[Any], list[Any]]]
    ) -> None:
        """``items`` go behind what of ``rep``'s waits now (a method: in ``_take_late`` the
        type checker holds ``rep.late`` to the None it set before ``_later`` set it again)."""
        assert rep.late is not None
        rep.late.extend(items)

    def _later(self, rep: Replica, rest: Message, inner: list[Any], packets: list[Any]) -> None:
        """``rest``, then ``inner`` (a batch's encoded messages), then ``packets``, all from
        ``rep``, wait for the end of this loop turn: behind the other connections read in it.

        Why this changes no outcome: it is as if these bytes came a moment later, which the
        front takes anyway (nothing orders two connections; a ``Dones`` cut in two is what
        the worker sends when its ends fall in two of its loop turns). What one connection
        delivers keeps its order: what it delivers meanwhile goes behind (``_receive``), and
        what waited is handled first in the next loop turn (``call_soon`` is FIFO and runs
        before that turn's I/O callbacks), where it may wait again, ``LATE_TURNS`` turns in a
        row at most (``_take_late``)."""
        assert rep.late is None
        rep.late = [(rest, inner, packets)]
        self._waiting[rep] = None
        asyncio.get_running_loop().call_soon(self._take_late, rep)

    def _take(self, rep: Replica, batch: list[Any], may_wait: bool) -> bool:
        """Handle what ``rep`` sent: check, decode, dispatch each message. ``may_wait``: a
        message about a run the front does not know yet may send the rest to ``_later``
        (then True)."""
        opener = rep.opener or self._opener
        time = asyncio.get_running_loop().time
        was, self.in_batch = self.in_batch, True
        try:
            for i, (_peer, frames) in enumerate(batch):
                inner = opener.open(frames)
                if inner is None:
                    self.dropped(rep, None)
                    continue
                rep.last_seen = time()
                try:
                    msg = decode_msg(inner)
                    if type(msg) is Batch:
                        if self._take_inner(rep, msg.ms, batch[i + 1 :], may_wait):
                            return True
                    else:
                        rest = self._handle(rep, msg, may_wait)
                        if rest is not None:
                            self._later(rep, rest, [], batch[i + 1 :])
                            return True
                except ProtocolError as exc:
                    self.dropped(rep, exc.reason, exc)
                except (KeyError, TypeError, ValueError) as exc:  # a malformed body
                    self.dropped(rep, "malformed", exc)
        finally:
            self.in_batch = was
        return False

    def _handle_inner(self, rep: Replica, m: Any, may_wait: bool) -> Message | None:
        """One message of a batch (a bad one is dropped alone); what should wait, if any."""
        try:
            return self._handle(rep, decode_inner(m), may_wait)
        except ProtocolError as exc:
            self.dropped(rep, exc.reason, exc)
        except (KeyError, TypeError, ValueError) as exc:  # a malformed body
            self.dropped(rep, "malformed", exc)
        return None

    def _handle_decoded(self, rep: Replica, msg: Message, may_wait: bool) -> Message | None:
        """A message decoded before it waited (a bad value in it is dropped alone)."""
        try:
            return self._handle(rep, msg, may_wait)
        except (KeyError, TypeError, ValueError) as exc:  # a malformed body
            self.dropped(rep, "malformed", exc)
        return None

    def _handle(self, rep: Replica, msg: Message, may_wait: bool) -> Message | None:
        """One checked message; what of it should wait for the end of the loop turn (only
        if ``may_wait``), if any."""
        if type(msg) not in _FLEET_KINDS:  # about calls: the commonest, straight on
            return self._on_message(rep, msg, may_wait)
        elif type(msg) is Bye:
            self._on_bye(rep)
        elif type(msg) is Ready and rep.ready is not None and not rep.ready.done():
            rep.pid = msg.pid
            self.event(rep, ReplicaEvent.READY, f"pid {msg.pid}")
            if rep.probation is not None:  # went missing while it connected
                self.event(rep, ReplicaEvent.MISSING, "gone from the registry")
            rep.ready.set_result(None)
        elif type(msg) is Heartbeat and msg.st is not None:
            rep.batches = msg.st
        # (a Heartbeat: last_seen is updated for every authentic message)
        return None

    def dropped(self, rep: Replica, reason: str | None, exc: BaseException | None = None) -> None:
        """A message from ``rep`` was dropped (counted, and logged now and then)."""
        self.wire.dropped_message(logger, f"front, last from {rep.replica_id}", reason, exc)

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

    # ------------------------------------------------------------------ supervision

    async def _reap(self, rep: Replica) -> None:
        assert rep.process is not None
        code = await rep.process.wait()
        rep.exit_code = code
        if self.closing:
            return
        self.lost(rep, f"its process exited with code {code}")
        # One that never became ready is retried by the _respawn (or start) that spawned it;
        # one that LEFT (said bye first) went as it said.
        dead = rep.life.state is ReplicaState.DEAD
        if self.respawn and rep.spec is not None and dead and rep.pid is not None:
            self.in_background(self._respawn(rep))

    async def _respawn(self, dead: Replica) -> None:
        """Start a new replica in the dead one's slot after a backoff (``_replica.Backoff``)."""
        assert dead.spec is not None
        loop = asyncio.get_running_loop()
        slot = (dead.spec.name, dead.slot)
        delay = self._backoff.after_death(slot, lived=loop.time() - dead.born)
        self.event(dead, ReplicaEvent.RESPAWN, f"a new replica takes its slot in {delay:.1f} s")
        if self.replicas.get(dead.replica_id) is dead:
            del self.replicas[dead.replica_id]
        for task in dead.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if dead.endpoint is not None:
            dead.endpoint.close()
        logger.warning(
            "respawning a replica of %s in %.1f s (restart %d of this slot)",
            dead.spec.name,
            delay,
            self._backoff.restarts(slot),
        )
        await asyncio.sleep(delay)
        while not self.closing:
            try:
                await asyncio.wait_for(self._spawn(dead.spec, dead.slot), self.start_timeout)
            except (OmniflowError, OSError, TimeoutError) as exc:
                delay = self._backoff.after_failed_start(slot)
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
        (a started one is killed first, so it cannot come back half-alive). A front whose own
        loop was stalled judges nobody on that tick: it has not read what waits."""
        loop = asyncio.get_running_loop()
        tick = self.heartbeat_interval / 4
        limit = self.heartbeat_misses * self.heartbeat_interval
        last = loop.time()
        while not self.closing:
            await asyncio.sleep(tick)
            now = loop.time()
            stalled, last = now - last > tick + self.heartbeat_interval / 2, now
            for rep in list(self.replicas.values()):
                if not rep.alive or rep.ready is None or not rep.ready.done():
                    continue
                if stalled:
                    rep.last_seen = max(rep.last_seen, now - tick)
                    continue
                if now - rep.last_seen <= limit:
                    continue
                silent = now - rep.last_seen
                self.lost(
                    rep,
                    f"it missed {self.heartbeat_misses} heartbeats ({silent:.2f} s "
                    "without a word; a spawned replica is killed)",
                )

    # ------------------------------------------------------------------ registry

    async def _watch(self, role: str) -> None:
        """Follow the registry: connect to replicas that appear, drop the ones that vanish.

        Replicas this front started are watched through their processes, not the registry, so
        a Redis restart (an empty registry until workers re-register, within one heartbeat
        interval) cannot fail their calls. A replica found elsewhere that vanishes gets two
        heartbeat intervals of grace (one to re-register after a restart, one for this watch
        to see it) before it counts as lost: with the default ttl of three intervals, a killed
        worker is lost within ``ttl + watch interval + grace`` = 6 intervals, under two ttls
        plus one watch interval. New replicas are connected in the background, so one that
        does not answer never holds up the watch.
        """
        assert self.registry is not None
        loop = asyncio.get_running_loop()
        grace = 2 * self.heartbeat_interval
        while not self.closing:
            try:
                async with self.registry.watch(role) as watch:
                    async for snapshot in watch:
                        present = {r.replica_id: r for r in snapshot.replicas}
                        for rep in list(self.replicas.values()):
                            if rep.process is not None or not rep.alive or role not in rep.roles:
                                continue
                            if rep.replica_id in present:
                                self.event(rep, ReplicaEvent.PRESENT)
                                if rep.probation is not None:
                                    rep.probation.cancel()
                                    rep.probation = None
                                continue
                            self.event(rep, ReplicaEvent.MISSING, "gone from the registry")
                            if rep.probation is None:
                                rep.probation = loop.call_later(grace, self._check_missing, rep)
                        for rid, replica in present.items():
                            if rid not in self.replicas:
                                self._adopt(role, rid, replica.address)
                            elif role not in self.replicas[rid].roles:
                                self.replicas[rid].roles.append(role)
            except RegistryError as exc:
                logger.warning("registry unreachable while watching %s: %s", role, exc)
                await asyncio.sleep(self.heartbeat_interval)

    def _adopt(self, role: str, rid: str, address: str) -> Replica:
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

    def _check_missing(self, rep: Replica) -> None:
        """Its probation ended and it is still absent from the registry (a snapshot that lists
        it again cancels the probation)."""
        rep.probation = None
        if not rep.alive or self.closing:
            return
        loop = asyncio.get_running_loop()
        leaving = rep.life.state is ReplicaState.LEAVING
        if leaving and rep.held and loop.time() - rep.last_bye < 3 * self.heartbeat_interval:
            # Deregistered on purpose and still finishing runs (its repeated byes say it lives).
            rep.probation = loop.call_later(self.heartbeat_interval, self._check_missing, rep)
            return
        self.lost(rep, "it stopped heartbeating (gone from the registry)")

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
            reason = (proc.start_error() if proc is not None else None) or why
            rep.ready.set_exception(
                OmniflowError(
                    f"worker {rep.replica_id} (role(s) {rep.roles}) died before ready: {reason}"
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
