"""Endpoints and the transport registry: one small base class, one transport per URL scheme.

>>> async def main():
...     async with bind("inproc://worker") as worker, connect("inproc://worker") as front:
...         await front.send([b"ping"])
...         peer, frames = await worker.recv()        # the bound side learns who spoke
...         await worker.send([b"pong"], peer=peer)   # ... and answers that peer
...         return (await front.recv()).frames
>>> asyncio.run(main())
[b'pong']

The pattern is ROUTER/DEALER: the side that **binds** (a worker hosting role replicas) receives
from many connected peers, each packet tagged with the sender's identity, and sends by naming a
peer; the side that **connects** (a front process, or another worker) has one peer, the bound
side, and sends to it without naming anyone. A connected endpoint keeps its identity for life,
so the bound side can reply to, or stream to, a peer at any time after its first message.

Frames are ``bytes``/``bytearray``/``memoryview`` (see :mod:`omniflow.transport._codec`); they
are sent without copying, so a buffer handed to ``send`` must not be written to afterwards.

Schemes: ``inproc://name`` (asyncio queues: a whole multi-process topology inside one process),
``ipc://path`` and ``tcp://host:port`` (pyzmq, ``tcp://host:0`` picks a free port; read the
real address from ``endpoint.url``), ``uds:///abs/path`` (plain Unix-domain sockets on the event
loop: the same-node fast path). :func:`register_transport` adds more.
"""

from __future__ import annotations

import asyncio
import enum
import os
import socket
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import ClassVar, NamedTuple, Self, TypeVar

from omniflow._exceptions import RuntimeClosedError, TransportError
from omniflow.transport._codec import Buffer

__all__ = [
    "Endpoint",
    "EndpointState",
    "Inbox",
    "Packet",
    "Receiver",
    "Transport",
    "bind",
    "connect",
    "register_transport",
    "socket_file_in_use",
    "transport_for",
]

T = TypeVar("T")


class Packet(NamedTuple):
    """What ``recv`` returns: the sending peer (``None`` on a connected endpoint) and frames."""

    peer: bytes | None
    frames: list[Buffer]


#: What ``Endpoint.set_receiver`` hands arriving messages to (from the event loop).
Receiver = Callable[[list[Packet]], None]
#: Most messages one call of a receiver gets (the rest follow on the next loop turn, so a
#: flood does not starve the loop's other work).
MAX_DELIVERY = 256


class EndpointState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Endpoint(ABC):
    """One end of the control plane: a bound endpoint (many peers) or a connected one (one).

    Subclasses implement ``_send``, ``_recv`` and ``_close``; this class checks arguments and
    lifetime, counts traffic, and turns "closed while waiting in recv" into
    :class:`~omniflow.RuntimeClosedError`.
    """

    #: Every connection of this endpoint proved the cluster key when it was made and the
    #: transport keeps its byte stream intact (``uds://`` opened with ``key=``): its messages
    #: need no per-message seal (``transport._auth``), and none is put on or checked.
    authenticated: bool = False

    def __init__(self, url: str, *, bound: bool, identity: bytes | None = None) -> None:
        #: The endpoint's address; for a bound ``tcp://host:0`` the port actually chosen.
        self.url = url
        #: True for the bound (ROUTER) side, False for the connected (DEALER) side.
        self.bound = bound
        #: This endpoint's routing identity (connected side), as the bound side sees it.
        self.identity = identity
        #: OPEN until ``close()``; never reopened.
        self.state = EndpointState.OPEN
        self._sent = 0
        self._received = 0
        self._sent_bytes = 0
        self._received_bytes = 0

    # ----------------------------------------------------------------------------- public API

    async def send(self, frames: Sequence[Buffer], *, peer: bytes | None = None) -> None:
        """Send one message of one or more frames; a bound endpoint must name the ``peer``."""
        self._check_open("send")
        self._check_send(frames, peer)
        await self._send(frames, peer)
        self._sent += 1
        self._sent_bytes += _nbytes(frames)

    def _check_send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        if not frames:
            raise TransportError(f"{self.url}: a message needs at least one frame", url=self.url)
        if self.bound and peer is None:
            raise TransportError(
                f"{self.url}: a bound endpoint sends to a peer; pass peer=<the identity "
                "recv() returned>",
                url=self.url,
            )
        if not self.bound and peer is not None:
            raise TransportError(
                f"{self.url}: a connected endpoint has a single peer; drop peer=", url=self.url
            )

    async def _receiving(self, waiting: Awaitable[T]) -> T:
        """Await a receive; a cancel that comes from ``close()`` (not from our caller) is a
        RuntimeClosedError."""
        try:
            return await waiting
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.state is EndpointState.CLOSED and (task is None or not task.cancelling()):
                raise self._closed_error("recv") from None
            raise

    async def recv(self) -> Packet:
        """Wait for the next message; raises RuntimeClosedError if the endpoint closes."""
        self._check_open("recv")
        packet = await self._receiving(self._recv())
        self._received += 1
        self._received_bytes += _nbytes(packet.frames)
        return packet

    async def recv_batch(self) -> list[Packet]:
        """Wait for at least one message; return it and every message already waiting, in
        order (one wake-up for a burst). Raises RuntimeClosedError if the endpoint closes."""
        self._check_open("recv")
        packets = await self._receiving(self._recv_batch())
        self._delivered(packets)
        return packets

    def try_send(self, frames: Sequence[Buffer], *, peer: bytes | None = None) -> bool:
        """Send now if that cannot block, else do nothing and return False (then ``send``).

        Never overtakes a ``send`` still waiting on this endpoint, so a caller that falls back
        to its own queue whenever this returns False keeps its messages in order.
        """
        if self.state is EndpointState.CLOSED:
            raise self._closed_error("send")
        if not frames or (peer is None) is self.bound:
            self._check_send(frames, peer)
        if not self._try_send(frames, peer):
            return False
        self._sent += 1
        self._sent_bytes += _nbytes(frames)
        return True

    def set_receiver(self, receiver: Receiver | None) -> bool:
        """Hand the messages that arrive from now on to ``receiver(packets)``, called by the
        event loop as they come (a burst at once, in order, at most MAX_DELIVERY a call)
        instead of keeping them for ``recv``: no task wakes up per burst. ``None`` keeps them
        for ``recv`` again. False where the transport has no such path (use ``recv_batch``)."""
        return False

    def drain(self) -> bool:
        """With a receiver (``set_receiver``): hand it, before returning, every message this
        endpoint's connections hold now, read or not (what a peer wrote before this call is
        in its hands then, in order). False where the transport cannot tell (zmq: messages
        may still be in its own queues): nothing is done then."""
        return False

    def _delivered(self, packets: list[Packet]) -> None:
        """Count ``packets`` as received (a transport that delivers to a receiver)."""
        self._received += len(packets)
        nbytes = 0
        for packet in packets:
            nbytes += _nbytes(packet.frames)
        self._received_bytes += nbytes

    def close(self) -> None:
        """Close the endpoint (idempotent); a pending ``recv`` raises RuntimeClosedError."""
        if self.state is EndpointState.CLOSED:
            return
        self.state = EndpointState.CLOSED
        self._close()

    def statistics(self) -> dict[str, int]:
        """Messages and bytes sent and received so far."""
        return {
            "sent": self._sent,
            "received": self._received,
            "sent_bytes": self._sent_bytes,
            "received_bytes": self._received_bytes,
        }

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        side = "bound" if self.bound else "connected"
        return f"<{type(self).__name__} {side} {self.url} {self.state.value}>"

    # --------------------------------------------------------------------------- for subclasses

    @abstractmethod
    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None: ...

    @abstractmethod
    async def _recv(self) -> Packet: ...

    @abstractmethod
    def _close(self) -> None: ...

    async def _recv_batch(self) -> list[Packet]:
        return [await self._recv()]

    def _try_send(self, frames: Sequence[Buffer], peer: bytes | None) -> bool:
        return False

    def _check_open(self, op: str) -> None:
        if self.state is EndpointState.CLOSED:
            raise self._closed_error(op)

    def _closed_error(self, op: str) -> RuntimeClosedError:
        return RuntimeClosedError(f"{self.url}: cannot {op}, the endpoint is closed")


class Inbox:
    """Packets received and not yet handed out, and the receivers waiting for them: what an
    endpoint driven by ``loop.add_reader`` (``_zmq``, ``_uds``) keeps between a readable
    event and ``recv``/``recv_batch``."""

    __slots__ = ("packets", "waiters")

    def __init__(self) -> None:
        #: Oldest first.
        self.packets: deque[Packet] = deque()
        #: Receivers waiting for the inbox to fill.
        self.waiters: deque[asyncio.Future[None]] = deque()

    def wake(self) -> None:
        """Packets arrived: every waiting receiver looks."""
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)

    def cancel(self) -> None:
        """The endpoint closed: every waiting receiver is cancelled (``Endpoint`` turns that
        into RuntimeClosedError)."""
        for waiter in self.waiters:
            waiter.cancel()

    async def wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until at least one packet is in."""
        while not self.packets:
            waiter: asyncio.Future[None] = loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                self.waiters.remove(waiter)

    async def one(self, loop: asyncio.AbstractEventLoop) -> Packet:
        await self.wait(loop)
        return self.packets.popleft()

    async def all(self, loop: asyncio.AbstractEventLoop) -> list[Packet]:
        await self.wait(loop)
        batch = list(self.packets)
        self.packets.clear()
        return batch


class Transport(ABC):
    """Opens endpoints for the URL schemes it serves."""

    #: URL schemes this transport serves.
    schemes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def bind(self, url: str, *, key: bytes | None = None) -> Endpoint:
        """Open the receiving side at ``url`` (raises TransportError if it is taken).
        ``key``: the cluster key, where the transport authenticates connections with it (see
        ``Endpoint.authenticated``); ignored elsewhere."""

    @abstractmethod
    def connect(
        self, url: str, *, identity: bytes | None = None, key: bytes | None = None
    ) -> Endpoint:
        """Open a connected endpoint to ``url`` with a stable ``identity`` (random if None);
        ``key`` as for ``bind`` (both sides give it, or neither)."""


_TRANSPORTS: dict[str, Transport] = {}


def _nbytes(frames: Sequence[Buffer]) -> int:
    if len(frames) == 1:  # (most messages: one small frame)
        f = frames[0]
        return len(f) if type(f) is bytes else memoryview(f).nbytes
    return sum(len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames)


def register_transport(transport: Transport, *, schemes: Sequence[str] | None = None) -> None:
    """Serve ``schemes`` (default: ``transport.schemes``) with ``transport``; replaces any."""
    for scheme in schemes if schemes is not None else transport.schemes:
        _TRANSPORTS[scheme] = transport


def transport_for(url: str) -> Transport:
    """The transport registered for ``url``'s scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise TransportError(
            f"{url!r} is not an endpoint URL; expected scheme://address, e.g. "
            "inproc://worker, ipc:///tmp/of.sock or tcp://127.0.0.1:7000",
            url=url,
        )
    try:
        return _TRANSPORTS[scheme]
    except KeyError:
        known = ", ".join(sorted(_TRANSPORTS))
        raise TransportError(
            f"{url}: no transport for scheme '{scheme}' (known: {known})", url=url
        ) from None


def bind(url: str, *, key: bytes | None = None) -> Endpoint:
    """Bind the receiving (ROUTER) side of ``url``; see the module docstring. ``key``: every
    connection must prove it where the transport can check that (``uds://``; then
    ``authenticated`` is True)."""
    return transport_for(url).bind(url, key=key)


def connect(url: str, *, identity: bytes | None = None, key: bytes | None = None) -> Endpoint:
    """Connect a (DEALER) endpoint to ``url``; see the module docstring. ``key`` as for
    ``bind``: a side that authenticates connections talks only to one that does too."""
    return transport_for(url).connect(url, identity=identity, key=key)


def socket_file_in_use(path: str) -> bool:
    """Whether a live socket listens at socket file ``path`` (a stale file, left by a process
    that died, refuses the connection): ``ipc://`` and ``uds://`` refuse to bind over one."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
