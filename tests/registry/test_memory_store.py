"""The in-memory store as plain synchronous code with a fake clock: no sleeps."""

from __future__ import annotations

import pytest

from omniflow.registry import MemoryStore, Replica


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_replicas_expire_exactly_at_their_deadline() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    store.put(Replica("llm", "a", "inproc://a"), ttl=3.0)
    clock.now += 2.0
    store.put(Replica("llm", "b", "inproc://b"), ttl=3.0)
    clock.now += 0.999
    assert [r.replica_id for r in store.live("llm")] == ["a", "b"]
    clock.now += 0.001
    assert [r.replica_id for r in store.live("llm")] == ["b"]
    store.put(Replica("llm", "b", "inproc://b"), ttl=3.0)  # a heartbeat
    clock.now += 2.9
    assert [r.replica_id for r in store.live("llm")] == ["b"]
    assert store.evictions == 1
    store.validate()


def test_sessions_expire_and_refresh() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    entry = store.session("s", 10.0, create=True)
    assert entry is not None
    entry.pins["llm"] = "a"
    clock.now += 9.0
    assert store.session("s", 10.0, create=False) is entry  # refreshed to now + 10
    clock.now += 9.0
    assert store.session("s", 10.0, create=False) is entry
    clock.now += 10.0
    assert store.session("s", 10.0, create=False) is None
    assert store.sessions == {}


def test_validate_catches_misfiled_records() -> None:
    store = MemoryStore(Clock())
    store.replicas["llm"] = {"a": (Replica("vae", "a", "x"), 0.0)}
    with pytest.raises(AssertionError):
        store.validate()
