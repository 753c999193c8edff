"""Pulling pages between nodes: a pool's pull server and the client that asks it.

The consumer pulls, the provider never pushes (the paper's pull-on-demand). Every request and
every answer is sealed with the cluster key (``omniflow.transport._auth``: an HMAC-SHA256 over
every frame, a per-sender counter against replay) and opened before a byte of it is decoded;
then it is decoded with the transport's msgpack codec without pickle. A pull request is
``{"r": nonce, "pool": name, "to": provider node, "k": [hashes]}``, the answer ``{"r": nonce,
"f": [fills], "d": [one buffer per (sub_name, slice)]}`` with the page bytes as out-of-band
frames. The random nonce ties an answer to its request (a captured answer cannot answer
another request, even in a later process) and ``"to"`` ties a request to the pool it was meant
for (a captured request replayed to another pool is dropped as foreign).

What fails authentication is dropped and counted (``WireStats``, shown in
``pool.stats()["wire"]``), never answered: a client without the key learns nothing, not even
that a page exists. An answer that fails it ends the pulls waiting on that connection at once
(only the peer at that address can write on it): the pool treats them as misses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

from omniflow._exceptions import DataError, DataTimeoutError, RuntimeClosedError
from omniflow.transport import bind, decode_message, encode
from omniflow.transport._auth import Opener, Sealer, WireStats
from omniflow.transport._dealers import Dealers

__all__ = ["PageSource", "PullClient", "PullServer"]

logger = logging.getLogger("omniflow.kv")

#: Most page hashes one pull request may name.
MAX_KEYS = 4096
#: Bytes of a request nonce.
NONCE_BYTES = 16


class PageSource(Protocol):
    """What a pull server asks of its pool: who it is and the bytes of its pages."""

    name: str
    node: str

    def serve_pages(self, keys: Sequence[str]) -> tuple[list[int], list[Any]]: ...


class PullServer:
    """Answers authenticated pulls of this pool's pages from other nodes."""

    def __init__(self, pool: PageSource, key: bytes, stats: WireStats) -> None:
        self._pool = pool
        self._stats = stats
        self._opener = Opener(key, stats)
        #: One sealer per asking peer (the ROUTER sends to each in seal order).
        self._sealers: dict[bytes | None, Sealer] = {}
        self._key = key
        self._ep: Any = None
        self._task: asyncio.Task[None] | None = None

    def rekey(self, key: bytes) -> None:
        """Use ``key`` from now on (the runtime that hosts the pool gave its cluster key)."""
        self._key = key
        self._opener = Opener(key, self._stats)
        self._sealers.clear()

    async def start(self, url: str) -> str:
        self._ep = bind(url)
        self._task = asyncio.get_running_loop().create_task(self._serve())
        address: str = self._ep.url
        return address

    def _request(self, frames: Sequence[Any]) -> tuple[bytes, list[str]] | None:
        """The nonce and keys of an authentic, well-formed request for this pool, else None
        (counted)."""
        inner = self._opener.open(frames)
        if inner is None:
            return None  # counted by the opener
        try:
            msg = decode_message(inner, allow_pickle=False)
            body = msg.body
            nonce, keys = body["r"], body["k"]
            ok = (
                msg.kind == "pull"
                and isinstance(nonce, bytes)
                and len(nonce) == NONCE_BYTES
                and isinstance(keys, list)
                and len(keys) <= MAX_KEYS
                and all(isinstance(k, str) for k in keys)
            )
        except Exception:
            ok = False
        if not ok:
            self._stats.drop("malformed")
            return None
        if body.get("pool") != self._pool.name or body.get("to") != self._pool.node:
            self._stats.drop("foreign")  # meant for another pool: a replay or a stale address
            return None
        return nonce, keys

    async def _serve(self) -> None:
        ep = self._ep
        while True:
            try:
                peer, frames = await ep.recv()
            except (RuntimeClosedError, asyncio.CancelledError):
                return
            req = self._request(frames)
            if req is None:
                continue  # never answered: an unauthenticated peer learns nothing
            nonce, keys = req
            try:
                fills, data = self._pool.serve_pages(keys)
                reply = encode({"r": nonce, "f": fills, "d": data}, kind="pages")
            except Exception as exc:  # an authentic request that fails is answered
                reply = encode({"r": nonce, "e": str(exc)[:200]}, kind="error")
            sealer = self._sealers.get(peer)
            if sealer is None:
                sealer = self._sealers[peer] = Sealer(self._key)
            with contextlib.suppress(Exception):
                await ep.send(sealer.seal(reply), peer=peer)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._ep is not None:
            self._ep.close()


# Not data/_pull.PullClient (both sit on transport/_dealers.Dealers): pages cross pools with
# random nonces, no pickle and a deadline; blocks ride the worker protocol with counted ids.
class PullClient:
    """One DEALER (and one sealer) per provider address; answers matched to requests by a
    random nonce, authenticated before they are decoded."""

    def __init__(self, key: bytes, stats: WireStats, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._stats = stats
        self._opener = Opener(key, stats)
        self._dealers = Dealers(key, self._read, random_identity=True)
        #: nonce -> (address asked, future of the answer's body).
        self._waiting: dict[bytes, tuple[str, asyncio.Future[Any]]] = {}

    def rekey(self, key: bytes) -> None:
        """Use ``key`` from now on (new sealers; answers under the old key fail as misses)."""
        self._opener = Opener(key, self._stats)
        self._dealers.rekey(key)

    async def pull(
        self,
        address: str,
        pool: str,
        node: str,
        keys: Sequence[str],
        *,
        timeout: float | None = None,
    ) -> tuple[list[int], list[Any]]:
        """The fills and page buffers of ``keys`` from the pool ``node`` at ``address``; a
        DataError (or DataTimeoutError) when no authentic answer comes within ``timeout``
        seconds (None: the client's ``timeout``; what is left of a match's budget)."""
        wait = self.timeout if timeout is None else min(timeout, self.timeout)
        if wait <= 0:
            raise DataTimeoutError(f"pool '{pool}': no time left to pull from {address}")
        ep, sealer = self._dealers.get(address)
        nonce = secrets.token_bytes(NONCE_BYTES)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[nonce] = (address, fut)
        try:
            msg = encode({"r": nonce, "pool": pool, "to": node, "k": list(keys)}, kind="pull")
            await ep.send(sealer.seal(msg))
            body = await asyncio.wait_for(fut, wait)
        except TimeoutError:
            raise DataTimeoutError(
                f"pool '{pool}': pulling {len(keys)} pages from {address} took longer than "
                f"{wait:.3g} s (a provider that is gone, or one without this cluster key)"
            ) from None
        finally:
            self._waiting.pop(nonce, None)
        fills = body.get("f")
        data = body.get("d")
        if (
            not isinstance(fills, list)
            or not isinstance(data, list)
            or len(fills) > len(keys)
            or not all(type(f) is int for f in fills)
        ):
            raise DataError(f"pool '{pool}': malformed pull answer from {address}")
        return fills, data

    def _fail(self, address: str, why: str) -> None:
        """An answer on ``address``'s connection failed authentication: only its peer writes
        there, so the pulls waiting on it will get no authentic answer; end them now."""
        for where, fut in list(self._waiting.values()):
            if where == address and not fut.done():
                fut.set_exception(DataError(f"pull answer from {address} {why}"))

    async def _read(self, address: str, ep: Any) -> None:
        while True:
            try:
                packet = await ep.recv()
            except (RuntimeClosedError, asyncio.CancelledError):
                return
            inner = self._opener.open(packet.frames)
            if inner is None:  # counted by the opener
                self._fail(address, "failed authentication (not this cluster's key)")
                continue
            try:
                msg = decode_message(inner, allow_pickle=False)
                nonce = msg.body["r"]
                waiting = self._waiting.get(nonce) if isinstance(nonce, bytes) else None
            except Exception:
                self._stats.drop("malformed")
                self._fail(address, "was malformed")
                continue
            if waiting is None or waiting[0] != address:
                self._stats.drop("foreign")  # no request of ours (late, or not for this peer)
                continue
            fut = waiting[1]
            if fut.done():
                continue
            if msg.kind == "pages":
                fut.set_result(msg.body)
            elif msg.kind == "error":
                fut.set_exception(DataError(f"pull refused: {msg.body.get('e')}"))
            else:
                self._stats.drop("unknown_kind")
                fut.set_exception(DataError(f"pull answer from {address} of unknown kind"))

    def close(self) -> None:
        self._dealers.close()
