"""The same behaviour from both backends: each test runs against memory and Redis.

``backend.client()`` is one registry client, i.e. one process of a deployment; clients of a
test share the backend (one MemoryStore, or one Redis server and namespace).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from omniflow import RegistryError, RuntimeClosedError
from omniflow.registry import (
    MemoryRegistry,
    RedisRegistry,
    SessionLoadBalance,
    Snapshot,
    Watch,
    create_registry,
)

HEARTBEAT = 0.1
TTL = 0.3


async def eventually(
    predicate: Callable[[], Awaitable[bool]], *, timeout: float = 30.0, interval: float = 0.01
) -> float:
    """Poll ``predicate`` until it holds; the seconds it took. The timeout is about hangs: how
    soon something happens is load-dependent, so tests assert orders, not durations."""
    start = time.monotonic()
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(interval)
    return time.monotonic() - start


async def ids(registry: Any, role: str) -> list[str]:
    return [r.replica_id for r in await registry.replicas(role)]


async def next_matching(watch: Watch, wanted: tuple[str, ...], timeout: float = 30.0) -> Snapshot:
    async with asyncio.timeout(timeout):
        async for snapshot in watch:
            if snapshot.replica_ids == wanted:
                return snapshot
    raise AssertionError(f"watch ended before seeing {wanted}")


async def test_register_list_deregister(backend: Any) -> None:
    worker, front = await backend.open(), await backend.open()
    assert await front.replicas("llm") == []
    replica = await worker.register("llm", "llm-1", "tcp://10.0.0.5:7001", {"gpu": 1})
    await worker.register("llm", "llm-0", "tcp://10.0.0.5:7000", {"gpu": 0, "tags": ["a"]})
    await worker.register("vae", "vae-0", "inproc://vae-0")
    assert replica.meta == {"gpu": 1}
    listed = await front.replicas("llm")
    assert [(r.replica_id, r.address, r.meta) for r in listed] == [
        ("llm-0", "tcp://10.0.0.5:7000", {"gpu": 0, "tags": ["a"]}),
        ("llm-1", "tcp://10.0.0.5:7001", {"gpu": 1}),
    ]
    assert listed[1] == replica
    await worker.register("llm", "llm-1", "tcp://10.0.0.6:7001")  # re-register: an update
    assert [r.address for r in await front.replicas("llm")][1] == "tcp://10.0.0.6:7001"
    await worker.deregister("llm", "llm-0")
    await worker.deregister("llm", "never-registered")
    assert await ids(front, "llm") == ["llm-1"]
    assert await ids(front, "vae") == ["vae-0"]
    assert worker.statistics()["local_replicas"] == 2


async def test_heartbeats_keep_replicas_alive(backend: Any) -> None:
    # A ttl of many intervals: a loaded machine may delay a heartbeat, not miss ten in a row.
    worker = await backend.open(ttl=10 * HEARTBEAT)
    front = await backend.open()
    await worker.register("llm", "llm-0", "inproc://llm-0")
    await asyncio.sleep(1.5 * 10 * HEARTBEAT)  # past its ttl: alive only through heartbeats
    assert await ids(front, "llm") == ["llm-0"]
    assert worker.statistics()["heartbeats"] >= 2
    assert worker.statistics()["heartbeat_failures"] == 0


async def test_crashed_replica_is_evicted_after_ttl(backend: Any) -> None:
    worker, survivor, front = await backend.open(), await backend.open(), await backend.open()
    await worker.register("llm", "llm-0", "inproc://llm-0")
    await survivor.register("llm", "llm-1", "inproc://llm-1")
    await worker.close(deregister=False)  # as if the process was killed: no goodbye
    assert await ids(front, "llm") == ["llm-0", "llm-1"]
    # Evicted by expiry (the ttl), which the next line waits for; how soon is load-dependent.
    await eventually(lambda: _equals(ids(front, "llm"), ["llm-1"]))
    assert await ids(front, "llm") == ["llm-1"]


async def test_close_deregisters_at_once(backend: Any) -> None:
    worker, front = await backend.open(), await backend.open()
    await worker.register("llm", "llm-0", "inproc://llm-0")
    await worker.close()
    assert await ids(front, "llm") == []


async def test_watch_sees_scale_up_and_down(backend: Any) -> None:
    front, worker_a, worker_b = await backend.open(), await backend.open(), await backend.open()
    async with front.watch("llm") as watch:
        first = await next_matching(watch, ())
        await worker_a.register("llm", "a-0", "inproc://a-0")
        await worker_a.register("llm", "a-1", "inproc://a-1")
        up = await next_matching(watch, ("a-0", "a-1"))
        await worker_b.register("llm", "b-0", "inproc://b-0")
        more = await next_matching(watch, ("a-0", "a-1", "b-0"))
        await worker_a.deregister("llm", "a-0")
        down = await next_matching(watch, ("a-1", "b-0"))
        await worker_b.close(deregister=False)  # b-0 dies and expires
        evicted = await next_matching(watch, ("a-1",))
        assert watch.latest is evicted
    versions = [s.version for s in (first, up, more, down, evicted)]
    assert versions == sorted(set(versions))
    assert await anext(watch, None) is None  # closed: iteration is over


async def test_local_changes_wake_watchers_at_once(backend: Any) -> None:
    registry = await backend.open(watch_interval=30.0)
    async with registry.watch("llm") as watch:
        assert (await anext(watch)).replicas == ()
        waiter = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.01)
        await registry.register("llm", "llm-0", "inproc://llm-0")
        async with asyncio.timeout(1):
            assert (await waiter).replica_ids == ("llm-0",)


async def test_watch_ends_when_the_registry_closes(backend: Any) -> None:
    registry = await backend.open()
    watch = registry.watch("llm")
    await anext(watch)
    waiter = asyncio.ensure_future(anext(watch, None))
    await asyncio.sleep(0.01)
    await registry.close()
    async with asyncio.timeout(1):
        assert await waiter is None


async def test_snapshot_versions_change_only_with_membership(backend: Any) -> None:
    registry = await backend.open()
    s0 = await registry.snapshot("llm")
    assert await registry.snapshot("llm") is s0
    await registry.register("llm", "llm-0", "inproc://llm-0")
    s1 = await registry.snapshot("llm")
    assert (s0.version, s1.version, s1.replica_ids) == (0, 1, ("llm-0",))


async def test_affinity_is_shared_by_two_fronts(backend: Any) -> None:
    front_a, front_b = await backend.open(), await backend.open()
    assert await front_b.get_affinity("s1", "llm") is None
    await front_a.set_affinity("s1", "llm", "llm-1")
    await front_a.set_affinity("s1", "vae", "vae-0")
    assert await front_b.get_affinity("s1", "llm") == "llm-1"
    assert await front_b.get_affinity("s2", "llm") is None
    await front_b.clear_affinity("s1", "llm")
    assert await front_a.get_affinity("s1", "llm") is None
    assert await front_a.get_affinity("s1", "vae") == "vae-0"
    await front_b.clear_affinity("s1")
    assert await front_a.get_affinity("s1", "vae") is None
    await front_b.clear_affinity("nobody")


async def test_pin_affinity_is_a_compare_and_set(backend: Any) -> None:
    front_a, front_b = await backend.open(), await backend.open()
    winners = await asyncio.gather(
        front_a.pin_affinity("s1", "llm", "llm-0"), front_b.pin_affinity("s1", "llm", "llm-1")
    )
    assert winners[0] == winners[1] in ("llm-0", "llm-1")
    pinned = winners[0]
    other = "llm-1" if pinned == "llm-0" else "llm-0"
    assert await front_a.pin_affinity("s1", "llm", other) == pinned  # taken: unchanged
    assert await front_a.pin_affinity("s1", "llm", other, replace="gone") == pinned
    assert await front_b.pin_affinity("s1", "llm", other, replace=pinned) == other  # re-pin
    assert await front_a.get_affinity("s1", "llm") == other


async def test_affinity_expires_unless_used(backend: Any) -> None:
    # Reads every 0.2 s keep a 1 s pin: a loaded machine would have to stall 0.8 s to lose it.
    front = await backend.open(affinity_ttl=1.0)
    await front.set_affinity("idle", "llm", "llm-0")
    await front.set_affinity("busy", "llm", "llm-0")
    for _ in range(6):  # 1.2 s in all (or more, under load): past the idle pin's ttl
        await asyncio.sleep(0.2)
        assert await front.get_affinity("busy", "llm") == "llm-0"  # a read refreshes it
    assert await front.get_affinity("idle", "llm") is None


async def test_session_load_balance_repins_after_replica_death(backend: Any) -> None:
    worker_0, worker_1 = await backend.open(), await backend.open()
    front_a, front_b = await backend.open(), await backend.open()
    await worker_0.register("llm", "llm-0", "inproc://llm-0")
    await worker_1.register("llm", "llm-1", "inproc://llm-1")
    lb_a, lb_b = SessionLoadBalance(front_a), SessionLoadBalance(front_b)
    sessions = [f"s{i}" for i in range(12)]

    async def routes(lb: SessionLoadBalance, front: Any) -> dict[str, str]:
        live = await front.replicas("llm")
        picked = [(await lb.select("llm", live, session=s))[0] for s in sessions]
        return {s: r.replica_id for s, r in zip(sessions, picked, strict=True)}

    before = await routes(lb_a, front_a)
    assert await routes(lb_b, front_b) == before  # two fronts agree
    assert set(before.values()) == {"llm-0", "llm-1"}
    assert await routes(lb_a, front_a) == before  # and stay put
    assert lb_a.statistics() == {"pinned": 12, "repinned": 0}

    await worker_0.close(deregister=False)
    await eventually(lambda: _equals(ids(front_a, "llm"), ["llm-1"]))
    after = await routes(lb_b, front_b)
    assert set(after.values()) == {"llm-1"}
    assert await routes(lb_a, front_a) == after
    orphans = sum(1 for s in sessions if before[s] == "llm-0")
    assert lb_b.statistics()["repinned"] == orphans
    assert lb_a.statistics()["repinned"] == 0  # b re-pinned first; a just follows the store


async def test_restart_reregisters_at_the_next_heartbeat(backend: Any) -> None:
    interval = 0.2
    worker = await backend.open(heartbeat_interval=interval, ttl=3 * interval)
    front = await backend.open(heartbeat_interval=interval, ttl=3 * interval)
    await worker.register("llm", "llm-0", "inproc://llm-0")
    await front.set_affinity("s1", "llm", "llm-0")
    backend.restart()  # every key is gone
    # Nominally within one interval; asserted is that it comes back by heartbeats alone (no
    # register call), not how soon: a loaded machine can delay any heartbeat.
    await eventually(lambda: _equals(ids(front, "llm"), ["llm-0"]), interval=0.005)
    assert await front.get_affinity("s1", "llm") is None  # pins are lost; sessions re-pin


async def test_lifecycle_errors(backend: Any) -> None:
    registry = backend.client()
    with pytest.raises(RuntimeClosedError, match="start"):
        await registry.replicas("llm")
    async with registry:
        with pytest.raises(RuntimeClosedError, match="twice"):
            await registry.start()
        await registry.register("llm", "llm-0", "inproc://llm-0")
    await registry.close()  # idempotent
    for call in (
        registry.replicas("llm"),
        registry.register("llm", "x", "inproc://x"),
        registry.get_affinity("s", "llm"),
    ):
        with pytest.raises(RuntimeClosedError, match="closed"):
            await call
    with pytest.raises(RuntimeClosedError):
        registry.watch("llm")


async def test_argument_errors(backend: Any) -> None:
    registry = await backend.open()
    with pytest.raises(RegistryError, match="JSON") as info:
        await registry.register("llm", "llm-0", "inproc://x", {"f": object()})
    assert info.value.role == "llm"
    with pytest.raises(RegistryError, match="role must be a non-empty str"):
        await registry.register("", "llm-0", "inproc://x")
    with pytest.raises(RegistryError, match="replica_id"):
        await registry.pin_affinity("s", "llm", "")
    with pytest.raises(ValueError, match="heartbeat_interval < ttl"):
        backend.client(heartbeat_interval=1.0, ttl=0.5)


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


# ------------------------------------------------------------------------------- Redis only


async def test_redis_outage_is_a_registry_error_and_heals(
    redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        RedisRegistry(redis.url, heartbeat_interval=HEARTBEAT, ttl=TTL) as worker,
        RedisRegistry(redis.url, heartbeat_interval=HEARTBEAT, ttl=TTL) as front,
    ):
        await worker.register("llm", "llm-0", "inproc://llm-0")
        redis.stop()
        with pytest.raises(RegistryError, match="list replicas failed") as info:
            await front.replicas("llm")
        assert info.value.url == redis.url and info.value.__cause__ is not None
        await eventually(lambda: _true(worker.statistics()["heartbeat_failures"] >= 2))
        redis.start()
        await eventually(lambda: _equals(ids(front, "llm"), ["llm-0"]))
    logged = [r.getMessage() for r in caplog.records if r.name == "omniflow.registry"]
    assert sum("heartbeat failed" in m for m in logged) == 1  # one line per outage
    assert sum("heartbeats restored" in m for m in logged) == 1


async def test_redis_unreachable_at_start(redis: Any) -> None:
    redis.stop()
    registry = RedisRegistry(redis.url, heartbeat_interval=HEARTBEAT, socket_timeout=0.5)
    with pytest.raises(RegistryError, match="connect failed"):
        await registry.start()
    await registry.close()


async def test_redis_key_layout_and_namespaces(redis: Any) -> None:
    import redis.asyncio as aioredis

    async with (
        RedisRegistry(redis.url, namespace="one", heartbeat_interval=HEARTBEAT, ttl=TTL) as one,
        RedisRegistry(redis.url, namespace="two", heartbeat_interval=HEARTBEAT, ttl=TTL) as two,
    ):
        await one.register("a:b", "c", "inproc://1")
        await one.register("a", "b:c", "inproc://2")  # would collide if names were not quoted
        await one.set_affinity("s:1", "a", "b:c")
        assert await ids(one, "a:b") == ["c"] and await ids(one, "a") == ["b:c"]
        assert await ids(two, "a") == []
        client = aioredis.Redis.from_url(redis.url)
        try:
            keys = sorted(k.decode() for k in await client.keys("*"))
            assert keys == [
                "one:replica:a%3Ab:c",
                "one:replica:a:b%3Ac",
                "one:role:a",
                "one:role:a%3Ab",
                "one:session:s%3A1",
            ]
            assert 0 < await client.pttl("one:replica:a:b%3Ac") <= TTL * 1000
            await client.set("one:replica:a:junk", b"not json")
            await client.sadd("one:role:a", "junk")
        finally:
            await client.aclose()
        with pytest.raises(RegistryError, match="not one omniflow wrote"):
            await one.replicas("a")


async def _true(value: bool) -> bool:
    return value


def test_create_registry() -> None:
    assert isinstance(create_registry(None), MemoryRegistry)
    assert isinstance(create_registry("memory://"), MemoryRegistry)
    redis = create_registry("redis://:secret@h:1/0", heartbeat_interval=2.0)
    assert isinstance(redis, RedisRegistry) and redis.ttl == 6.0
    assert "secret" not in repr(redis) and "***" in repr(redis)
    with pytest.raises(RegistryError, match="unsupported registry URL"):
        create_registry("etcd://h")


class _SwallowsCancel(MemoryRegistry):
    """A registry whose heartbeat write loses a cancel, as a client library may when the
    cancel races one of its own timeouts: the write turns it into a RegistryError."""

    writing: asyncio.Event

    async def _heartbeat(self, replicas: Any) -> None:
        self.writing.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RegistryError("the write was interrupted") from None


async def test_close_ends_heartbeats_even_if_a_write_swallows_the_cancel() -> None:
    registry = _SwallowsCancel(heartbeat_interval=0.01, ttl=1.0)
    registry.writing = asyncio.Event()
    await registry.start()
    await registry.register("llm", "llm-0", "inproc://llm-0")
    await asyncio.wait_for(registry.writing.wait(), 30)  # a heartbeat write is under way
    await asyncio.wait_for(registry.close(), 30)  # (a hang guard: it returns at once)
    assert registry._heartbeat_task is not None and registry._heartbeat_task.done()
