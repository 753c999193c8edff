"""Authenticated messages: a MAC over every frame, checked before anything is decoded.

>>> key = b"k" * 32
>>> sealer, opener = Sealer(key), Opener(key)
>>> sealed = sealer.seal([b"hello"])
>>> [bytes(f) for f in opener.open(sealed)]
[b'hello']
>>> opener.open(sealed) is None, opener.stats.dropped["replay"]       # the same message again
(True, 1)

A sealed message is ``frames`` with a 50-byte tag in front of the first frame::

    b"OA" | sender id (8 bytes) | counter (8 bytes, big-endian) | MAC (32 bytes)

The MAC covers the tag's first 18 bytes (its *head*) and every frame, each preceded by its
length, so a frame cut short, dropped, added or moved fails it. Which MAC depends only on the
frames' total length, which the receiver knows before it checks anything:

- under ``BULK_BYTES`` (8 KiB, every control message): HMAC-SHA256 with the cluster key;
- from ``BULK_BYTES`` up (inline tensors, pulled blocks, KV pages): GMAC, i.e. AES-256-GCM
  over no plaintext with the covered bytes as associated data, under a one-time key
  ``HMAC-SHA256(bulk key, head)`` where ``bulk key = HMAC-SHA256(cluster key, label)``; its
  16-byte tag is followed by 16 zero bytes. This is how ChaCha20-Poly1305 and AES-GCM-SIV
  use their universal hashes: a fresh key per message (the head is unique per sender and
  counter), so a fixed nonce is safe, and forging one message teaches nothing about another.
  A forgery succeeds with probability at most about (bytes / 16) / 2^128 per try. Measured on
  this project's CPU (benchmarks/bench_wire_auth.py --only mac), GMAC runs 6-7x faster than
  HMAC-SHA256 (about a memcpy), Poly1305 ~4x, keyed BLAKE2b slower than SHA-256.

``Opener.open`` checks the MAC with ``hmac.compare_digest`` before looking at a single byte of
the frames: nothing from a peer is unpacked (msgpack) or unpickled before it holds.

Replay: a ``Sealer`` is one sender (a random id) whose counter grows with every message it
seals, and a receiver accepts from each sender only counters greater than the last one it
accepted. A sealer is used by one connection's writer only (seal just before the send, in send
order), and a connection delivers in order, so honest traffic is never refused; a replayed or
reordered message is dropped and counted. The replay state is per receiving process: a copy of
a message captured on the network can only be replayed to a process that never heard from its
sender (one started after the capture), where it is a duplicate of what the capture already
disclosed (the MAC gives integrity, not secrecy; bind tcp:// on private networks or tunnel it).

Authenticated endpoints: a ``uds://`` endpoint opened with the key (``bind``/``connect``
``key=``) makes every connection prove the key, both ways, before a message crosses, and no
one but the two processes at its ends can write its byte stream; its messages travel unsealed
(``sealer_for`` / ``opener_for`` give that endpoint's ``PlainSealer`` / ``PlainOpener``),
which saves the control plane's hot path a MAC per message at each end.

The cluster key is ``OMNIFLOW_CLUSTER_KEY`` (text, at least 16 characters), a key file, or
``Runtime(cluster_key=...)``; a runtime with none generates one with ``secrets`` and hands it to
the workers it spawns through their environment, never their command line.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omniflow._exceptions import RuntimeClosedError, TransportError

__all__ = [
    "BULK_BYTES",
    "KEY_ENV",
    "TAG_BYTES",
    "Opener",
    "PlainOpener",
    "PlainSealer",
    "Sealer",
    "WireStats",
    "generate_key",
    "load_key_file",
    "opener_for",
    "resolve_key",
    "sealer_for",
    "send_sealed_now",
]

#: Environment variable holding the cluster key (text).
KEY_ENV = "OMNIFLOW_CLUSTER_KEY"
#: Shortest key accepted (characters / bytes).
MIN_KEY_BYTES = 16
_MAGIC = b"OA"
_HEAD = 2 + 8 + 8
#: Bytes of a message's tag frame.
TAG_BYTES = _HEAD + 32
#: Messages whose frames hold at least this many bytes in all are MACed with GMAC under a
#: one-time key (~7x HMAC-SHA256's throughput here); smaller ones with HMAC-SHA256, which
#: costs less per message (~0.7 µs against ~4.5 µs). Both ends apply the same rule.
BULK_BYTES = 8 * 1024
_BULK_LABEL = b"omniflow bulk-mac key v1"
#: GCM's nonce: fixed, because the key is new for every message.
_NONCE = bytes(12)
_PAD = bytes(16)
#: Reasons a message is dropped (counters of WireStats.dropped).
DROP_REASONS = ("bad_mac", "replay", "malformed", "unknown_kind", "foreign")


def generate_key() -> bytes:
    """A fresh random cluster key (64 hex characters)."""
    return secrets.token_hex(32).encode()


def _check_key(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise TransportError(
            f"the cluster key from {where} has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return key


def load_key_file(path: str | os.PathLike[str]) -> bytes:
    """The key in ``path`` (its text, surrounding whitespace removed)."""
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TransportError(f"cannot read the cluster key file {str(path)!r}: {exc}") from exc
    return _check_key(text.encode(), f"file {str(path)!r}")


def resolve_key(key: str | bytes | None = None, *, generate: bool = True) -> tuple[bytes, bool]:
    """``(key, generated)``: ``key`` if given, else ``$OMNIFLOW_CLUSTER_KEY``, else a new one
    (``generate=True``) or a TransportError that says how to give one."""
    if key is not None:
        raw = key.encode() if isinstance(key, str) else bytes(key)
        if b"\0" in raw:
            raise TransportError("the cluster key must not contain NUL bytes (it travels in env)")
        try:
            raw.decode()
        except UnicodeDecodeError:
            raise TransportError(
                "the cluster key must be text (UTF-8): it travels in env"
            ) from None
        return _check_key(raw, "cluster_key="), False
    env = os.environ.get(KEY_ENV)
    if env:
        return _check_key(env.encode(), f"${KEY_ENV}"), False
    if not generate:
        raise TransportError(
            f"no cluster key: set {KEY_ENV} or pass --cluster-key-file (the same key as the "
            "front processes this worker serves)"
        )
    return generate_key(), True


class WireStats:
    """Counters of one process's authenticated wire: messages accepted and dropped by reason."""

    __slots__ = ("accepted", "dropped")

    def __init__(self) -> None:
        self.accepted = 0
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def dropped_message(
        self, log: logging.Logger, where: str, reason: str | None, exc: BaseException | None
    ) -> None:
        """Count a dropped message (``reason`` None: the opener counted it already) and log
        the first and then every 1000th, so a flood cannot flood the log too."""
        if reason is not None:
            self.drop(reason)
        total = sum(self.dropped.values())
        if total == 1 or total % 1000 == 0:
            log.warning(
                "%s: dropped %d messages so far (%s); last: %s",
                where,
                total,
                self.dropped,
                exc or "not authentic",
            )

    def statistics(self) -> dict[str, int]:
        """``{"accepted": n, "dropped_bad_mac": n, ...}``."""
        return {"accepted": self.accepted, **{f"dropped_{k}": v for k, v in self.dropped.items()}}


class _HmacSha256:
    """HMAC-SHA256 (RFC 2104) with the key's padded blocks hashed once: each message then
    costs two SHA-256 copies instead of an HMAC context copy (about half the time for the
    small messages of the hot path). ``mac(data) == hmac.new(key, data, sha256).digest()``."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:
            key = hashlib.sha256(key).digest()
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def copy(self) -> _Mac:
        return _Mac(self._inner.copy(), self._outer)

    def mac(self, data: bytes) -> bytes:
        """The MAC of ``data`` in one go (the small-message path)."""
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        digest: bytes = outer.digest()
        return digest


class _Mac:
    __slots__ = ("_inner", "_outer")

    def __init__(self, inner: Any, outer: Any) -> None:
        self._inner = inner
        self._outer = outer

    def update(self, data: Any) -> None:
        self._inner.update(data)

    def digest(self) -> bytes:
        outer = self._outer.copy()
        outer.update(self._inner.digest())
        return bytes(outer.digest())


class _Keys:
    """The two MACs of one cluster key: HMAC-SHA256 for small messages, and for bulk ones GMAC
    under a one-time key per message (see the module docstring)."""

    __slots__ = ("_bulk", "hmac")

    def __init__(self, key: bytes) -> None:
        self.hmac = _HmacSha256(key)
        # The bulk key is a PRF output of the cluster key on a label nothing else HMACs under
        # that key can equal: sealed messages start with _MAGIC, registry and KV pool records
        # are JSON ("{" or "["). So the two MACs have independent keys.
        self._bulk = _HmacSha256(self.hmac.mac(_BULK_LABEL))

    def one_time_key(self, head: bytes) -> bytes:
        """The AES-256 key of the message with tag head ``head`` (sender and counter)."""
        return self._bulk.mac(head)

    def mac(self, head: bytes, frames: Sequence[Any], sizes: Sequence[int]) -> bytes:
        """The 32-byte MAC field of a message: HMAC-SHA256 below BULK_BYTES, else GMAC's
        16-byte tag and 16 zero bytes."""
        if sum(sizes) < BULK_BYTES:
            mac = self.hmac.copy()
            mac.update(head)
            for frame, n in zip(frames, sizes, strict=True):
                mac.update(n.to_bytes(8, "big"))
                mac.update(frame)
            return mac.digest()
        gmac = _gcm(self.one_time_key(head))
        gmac.authenticate_additional_data(head)
        for frame, n in zip(frames, sizes, strict=True):
            gmac.authenticate_additional_data(n.to_bytes(8, "big"))
            if n:
                gmac.authenticate_additional_data(_octets(frame))
        gmac.finalize()
        return bytes(gmac.tag) + _PAD


def _gcm(key: bytes) -> Any:
    """An AES-256-GCM encryptor under ``key``. ``cryptography`` is imported on first use (a
    process that never sees a bulk message does not pay its import), then kept here."""
    global _GCM_PARTS
    if _GCM_PARTS is None:
        from cryptography.hazmat.primitives.ciphers import Cipher
        from cryptography.hazmat.primitives.ciphers.algorithms import AES
        from cryptography.hazmat.primitives.ciphers.modes import GCM

        _GCM_PARTS = (Cipher, AES, GCM(_NONCE))
    cipher, aes, mode = _GCM_PARTS
    return cipher(aes(key), mode).encryptor()


_GCM_PARTS: tuple[Any, Any, Any] | None = None


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


def _octets(frame: Any) -> Any:
    """``frame`` as a flat byte buffer (what ``cryptography`` accepts): no copy for bytes and
    contiguous buffers (numpy's memoryviews have a format and a shape, so they are cast)."""
    if type(frame) is bytes:
        return frame
    view = memoryview(frame)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.c_contiguous else view.tobytes()


class Sealer:
    """One sender: seals messages with its id, a growing counter and the MAC."""

    __slots__ = ("_counter", "_keys", "_mac", "_prefix", "sender")

    def __init__(self, key: bytes) -> None:
        self._keys = _Keys(key)
        self._mac = self._keys.hmac.mac
        #: Random per sender, so receivers keep one counter per sender.
        self.sender = secrets.token_bytes(8)
        self._prefix = _MAGIC + self.sender
        self._counter = 0

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """``frames`` with the tag in front of the first; call it right before the send, in
        send order."""
        self._counter += 1
        head = self._prefix + self._counter.to_bytes(8, "big")
        first = frames[0]
        if len(frames) == 1:
            n = len(first) if type(first) is bytes else _nbytes(first)
            if n < BULK_BYTES:  # the hot path: one small frame, one buffer, one HMAC
                mac = self._mac(b"".join((head, n.to_bytes(8, "big"), first)))
                return [b"".join((head, mac, first))]
            sizes: Sequence[int] = (n,)
        else:
            sizes = [_nbytes(f) for f in frames]
        # The tag goes in front of the first frame, not in a frame of its own: one more zmq
        # frame per message would cost more than the MAC.
        return [b"".join((head, self._keys.mac(head, frames, sizes), first)), *frames[1:]]


class PlainSealer:
    """The sealer of an authenticated endpoint (``Endpoint.authenticated``): its connections
    proved the key when they were made, so messages leave as they are."""

    __slots__ = ()

    def seal(self, frames: Sequence[Any]) -> Sequence[Any]:
        return frames


class PlainOpener:
    """The opener of an authenticated endpoint: what it delivers came from a connection that
    proved the key (counted as accepted, like a message whose MAC held)."""

    __slots__ = ("stats",)

    def __init__(self, stats: WireStats) -> None:
        self.stats = stats

    def open(self, frames: Sequence[Any]) -> list[Any] | None:
        self.stats.accepted += 1
        return frames if type(frames) is list else list(frames)


def sealer_for(endpoint: Any, key: bytes) -> Sealer | PlainSealer:
    """The sealer for what ``endpoint`` sends: plain where its connections are authenticated
    (``Endpoint.authenticated``), else under ``key``."""
    return PlainSealer() if endpoint.authenticated else Sealer(key)


def send_sealed_now(
    endpoint: Any, sealer: Sealer | PlainSealer, frames: Sequence[Any], peer: bytes | None = None
) -> bool:
    """Seal ``frames`` and send them at once if that cannot block (``Endpoint.try_send``):
    no writer wake-up on a hop's critical path. False: the caller queues them behind what
    waits, for its writer, which sends them in order and meets any error swallowed here (it
    declares the peer lost). A refused try used a counter the writer skips: gaps are allowed.
    The one rule of the front's runs, the worker's answers and its forward links."""
    try:
        ok: bool = endpoint.try_send(sealer.seal(frames), peer=peer)
    except (TransportError, RuntimeClosedError):
        return False
    return ok


def opener_for(endpoint: Any, key: bytes, stats: WireStats) -> Opener | PlainOpener:
    """The opener for what ``endpoint`` receives, counted in ``stats`` (as ``sealer_for``)."""
    return PlainOpener(stats) if endpoint.authenticated else Opener(key, stats)


class Opener:
    """One receiving process's check of sealed messages (MAC, then replay)."""

    __slots__ = ("_keys", "_last", "_mac", "stats")

    def __init__(self, key: bytes, stats: WireStats | None = None) -> None:
        self._keys = _Keys(key)
        self._mac = self._keys.hmac.mac
        #: Highest counter accepted from each sender (only senders that hold the key).
        self._last: dict[bytes, int] = {}
        #: Where accepted and dropped messages are counted.
        self.stats = stats if stats is not None else WireStats()

    def open(self, frames: Sequence[Any]) -> list[Any] | None:
        """The frames under the tag, or None (counted) if the message is not authentic or is
        a replay. Reads nothing but lengths and bytes for the MAC before it holds."""
        stats = self.stats
        if not frames:
            stats.drop("bad_mac")
            return None
        if len(frames) == 1:
            small = frames[0]
            if type(small) is not bytes and memoryview(small).nbytes < BULK_BYTES + TAG_BYTES:
                small = bytes(small)
            if type(small) is bytes and len(small) < BULK_BYTES + TAG_BYTES:
                # the hot path: one small frame, plain bytes slicing, one HMAC
                if len(small) < TAG_BYTES:
                    stats.drop("bad_mac")
                    return None
                header = small[TAG_BYTES:]
                covered = b"".join((small[:_HEAD], len(header).to_bytes(8, "big"), header))
                return self._accept(small[:TAG_BYTES], self._mac(covered), [header])
        try:
            first = memoryview(frames[0]).cast("B")
            if first.nbytes < TAG_BYTES:
                stats.drop("bad_mac")
                return None
            tag = first[:TAG_BYTES].tobytes()
            body = [first[TAG_BYTES:], *frames[1:]]
            digest = self._keys.mac(tag[:_HEAD], body, [_nbytes(f) for f in body])
        except (TypeError, ValueError, BufferError):
            stats.drop("bad_mac")
            return None
        return self._accept(tag, digest, body)

    def _accept(self, tag: bytes, digest: bytes, body: list[Any]) -> list[Any] | None:
        stats = self.stats
        if not hmac.compare_digest(digest, tag[_HEAD:]) or tag[:2] != _MAGIC:
            stats.drop("bad_mac")
            return None
        sender, counter = tag[2:10], int.from_bytes(tag[10:18], "big")
        if counter <= self._last.get(sender, 0):
            stats.drop("replay")
            return None
        self._last[sender] = counter
        stats.accepted += 1
        return body

    def forget(self, sender: bytes) -> None:
        """Drop a sender's replay state (its connection is gone for good)."""
        self._last.pop(sender, None)
