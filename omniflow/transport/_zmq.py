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

Every ``zmq.ZMQError`` is translated here into TransportError, chained with ``from exc``.
"""

from __future__ import annotations

import contextlib
import os
import socket as _socket
import uuid
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from omniflow._exceptions import TransportError
from omniflow.transport._base import Endpoint, Packet, Transport, register_transport
from omniflow.transport._codec import Buffer

__all__ = ["ZmqTransport"]


class _ZmqEndpoint(Endpoint):
    def __init__(
        self,
        url: str,
        socket: zmq.asyncio.Socket,
        *,
        bound: bool,
        identity: bytes | None,
        ipc_path: str | None = None,
    ) -> None:
        super().__init__(url, bound=bound, identity=identity)
        self._socket = socket
        #: The socket file to remove at close (bound ipc endpoints only).
        self._ipc_path = ipc_path

    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        parts: Sequence[Any] = frames if peer is None else [peer, *frames]
        try:
            await self._socket.send_multipart(parts, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise TransportError(
                    f"{self.url}: peer {peer!r} is not connected (it closed, or never sent "
                    "a message here)",
                    url=self.url,
                ) from exc
            raise TransportError(f"{self.url}: send failed: {exc}", url=self.url) from exc

    async def _recv(self) -> Packet:
        try:
            parts = await self._socket.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"{self.url}: receive failed: {exc}", url=self.url) from exc
        if self.bound:
            return Packet(parts[0].bytes, [part.buffer for part in parts[1:]])
        return Packet(None, [part.buffer for part in parts])

    def _close(self) -> None:
        self._socket.close()
        if self._ipc_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)


class ZmqTransport(Transport):
    """Serves ``ipc://`` and ``tcp://`` with one pyzmq context per process.

    ``linger_ms`` is how long libzmq keeps delivering messages still queued when an endpoint
    closes (in the background; ``close()`` never blocks).
    """

    schemes = ("ipc", "tcp")

    def __init__(self, *, linger_ms: int = 1000) -> None:
        #: ZMQ_LINGER of every socket this transport opens.
        self.linger_ms = linger_ms
        self._context: zmq.asyncio.Context | None = None
        self._pid = 0

    def context(self) -> zmq.asyncio.Context:
        """The process's context, created on first use (and again in a forked child)."""
        if self._context is None or self._pid != os.getpid():
            self._context = zmq.asyncio.Context()
            self._pid = os.getpid()
        return self._context

    def bind(self, url: str) -> Endpoint:
        address = _zmq_address(url)
        ipc_path = _ipc_path(url)
        if ipc_path is not None and _ipc_in_use(ipc_path):
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

    def connect(self, url: str, *, identity: bytes | None = None) -> Endpoint:
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

    def _socket(self, kind: int, url: str) -> zmq.asyncio.Socket:
        try:
            socket = self.context().socket(kind)
            socket.setsockopt(zmq.LINGER, self.linger_ms)
        except zmq.ZMQError as exc:
            raise TransportError(f"{url}: cannot open a socket: {exc}", url=url) from exc
        return socket


def _ipc_path(url: str) -> str | None:
    """The socket file of an ``ipc://`` URL (None for tcp and for abstract ``ipc://@name``)."""
    if not url.startswith("ipc://") or url.startswith("ipc://@"):
        return None
    return url.removeprefix("ipc://")


def _ipc_in_use(path: str) -> bool:
    """Whether a live socket listens at ``path`` (a stale file refuses the connection)."""
    if not os.path.exists(path):
        return False
    with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _zmq_address(url: str) -> str:
    """``tcp://host:0`` means "any free port", which libzmq spells ``tcp://host:*``."""
    if url.startswith("tcp://") and url.endswith(":0"):
        return url[:-1] + "*"
    return url


register_transport(ZmqTransport())
