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
- **Connected side** (DEALER): a fixed identity. It may send before the bound side exists or
  while it restarts: messages queue and the connection is retried every 10 ms, backing off to
  50 ms (a timer on the loop, non-blocking ``connect``; no thread, no polling in between) until
  it succeeds or the endpoint closes. A peer that goes away (EOF, ECONNRESET, EPIPE) is
  reconnected the same way; it never raises (supervision lives in the fleet, as with ZMQ).
  A message cut by a broken connection is lost (its rest is never sent on the next one), as
  with ZMQ.

Wire: per message, a header ``<u32 frame count><u64 length>*count`` and then the frames,
written with ``socket.sendmsg`` (scatter: no joining copy), non-blocking. A message that
cannot be written now, or only in part, waits in the connection's outbox, which
``loop.add_writer`` drains in order (several messages per ``sendmsg``); ``try_send`` and
``send`` never overtake it. Up to ``hwm`` messages may wait (ZMQ's high-water mark, 1000);
``send`` beyond that waits for room, ``try_send`` returns False.

Reads: one ``add_reader`` callback reads what is readable (``recv_into`` a reusable 256 KiB
buffer) and parses every complete message in it, so a burst is one ``recv_batch``. Frames up
to 64 KiB are returned as ``bytes`` (what the MAC and the codec's fast paths want); a bigger
frame is read straight into a buffer of its own size (no growing concatenation), a writable
``memoryview`` over an anonymous ``mmap`` that the connection recycles once the receiver let go
of every view of it (``_Slabs``). (A fresh ``bytearray`` per frame is zero-filled by hand and,
freed, makes glibc move its mmap threshold and trim the heap on every message, which slowed
the codec's next ``encode`` tenfold; a fresh mmap per frame faults its pages in, ~0.6 ms a MiB
here.) A header
announcing more than ``MAX_FRAMES`` frames or a frame over ``MAX_FRAME_BYTES`` drops that
connection with a logged reason before anything of that size is allocated. Framing is not
authentication: every message is sealed and checked one layer up (``_auth``), and only this
user can connect at all.

``close()`` wakes a pending ``recv`` with RuntimeClosedError, fails sends still waiting for
room, makes one last non-blocking attempt to write what is queued, removes readers and
writers, closes the sockets and unlinks the socket file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
import socket as _socket
import struct
import sys
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

from omniflow._exceptions import TransportError
from omniflow.transport._base import (
    Endpoint,
    EndpointState,
    Packet,
    Transport,
    register_transport,
)
from omniflow.transport._codec import Buffer

__all__ = ["MAX_FRAMES", "MAX_FRAME_BYTES", "UdsTransport"]

logger = logging.getLogger("omniflow.transport")

#: At most this many frames per message (a header announcing more drops the connection).
MAX_FRAMES: Final = 1000
#: At most this many bytes per frame (a header announcing more drops the connection).
MAX_FRAME_BYTES: Final = 1 << 32
#: The first message of every connection: this, then the connected side's identity.
HANDSHAKE: Final = b"OFU\x01"
#: Longest identity (ZMQ's routing-id limit).
MAX_IDENTITY: Final = 255

#: Frames up to this size are copied out of the read buffer as ``bytes``; bigger ones get a
#: buffer of their own and are read into it directly.
_SMALL: Final = 64 * 1024
#: The reusable read buffer (a burst of small messages is parsed out of one ``recv_into``).
_RBUF: Final = 256 * 1024
#: Big-frame slabs a connection keeps for reuse, and the largest it keeps.
_KEEP: Final = 4
_KEEP_BYTES: Final = 16 << 20
#: Buffers per ``sendmsg`` when the outbox drains (IOV_MAX is 1024 on Linux).
_IOV: Final = 512
#: Socket send buffer asked for (the kernel caps it at net.core.wmem_max): the writer wakes
#: when the peer drained most of it, so a big one keeps a large frame from stalling on
#: loop wake-ups every 200 KiB.
_SNDBUF: Final = 4 << 20
#: Reconnect delays of the connected side: the first retry, and the cap of its doubling.
_RETRY_MIN: Final = 0.01
_RETRY_MAX: Final = 0.05

_COUNT = struct.Struct("<I")
_ONE = struct.Struct("<IQ")
_MSG_NOSIGNAL: Final = getattr(_socket, "MSG_NOSIGNAL", 0)
_SOCK_FLAGS: Final = (
    _socket.SOCK_STREAM | getattr(_socket, "SOCK_NONBLOCK", 0) | getattr(_socket, "SOCK_CLOEXEC", 0)
)


#: Why a connection ended when its peer simply closed it (not worth a warning).
_EOF: Final = "the peer closed the connection"


class _Broken(Exception):
    """A connection's byte stream cannot be parsed any further (the reason is the message)."""


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


def _pack(url: str, frames: Sequence[Buffer]) -> tuple[list[Any], int]:
    """``[header, *frames]`` and the message's size on the wire."""
    n = len(frames)
    if n == 1:
        size = _nbytes(frames[0])
        if size > MAX_FRAME_BYTES:
            raise _too_big(url, size)
        return [_ONE.pack(1, size), frames[0]], 12 + size
    if n > MAX_FRAMES:
        raise TransportError(
            f"{url}: a message of {n} frames is more than the {MAX_FRAMES} a uds endpoint "
            "carries; send fewer, bigger frames",
            url=url,
        )
    sizes = [_nbytes(f) for f in frames]
    for size in sizes:
        if size > MAX_FRAME_BYTES:
            raise _too_big(url, size)
    header = struct.pack(f"<I{n}Q", n, *sizes)
    return [header, *frames], len(header) + sum(sizes)


def _too_big(url: str, size: int) -> TransportError:
    return TransportError(
        f"{url}: a frame of {size:,} bytes is over the {MAX_FRAME_BYTES:,}-byte limit of a uds "
        "frame; split it, or move it through the data plane",
        url=url,
    )


class _Slabs:
    """Buffers for one connection's big frames: anonymous mmaps, recycled once nothing refers
    to them any more (the receiver dropped every view of the frame), so a steady stream of big
    frames reuses pages already mapped instead of faulting fresh ones in (~0.6 ms a MiB here).

    A slab is free when its only references are this list's and ``getrefcount``'s own: every
    view handed out (and every numpy array or tensor made from one) holds a reference through
    the buffer export. At most ``_KEEP`` slabs of at most ``_KEEP_BYTES`` each are kept.
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        #: Slabs this connection may reuse (each possibly still in use by a receiver).
        self._kept: list[mmap.mmap] = []

    def take(self, size: int) -> memoryview:
        """A writable buffer of exactly ``size`` bytes (its contents are to be overwritten)."""
        for slab in self._kept:
            if size <= len(slab) <= 2 * size and sys.getrefcount(slab) == 3:
                return memoryview(slab)[:size]  # 3: the list, ``slab``, getrefcount's argument
        slab = mmap.mmap(-1, size)
        if size <= _KEEP_BYTES:
            if len(self._kept) >= _KEEP:
                self._kept.pop(0)  # the oldest goes (freed with its last view)
            self._kept.append(slab)
        return memoryview(slab)


def _octets(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# ------------------------------------------------------------------------------------ outbox


class _Outbox:
    """Messages accepted for sending and not yet (fully) written, oldest first.

    The connected side keeps one for life (it outlives reconnects); the bound side one per
    connection.
    """

    __slots__ = ("blocked", "head_sent", "hwm", "queue")

    def __init__(self, hwm: int) -> None:
        #: ``([header, *frames], wire size)`` per accepted message.
        self.queue: deque[tuple[list[Any], int]] = deque()
        #: Bytes of ``queue[0]`` already written (its rest must follow on the same connection).
        self.head_sent = 0
        #: Sends waiting for room (the queue is at ``hwm``), in order, with their futures.
        self.blocked: deque[tuple[tuple[list[Any], int], asyncio.Future[None]]] = deque()
        #: How many messages may wait before ``send`` waits too.
        self.hwm = hwm

    def has_room(self) -> bool:
        return not self.blocked and len(self.queue) < self.hwm

    def write(self, sock: _socket.socket) -> bool:
        """Write queued messages until the socket would block; True once the queue is empty.
        Raises OSError when the connection is broken."""
        queue = self.queue
        while queue:
            bufs: list[Any] = []
            first = True
            for parts, _size in queue:
                if first and self.head_sent:
                    bufs.extend(self._rest(parts))
                elif len(bufs) + len(parts) > _IOV and bufs:
                    break  # IOV_MAX bounds one sendmsg; the rest goes in the next one
                else:
                    bufs.extend(parts)
                first = False
            try:
                n = sock.sendmsg(bufs, (), _MSG_NOSIGNAL)
            except BlockingIOError:
                return False
            full = self._advance(n)
            self._admit()
            if not full:
                return False
        return True

    def _rest(self, parts: list[Any]) -> list[Any]:
        """What is left to write of the head message."""
        skip = self.head_sent
        rest: list[Any] = []
        for part in parts:
            size = _nbytes(part)
            if skip >= size:
                skip -= size
                continue
            rest.append(_octets(part)[skip:] if skip else part)
            skip = 0
        return rest

    def _advance(self, n: int) -> bool:
        """``n`` more bytes went out: drop the messages they complete. Whether every buffer
        handed to that ``sendmsg`` went (no partial write)."""
        queue = self.queue
        while n and queue:
            left = queue[0][1] - self.head_sent
            if n < left:
                self.head_sent += n
                return False
            n -= left
            self.head_sent = 0
            queue.popleft()
        # An empty message never occurs (a header has at least 12 bytes), so n is spent here.
        return True

    def _admit(self) -> None:
        """Move waiting sends into the queue as room frees (their ``send`` returns)."""
        while self.blocked and len(self.queue) < self.hwm:
            msg, fut = self.blocked.popleft()
            if fut.done():  # its sender was cancelled: the message is not sent
                continue
            self.queue.append(msg)
            fut.set_result(None)

    def drop_partial(self) -> None:
        """The connection broke: a message cut in the middle is lost (never resumed on the
        next connection, whose peer would read garbage)."""
        if self.head_sent:
            self.queue.popleft()
            self.head_sent = 0
            self._admit()

    def fail(self, error: BaseException) -> None:
        """Fail every waiting send and forget every queued message."""
        for _msg, fut in self.blocked:
            if not fut.done():
                fut.set_exception(error)
        self.blocked.clear()
        self.queue.clear()
        self.head_sent = 0

    def validate(self) -> None:
        assert self.head_sent == 0 or (self.queue and self.head_sent < self.queue[0][1])
        assert len(self.queue) <= self.hwm
        assert (
            not self.blocked
            or len(self.queue) == self.hwm
            or all(f.done() for _m, f in self.blocked)
        )


# ------------------------------------------------------------------------------ a connection


class _Conn:
    """One socket connection: its read state (header, frames so far) and, on the bound side,
    its identity and outbox."""

    __slots__ = (
        "_big",
        "_big_pos",
        "_buf",
        "_end",
        "_fi",
        "_frames",
        "_lens",
        "_slabs",
        "_start",
        "_view",
        "closed",
        "fd",
        "identity",
        "outbox",
        "sock",
        "writing",
    )

    def __init__(self, sock: _socket.socket, outbox: _Outbox) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, _SNDBUF)
        #: The connected socket (non-blocking).
        self.sock = sock
        self.fd = sock.fileno()
        #: The peer's identity once its handshake arrived (bound side); None before.
        self.identity: bytes | None = None
        #: What waits to be written on this connection.
        self.outbox = outbox
        #: Whether a writer is registered for ``fd`` (the socket was full).
        self.writing = False
        #: Set once the socket is closed (its fd number may already belong to another).
        self.closed = False
        self._buf = bytearray(_RBUF)
        self._view = memoryview(self._buf)
        #: Unparsed bytes are ``_buf[_start:_end]``.
        self._start = 0
        self._end = 0
        #: Frame lengths of the message being read (None between messages), the index of the
        #: frame being read, and the frames complete so far.
        self._lens: Sequence[int] | None = None
        self._fi = 0
        self._frames: list[Buffer] = []
        #: A big frame being read straight into its own buffer, and how far it is filled.
        self._big: memoryview | None = None
        self._big_pos = 0
        #: Where big frames' buffers come from.
        self._slabs = _Slabs()

    def read(self) -> tuple[list[list[Buffer]], str | None]:
        """Read what the socket has: the messages completed, and why the connection must be
        dropped (None while it is fine)."""
        done: list[list[Buffer]] = []
        sock = self.sock
        try:
            while True:
                big = self._big
                if big is not None:
                    n = sock.recv_into(big[self._big_pos :])
                    if n == 0:
                        return done, _EOF
                    self._big_pos += n
                    if self._big_pos == len(big):
                        self._frames.append(big)
                        self._big = None
                        self._fi += 1
                        self._parse(done)
                    continue  # a big frame streams in: read until EAGAIN
                start, end = self._start, self._end
                if start == end:
                    self._start = self._end = end = 0
                elif _RBUF - end < _SMALL:
                    # What is left is part of one header or small frame (< 64 KiB): move it
                    # to the front so the whole of it fits.
                    end -= start
                    self._buf[:end] = bytes(self._view[start : start + end])  # may overlap
                    self._start, self._end = 0, end
                space = _RBUF - end
                n = sock.recv_into(self._view[end:])
                if n == 0:
                    return done, _EOF
                self._end = end + n
                self._parse(done)
                if n < space and self._big is None:
                    return done, None  # all that was readable (the reader is level-triggered)
        except BlockingIOError:
            return done, None
        except _Broken as exc:
            return done, str(exc)
        except OSError as exc:
            return done, f"reading failed: {exc}"

    def _parse(self, done: list[list[Buffer]]) -> None:
        """Take every complete message out of the read buffer into ``done``; start a big frame
        if one is under way."""
        buf, view = self._buf, self._view
        start, end = self._start, self._end
        lens, fi, frames = self._lens, self._fi, self._frames
        while True:
            if lens is None:
                avail = end - start
                if avail < 4:
                    break
                (count,) = _COUNT.unpack_from(buf, start)
                if count == 1:
                    if avail < 12:
                        break
                    lens = (_ONE.unpack_from(buf, start)[1],)
                    start += 12
                else:
                    if not 0 < count <= MAX_FRAMES:
                        raise _Broken(
                            f"a message header announces {count} frames (1 to {MAX_FRAMES} "
                            "allowed): not an omniflow uds peer, or a broken one"
                        )
                    if avail < 4 + 8 * count:
                        break
                    lens = struct.unpack_from(f"<{count}Q", buf, start + 4)
                    start += 4 + 8 * count
                for size in lens:
                    if size > MAX_FRAME_BYTES:
                        raise _Broken(
                            f"a message header announces a frame of {size:,} bytes (at most "
                            f"{MAX_FRAME_BYTES:,}): not an omniflow uds peer, or a broken one"
                        )
                fi, frames = 0, []
            while fi < len(lens):
                size = lens[fi]
                avail = end - start
                if size <= _SMALL:
                    if avail < size:
                        break
                    frames.append(bytes(view[start : start + size]))
                    start += size
                else:
                    big = self._slabs.take(size)
                    take = min(avail, size)
                    big[:take] = view[start : start + take]
                    start += take
                    if take < size:
                        self._big, self._big_pos = big, take
                        break
                    frames.append(big)
                fi += 1
            else:
                done.append(frames)
                lens, frames = None, []  # the message is the caller's now: hold no reference
                continue
            break
        self._start, self._end = start, end
        self._lens, self._fi, self._frames = lens, fi, frames


def _peer_uid(sock: _socket.socket) -> int | None:
    """The user id of the process at the other end (None where the OS does not say)."""
    opt = getattr(_socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, opt, 12))
    except OSError:
        return None
    return int(uid)


# ---------------------------------------------------------------------------- the endpoints


class _UdsEndpoint(Endpoint):
    """What both sides share: the loop they run on, the inbox and its waiters, and the
    reader/writer plumbing of a connection."""

    def __init__(self, url: str, *, bound: bool, identity: bytes | None, hwm: int) -> None:
        super().__init__(url, bound=bound, identity=identity)
        #: Messages before ``send`` waits (per connection on the bound side).
        self.hwm = hwm
        #: The loop whose readers and writers watch our sockets (attached on first use).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Messages received and not yet handed out, oldest first.
        self._inbox: deque[Packet] = deque()
        #: Receivers waiting for the inbox to fill.
        self._waiters: deque[asyncio.Future[None]] = deque()

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

    def _attached(self, loop: asyncio.AbstractEventLoop) -> None:
        """Register our sockets with ``loop`` (first use, or a new loop)."""

    def _detach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Unregister our sockets from ``loop``."""

    def _watch(self, conn: _Conn) -> None:
        loop = self._loop
        assert loop is not None
        loop.add_reader(conn.fd, self._on_readable, conn)
        conn.writing = False
        if conn.outbox.queue:
            self._flush(conn)

    def _unwatch(self, conn: _Conn, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop if loop is not None else self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(conn.fd)
            if conn.writing:
                loop.remove_writer(conn.fd)
        conn.writing = False

    # ------------------------------------------------------------ reading

    def _on_readable(self, conn: _Conn) -> None:
        messages, broken = conn.read()
        if messages:
            self._arrived(conn, messages)
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)
        if broken is not None and not conn.closed and self.state is EndpointState.OPEN:
            self._lost(conn, broken)

    def _arrived(self, conn: _Conn, messages: list[list[Buffer]]) -> None:
        raise NotImplementedError

    def _lost(self, conn: _Conn, reason: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ writing

    def _flush(self, conn: _Conn) -> None:
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

    async def _send_on(self, conn: _Conn | None, outbox: _Outbox, frames: Sequence[Buffer]) -> None:
        msg = _pack(self.url, frames)
        if outbox.has_room():
            outbox.queue.append(msg)
        else:
            assert self._loop is not None
            fut: asyncio.Future[None] = self._loop.create_future()
            outbox.blocked.append((msg, fut))
            await fut  # in the queue now (room freed), or failed
            return
        if conn is not None and not conn.writing:
            self._flush(conn)

    def _try_send_on(self, conn: _Conn | None, outbox: _Outbox, frames: Sequence[Buffer]) -> bool:
        if not outbox.has_room():
            return False
        outbox.queue.append(_pack(self.url, frames))
        if conn is not None and not conn.writing:
            self._flush(conn)
        return True

    # ------------------------------------------------------------ receiving

    async def _recv(self) -> Packet:
        await self._wait()
        return self._inbox.popleft()

    async def _recv_batch(self) -> list[Packet]:
        await self._wait()
        batch = list(self._inbox)
        self._inbox.clear()
        return batch

    async def _wait(self) -> None:
        loop = self._attach()
        while not self._inbox:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)

    def _close_conn(self, conn: _Conn, *, last_try: bool = False) -> None:
        """Unwatch and close ``conn`` (once); with ``last_try``, first write what its outbox
        holds as far as the socket takes it without blocking."""
        if conn.closed:
            return
        self._unwatch(conn)
        if last_try:
            with contextlib.suppress(OSError):
                conn.outbox.write(conn.sock)
        conn.closed = True
        conn.sock.close()

    def _wake_for_close(self) -> None:
        for waiter in self._waiters:
            waiter.cancel()


class _UdsRouter(_UdsEndpoint):
    """The bound side: accepts connections, routes by the identity each one announced."""

    def __init__(
        self, url: str, listener: _socket.socket, path: str, inode: int, *, hwm: int
    ) -> None:
        super().__init__(url, bound=True, identity=None, hwm=hwm)
        self._listener = listener
        self._lfd = listener.fileno()
        #: The socket file, and its inode (unlinked at close only if it is still ours).
        self._path = path
        self._inode = inode
        #: Every accepted connection, before and after its handshake.
        self._conns: set[_Conn] = set()
        #: Connections by the identity their handshake announced.
        self._peers: dict[bytes, _Conn] = {}
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
            peer_uid = _peer_uid(sock)
            if peer_uid is not None and peer_uid != uid:
                logger.warning(
                    "%s: refused a connection from user id %d (only %d may connect)",
                    self.url, peer_uid, uid,
                )  # fmt: skip
                self.dropped += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, _Outbox(self.hwm))
            self._conns.add(conn)
            self._watch(conn)

    def _arrived(self, conn: _Conn, messages: list[list[Buffer]]) -> None:
        inbox = self._inbox
        identity = conn.identity
        for frames in messages:
            if identity is None:
                identity = self._handshake(conn, frames)
                if identity is None:
                    return
                continue
            inbox.append(Packet(identity, frames))

    def _handshake(self, conn: _Conn, frames: list[Buffer]) -> bytes | None:
        first = bytes(frames[0])
        identity = first[len(HANDSHAKE) :]
        if len(frames) != 1 or not first.startswith(HANDSHAKE) or not identity:
            self._lost(
                conn,
                "its first message is not a uds handshake (another program, or another "
                "omniflow wire version)",
            )
            return None
        old = self._peers.get(identity)
        if old is not None:  # ROUTER_HANDOVER: the newest connection takes the route
            self._drop(old, "a new connection with the same identity took its route over")
        conn.identity = identity
        self._peers[identity] = conn
        return identity

    def _lost(self, conn: _Conn, reason: str) -> None:
        if reason != _EOF:
            logger.warning(
                "%s: dropped the connection of peer %s: %s",
                self.url, conn.identity.hex() if conn.identity else "-", reason,
            )  # fmt: skip
            self.dropped += 1
        self._drop(conn, reason)

    def _drop(self, conn: _Conn, reason: str) -> None:
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

    def _conn_for(self, peer: bytes | None) -> _Conn:
        conn = self._peers.get(peer) if peer is not None else None
        if conn is None:
            raise self._gone(peer, "no connection with that identity")
        return conn

    async def _send(self, frames: Sequence[Buffer], peer: bytes | None) -> None:
        self._attach()
        conn = self._conn_for(peer)
        await self._send_on(conn, conn.outbox, frames)

    def _try_send(self, frames: Sequence[Buffer], peer: bytes | None) -> bool:
        with contextlib.suppress(RuntimeError):  # outside a loop: written, but not watched
            self._attach()
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

    def __init__(self, url: str, path: str, identity: bytes, *, hwm: int) -> None:
        super().__init__(url, bound=False, identity=identity, hwm=hwm)
        self._path = path
        #: Messages accepted and not yet written; outlives the connections.
        self._outbox = _Outbox(hwm)
        #: The live connection (None while connecting).
        self._conn: _Conn | None = None
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
            hello = _pack(self.url, [HANDSHAKE + (self.identity or b"")])[0]
            if sock.sendmsg(hello, (), _MSG_NOSIGNAL) != 12 + len(hello[1]):
                raise BlockingIOError("the handshake did not fit a fresh connection")
        except OSError:  # not bound (yet, or any more), backlog full, or gone already
            sock.close()
            self._schedule()
            return
        self.connects += 1
        conn = self._conn = _Conn(sock, self._outbox)
        self._watch(conn)

    def _schedule(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or self._retry is not None:
            return
        self._retry = loop.call_later(self._delay, self._connect)
        self._delay = min(self._delay * 2, _RETRY_MAX)

    def _arrived(self, conn: _Conn, messages: list[list[Buffer]]) -> None:
        self._delay = _RETRY_MIN  # a working connection: the next loss retries fast again
        inbox = self._inbox
        for frames in messages:
            inbox.append(Packet(None, frames))

    def _lost(self, conn: _Conn, reason: str) -> None:
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
        with contextlib.suppress(RuntimeError):  # outside a loop: queued for the first use
            self._attach()
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

    def bind(self, url: str) -> Endpoint:
        path = _path(url)
        if _in_use(path):
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
        return _UdsRouter(url, listener, path, inode, hwm=self.hwm)

    def connect(self, url: str, *, identity: bytes | None = None) -> Endpoint:
        path = _path(url)
        identity = identity if identity is not None else uuid.uuid4().bytes
        if not 0 < len(identity) <= MAX_IDENTITY:
            raise TransportError(
                f"{url}: an identity is 1 to {MAX_IDENTITY} bytes, got {len(identity)}", url=url
            )
        return _UdsDealer(url, path, identity, hwm=self.hwm)


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
            os.unlink(path)  # stale (_in_use said nothing listens)
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


def _in_use(path: str) -> bool:
    """Whether a live socket listens at ``path`` (a stale file refuses the connection)."""
    if not os.path.exists(path):
        return False
    with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


register_transport(UdsTransport())
