"""The Redis registry: shared by every process of a deployment.

>>> async with RedisRegistry("redis://10.0.0.2:6379/0") as registry:   # doctest: +SKIP
...     await registry.register("llm", "llm-0", "tcp://10.0.0.5:7000", {"gpu": 0})

Keys (``ns`` is the namespace, default ``omniflow``; names are %-quoted inside keys)::

    {ns}:replica:{role}:{replica_id}   string, JSON record, PX ttl    one per live replica
    {ns}:role:{role}                   set of quoted replica ids      index, evicted lazily
    {ns}:session:{session}             hash role -> replica id, PX affinity_ttl

A replica is live while its record key exists; readers drop index entries whose record
expired (atomically, in a Lua script, so a heartbeat racing the eviction cannot be lost for
more than one interval). Heartbeats run on a connection of their own, with a socket timeout of
one interval, so a slow main connection cannot starve them and vice versa. Both connections
retry a failed command once on a fresh connection, which is what brings a client back after a
Redis restart; every remaining ``redis`` error is translated to RegistryError here.

A restarted Redis (without persistence) loses sessions' pins: sessions are re-pinned on their
next call, as after a replica death.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, Unpack
from urllib.parse import quote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from omniflow._exceptions import RegistryError
from omniflow.registry._base import RegistryOptions, Replica, ServiceRegistry

__all__ = ["RedisRegistry"]

# KEYS[1] index set; ARGV[1] record key prefix. Returns the live records; drops dead ids.
_LIST = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local record = redis.call('GET', ARGV[1] .. id)
  if record then
    table.insert(out, record)
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return out
"""

# KEYS[1] session hash; ARGV role, candidate, replace ('' = none), ttl ms ('' = none).
_PIN = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if (not current) or current == ARGV[3] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  current = ARGV[2]
end
if ARGV[4] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return current
"""


class RedisRegistry(ServiceRegistry):
    """A ServiceRegistry over Redis (``redis://host:port/db``); see the module docstring."""

    backend = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "omniflow",
        socket_timeout: float = 5.0,
        **options: Unpack[RegistryOptions],
    ) -> None:
        super().__init__(**options)
        #: The server, as given (password included; use ``redacted_url`` in messages).
        self.url = url
        #: The server without credentials.
        self.redacted_url = _redact(url)
        #: Prefix of every key this registry touches.
        self.namespace = namespace
        #: Socket timeout of the main connection.
        self.socket_timeout = socket_timeout
        self._client: aioredis.Redis | None = None
        self._heartbeat_client: aioredis.Redis | None = None
        #: Lua scripts, registered on the main client at open (re-sent after a restart).
        self._list_script: Any = None
        self._pin_script: Any = None

    # ---------------------------------------------------------------------------- connections

    def _connect(self, timeout: float) -> aioredis.Redis:
        try:
            return aioredis.Redis.from_url(
                self.url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 1),
                client_name=f"omniflow-{self.namespace}",
            )
        except ValueError as exc:
            raise RegistryError(
                f"{self.url!r} is not a Redis URL (redis://host:port/db): {exc}",
                url=self.redacted_url,
            ) from exc

    async def _open(self) -> None:
        self._client = self._connect(self.socket_timeout)
        self._heartbeat_client = self._connect(self.heartbeat_interval)
        try:
            with self._errors("connect"):
                await self._client.ping()
        except RegistryError:
            await self._close()
            raise
        self._list_script = self._client.register_script(_LIST)
        self._pin_script = self._client.register_script(_PIN)

    async def _close(self) -> None:
        clients = [c for c in (self._client, self._heartbeat_client) if c is not None]
        self._client = self._heartbeat_client = None
        for client in clients:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

    @contextlib.contextmanager
    def _errors(self, op: str, role: str | None = None) -> Iterator[None]:
        try:
            yield
        except (RedisError, OSError) as exc:
            raise RegistryError(
                f"redis registry {self.redacted_url}: {op} failed: {type(exc).__name__}: {exc}",
                role=role,
                url=self.redacted_url,
            ) from exc

    @property
    def _redis(self) -> aioredis.Redis:
        assert self._client is not None, "registry not open"
        return self._client

    # ------------------------------------------------------------------------------------ keys

    def _record_prefix(self, role: str) -> str:
        return f"{self.namespace}:replica:{quote(role, safe='')}:"

    def _record_key(self, role: str, replica_id: str) -> str:
        return self._record_prefix(role) + quote(replica_id, safe="")

    def _index_key(self, role: str) -> str:
        return f"{self.namespace}:role:{quote(role, safe='')}"

    def _session_key(self, session: str) -> str:
        return f"{self.namespace}:session:{quote(session, safe='')}"

    # -------------------------------------------------------------------------------- replicas

    async def _put(self, replicas: list[Replica]) -> None:
        await self._write(self._redis, replicas, "register")

    async def _heartbeat(self, replicas: list[Replica]) -> None:
        assert self._heartbeat_client is not None
        await self._write(self._heartbeat_client, replicas, "heartbeat")

    async def _write(self, client: aioredis.Redis, replicas: list[Replica], op: str) -> None:
        ttl_ms = max(1, round(self.ttl * 1000))
        with self._errors(op, replicas[0].role if len(replicas) == 1 else None):
            async with client.pipeline(transaction=False) as pipe:
                for r in replicas:
                    # Signed: "<hex hmac>\n<record>", checked before the JSON is parsed.
                    record = r.record() if self._key is None else f"{r.sig}\n{r.record()}"
                    pipe.set(self._record_key(r.role, r.replica_id), record, px=ttl_ms)
                    pipe.sadd(self._index_key(r.role), quote(r.replica_id, safe=""))
                await pipe.execute()

    async def _remove(self, role: str, replica_id: str) -> None:
        with self._errors("deregister", role):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(self._record_key(role, replica_id))
                pipe.srem(self._index_key(role), quote(replica_id, safe=""))
                await pipe.execute()

    async def _list(self, role: str) -> list[Replica]:
        with self._errors("list replicas", role):
            records = await self._list_script(
                keys=[self._index_key(role)], args=[self._record_prefix(role)]
            )
        replicas = []
        forged = 0
        for raw in records:
            raw_bytes = raw if isinstance(raw, bytes) else str(raw).encode()
            sig = b""
            if b"\n" in raw_bytes:  # "<signature>\n<record>"
                sig, _, raw = raw_bytes.partition(b"\n")
            if self._key is not None and not self.verify(raw, sig):
                forged += 1  # ignored without being decoded
                continue
            try:
                data: dict[str, Any] = json.loads(raw)
                replicas.append(
                    Replica(role, data["id"], data["address"], data["meta"], sig.decode())
                )
            except (ValueError, KeyError, TypeError) as exc:
                if self._key is not None:  # signed but not ours: a key shared with another tool
                    forged += 1
                    continue
                raise RegistryError(
                    f"redis registry {self.redacted_url}: a replica record of role '{role}' "
                    f"is not one omniflow wrote ({exc}); is another program using namespace "
                    f"'{self.namespace}'?",
                    role=role,
                    url=self.redacted_url,
                ) from exc
        if forged:
            self.forged(forged, role)
        return replicas

    # ------------------------------------------------------------------------ session affinity

    def _ttl_ms(self) -> int | None:
        return None if self.affinity_ttl is None else max(1, round(self.affinity_ttl * 1000))

    async def _get_affinity(self, session: str, role: str) -> str | None:
        key = self._session_key(session)
        ttl_ms = self._ttl_ms()
        with self._errors("get affinity", role):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hget(key, role)
                if ttl_ms is not None:
                    pipe.pexpire(key, ttl_ms)
                value = (await pipe.execute())[0]
        return None if value is None else bytes(value).decode()

    async def _set_affinity(self, session: str, role: str, replica_id: str) -> None:
        key = self._session_key(session)
        ttl_ms = self._ttl_ms()
        with self._errors("set affinity", role):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, role, replica_id)
                if ttl_ms is not None:
                    pipe.pexpire(key, ttl_ms)
                await pipe.execute()

    async def _pin_affinity(
        self, session: str, role: str, replica_id: str, replace: str | None
    ) -> str:
        ttl_ms = self._ttl_ms()
        args = [role, replica_id, replace or "", "" if ttl_ms is None else str(ttl_ms)]
        with self._errors("pin affinity", role):
            winner = await self._pin_script(keys=[self._session_key(session)], args=args)
        return bytes(winner).decode()

    async def _clear_affinity(self, session: str, role: str | None) -> None:
        key = self._session_key(session)
        with self._errors("clear affinity", role):
            if role is None:
                await self._redis.delete(key)
            else:
                await self._redis.hdel(key, role)

    def __repr__(self) -> str:
        return f"<RedisRegistry {self.redacted_url} {self.state.value}>"


def _redact(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))
