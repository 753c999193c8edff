"""``ipc://path`` and ``tcp://host:port``: endpoints over pyzmq ROUTER/DEALER sockets.

>>> async def main():
...     async with bind("tcp://127.0.0.1:0") as worker:          # port 0: any free port
...         async with connect(worker.url, identity=b"front-1") as front:
...             await front.send([b"ping"])
...             peer, _ = await worker.recv()
...             await worker.send([b"pong"], peer=peer)
...             return peer, (await front.recv()).frames
>>> asyncio.run(main())                                          # doctest: +SKIP
(b'front-1', [<memory at 0x...>])

An ``ipc://`` path that another live socket is bound to is refused (libzmq would silently
take it over), a stale socket file left by a dead process is replaced, and the file is
removed when the bound endpoint closes.

The bound side is a ROUTER (``ROUTER_MANDATORY``: a send to a peer that is not connected raises
TransportError instead of vanishing; ``ROUTER_HANDOVER``: a peer that reconnects with the same
identity takes its route over). The connected side is a DEALER with a fixed ``ROUTING_ID``, so
the ROUTER can address it from its first message on, across reconnects. No empty delimiter
frame: the wire message is ``[identity, *frames]`` on the ROUTER side, ``frames`` on the DEALER.

Sends pass ``copy=False``: pyzmq copies frames below ``zmq.COPY_THRESHOLD`` (64 KiB) itself and
hands bigger ones to libzmq by reference. Receives also use ``copy=False`` and return each frame
as a ``memoryview`` over the libzmq message, which the codec decodes in place.

The sockets are plain (blocking-API) pyzmq sockets driven by the event loop, not
``zmq.asyncio``: one ``loop.add_reader`` on the socket's ``ZMQ_FD`` per endpoint, whose callback
drains every waiting message (``NOBLOCK`` until ``EAGAIN``) into an inbox, so one wake-up hands
a whole burst to ``recv_batch``. ``ZMQ_FD`` is edge-triggered: it fires when ``ZMQ_EVENTS``
changes, and any send or receive may consume that edge. Hence the rules kept here: the inbox
is drained until ``EAGAIN``, never partly; after every send ``ZMQ_EVENTS`` is checked and
waiting input drained; a send first tries ``NOBLOCK`` and only a send that would block (high-
water mark) waits, in FIFO order behind earlier blocked ones, for ``POLLOUT``. Event masks are
plain ints (pyzmq's ``Flag`` enums cost more than the I/O at this rate).

Every ``zmq.ZMQError`` is translated here into TransportError, chained with ``from exc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import zmq

from omniflow._exceptions import TransportError
from omniflow.transport._base import (
    Endpoint,
    EndpointState,
    Inbox,
    Packet,
    Transport,
    register_transport,
    socket_file_in_use,
)
from omniflow.transport._codec import Buffer

__all__ = ["ZmqTransport"]


#: ZMQ_EVENTS and its bits, as plain ints (no enum arithmetic on the hot path).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)


class _ZmqEndpoint(Endpoint):
    def __init__(
        self,
        url: str,
        socket: zmq.Socket[Any],
        *,
        bound: bool,
        identity: bytes | None,
        ipc_path: str | None = None,
    ) -> None:
        super().__init__(url, bound=bound, identity=identity)
        self._socket = socket
        #: The socket file to remove at close (bound ipc endpoints only).
        self._ipc_path = ipc_path
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        #: The loop whose reader watches ``_fd`` (attached on first use).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Messages received and not yet handed out, and who waits for them.
        self._in = Inbox()
        #: Sends that would have blocked (high-water mark), in order, waiting for POLLOUT.
        self._outbox: deque[tuple[Sequence[Any], asyncio.Future[None]]] = deque()

    # ---------------------------------------------------------------- event-loop plumbing

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            self._loop = loop
            loop.add_reader(self._fd, self._ready)
            self._ready()  # what came before the reader: its edge may be gone already
        return loop

    def _ready(self) -> None:
        """The FD fired, or a call of ours may have consumed its edge: send what waits and
        drain the input, again while either made progress (each zmq call may process the
        commands, "readable" or "writable", whose edge would otherwise be lost)."""
        if self.state is EndpointState.CLOSED:
            return
        try:
            while True:
                events = cast(int, self._socket.getsockopt(_EVENTS))
                progress = bool(self._outbox) and bool(events & _POLLOUT) and self._flush()
                if events & _POLLIN:
                    progress = self._drain() or progress
                if not progress:
                    return
        except zmq.ZMQError:  # closed under us; close() wakes everyone
            return

    def _drain(self) -> bool:
        """Receive until EAGAIN (never less: the FD fires again only after that)."""
        recv = self._socket.recv_multipart
        inbox = self._in.packets
        n = len(inbox)
        while True:
            try:
                parts = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            if self.bound:
                inbox.append(Packet(parts[0].bytes, [part.buffer for part in parts[1:]]))
            else:
                inbox.append(Packet(None, [part.buffer for part in parts]))
        if len(inbox) == n:
            return False
        self._in.wake()
        return True

    def _flush(self) -> bool:
        """Send waiting messages in order until one would block; whether any went."""
        progress = False
        while self._outbox:
            parts, fut = self._outbox[0]
            if fut.done():  # its sender was cancelled: the message is not sent
                self._outbox.popleft()
                continue
            try:
                self._socket.send_multipart(parts, _NOBLOCK, copy=False)
            except zmq.Again:
                return progress
            except zmq.ZMQError as exc:
                self._outbox.popleft()
                fut.set_exception(self._send_error(exc, parts))
                progress = True
                continue
            self._outbox.popleft()
            fut.set_result(None)
            progress = True
        return progress

    def _send_error(self, exc: zmq.ZMQError, parts: Sequence[Any]) -> TransportError:
        if exc.errno == zmq.EHOSTUNREACH:
            peer = parts[0] if self.bound else None
            err = TransportError(
                f"{self.url}: peer {peer!r} is not connected (it closed, or never sent "
                "a message here)",
                url=self.url,
            )
        else:
            err = TransportError(f"{self.url}: send failed: {exc}", url=self.url)
        err.__cause__ = exc
        return err

    # ---------------------------------------------------------------- Endpoint hooks

    def _try_send(self, frames: Sequence[Buffer], peer: bytes | None) -> bool:
        if self._outbox:  # never overtake a send that waits
            return False
        parts: Sequence[Any] = frames if peer is None else [peer, *frames]
        try:
            self._socket.send_multipart(parts, _NOBLOCK, copy=False)
        except zmq.Again:
            sent = False
        except zmq.ZMQError as exc:
            raise self._send_error(exc, parts) from exc
        else:
            sent = True
        # A send (even one refused) can consume the FD's edge for input that arrived meanwhile.
        if cast(int, self._socket.getsockopt(_EVENTS)) & _POLLIN:
            self._drain()
        if self._loop is None:
            with contextlib.suppress(RuntimeError):
                self._attach()
        return sent

    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        loop = self._attach()
        if self._try_send(frames, peer):
            return
        parts: Sequence[Any] = frames if peer is None else [peer, *frames]
        fut: asyncio.Future[None] = loop.create_future()
        self._outbox.append((parts, fut))
        self._ready()  # POLLOUT may have come back already (its edge consumed by the try)
        await fut

    async def _recv(self) -> Packet:
        return await self._in.one(self._attach())

    async def _recv_batch(self) -> list[Packet]:
        return await self._in.all(self._attach())

    def _close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._in.cancel()
        for _parts, fut in self._outbox:
            if not fut.done():
                fut.set_exception(self._closed_error("send"))
        self._outbox.clear()
        self._socket.close()
        if self._ipc_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)


# ROUTER/DEALER again beside _uds by design: one Endpoint contract (_base, tests/transport/
# test_endpoints.py over every scheme); this one crosses hosts (tcp) through libzmq.
class ZmqTransport(Transport):
    """Serves ``ipc://`` and ``tcp://`` with one pyzmq context per process.

    ``linger_ms`` is how long libzmq keeps delivering messages still queued when an endpoint
    closes (in the background; ``close()`` never blocks).
    """

    schemes = ("ipc", "tcp")

    def __init__(self, *, linger_ms: int = 1000) -> None:
        #: ZMQ_LINGER of every socket this transport opens.
        self.linger_ms = linger_ms
        self._context: zmq.Context[Any] | None = None
        self._pid = 0

    def context(self) -> zmq.Context[Any]:
        """The process's context, created on first use (and again in a forked child)."""
        if self._context is None or self._pid != os.getpid():
            self._context = zmq.Context()
            self._pid = os.getpid()
        return self._context

    def bind(self, url: str, *, key: bytes | None = None) -> Endpoint:
        # (ZMQ connections are not authenticated: every message is sealed instead.)
        address = _zmq_address(url)
        ipc_path = _ipc_path(url)
        if ipc_path is not None and socket_file_in_use(ipc_path):
            raise TransportError(f"{url}: address already in use by a live socket", url=url)
        socket = self._socket(zmq.ROUTER, url)
        try:
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
            socket.bind(address)
            actual = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise TransportError(f"{url}: cannot bind: {exc}", url=url) from exc
        return _ZmqEndpoint(actual, socket, bound=True, identity=None, ipc_path=ipc_path)

    def connect(
        self, url: str, *, identity: bytes | None = None, key: bytes | None = None
    ) -> Endpoint:
        address = _zmq_address(url)
        identity = identity if identity is not None else uuid.uuid4().bytes
        socket = self._socket(zmq.DEALER, url)
        try:
            socket.setsockopt(zmq.ROUTING_ID, identity)
            socket.connect(address)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise TransportError(f"{url}: cannot connect: {exc}", url=url) from exc
        return _ZmqEndpoint(url, socket, bound=False, identity=identity)

    def _socket(self, kind: int, url: str) -> zmq.Socket[Any]:
        try:
            socket: zmq.Socket[Any] = self.context().socket(kind)
            socket.setsockopt(zmq.LINGER, self.linger_ms)
        except zmq.ZMQError as exc:
            raise TransportError(f"{url}: cannot open a socket: {exc}", url=url) from exc
        return socket


def _ipc_path(url: str) -> str | None:
    """The socket file of an ``ipc://`` URL (None for tcp and for abstract ``ipc://@name``)."""
    if not url.startswith("ipc://") or url.startswith("ipc://@"):
        return None
    return url.removeprefix("ipc://")


def _zmq_address(url: str) -> str:
    """``tcp://host:0`` means "any free port", which libzmq spells ``tcp://host:*``."""
    if url.startswith("tcp://") and url.endswith(":0"):
        return url[:-1] + "*"
    return url


register_transport(ZmqTransport())
