"""Publish notifications that cross Redis: sealed with the cluster key, opened before use.

>>> from omniflow.transport._auth import generate_key
>>> key = generate_key()
>>> a, b = NoticeSeal("kv", "node-a", key), NoticeSeal("kv", "node-b", key)
>>> b.open("chat", "0,1|" + a.seal("chat", ["h0", "h1", "h2"]))
['h0', 'h1']
>>> b.open("chat", "0|" + NoticeSeal("kv", "evil", generate_key()).seal("chat", ["h9"])) is None
True
>>> b.stats.dropped["bad_mac"]
1

In memory and front-hosted metadata a notification never leaves trusted code (a callback, or a
message on the worker's authenticated connection). Through Redis it is a pub/sub message that
anyone who can write to that Redis could forge, so the publishing pool seals the batch -- pool,
publishing node, session and hashes, as JSON, with ``omniflow.transport._auth.Sealer`` (an
HMAC-SHA256 under the cluster key, a per-sender counter against replay) -- and the ``PUBLISH``
script sends it as ``"<indices that joined the chain>|<base64 sealed batch>"``. A subscriber
opens it before it reads a byte of the JSON: a notice without the key's MAC, a replay, one for
another pool or session, or a malformed one is dropped and counted (``stats``), never preloaded.
The indices are the only unsealed part: they can only pick among hashes the publisher sealed.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence

from omniflow.transport._auth import Opener, Sealer, WireStats

__all__ = ["MAX_NOTICE", "NoticeSeal"]

#: Longest notice accepted, in characters (a 4,096-page batch is about 160 KiB).
MAX_NOTICE = 1 << 20


class NoticeSeal:
    """One pool instance's sealing of the notices it publishes and opening of those it gets."""

    __slots__ = ("_opener", "_sealer", "node", "pool", "stats")

    def __init__(self, pool: str, node: str, key: bytes, stats: WireStats | None = None) -> None:
        #: The pool and node this seal speaks for (its own notices are not news to it).
        self.pool = pool
        self.node = node
        #: Notices accepted and dropped (bad MAC, replay, malformed, foreign).
        self.stats = stats if stats is not None else WireStats()
        self._sealer = Sealer(key)
        self._opener = Opener(key, self.stats)

    def rekey(self, key: bytes) -> None:
        """Seal and open with ``key`` from now on (the hosting runtime's cluster key)."""
        self._sealer = Sealer(key)
        self._opener = Opener(key, self.stats)

    def seal(self, session: str | None, keys: Sequence[str]) -> str:
        """The sealed batch, as text (Redis replies are decoded as UTF-8)."""
        body = json.dumps(
            {"p": self.pool, "n": self.node, "s": session, "k": list(keys)},
            separators=(",", ":"),
        ).encode()
        (frame,) = self._sealer.seal([body])
        return base64.b64encode(frame).decode("ascii")

    def open(self, session: str | None, payload: object) -> list[str] | None:
        """The hashes of an authentic notice of ``session``'s chain that joined it; None for
        one this node published itself and for anything dropped (counted)."""
        if type(payload) is not str or len(payload) > MAX_NOTICE or "|" not in payload:
            self.stats.drop("malformed")
            return None
        picks, _, sealed = payload.partition("|")
        try:
            frame = base64.b64decode(sealed, validate=True)
        except (binascii.Error, ValueError):
            self.stats.drop("malformed")
            return None
        inner = self._opener.open([frame])
        if inner is None:
            return None  # counted by the opener: bad MAC or replay
        try:
            doc = json.loads(bytes(inner[0]))
            keys, who = doc["k"], doc["n"]
            joined = [int(i) for i in picks.split(",")] if picks else []
            ok = (
                isinstance(keys, list)
                and all(type(k) is str for k in keys)
                and type(who) is str
                and all(0 <= i < len(keys) for i in joined)
            )
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            self.stats.drop("malformed")
            return None
        if doc.get("p") != self.pool or doc.get("s") != session:
            self.stats.drop("foreign")  # replayed onto another pool's or session's channel
            return None
        if who == self.node:
            return None
        return [keys[i] for i in joined]
