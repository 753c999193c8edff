"""The state of a worker process, which every part of it reads, and how it sends to fronts.

``Worker`` (``_worker``: the process shell: load, bind, read, write, heartbeat, leave) is
built from parts that each own one concern: running activations (``_worker_runs``), the fast
path's forwards and links (``_worker_links``), and call-scoped state (``_worker_calls``). Why
they are mixins over this one state rather than objects the Worker owns: every hop touches
one received batch's state (``_reading``, ``_direct``, what is held per peer and link) from
all of them, in one object a hop's code reaches with one attribute lookup; the worker's tests
drive and stub these methods on that one object (``w._start``, ``w._link``); and a part that
held a reference back to the worker would be the same coupling with a hop more.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import socket
from collections.abc import Iterable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from omniflow.cluster._forward import Route
from omniflow.cluster._launch import EDGE_BYTES_ENV
from omniflow.cluster._worker_held import DoneBatch, Fw, FwdBatch, Link
from omniflow.data._plane import DataPlane, PullClient
from omniflow.data.kv._hosted import HostedMetadata
from omniflow.dsl._graph import GlobalParameters
from omniflow.runtime._batcher import Batcher
from omniflow.runtime._params import SessionParams
from omniflow.transport._auth import (
    Opener,
    PlainOpener,
    PlainSealer,
    Sealer,
    WireStats,
    resolve_key,
    send_sealed_now,
)
from omniflow.transport._protocol import Message, Run, encode_msg

logger = logging.getLogger("omniflow.worker")

#: A running activation as the worker knows it: (front's peer, call id, wire id).
_Key = tuple[bytes | None, str, int | str]

#: Most frames of one generator activation sent in one ``frames`` message.
FRAME_BATCH = 64

#: Most cancels kept for forwarded runs that had not arrived when their cancel did (the
#: oldest is forgotten first: a cancel whose forward never comes costs one entry a while).
CANCELLED_EARLY = 4096


class WorkerState:
    """What a worker holds: its roles, running activations, peers, links and held messages."""

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
        #: Bytes this worker forwarded to other workers, per edge (graph, producer, field,
        #: consumer), while its front counts them (EDGE_BYTES_ENV; None: not counted).
        self._edge_bytes: dict[tuple[str, str, str, str], int] | None = (
            {} if os.environ.get(EDGE_BYTES_ENV) == "1" else None
        )
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
        self._fw: dict[_Key, Fw] = {}
        #: Hosted node -> the fast-path routes last parsed for its runs (raw, parsed).
        self._routes_seen: dict[str, tuple[list[Any], tuple[Route, ...]]] = {}
        #: Address -> connection to the worker there (fast-path forwards).
        self._links: dict[str, Link] = {}
        #: Addresses of workers a front said are lost (``SourceLost``): nothing is forwarded
        #: there (the front runs those runs the slow way) until a front's run routes there again.
        self._gone: set[str] = set()
        #: The bound endpoint (sends to fronts go straight out when nothing waits before them).
        self._endpoint: Any = None
        #: The writer holds a message it has not sent yet.
        self._writing = False
        #: Handling a batch of received messages: what they make waits here, per peer or
        #: link address, and leaves as few messages as possible when the batch is handled
        #: (consecutive good ends to one peer gather in a ``DoneBatch``: one ``Dones``).
        self._reading = False
        #: The context each method's runs in a copy of (``run`` takes it again, before setup).
        self._ctx = contextvars.copy_context()
        for batcher in self._batchers.values():
            batcher.base = self._ctx
        #: Handling a batch of one run (a chain's hop): nothing to gather, so its end leaves
        #: as it is made and its forwards right after it (``_take``), here meanwhile.
        self._direct = False
        self._after_end: list[tuple[str, list[Any]]] = []
        self._held: dict[bytes | None, list[list[Any] | DoneBatch]] = {}
        #: (consecutive forwards to one link that differ only in id, value and SeqId index
        #: gather in a ``FwdBatch``: one ``Forwards``).
        self._held_links: dict[str, list[list[Any] | FwdBatch]] = {}
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

    def _dropped(self, reason: str | None, exc: BaseException | None = None) -> None:
        """A message was dropped (counted, and logged now and then)."""
        self.wire.dropped_message(logger, f"worker {self.replica_id}", reason, exc)

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
        if (
            not self._writing
            and self._out.empty()
            and endpoint is not None
            and send_sealed_now(endpoint, self._sealer, frames, peer)
        ):
            return
        self._out.put_nowait((peer, frames))

    if TYPE_CHECKING:  # (each defined by one part; the others call it)

        def _start(self, peer: bytes | None, run: Run) -> None: ...

        def _forward(self, key: _Key, frame: Any) -> list[Any] | None: ...

        def _routes_of(self, node: str, raw: list[Any]) -> tuple[Route, ...] | None: ...

        def _params(self, session: str | None, call_id: str, graph: str = "") -> SessionParams: ...

        def _flush_held(self) -> None: ...
