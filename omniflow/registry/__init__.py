"""Service registry: which replicas of which roles are alive, and where sessions are pinned.

>>> import asyncio
>>> from omniflow import registry
>>> async def main():
...     async with registry.create_registry(None, heartbeat_interval=0.5) as reg:
...         await reg.register("llm", "llm-0", "tcp://10.0.0.5:7000")
...         lb = registry.SessionLoadBalance(reg)
...         [replica] = await lb.select("llm", await reg.replicas("llm"), session="s1")
...         return replica.replica_id, await reg.get_affinity("s1", "llm")
>>> asyncio.run(main())
('llm-0', 'llm-0')

``_base`` (Replica, Snapshot, the ServiceRegistry interface: lifecycle, heartbeats, watches) →
``_memory`` / ``_redis`` (the backends) → ``_lb`` (RoundRobin, SessionLoadBalance, Broadcast).
This layer imports nothing above it (no runtime, no transport).
"""

from __future__ import annotations

from typing import Any

from omniflow._exceptions import RegistryError
from omniflow.registry._base import RegistryState, Replica, ServiceRegistry, Snapshot, Watch
from omniflow.registry._lb import (
    AffinityStore,
    Broadcast,
    LoadBalance,
    RoundRobin,
    SessionLoadBalance,
    load_balance,
)
from omniflow.registry._memory import MemoryRegistry, MemoryStore
from omniflow.registry._redis import RedisRegistry

__all__ = [
    "AffinityStore",
    "Broadcast",
    "LoadBalance",
    "MemoryRegistry",
    "MemoryStore",
    "RedisRegistry",
    "RegistryError",
    "RegistryState",
    "Replica",
    "RoundRobin",
    "ServiceRegistry",
    "SessionLoadBalance",
    "Snapshot",
    "Watch",
    "create_registry",
    "load_balance",
]


def create_registry(url: str | None = None, **options: Any) -> ServiceRegistry:
    """The registry for ``Runtime(registry=url)``: in memory for ``None`` or ``memory://``,
    Redis for ``redis://`` / ``rediss://`` / ``unix://`` URLs. ``options`` go to the backend
    (``heartbeat_interval``, ``ttl``, ``affinity_ttl``, ``watch_interval``, ...)."""
    if url is None or url == "memory://":
        return MemoryRegistry(**options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisRegistry(url, **options)
    raise RegistryError(
        f"unsupported registry URL {url!r}; use None (in memory) or redis://host:port/db",
        url=url,
    )
