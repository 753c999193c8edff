"""The bound side of ``uds://`` (ROUTER, ``_uds``): a private listening socket that accepts
connections, takes each one's handshake (plain identity, or the keyed proof) and routes by the
identity it announced (handover to a newer connection; a send to an unknown peer raises).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket as _socket
from collections.abc import Sequence

from omniflow._exceptions import TransportError
from omniflow.transport._base import EndpointState, Packet
from omniflow.transport._codec import Buffer
from omniflow.transport._udsendpoint import MAX_IDENTITY, UdsEndpoint
from omniflow.transport._udshandshake import HANDSHAKE, Handshake, peer_uid
from omniflow.transport._udswire import EOF, Conn, Outbox

__all__ = ["UdsRouter"]

logger = logging.getLogger("omniflow.transport")

#: ``Packet(peer, frames)`` without the NamedTuple's Python-level constructor.
_new = tuple.__new__


class UdsRouter(UdsEndpoint):
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
