"""Front-hosted metadata: one ``MemoryMetadata`` in the front, reached by every worker.

With ``metadata=None`` in a multi-process runtime, the front keeps the Params Pools' metadata
in its memory (as it keeps the in-memory registry) and every worker's pools use a
``HostedMetadata``: each call of the ``Metadata`` interface is one ``MetaCall`` message over the
worker's authenticated connection to the front that spawned it, answered by one ``MetaReply``
(request ids pair them; a call is one round trip, as one Lua script or one pipeline is in
Redis). Publish notifications of chains a worker's pool subscribed to come back as one
``MetaNotify(pool, session, hashes)`` per publish. The front applies each call with
``serve`` to its ``MemoryMetadata``, whose methods are atomic, so every process sees one
truth::

    worker pool --MetaCall(r, op, [pool, ...])--> front: serve(meta, op, args)
                <--MetaReply(r, value, error)----

``serve`` checks the operation and every argument's exact type before it touches the
metadata; a malformed call is answered with an error and changes nothing.

A worker sets its roles up before it serves, so before its front says hello: a pool opened in
``setup()`` (an engine started there, docs/contract.md §8) allocates its tiers at once and its
``register`` waits, to be the first call sent when the front attaches. Until then nothing can
reach the worker's pages, so nothing needs to know of them; any other call fails at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from omniflow._exceptions import DataError
from omniflow.data.kv._meta import MemoryMetadata, Metadata, Notify

__all__ = ["OPS", "HostedMetadata", "serve"]

logger = logging.getLogger("omniflow.kv")

#: Seconds a worker waits for the front's answer before the call fails (never hangs).
DEFAULT_TIMEOUT = 30.0

# Argument kinds: s str, o str or None, l list of str, n list of (str or None), d dict
# str -> str, i int, b bool; those after "|" may be left out (a call from a worker that does
# not use them reads as before).
#: operation -> kinds of its arguments after the pool name.
OPS: dict[str, str] = {
    "register": "sd|i",
    "heartbeat": "si",
    "sweep": "",
    "nodes": "l",
    "publish": "soll",
    "provide": "sll",
    "match": "ol|b",
    "evict": "sln",
    "lock": "ssl",
    "unlock": "ssl",
    "run": "si",
    "leave": "s",
    "subscribe": "sob",
    "dump": "",
}


def _ok(kind: str, v: Any) -> bool:
    t = type(v)
    if kind == "s":
        return t is str
    if kind == "o":
        return v is None or t is str
    if kind == "i":
        return t is int
    if kind == "b":
        return t is bool
    if kind == "l":
        return t is list and all(type(x) is str for x in v)
    if kind == "n":
        return t is list and all(x is None or type(x) is str for x in v)
    if kind == "d":
        return t is dict and all(type(k) is str and type(x) is str for k, x in v.items())
    raise AssertionError(kind)  # pragma: no cover - OPS uses only the kinds above


def check(op: str, args: Any) -> None:
    """DataError unless ``args`` are ``[pool, *arguments]`` of the metadata operation ``op``."""
    spec = OPS.get(op) if type(op) is str else None
    if spec is None:
        raise DataError(f"hosted metadata: unknown operation {op!r:.40}")
    need, _, optional = spec.partition("|")
    n = len(args) - 1 if type(args) is list else -1
    if not len(need) <= n <= len(need) + len(optional) or type(args[0]) is not str:
        raise DataError(f"hosted metadata: '{op}' takes a pool name and {len(need)} arguments")
    kinds = (need + optional)[:n]
    for i, (kind, v) in enumerate(zip(kinds, args[1:], strict=True)):
        if not _ok(kind, v):
            raise DataError(
                f"hosted metadata: argument {i + 1} of '{op}' (pool {args[0]!r:.40}) has the "
                f"wrong type {type(v).__name__}"
            )


async def serve(meta: MemoryMetadata, op: str, args: Any) -> Any:
    """Apply one checked call to the front's metadata; its value as plain data."""
    check(op, args)
    value = await getattr(meta, op)(*args)
    return value


class HostedMetadata(Metadata):
    """A worker's client of the front's metadata (the same behaviour as ``MemoryMetadata``).

    ``attach(send)`` is called when the front that spawned the worker says hello; ``send``
    puts one ``(request id, op, args)`` on the wire to it. ``reply`` resolves a request.
    Before the first attach a ``register`` is kept and sent first at the attach (a lease's
    ``heartbeat`` meanwhile holds: its clock starts there); every other call made before a
    front is attached, or after it is gone, raises ``DataError`` at once (``leave`` excepted:
    it has nothing to do then).
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.round_trips = 0
        self._send: Callable[[int, str, list[Any]], None] | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._listeners: dict[str, Notify] = {}
        #: Registers made before the first attach (sent first then); None once attached.
        self._deferred: list[list[Any]] | None = []

    @property
    def attached(self) -> bool:
        return self._send is not None

    def attach(self, send: Callable[[int, str, list[Any]], None]) -> None:
        self._send = send
        deferred, self._deferred = self._deferred, None
        for args in deferred or ():
            # Ahead of anything sent later on this connection, and the front serves its
            # calls in order: the node is known before any other call of its pool.
            r = next(self._ids)
            loop = asyncio.get_running_loop()
            fut = self._waiting[r] = loop.create_future()
            fut.add_done_callback(_log_deferred(args[0]))
            loop.call_later(self.timeout, self._expire, r, "register", args[0])
            self.round_trips += 1
            send(r, "register", args)

    def _expire(self, r: int, op: str, pool: str) -> None:
        """Request ``r``, which nobody awaits, was not answered in time: it fails."""
        fut = self._waiting.pop(r, None)
        if fut is not None and not fut.done():
            fut.set_exception(
                DataError(f"pool '{pool}': the front did not answer '{op}' within {self.timeout} s")
            )

    def detach(self, why: str) -> None:
        """The front is gone: fail every call waiting for it."""
        self._send = None
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(DataError(f"hosted metadata: {why}"))
                fut.exception()  # retrieved: its caller may have been cancelled

    def reply(self, r: int, value: Any, error: str | None) -> None:
        fut = self._waiting.pop(r, None)
        if fut is None or fut.done():
            return  # late (timed out) or never asked: nothing waits for it
        if error is not None:
            fut.set_exception(DataError(f"hosted metadata: the front refused: {error}"))
        else:
            fut.set_result(value)

    def listen(self, pool: str, node: str, callback: Notify) -> None:
        self._listeners[pool] = callback  # the worker's connection is sealed already

    def notify(self, pool: str, session: str | None, keys: list[str]) -> None:
        """A batch the front sent: pages published in a chain this process subscribed to."""
        callback = self._listeners.get(pool)
        if callback is not None:
            callback(pool, session, keys)

    async def subscribe(self, pool: str, node: str, session: str | None, on: bool) -> None:
        await self._call("subscribe", pool, node, session, on)

    async def settle(self, pool: str) -> None:
        """One round trip: the front sends a notification on this worker's connection inside
        the publish, so it is here once the answer to a call made after the publish is."""
        await self._call("nodes", pool, [])

    @property
    def pending(self) -> int:
        return len(self._waiting)

    async def _call(self, op: str, *args: Any) -> Any:
        if self._send is None:
            if self._deferred is not None and op == "register":
                self._deferred.append(list(args))  # (sent first at the attach)
                return None
            if op == "heartbeat" and any(a[:2] == list(args[:2]) for a in self._deferred or ()):
                return True  # (the lease starts when the deferred register is served)
            raise DataError(
                f"pool '{args[0]}': its metadata is hosted by the front, which this worker "
                "reaches only once it serves (in setup() a pool opens, nothing more; not after "
                "the front left); give the pool metadata='redis://...' to use it there"
            )
        r = next(self._ids)
        fut = self._waiting[r] = asyncio.get_running_loop().create_future()
        self.round_trips += 1
        try:
            self._send(r, op, list(args))
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            raise DataError(
                f"pool '{args[0]}': the front did not answer '{op}' within {self.timeout} s"
            ) from None
        finally:
            self._waiting.pop(r, None)

    async def register(self, pool: str, node: str, info: dict[str, str], ttl_ms: int = 0) -> None:
        args: list[Any] = [node, dict(info), int(ttl_ms)] if ttl_ms else [node, dict(info)]
        await self._call("register", pool, *args)

    async def heartbeat(self, pool: str, node: str, ttl_ms: int) -> bool:
        out: bool = await self._call("heartbeat", pool, node, int(ttl_ms))
        return out

    async def sweep(self, pool: str) -> list[str]:
        out: list[str] = await self._call("sweep", pool)
        return out

    async def nodes(self, pool: str, names: Sequence[str]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = await self._call("nodes", pool, list(names))
        return out

    async def publish(
        self, pool: str, node: str, session: str | None, keys: Sequence[str], locs: Sequence[str]
    ) -> None:
        await self._call("publish", pool, node, session, list(keys), list(locs))

    async def provide(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str]
    ) -> list[bool]:
        out: list[bool] = await self._call("provide", pool, node, list(keys), list(locs))
        return out

    async def match(
        self, pool: str, session: str | None, keys: Sequence[str], run: bool = False
    ) -> list[dict[str, str]]:
        args: list[Any] = [session, list(keys), True] if run else [session, list(keys)]
        out: list[dict[str, str]] = await self._call("match", pool, *args)
        return out

    async def evict(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str | None]
    ) -> list[bool]:
        out: list[bool] = await self._call("evict", pool, node, list(keys), list(locs))
        return out

    async def lock(
        self, pool: str, reader: str, provider: str, keys: Sequence[str]
    ) -> list[str | None]:
        out: list[str | None] = await self._call("lock", pool, reader, provider, list(keys))
        return out

    async def unlock(self, pool: str, reader: str, provider: str, keys: Sequence[str]) -> None:
        await self._call("unlock", pool, reader, provider, list(keys))

    async def run(self, pool: str, session: str, delta: int) -> None:
        await self._call("run", pool, session, delta)

    async def leave(self, pool: str, node: str) -> None:
        """Without a front (gone, detached, or never attached) there is nothing to leave: a
        deferred register of the node is dropped, and the front forgets the pools of a replica
        it lost (``_remote_meta``). A stopping worker's pools so close at once, never waiting
        ``timeout`` for an answer that cannot come (their shared memory goes with them)."""
        if self._send is None:
            if self._deferred is not None:
                self._deferred = [a for a in self._deferred if a[:2] != [pool, node]]
            return
        await self._call("leave", pool, node)

    async def dump(self, pool: str) -> dict[str, object]:
        out: dict[str, object] = await self._call("dump", pool)
        return out


def _log_deferred(pool: str) -> Callable[[asyncio.Future[Any]], None]:
    """A done callback: a deferred ``register`` the front refused (or never answered) is
    logged, since nobody awaits it."""

    def done(fut: asyncio.Future[Any]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            logger.warning("pool '%s': registering with the front's metadata failed: %s", pool, exc)

    return done
