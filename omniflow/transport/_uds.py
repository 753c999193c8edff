"""``uds:///abs/path.sock``: ROUTER/DEALER endpoints over plain Unix-domain stream sockets.

>>> async def main():
...     async with bind("uds:///tmp/of-doc/w.sock") as worker:
...         async with connect(worker.url, identity=b"front-1") as front:
...             await front.send([b"ping"])
...             peer, _ = await worker.recv()
...             await worker.send([b"pong"], peer=peer)
...             return peer, (await front.recv()).frames
>>> asyncio.run(main())                                          # doctest: +SKIP
(b'front-1', [b'pong'])

The same-node fast path of the control plane. libzmq moves every message through its I/O
thread (four thread wake-ups per message, application to I/O thread to socket and back); here
the event loop's own ``add_reader``/``add_writer`` drive the socket, one wake-up per burst.
The semantics are those of ``_zmq``'s ROUTER/DEALER, which the fleet and the worker rely on:

- **Bound side** (ROUTER): a listening socket, file mode 0600 (bound under a temporary name,
  chmod-ed, then renamed into place, so it is never reachable with a wider mode), in a directory
  the caller made private. Each accepted connection first sends a handshake frame
  (``b"OFU\\x01" + identity``); from then on its messages are tagged with that identity. A
  connection from another user id (``SO_PEERCRED``) is refused. A new connection with an
  identity already connected takes the route over (``ROUTER_HANDOVER``). ``send(peer=...)`` to
  an identity with no connection raises TransportError (``ROUTER_MANDATORY``). A live socket at
  the path is refused, a stale file replaced, and the file is removed on close (if it is still
  ours).
- **With a key** (``bind``/``connect`` ``key=``: the cluster key on both sides), the first
  message is instead the keyed handshake (``_udshandshake.Handshake``: hello, challenge, proof;
  each side proves the key for this connection's two nonces). The connected side writes
  nothing else until the bound side's proof held; the bound side delivers nothing of a
  connection, and routes nothing to it, until the connected side's did. A wrong or missing
  proof drops the connection (logged; the connected side retries as after any loss). Such an
  endpoint is ``authenticated``: its messages need no per-message seal.
- **Connected side** (DEALER): a fixed identity. It may send before the bound side exists or
  while it restarts: messages queue and the connection is retried every 10 ms, backing off to
  50 ms (a timer on the loop, non-blocking ``connect``; no thread, no polling in between) until
  it succeeds or the endpoint closes. A peer that goes away (EOF, ECONNRESET, EPIPE) is
  reconnected the same way; it never raises (supervision lives in the fleet, as with ZMQ).
  A message cut by a broken connection is lost (its rest is never sent on the next one), as
  with ZMQ.

Received messages wait for ``recv``/``recv_batch``, or, once ``set_receiver(fn)`` was called,
go to ``fn`` from the readable event itself (at most 256 a call, the rest on the next loop
turns: no future and no task wake-up per burst). A message sent with nothing queued before it
goes out in one ``sendmsg`` and is never queued.

The byte stream of one connection (framing, the outbox, reading and parsing) is
``_udswire``; this module is the endpoints and the loop plumbing around it.

``close()`` wakes a pending ``recv`` with RuntimeClosedError, fails sends still waiting for
room, makes one last non-blocking attempt to write what is queued, removes readers and
writers, closes the sockets and unlinks the socket file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket as _socket
import uuid
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Final

from omniflow._exceptions import TransportError
from omniflow.transport._base import (
    MAX_DELIVERY,
    Endpoint,
    EndpointState,
    Inbox,
    Packet,
    Receiver,
    Transport,
    register_transport,
    socket_file_in_use,
)
from omniflow.transport._codec import Buffer
from omniflow.transport._udshandshake import HANDSHAKE, Handshake, peer_uid
from omniflow.transport._udswire import (
    _ONE,
    EOF,
    MAX_FRAME_BYTES,
    MSG_NOSIGNAL,
    Conn,
    Outbox,
    pack,
)

__all__ = ["UdsTransport"]

logger = logging.getLogger("omniflow.transport")

#: ``Packet(peer, frames)`` without the NamedTuple's Python-level constructor.
_new = tuple.__new__

#: Longest identity (ZMQ's routing-id limit).
MAX_IDENTITY: Final = 255

#: Reconnect delays of the connected side: the first retry, and the cap of its doubling.
_RETRY_MIN: Final = 0.01
_RETRY_MAX: Final = 0.05

_SOCK_FLAGS: Final = (
    _socket.SOCK_STREAM | getattr(_socket, "SOCK_NONBLOCK", 0) | getattr(_socket, "SOCK_CLOEXEC", 0)
)


# ---------------------------------------------------------------------------- the endpoints


class _UdsEndpoint(Endpoint):
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


class _UdsRouter(_UdsEndpoint):
    """The bound side: accepts connections, routes by the identity each one announced."""

    def __init__(
        self,
        url: str,
        listener: _socket.socket,
        path: str,
        inode: int,
        *,
        hwm: int,
        key: bytes | None = None,
    ) -> None:
        super().__init__(url, bound=True, identity=None, hwm=hwm, key=key)
        self._listener = listener
        self._lfd = listener.fileno()
        #: The socket file, and its inode (unlinked at close only if it is still ours).
        self._path = path
        self._inode = inode
        #: Every accepted connection, before and after its handshake.
        self._conns: set[Conn] = set()
        #: Connections by the identity their handshake announced.
        self._peers: dict[bytes, Conn] = {}
        #: Connections dropped for a broken stream, a bad handshake or another user.
        self.dropped = 0
        with contextlib.suppress(RuntimeError):  # accept from now on if a loop runs
            self._attach()

    def _attached(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self._lfd, self._accept)
        for conn in self._conns:
            self._watch(conn)
        self._accept()  # connections that queued in the backlog before the reader

    def _detach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._lfd)
        for conn in self._conns:
            self._unwatch(conn, loop)

    def _accept(self) -> None:
        uid = os.getuid()
        while self.state is EndpointState.OPEN:
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: try again on the next wake-up
                logger.warning("%s: cannot accept a connection: %s", self.url, exc)
                return
            other = peer_uid(sock)
            if other is not None and other != uid:
                logger.warning(
                    "%s: refused a connection from user id %d (only %d may connect)",
                    self.url, other, uid,
                )  # fmt: skip
                self.dropped += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = Conn(sock, Outbox(self.hwm))
            conn.ready = self._hs is None  # (keyed: once its proof held)
            self._conns.add(conn)
            self._watch(conn)

    def _connections(self) -> list[Conn]:
        return list(self._conns)

    def _arrived(self, conn: Conn, messages: list[list[Buffer]]) -> None:
        inbox = self._in.packets
        identity = conn.identity
        for frames in messages:
            if identity is None:
                identity = self._handshake(conn, frames)
                if conn.closed:
                    return
                continue
            inbox.append(Packet(identity, frames))

    def _packets(self, conn: Conn, messages: list[list[Buffer]]) -> list[Packet] | None:
        identity = conn.identity
        if identity is None:
            return None
        return [_new(Packet, (identity, frames)) for frames in messages]

    def _ready_conn(self, peer: bytes | None) -> Conn | None:
        conn = self._peers.get(peer) if peer is not None else None
        return conn if conn is not None and conn.ready else None

    def _handshake(self, conn: Conn, frames: list[Buffer]) -> bytes | None:
        """Take the next handshake message of ``conn``: its identity once the handshake is
        complete, else None (and ``conn`` dropped if the message was wrong)."""
        hs = self._hs
        if hs is not None:
            return self._keyed_handshake(hs, conn, frames)
        first = bytes(frames[0])
        identity = first[len(HANDSHAKE) :]
        if len(frames) != 1 or not first.startswith(HANDSHAKE) or not identity:
            self._lost(
                conn,
                "its first message is not a uds handshake (another program, a peer that "
                "proves a cluster key where none is set here, or another omniflow wire "
                "version)",
            )
            return None
        return self._route(conn, identity)

    def _keyed_handshake(self, hs: Handshake, conn: Conn, frames: list[Buffer]) -> bytes | None:
        if conn.hs is None:  # the hello: answer with our nonce and proof
            hello = hs.read_hello(frames)
            if hello is None or len(hello[1]) > MAX_IDENTITY:
                self._lost(
                    conn,
                    "its first message is not an authenticated uds handshake (a peer "
                    "without the cluster key, or another omniflow wire version)",
                )
                return None
            n_connected, identity = hello
            n_bound = hs.nonce()
            if self._send_handshake(conn, hs.challenge(n_connected, n_bound, identity)):
                conn.hs = (n_connected, n_bound, identity)
            return None
        n_connected, n_bound, identity = conn.hs
        if not hs.check_answer(frames, n_connected, n_bound, identity):
            self._lost(conn, "it did not prove the cluster key (a peer with another key)")
            return None
        conn.hs = None
        conn.ready = True
        return self._route(conn, identity)

    def _route(self, conn: Conn, identity: bytes) -> bytes:
        old = self._peers.get(identity)
        if old is not None:  # ROUTER_HANDOVER: the newest connection takes the route
            self._drop(old, "a new connection with the same identity took its route over")
        conn.identity = identity
        self._peers[identity] = conn
        return identity

    def _lost(self, conn: Conn, reason: str) -> None:
        if reason != EOF:
            logger.warning(
                "%s: dropped the connection of peer %s: %s",
                self.url, conn.identity.hex() if conn.identity else "-", reason,
            )  # fmt: skip
            self.dropped += 1
        self._drop(conn, reason)

    def _drop(self, conn: Conn, reason: str) -> None:
        if conn.closed:
            return
        self._close_conn(conn)
        self._conns.discard(conn)
        if conn.identity is not None and self._peers.get(conn.identity) is conn:
            del self._peers[conn.identity]
        conn.outbox.fail(self._gone(conn.identity, reason))

    def _gone(self, peer: bytes | None, why: str) -> TransportError:
        return TransportError(
            f"{self.url}: peer {peer!r} is not connected (it closed, or never sent a message "
            f"here): {why}",
            url=self.url,
        )

    def _conn_for(self, peer: bytes | None) -> Conn:
        conn = self._peers.get(peer) if peer is not None else None
        if conn is None:
            raise self._gone(peer, "no connection with that identity")
        return conn

    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        self._attach()
        conn = self._conn_for(peer)
        await self._send_on(conn, conn.outbox, frames)

    def _try_send(self, frames: Sequence[Buffer], peer: bytes | None) -> bool:
        self._attach_now()  # (outside a loop: written, but not watched)
        conn = self._conn_for(peer)
        return self._try_send_on(conn, conn.outbox, frames)

    def _close(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._lfd)
        self._wake_for_close()
        for conn in list(self._conns):
            self._close_conn(conn, last_try=True)
            conn.outbox.fail(self._closed_error("send"))
        self._conns.clear()
        self._peers.clear()
        self._listener.close()
        with contextlib.suppress(OSError):
            if os.stat(self._path).st_ino == self._inode:
                os.unlink(self._path)

    def statistics(self) -> dict[str, int]:
        """The base counters, plus connections now open and connections dropped."""
        return {**super().statistics(), "peers": len(self._peers), "dropped": self.dropped}

    def validate(self) -> None:
        """Check the routing table against the connections (tests call it)."""
        for identity, conn in self._peers.items():
            assert conn.identity == identity and conn in self._conns
        for conn in self._conns:
            conn.outbox.validate()


class _UdsDealer(_UdsEndpoint):
    """The connected side: one connection, re-made whenever it is missing."""

    def __init__(
        self, url: str, path: str, identity: bytes, *, hwm: int, key: bytes | None = None
    ) -> None:
        super().__init__(url, bound=False, identity=identity, hwm=hwm, key=key)
        self._path = path
        #: Messages accepted and not yet written; outlives the connections.
        self._outbox = Outbox(hwm)
        #: The live connection (None while connecting).
        self._conn: Conn | None = None
        #: The pending reconnect timer, and the delay of the next one.
        self._retry: asyncio.TimerHandle | None = None
        self._delay = _RETRY_MIN
        #: Connections made so far (1 + reconnects).
        self.connects = 0
        with contextlib.suppress(RuntimeError):  # connect now if a loop runs
            self._attach()

    def _attached(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._conn is not None:
            self._watch(self._conn)
        else:
            self._connect()

    def _detach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._conn is not None:
            self._unwatch(self._conn, loop)

    def _connect(self) -> None:
        self._retry = None
        if self.state is not EndpointState.OPEN or self._conn is not None:
            return
        sock = _socket.socket(_socket.AF_UNIX, _SOCK_FLAGS)
        try:
            sock.setblocking(False)
            sock.connect(self._path)
            identity = self.identity or b""
            nonce = b""
            if self._hs is None:
                first = HANDSHAKE + identity
            else:
                nonce = self._hs.nonce()
                first = self._hs.hello(nonce, identity)
            hello = pack(self.url, [first])[0]
            if sock.sendmsg(hello, (), MSG_NOSIGNAL) != 12 + len(hello[1]):
                raise BlockingIOError("the handshake did not fit a fresh connection")
        except OSError:  # not bound (yet, or any more), backlog full, or gone already
            sock.close()
            self._schedule()
            return
        self.connects += 1
        conn = self._conn = Conn(sock, self._outbox)
        if self._hs is not None:  # nothing goes out before the bound side's proof held
            conn.ready = False
            conn.hs = (nonce,)
        self._watch(conn)

    def _schedule(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or self._retry is not None:
            return
        self._retry = loop.call_later(self._delay, self._connect)
        self._delay = min(self._delay * 2, _RETRY_MAX)

    def _arrived(self, conn: Conn, messages: list[list[Buffer]]) -> None:
        inbox = self._in.packets
        for frames in messages:
            if not conn.ready:
                if not self._authenticate(conn, frames):
                    return
                continue
            inbox.append(Packet(None, frames))
        self._delay = _RETRY_MIN  # a working connection: the next loss retries fast again

    def _packets(self, conn: Conn, messages: list[list[Buffer]]) -> list[Packet] | None:
        if not conn.ready:
            return None
        self._delay = _RETRY_MIN  # (as ``_arrived``)
        return [_new(Packet, (None, frames)) for frames in messages]

    def _ready_conn(self, peer: bytes | None) -> Conn | None:
        conn = self._conn
        return conn if peer is None and conn is not None and conn.ready else None

    def _connections(self) -> list[Conn]:
        return [self._conn] if self._conn is not None else []

    def _authenticate(self, conn: Conn, frames: list[Buffer]) -> bool:
        """Check the bound side's challenge, answer it, and start writing; False (and the
        connection dropped, then re-made later) if the bound side did not prove the key."""
        hs, identity = self._hs, self.identity or b""
        assert hs is not None and conn.hs is not None
        (nonce,) = conn.hs
        n_bound = hs.read_challenge(frames, nonce, identity)
        if n_bound is None:
            logger.warning(
                "%s: the bound side did not prove the cluster key (another key, or not an "
                "omniflow uds endpoint opened with one); dropped, retrying",
                self.url,
            )
            self._lost(conn, "the bound side did not prove the cluster key")
            return False
        if not self._send_handshake(conn, hs.answer(nonce, n_bound, identity)):
            return False
        conn.hs = None
        conn.ready = True
        if conn.outbox.queue and not conn.writing:
            self._flush(conn)
        return True

    def _lost(self, conn: Conn, reason: str) -> None:
        if conn is not self._conn:
            return
        logger.debug("%s: connection lost (%s); reconnecting", self.url, reason)
        self._close_conn(conn)
        self._conn = None
        self._outbox.drop_partial()
        self._schedule()

    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        self._attach()
        await self._send_on(self._conn, self._outbox, frames)

    def _try_send(self, frames: Sequence[Buffer], peer: bytes | None) -> bool:
        self._attach_now()  # (outside a loop: queued for the first use)
        return self._try_send_on(self._conn, self._outbox, frames)

    def _close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._wake_for_close()
        if self._conn is not None:
            self._close_conn(self._conn, last_try=True)
            self._conn = None
        self._outbox.fail(self._closed_error("send"))

    def statistics(self) -> dict[str, int]:
        """The base counters, plus connections made and messages waiting to be written."""
        return {**super().statistics(), "connects": self.connects,
                "queued": len(self._outbox.queue)}  # fmt: skip

    def validate(self) -> None:
        """Check the outbox's invariants (tests call it)."""
        self._outbox.validate()


# ------------------------------------------------------------------------------ the transport


class UdsTransport(Transport):
    """Serves ``uds:///abs/path.sock``.

    ``hwm``: messages that may wait to be written per connection before ``send`` waits too
    (ZMQ's high-water mark).
    """

    schemes = ("uds",)

    def __init__(self, *, hwm: int = 1000) -> None:
        #: Messages per connection before ``send`` waits.
        self.hwm = hwm

    def bind(self, url: str, *, key: bytes | None = None) -> Endpoint:
        path = _path(url)
        if socket_file_in_use(path):
            raise TransportError(f"{url}: address already in use by a live socket", url=url)
        listener = _socket.socket(_socket.AF_UNIX, _SOCK_FLAGS)
        try:
            listener.setblocking(False)
            _bind_private(listener, path)
            listener.listen(_socket.SOMAXCONN)
            inode = os.stat(path).st_ino
        except OSError as exc:
            listener.close()
            raise TransportError(f"{url}: cannot bind: {exc}", url=url) from exc
        return _UdsRouter(url, listener, path, inode, hwm=self.hwm, key=key)

    def connect(
        self, url: str, *, identity: bytes | None = None, key: bytes | None = None
    ) -> Endpoint:
        path = _path(url)
        identity = identity if identity is not None else uuid.uuid4().bytes
        if not 0 < len(identity) <= MAX_IDENTITY:
            raise TransportError(
                f"{url}: an identity is 1 to {MAX_IDENTITY} bytes, got {len(identity)}", url=url
            )
        return _UdsDealer(url, path, identity, hwm=self.hwm, key=key)


def _path(url: str) -> str:
    path = url.removeprefix("uds://")
    if path == url or not path.startswith("/"):
        raise TransportError(
            f"{url!r} is not a uds URL: expected uds:// and an absolute path, e.g. "
            "uds:///run/omniflow/w0.sock",
            url=url,
        )
    if len(os.fsencode(path)) > 107:
        raise TransportError(
            f"{url}: the socket path is {len(os.fsencode(path))} bytes, over the 107 a Unix "
            "socket address holds; use a shorter directory",
            url=url,
        )
    return path


def _bind_private(listener: _socket.socket, path: str) -> None:
    """Bind ``path`` with mode 0600 from the first moment it is reachable: bind a temporary
    name beside it, chmod, rename over ``path`` (which also replaces a stale file)."""
    tmp = os.path.join(os.path.dirname(path), f".of{secrets.token_hex(4)}")
    if len(os.fsencode(tmp)) > 107:  # no room for the temporary name: rely on the directory
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale (socket_file_in_use said nothing listens)
        listener.bind(path)
        os.chmod(path, 0o600)
        return
    listener.bind(tmp)
    try:
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


register_transport(UdsTransport())
