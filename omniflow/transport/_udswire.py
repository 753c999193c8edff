"""The byte stream of one ``uds://`` connection: framing, the outbox, reading and parsing.

Used by ``_uds`` (the endpoints, which register the sockets with the event loop and log):
``Outbox.write`` and ``Conn.read`` do what the socket allows without blocking and say what is
left, or why the connection must be dropped.

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
of every view of it (``Slabs``). (A fresh ``bytearray`` per frame is zero-filled by hand and,
freed, makes glibc move its mmap threshold and trim the heap on every message, which slowed
the codec's next ``encode`` tenfold; a fresh mmap per frame faults its pages in, ~0.6 ms a MiB
here.) A header announcing more than ``MAX_FRAMES`` frames or a frame over
``MAX_FRAME_BYTES`` drops that connection with a logged reason before anything of that size is
allocated. Framing is not
authentication: only this user can connect at all, and then either every message is sealed
and checked one layer up (``_auth``), or the connection proved the cluster key once when it
was made (``_udshandshake.Handshake``: endpoints opened with ``key=``) and its byte stream,
which only the two processes at its ends can write, is trusted from then on.
"""

from __future__ import annotations

import contextlib
import mmap
import socket as _socket
import struct
import sys
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from omniflow._exceptions import TransportError
from omniflow.transport._codec import Buffer

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "EOF",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "MSG_NOSIGNAL",
    "Conn",
    "Outbox",
    "pack",
]

#: At most this many frames per message (a header announcing more drops the connection).
MAX_FRAMES: Final = 1000
#: At most this many bytes per frame (a header announcing more drops the connection).
MAX_FRAME_BYTES: Final = 1 << 32
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

_COUNT = struct.Struct("<I")
_ONE = struct.Struct("<IQ")
MSG_NOSIGNAL: Final = getattr(_socket, "MSG_NOSIGNAL", 0)


#: Why a connection ended when its peer simply closed it (not worth a warning).
EOF: Final = "the peer closed the connection"


class Broken(Exception):
    """A connection's byte stream cannot be parsed any further (the reason is the message)."""


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


def pack(url: str, frames: Sequence[Buffer]) -> tuple[list[Any], int]:
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


class Slabs:
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


class Outbox:
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
                n = sock.sendmsg(bufs, (), MSG_NOSIGNAL)
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


class Conn:
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
        "hs",
        "identity",
        "outbox",
        "ready",
        "sock",
        "writing",
    )

    def __init__(self, sock: _socket.socket, outbox: Outbox) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, _SNDBUF)
        #: The connected socket (non-blocking).
        self.sock = sock
        self.fd = sock.fileno()
        #: The peer's identity once its handshake arrived (bound side); None before.
        self.identity: bytes | None = None
        #: May carry messages (False while a keyed handshake is under way: nothing is written
        #: from the outbox, nothing received is delivered).
        self.ready = True
        #: A keyed handshake's state: the nonces (and identity) it needs next; None when done.
        self.hs: tuple[bytes, ...] | None = None
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
        self._slabs = Slabs()

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
                        return done, EOF
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
                    return done, EOF
                self._end = end + n
                self._parse(done)
                if n < space and self._big is None:
                    return done, None  # all that was readable (the reader is level-triggered)
        except BlockingIOError:
            return done, None
        except Broken as exc:
            return done, str(exc)
        except OSError as exc:
            return done, f"reading failed: {exc}"

    def _parse(self, done: list[list[Buffer]]) -> None:
        """Take every complete message out of the read buffer into ``done``; start a big frame
        if one is under way."""
        buf, view = self._buf, self._view
        start, end = self._start, self._end
        if self._lens is None:
            # The common case first: whole messages of one small frame, one header unpack
            # each (a count other than 1, a big frame, or a part: the general way below).
            while end - start >= 12:
                count, size = _ONE.unpack_from(buf, start)
                stop = start + 12 + size
                if count != 1 or size > _SMALL or stop > end:
                    break
                done.append([bytes(view[start + 12 : stop])])
                start = stop
            if start == end:
                self._start = start
                return
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
                        raise Broken(
                            f"a message header announces {count} frames (1 to {MAX_FRAMES} "
                            "allowed): not an omniflow uds peer, or a broken one"
                        )
                    if avail < 4 + 8 * count:
                        break
                    lens = struct.unpack_from(f"<{count}Q", buf, start + 4)
                    start += 4 + 8 * count
                for size in lens:
                    if size > MAX_FRAME_BYTES:
                        raise Broken(
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
