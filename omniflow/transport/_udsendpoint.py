"""What both ``uds://`` endpoints share (``_uds``): the loop they run on, the inbox and its
waiters or receiver, and the reader/writer plumbing of a connection (its byte stream is
``_udswire``). The bound side is ``_udsrouter.UdsRouter``, the connected side
``_udsdealer.UdsDealer``; each says how it finds the connection of a message and what its
handshake is.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket as _socket
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Final

from omniflow.transport._base import MAX_DELIVERY, Endpoint, EndpointState, Inbox, Packet, Receiver
from omniflow.transport._codec import Buffer
from omniflow.transport._udshandshake import Handshake
from omniflow.transport._udswire import _ONE, MAX_FRAME_BYTES, MSG_NOSIGNAL, Conn, Outbox, pack

__all__ = ["MAX_IDENTITY", "SOCK_FLAGS", "UdsEndpoint"]

#: Longest identity (ZMQ's routing-id limit).
MAX_IDENTITY: Final = 255

#: A non-blocking, close-on-exec stream socket.
SOCK_FLAGS: Final = (
    _socket.SOCK_STREAM | getattr(_socket, "SOCK_NONBLOCK", 0) | getattr(_socket, "SOCK_CLOEXEC", 0)
)


class UdsEndpoint(Endpoint):
    """What both sides share: the loop they run on, the inbox and its waiters, and the
    reader/writer plumbing of a connection."""

    def __init__(
        self, url: str, *, bound: bool, identity: bytes | None, hwm: int, key: bytes | None
    ) -> None:
        super().__init__(url, bound=bound, identity=identity)
        #: With a cluster key, every connection proves it when made (``Handshake``).
        self._hs = Handshake(key) if key is not None else None
        self.authenticated = key is not None
        #: Messages before ``send`` waits (per connection on the bound side).
        self.hwm = hwm
        #: The loop whose readers and writers watch our sockets (attached on first use).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Messages received and not yet handed out, and who waits for them.
        self._in = Inbox()
        #: Where arriving messages go instead of ``_in``'s waiters (``set_receiver``).
        self._receiver: Receiver | None = None
        #: A delivery of what a receiver call left in ``_in`` is due on the next loop turn.
        self._delivering = False

    # ------------------------------------------------------------ loop

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            old = self._loop
            if old is not None and not old.is_closed():
                self._detach(old)
            self._loop = loop
            self._attached(loop)
        return loop

    @abstractmethod
    def _attached(self, loop: asyncio.AbstractEventLoop) -> None:
        """Register our sockets with ``loop`` (first use, or a new loop)."""

    @abstractmethod
    def _detach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Unregister our sockets from ``loop``."""

    def _watch(self, conn: Conn) -> None:
        loop = self._loop
        assert loop is not None
        loop.add_reader(conn.fd, self._on_readable, conn)
        conn.writing = False
        if conn.outbox.queue and conn.ready:
            self._flush(conn)

    def _unwatch(self, conn: Conn, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop if loop is not None else self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(conn.fd)
            if conn.writing:
                loop.remove_writer(conn.fd)
        conn.writing = False

    # ------------------------------------------------------------ reading

    def _on_readable(self, conn: Conn) -> None:
        messages, broken = conn.read()
        if messages:
            receiver = self._receiver
            if (
                receiver is not None
                and not self._delivering
                and not self._in.packets
                and len(messages) <= MAX_DELIVERY
            ):
                # What ``_arrived`` + ``_deliver`` do when nothing waits before these: straight
                # to the receiver, one call (None: the connection is in its handshake).
                batch = self._packets(conn, messages)
                if batch is not None:
                    self._delivered(batch)
                    receiver(batch)
                    messages = []
            if messages:
                self._arrived(conn, messages)
                if self._receiver is None:
                    self._in.wake()
                elif not self._delivering:
                    self._deliver()
        if broken is not None and not conn.closed and self.state is EndpointState.OPEN:
            self._lost(conn, broken)

    def set_receiver(self, receiver: Receiver | None) -> bool:
        self._check_open("receive")
        self._receiver = receiver
        if receiver is not None and self._in.packets and not self._delivering:
            self._delivering = True  # (what arrived before: on the next loop turn)
            self._attach().call_soon(self._deliver)
        return True

    def drain(self) -> bool:
        """``Endpoint.drain``: each connection read until the kernel has nothing more for it
        (``Conn.read`` stops at a short read), then the whole inbox handed to the receiver,
        ``MAX_DELIVERY`` at a time, now (a rare call: a lost peer's last words)."""
        receiver = self._receiver
        if receiver is None or self.state is not EndpointState.OPEN:
            return False
        for conn in self._connections():
            if not conn.closed:
                self._on_readable(conn)
        while self._in.packets and self._receiver is receiver and self.state is EndpointState.OPEN:
            batch = self._next_batch()
            self._delivered(batch)
            receiver(batch)
        return True

    @abstractmethod
    def _connections(self) -> list[Conn]:
        """The connections that may deliver messages."""

    def _deliver(self) -> None:
        """Hand what waits in ``_in`` to the receiver, MAX_DELIVERY at a time, one batch per
        loop turn."""
        self._delivering = False
        packets = self._in.packets
        receiver = self._receiver
        if receiver is None or not packets or self.state is not EndpointState.OPEN:
            return
        batch = self._next_batch()
        if packets:
            self._delivering = True
            assert self._loop is not None
            self._loop.call_soon(self._deliver)
        self._delivered(batch)
        receiver(batch)

    def _next_batch(self) -> list[Packet]:
        """The next (at most MAX_DELIVERY) packets of the inbox, taken out of it."""
        packets = self._in.packets
        if len(packets) <= MAX_DELIVERY:
            batch = list(packets)
            packets.clear()
            return batch
        return [packets.popleft() for _ in range(MAX_DELIVERY)]

    @abstractmethod
    def _arrived(self, conn: Conn, messages: list[list[Buffer]]) -> None:
        """``messages`` came in on ``conn``: put them in the inbox (after the handshake)."""

    @abstractmethod
    def _packets(self, conn: Conn, messages: list[list[Buffer]]) -> list[Packet] | None:
        """``messages`` of ``conn`` as packets, as ``_arrived`` would put them in the inbox;
        None while the connection is in its handshake (then ``_arrived`` takes them)."""

    def try_send(self, frames: Sequence[Buffer], *, peer: bytes | None = None) -> bool:
        """``Endpoint.try_send``; the common case (one frame, on a connection that is ready
        with nothing queued, from the loop the endpoint is attached to) in one step."""
        if len(frames) == 1 and self.state is EndpointState.OPEN:
            conn = self._ready_conn(peer)
            loop = self._loop
            if conn is not None and loop is not None and asyncio._get_running_loop() is loop:
                outbox = conn.outbox
                if not conn.writing and not outbox.queue and not outbox.blocked:
                    frame = frames[0]
                    size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
                    if size <= MAX_FRAME_BYTES:
                        self._push(conn, outbox, ([_ONE.pack(1, size), frame], 12 + size))
                        self._sent += 1
                        self._sent_bytes += size
                        return True
        return super().try_send(frames, peer=peer)

    @abstractmethod
    def _ready_conn(self, peer: bytes | None) -> Conn | None:
        """The connection a message to ``peer`` goes out on if it is ready to write to now
        (past its handshake), else None (``try_send`` then takes the general way)."""

    @abstractmethod
    def _lost(self, conn: Conn, reason: str) -> None:
        """``conn`` broke (EOF, an error, a bad header): drop it, or reconnect."""

    # ------------------------------------------------------------ writing

    def _flush(self, conn: Conn) -> None:
        """Write what ``conn``'s outbox holds; watch for writability if the socket is full."""
        try:
            drained = conn.outbox.write(conn.sock)
        except OSError as exc:
            self._lost(conn, f"writing failed: {exc}")
            return
        loop = self._loop
        if drained:
            if conn.writing and loop is not None:
                loop.remove_writer(conn.fd)
                conn.writing = False
        elif not conn.writing and loop is not None:
            loop.add_writer(conn.fd, self._flush, conn)
            conn.writing = True

    def _push(self, conn: Conn | None, outbox: Outbox, msg: tuple[list[Any], int]) -> None:
        """Queue ``msg`` (there is room) and write what the socket takes. With nothing queued
        before it (the common case) it goes out in one ``sendmsg`` and is never queued."""
        queue = outbox.queue
        if conn is None or conn.writing or queue or not conn.ready:
            queue.append(msg)
            if conn is not None and conn.ready and not conn.writing:
                self._flush(conn)
            return
        try:
            n = conn.sock.sendmsg(msg[0], (), MSG_NOSIGNAL)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            queue.append(msg)  # (as if queued first: a reconnecting dealer sends it later)
            self._lost(conn, f"writing failed: {exc}")
            return
        if n == msg[1]:
            return
        queue.append(msg)
        outbox.head_sent = n  # the rest follows on this connection, when it has room
        loop = self._loop
        if loop is not None:
            loop.add_writer(conn.fd, self._flush, conn)
            conn.writing = True

    async def _send_on(self, conn: Conn | None, outbox: Outbox, frames: Sequence[Buffer]) -> None:
        msg = pack(self.url, frames)
        if outbox.has_room():
            self._push(conn, outbox, msg)
            return
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        outbox.blocked.append((msg, fut))
        await fut  # in the queue now (room freed), or failed

    def _try_send_on(self, conn: Conn | None, outbox: Outbox, frames: Sequence[Buffer]) -> bool:
        if not outbox.has_room():
            return False
        self._push(conn, outbox, pack(self.url, frames))
        return True

    def _attach_now(self) -> None:
        """Attach to the running loop if there is one and it is not ours yet (a send made
        outside a loop is written, or queued, and watched from the first use in one). An
        endpoint serves one thread: while its loop runs, the caller runs in it."""
        loop = self._loop
        if loop is None or not loop.is_running():
            with contextlib.suppress(RuntimeError):
                self._attach()

    # ------------------------------------------------------------ receiving

    async def _recv(self) -> Packet:
        return await self._in.one(self._attach())

    async def _recv_batch(self) -> list[Packet]:
        return await self._in.all(self._attach())

    def _close_conn(self, conn: Conn, *, last_try: bool = False) -> None:
        """Unwatch and close ``conn`` (once); with ``last_try``, first write what its outbox
        holds as far as the socket takes it without blocking."""
        if conn.closed:
            return
        self._unwatch(conn)
        if last_try and conn.ready:
            with contextlib.suppress(OSError):
                conn.outbox.write(conn.sock)
        conn.closed = True
        conn.sock.close()

    def _wake_for_close(self) -> None:
        self._in.cancel()

    def _send_handshake(self, conn: Conn, payload: bytes) -> bool:
        """Write one handshake message on a fresh connection (it fits: nothing else was
        written on it); False (and the connection dropped) if it did not go out whole."""
        msg, size = pack(self.url, [payload])
        try:
            sent = conn.sock.sendmsg(msg, (), MSG_NOSIGNAL)
        except OSError as exc:
            self._lost(conn, f"writing the handshake failed: {exc}")
            return False
        if sent != size:
            self._lost(conn, "the handshake did not fit a fresh connection")
            return False
        return True
