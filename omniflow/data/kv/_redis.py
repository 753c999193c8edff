"""The Params Pools' metadata in Redis: every write and a match one Lua script, other reads one
pipeline (the scripts are in ``_redis_lua``).

Keys of pool ``p`` (prefix ``ofkv:{p}:``), all values plain strings (JSON for node records;
nothing read from Redis is ever unpickled):

    N             hash   node -> JSON {host, pid, shm, l2, addr, layout, lid}
    C:{chain}     set    page hashes published in the chain (``s:{session}`` or public)
    S:{key}       set    chains that hold the page
    P:{key}       hash   node -> "tier:index:fill" (or "m" while the replica moves)
    L:{key}:{n}   hash   reader -> count: replica locks on node n's copy
    R             hash   chain -> count of calls of that session holding pages (run lock)
    X:{node}      set    pages the node provides (for ``leave``)
    RL:{reader}   set    "key\\nprovider" the reader has locked (for ``leave``)
    T             zset   node -> Redis time (ms) its lease runs out (nodes with a lease)
    E:{node}      string a forgotten node, until it registers again (expires after a day)

Leases are timed by the Redis server's clock (``TIME`` inside the scripts), so the nodes'
clocks never need to agree.

The scripts build key names from the prefix, so they assume one Redis (no Cluster). What each
guarantees is in ``docs/params-pool.md`` ("Metadata").
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import DataError
from omniflow.data.kv._meta import PUBLIC, Metadata, Notify, chain_name
from omniflow.data.kv._redis_lua import SCRIPTS

if TYPE_CHECKING:
    from omniflow.data.kv._notice import NoticeSeal

logger = logging.getLogger("omniflow.kv")

#: Seconds a subscribe or settle waits for Redis to confirm on the pub/sub connection.
PUBSUB_TIMEOUT = 30.0

__all__ = ["RedisMetadata"]


class RedisMetadata(Metadata):
    """``Metadata`` in one Redis server (``redis://host:port/db``)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self._r: Any = aioredis.from_url(url, decode_responses=True)
        self._scripts = {name: self._r.register_script(src) for name, src in SCRIPTS.items()}
        self.round_trips = 0
        #: Whether the scripts were loaded into the server (once, by the first call).
        self._loaded = False
        #: (pool, node) -> the seal of its notices (seals its publishes, opens what it gets).
        self._seals: dict[tuple[str, str], NoticeSeal] = {}
        #: (pool, node) -> where its notifications go.
        self._listeners: dict[tuple[str, str], Notify] = {}
        #: pub/sub channel -> the (pool, node)s of this client subscribed to it, and session.
        self._channels: dict[str, dict[tuple[str, str], str | None]] = {}
        #: The pub/sub connection (made by the first subscribe) and the task reading it.
        self._ps: Any = None
        self._reader: asyncio.Task[None] | None = None
        #: (reply type, channel or ping token) -> who waits for Redis to confirm it.
        self._waits: dict[tuple[str, str], asyncio.Future[None]] = {}
        #: This client's own channel for ``settle`` tokens, and whether it is subscribed.
        self._settle_channel = f"ofkv-settle:{secrets.token_hex(8)}"
        self._settling = False

    async def _call(self, name: str, args: list[Any]) -> Any:
        try:
            if not self._loaded:  # every script in one request, so no call pays a NOSCRIPT
                self.round_trips += 1
                pipe = self._r.pipeline(transaction=False)
                for script in self._scripts.values():
                    pipe.script_load(script.script)
                await pipe.execute()
                self._loaded = True
            self.round_trips += 1
            return await self._scripts[name](keys=[], args=args)
        except OSError as exc:
            raise DataError(f"params pool metadata at {self.url} is unreachable: {exc}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("redis"):
                raise DataError(f"params pool metadata at {self.url}: {exc}") from exc
            raise

    @staticmethod
    def _pre(pool: str) -> str:
        return f"ofkv:{pool}:"

    async def register(self, pool: str, node: str, info: dict[str, str], ttl_ms: int = 0) -> None:
        doc = json.dumps(info, sort_keys=True)
        await self._call("register", [self._pre(pool), node, doc, int(ttl_ms)])

    async def heartbeat(self, pool: str, node: str, ttl_ms: int) -> bool:
        return bool(await self._call("heartbeat", [self._pre(pool), node, int(ttl_ms)]))

    async def sweep(self, pool: str) -> list[str]:
        return sorted(await self._call("sweep", [self._pre(pool)]))

    async def nodes(self, pool: str, names: Sequence[str]) -> dict[str, dict[str, str]]:
        if not names:
            return {}
        self.round_trips += 1
        raw = await self._r.hmget(self._pre(pool) + "N", list(names))
        out: dict[str, dict[str, str]] = {}
        for name, text in zip(names, raw, strict=True):
            if text is None:
                continue
            try:
                doc = json.loads(text)
            except ValueError:
                continue  # a malformed record is ignored, never trusted
            if isinstance(doc, dict) and all(isinstance(v, str) for v in doc.values()):
                out[name] = doc
        return out

    async def publish(
        self, pool: str, node: str, session: str | None, keys: Sequence[str], locs: Sequence[str]
    ) -> None:
        seal = self._seals.get((pool, node))
        notice = seal.seal(session, keys) if seal is not None and keys else ""
        args: list[Any] = [self._pre(pool), node, chain_name(session), notice]
        for key, loc in zip(keys, locs, strict=True):
            args += [key, loc]
        await self._call("publish", args)

    async def provide(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str]
    ) -> list[bool]:
        if not keys:
            return []
        args: list[Any] = [self._pre(pool), node]
        for key, loc in zip(keys, locs, strict=True):
            args += [key, loc]
        return [bool(x) for x in await self._call("provide", args)]

    async def match(
        self, pool: str, session: str | None, keys: Sequence[str], run: bool = False
    ) -> list[dict[str, str]]:
        take = run and session is not None
        if not keys and not take:
            return []
        args = [self._pre(pool), chain_name(session), PUBLIC, "1" if take else "0", *keys]
        raw = await self._call("match", args)
        return [dict(zip(flat[::2], flat[1::2], strict=True)) for flat in raw]

    async def evict(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str | None]
    ) -> list[bool]:
        if not keys:
            return []
        args: list[Any] = [self._pre(pool), node]
        for key, loc in zip(keys, locs, strict=True):
            args += [key, loc or ""]
        return [bool(x) for x in await self._call("evict", args)]

    async def lock(
        self, pool: str, reader: str, provider: str, keys: Sequence[str]
    ) -> list[str | None]:
        raw = await self._call("lock", [self._pre(pool), reader, provider, *keys])
        return [x or None for x in raw]

    async def unlock(self, pool: str, reader: str, provider: str, keys: Sequence[str]) -> None:
        await self._call("unlock", [self._pre(pool), reader, provider, *keys])

    async def run(self, pool: str, session: str, delta: int) -> None:
        await self._call("run", [self._pre(pool), chain_name(session), int(delta)])

    async def leave(self, pool: str, node: str) -> None:
        await self._call("leave", [self._pre(pool), node])
        self._listeners.pop((pool, node), None)
        self._seals.pop((pool, node), None)
        for subs in list(self._channels.values()):
            if (pool, node) in subs:
                await self.subscribe(pool, node, subs[(pool, node)], False)

    async def dump(self, pool: str) -> dict[str, object]:
        pre = self._pre(pool)
        chains: dict[str, list[str]] = {}
        providers: dict[str, dict[str, str]] = {}
        locks: dict[str, dict[str, int]] = {}
        async for name in self._r.scan_iter(match=pre + "*", count=1000):
            rest = name[len(pre) :]
            if rest.startswith("C:"):
                chains[rest[2:]] = sorted(await self._r.smembers(name))
            elif rest.startswith("P:"):
                providers[rest[2:]] = await self._r.hgetall(name)
            elif rest.startswith("L:"):
                key, node = rest[2:].split(":", 1)
                locks[f"{key}|{node}"] = {
                    k: int(v) for k, v in (await self._r.hgetall(name)).items()
                }
        runs = {k: int(v) for k, v in (await self._r.hgetall(pre + "R")).items()}
        return {"chains": chains, "providers": providers, "locks": locks, "runs": runs}

    # -- publish notifications: Redis pub/sub, sealed by the publishing pool ------------------

    def use_seal(self, pool: str, node: str, seal: NoticeSeal) -> None:
        self._seals[(pool, node)] = seal

    def listen(self, pool: str, node: str, callback: Notify) -> None:
        if (pool, node) not in self._seals:
            raise DataError(
                f"pool '{pool}': notifications through Redis are sealed with the cluster key; "
                "use_seal(pool, node, seal) before listen"
            )
        self._listeners[(pool, node)] = callback

    async def subscribe(self, pool: str, node: str, session: str | None, on: bool) -> None:
        channel = self._pre(pool) + "notify:" + chain_name(session)
        subs = self._channels.get(channel, {})
        if not on:
            if subs.pop((pool, node), None) is not None and not subs:
                del self._channels[channel]
                await self._pubsub(lambda ps: ps.unsubscribe(channel))
            return
        if (pool, node) not in self._listeners:
            raise DataError(f"pool '{pool}': subscribe of node {node} before listen")
        self._channels[channel] = {**subs, (pool, node): session}
        if not subs:  # the first of this client on the channel: subscribe, await Redis's yes
            try:
                await self._confirmed("subscribe", channel, lambda ps: ps.subscribe(channel))
            except BaseException:
                self._channels[channel].pop((pool, node), None)
                if not self._channels[channel]:
                    del self._channels[channel]
                raise

    async def settle(self, pool: str) -> None:
        """A token published on a channel of this client's own: Redis delivers pub/sub
        messages in the order it ran their PUBLISH, so every notice published before the
        token has been delivered when the token arrives."""
        if self._ps is None:
            return
        if not self._settling:
            await self._confirmed(
                "subscribe", self._settle_channel, lambda ps: ps.subscribe(self._settle_channel)
            )
            self._settling = True
        token = secrets.token_hex(8)

        async def send(_ps: Any) -> None:
            await self._r.publish(self._settle_channel, token)

        await self._confirmed("settle", token, send)

    async def _confirmed(self, kind: str, token: str, send: Any) -> None:
        fut = self._waits[(kind, token)] = asyncio.get_running_loop().create_future()
        try:
            await self._pubsub(send)
            await asyncio.wait_for(asyncio.shield(fut), PUBSUB_TIMEOUT)
        except TimeoutError:
            raise DataError(
                f"params pool metadata at {self.url}: no {kind} confirmation on the pub/sub "
                f"connection within {PUBSUB_TIMEOUT} s"
            ) from None
        finally:
            if self._waits.get((kind, token)) is fut:
                del self._waits[(kind, token)]

    async def _pubsub(self, send: Any) -> None:
        if self._ps is None:
            self._ps = self._r.pubsub()
        try:
            await send(self._ps)
        except OSError as exc:
            raise DataError(f"params pool metadata at {self.url} is unreachable: {exc}") from exc
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(self._ps))

    async def _read(self, ps: Any) -> None:
        """Deliver each notification to the listeners of its channel; resolve confirmations."""
        while True:
            try:
                msg = await ps.get_message(timeout=None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection is gone: nobody waits forever
                logger.warning("params pool metadata at %s: pub/sub ended: %s", self.url, exc)
                for fut in self._waits.values():
                    if not fut.done():
                        fut.set_exception(DataError(f"pub/sub connection lost: {exc}"))
                        fut.exception()  # retrieved: its waiter may have been cancelled
                return
            if msg is None:
                continue
            kind = msg.get("type")
            if kind == "message" and msg.get("channel") == self._settle_channel:
                kind = "settle"
            elif kind == "message":
                self._deliver(msg.get("channel"), msg.get("data"))
                continue
            token = msg.get("channel") if kind == "subscribe" else msg.get("data")
            waiter = self._waits.get((str(kind), str(token)))
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _deliver(self, channel: Any, payload: Any) -> None:
        for (pool, node), session in list(self._channels.get(channel, {}).items()):
            callback, seal = self._listeners.get((pool, node)), self._seals.get((pool, node))
            if callback is None or seal is None:
                continue
            keys = seal.open(session, payload)
            if keys:
                callback(pool, session, keys)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._ps is not None:
            await self._ps.aclose()
        await self._r.aclose()
