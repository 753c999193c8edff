"""Who is at the other end of a ``uds://`` connection: the first message of every
connection (``HANDSHAKE`` and the connected side's identity, or the keyed ``Handshake``'s
three messages for endpoints opened with ``key=``) and the peer's user id (``peer_uid``).

>>> hs = Handshake(key)                                    # doctest: +SKIP
>>> hello = hs.hello(n_connected := hs.nonce(), b"w1")     # doctest: +SKIP

Pure bytes in, bytes or a verdict out: the endpoints (``_uds``) send and receive these
messages and drop a connection whose proof fails.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket as _socket
import struct
from collections.abc import Sequence
from typing import Final

from omniflow.transport._codec import Buffer

__all__ = [
    "AUTH_CHALLENGE",
    "AUTH_HELLO",
    "AUTH_PROOF",
    "HANDSHAKE",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "Handshake",
    "peer_uid",
]

#: The first message of every connection: this, then the connected side's identity.
HANDSHAKE: Final = b"OFU\x01"
#: The keyed handshake's three messages (``Handshake``): hello (connected side: this, its
#: nonce, its identity), challenge (bound side: this, its nonce, its proof) and proof
#: (connected side: this, its proof).
AUTH_HELLO: Final = b"OFU\x02"
AUTH_CHALLENGE: Final = b"OFU\x03"
AUTH_PROOF: Final = b"OFU\x04"
#: Bytes of each side's nonce and of a proof.
NONCE_BYTES: Final = 16
PROOF_BYTES: Final = 32


class Handshake:
    """Mutual proof of the cluster key when a connection is made (endpoints opened with
    ``key=``), in three messages: the connected side sends a fresh nonce and its identity;
    the bound side answers with a nonce of its own and HMAC-SHA256 under the handshake key of
    ``"bound" + both nonces + identity``; the connected side checks that and answers with the
    same over ``"connected" + ...``. Each side thereby proves it holds the key for this
    connection alone (fresh nonces from both: nothing recorded elsewhere replays), and neither
    sends a message before the other's proof held. The handshake key is HMAC(key, a label
    nothing else MACs under the cluster key), so these proofs are never valid seals."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = hmac.new(key, b"omniflow uds connection v1", hashlib.sha256).digest()

    @staticmethod
    def nonce() -> bytes:
        return secrets.token_bytes(NONCE_BYTES)

    def hello(self, nonce: bytes, identity: bytes) -> bytes:
        return AUTH_HELLO + nonce + identity

    @staticmethod
    def read_hello(frames: Sequence[Buffer]) -> tuple[bytes, bytes] | None:
        """(nonce, identity) of a hello, or None if ``frames`` is not one."""
        if len(frames) != 1:
            return None
        first = bytes(frames[0])
        body = first[len(AUTH_HELLO) :]
        if not first.startswith(AUTH_HELLO) or len(body) <= NONCE_BYTES:
            return None
        return body[:NONCE_BYTES], body[NONCE_BYTES:]

    def proof(self, side: bytes, theirs: bytes, ours: bytes, identity: bytes) -> bytes:
        """The proof of ``side`` (b"bound" / b"connected") for the connection whose
        connected side sent nonce ``theirs`` ... (arguments: connected nonce, bound nonce)."""
        data = b"".join((side, b"|", theirs, ours, identity))
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def challenge(self, n_connected: bytes, n_bound: bytes, identity: bytes) -> bytes:
        return AUTH_CHALLENGE + n_bound + self.proof(b"bound", n_connected, n_bound, identity)

    def read_challenge(
        self, frames: Sequence[Buffer], n_connected: bytes, identity: bytes
    ) -> bytes | None:
        """The bound side's nonce if ``frames`` is its valid challenge, else None."""
        if len(frames) != 1:
            return None
        first = bytes(frames[0])
        body = first[len(AUTH_CHALLENGE) :]
        if not first.startswith(AUTH_CHALLENGE) or len(body) != NONCE_BYTES + PROOF_BYTES:
            return None
        n_bound, mac = body[:NONCE_BYTES], body[NONCE_BYTES:]
        good = self.proof(b"bound", n_connected, n_bound, identity)
        return n_bound if hmac.compare_digest(mac, good) else None

    def answer(self, n_connected: bytes, n_bound: bytes, identity: bytes) -> bytes:
        return AUTH_PROOF + self.proof(b"connected", n_connected, n_bound, identity)

    def check_answer(
        self, frames: Sequence[Buffer], n_connected: bytes, n_bound: bytes, identity: bytes
    ) -> bool:
        if len(frames) != 1:
            return False
        first = bytes(frames[0])
        good = AUTH_PROOF + self.proof(b"connected", n_connected, n_bound, identity)
        return len(first) == len(good) and hmac.compare_digest(first, good)


def peer_uid(sock: _socket.socket) -> int | None:
    """The user id of the process at the other end (None where the OS does not say)."""
    opt = getattr(_socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, opt, 12))
    except OSError:
        return None
    return int(uid)
