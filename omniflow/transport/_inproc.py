"""``inproc://name``: endpoints over asyncio queues, for whole topologies in one process.

>>> from omniflow.transport import bind, connect
>>> async def main():
...     async with bind("inproc://llm-0") as worker, connect("inproc://llm-0") as front:
...         await front.send([b"hello"])
...         return (await worker.recv()).frames
>>> asyncio.run(main())
[b'hello']

Same semantics as the ZMQ transport where tests can observe them: ROUTER/DEALER addressing,
frames delivered as the very objects sent (no copy), a send to an unknown peer raising
TransportError. Two differences, both stricter: ``connect`` needs the name to be bound already,
and a connected endpoint's ``send`` fails once the bound side is gone (ZMQ would queue and wait
for a reconnect). Queues are unbounded. Names live in one process-wide table.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Final

from omniflow._exceptions import TransportError
from omniflow.transport._base import (
    Endpoint,
    EndpointState,
    Packet,
    Transport,
    register_transport,
)
from omniflow.transport._codec import Buffer

__all__ = ["InprocTransport"]

#: Put into an inbox at close so a waiting ``recv`` wakes up.
_CLOSED: Final = Packet(None, [])


class _Inbox:
    """An unbounded queue whose close wakes every waiter."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Packet] = asyncio.Queue()

    async def get(self) -> Packet:
        packet = await self.queue.get()
        if packet is _CLOSED:
            self.queue.put_nowait(_CLOSED)  # for the next waiter
            raise asyncio.CancelledError  # Endpoint.recv turns this into RuntimeClosedError
        return packet

    async def get_batch(self) -> list[Packet]:
        """The next packet and every one already queued behind it (up to a close)."""
        batch = [await self.get()]
        queue = self.queue
        while not queue.empty():
            packet = queue.get_nowait()
            if packet is _CLOSED:
                queue.put_nowait(_CLOSED)
                break
            batch.append(packet)
        return batch


class _InprocListener(Endpoint):
    def __init__(self, url: str, name: str, transport: InprocTransport) -> None:
        super().__init__(url, bound=True)
        self._name = name
        self._transport = transport
        self._inbox = _Inbox()
        #: Connected endpoints by identity.
        self.peers: dict[bytes, _InprocConnection] = {}

    def deliver(self, packet: Packet) -> None:
        self._inbox.queue.put_nowait(packet)

    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        conn = self.peers.get(peer) if peer is not None else None
        if conn is None:
            raise TransportError(
                f"{self.url}: peer {peer!r} is not connected (it closed, or never connected)",
                url=self.url,
            )
        conn.deliver(Packet(None, list(frames)))

    async def _recv(self) -> Packet:
        return await self._inbox.get()

    async def _recv_batch(self) -> list[Packet]:
        return await self._inbox.get_batch()

    def _close(self) -> None:
        self._transport.listeners.pop(self._name, None)
        self._inbox.queue.put_nowait(_CLOSED)


class _InprocConnection(Endpoint):
    def __init__(self, url: str, identity: bytes, listener: _InprocListener) -> None:
        super().__init__(url, bound=False, identity=identity)
        self._listener = listener
        self._inbox = _Inbox()

    def deliver(self, packet: Packet) -> None:
        self._inbox.queue.put_nowait(packet)

    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        if self._listener.state is EndpointState.CLOSED:
            raise TransportError(f"{self.url}: the bound endpoint has closed", url=self.url)
        assert self.identity is not None
        self._listener.deliver(Packet(self.identity, list(frames)))

    async def _recv(self) -> Packet:
        return await self._inbox.get()

    async def _recv_batch(self) -> list[Packet]:
        return await self._inbox.get_batch()

    def _close(self) -> None:
        assert self.identity is not None
        if self._listener.peers.get(self.identity) is self:
            del self._listener.peers[self.identity]
        self._inbox.queue.put_nowait(_CLOSED)


class InprocTransport(Transport):
    """Serves ``inproc://``; one instance (registered at import) holds the name table."""

    schemes = ("inproc",)

    def __init__(self) -> None:
        #: Bound endpoints by name.
        self.listeners: dict[str, _InprocListener] = {}

    def bind(self, url: str, *, key: bytes | None = None) -> Endpoint:
        name = _name(url)
        if name in self.listeners:
            raise TransportError(f"{url}: address already in use", url=url)
        listener = _InprocListener(url, name, self)
        self.listeners[name] = listener
        return listener

    def connect(
        self, url: str, *, identity: bytes | None = None, key: bytes | None = None
    ) -> Endpoint:
        listener = self.listeners.get(_name(url))
        if listener is None:
            raise TransportError(
                f"{url}: nothing is bound there; bind it before connecting (inproc does not "
                "wait for a late bind)",
                url=url,
            )
        identity = identity if identity is not None else uuid.uuid4().bytes
        if identity in listener.peers:
            raise TransportError(
                f"{url}: a peer with identity {identity!r} is already connected", url=url
            )
        conn = _InprocConnection(url, identity, listener)
        listener.peers[identity] = conn
        return conn


def _name(url: str) -> str:
    name = url.removeprefix("inproc://")
    if not name or name == url:
        raise TransportError(f"{url!r} is not an inproc URL (inproc://<name>)", url=url)
    return name


register_transport(InprocTransport())
