from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omniflow.registry import MemoryRegistry, MemoryStore, RedisRegistry, ServiceRegistry
from omniflow.testing import RedisServer

#: Short timings for tests: expiry within ~0.3 s, no long sleeps.
HEARTBEAT = 0.1
TTL = 0.3


class Backend:
    """Makes registry clients that share one backend (each client is a 'process')."""

    def __init__(self, name: str, redis: RedisServer | None) -> None:
        self.name = name
        self.redis = redis
        self.store = MemoryStore()
        self.namespace = f"test-{uuid.uuid4().hex[:8]}"
        self.clients: list[ServiceRegistry] = []

    def client(self, **options: Any) -> ServiceRegistry:
        options = {"heartbeat_interval": HEARTBEAT, "ttl": TTL, **options}
        registry: ServiceRegistry
        if self.redis is None:
            registry = MemoryRegistry(self.store, **options)
        else:
            registry = RedisRegistry(self.redis.url, namespace=self.namespace, **options)
        self.clients.append(registry)
        return registry

    async def open(self, **options: Any) -> ServiceRegistry:
        return await self.client(**options).start()

    def restart(self) -> None:
        """Lose every key, as a Redis restart without persistence does."""
        if self.redis is None:
            self.store.clear()
        else:
            self.redis.restart()


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    redis: RedisServer | None = None
    if request.param == "redis":
        redis = request.getfixturevalue("redis")
    backend = Backend(request.param, redis)
    try:
        yield backend
    finally:
        for client in backend.clients:
            with contextlib.suppress(Exception):
                await client.close()
        if redis is None:
            backend.store.validate()
