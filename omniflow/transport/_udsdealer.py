"""The connected side of ``uds://`` (DEALER, ``_uds``): one connection with a fixed identity,
re-made on a timer whenever it is missing (10 ms, doubling to 50 ms), the keyed handshake's
connected half, and an outbox that outlives the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket as _socket
from collections.abc import Sequence
from typing import Final

from omniflow.transport._base import EndpointState, Packet
from omniflow.transport._codec import Buffer
from omniflow.transport._udsendpoint import SOCK_FLAGS, UdsEndpoint
from omniflow.transport._udshandshake import HANDSHAKE
from omniflow.transport._udswire import MSG_NOSIGNAL, Conn, Outbox, pack

__all__ = ["UdsDealer"]

logger = logging.getLogger("omniflow.transport")

#: ``Packet(peer, frames)`` without the NamedTuple's Python-level constructor.
_new = tuple.__new__

#: Reconnect delays of the connected side: the first retry, and the cap of its doubling.
_RETRY_MIN: Final = 0.01
_RETRY_MAX: Final = 0.05


class UdsDealer(UdsEndpoint):
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
        sock = _socket.socket(_socket.AF_UNIX, SOCK_FLAGS)
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
