"""The in-memory registry: the default, and the one that needs no server.

>>> store = MemoryStore()                                  # what Redis is to RedisRegistry
>>> async def main():
...     async with MemoryRegistry(store) as worker, MemoryRegistry(store) as front:
...         await worker.register("llm", "llm-0", "inproc://llm-0")
...         return [r.replica_id for r in await front.replicas("llm")]
>>> import asyncio
>>> asyncio.run(main())
['llm-0']

Several clients may share one :class:`MemoryStore`, each standing for a process of a
topology run inside one test process; each heartbeats its own replicas exactly as with Redis.
The store is plain synchronous code with an injectable clock, so expiry is testable without
sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Unpack

from omniflow.registry._base import RegistryOptions, Replica, ServiceRegistry

__all__ = ["MemoryRegistry", "MemoryStore"]


@dataclass(slots=True)
class _Session:
    #: Replica id per role.
    pins: dict[str, str] = field(default_factory=dict)
    #: Clock time after which the whole session is forgotten (None: never).
    deadline: float | None = None


class MemoryStore:
    """Replica records with deadlines, and session pins; what several clients share."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        #: Seconds, monotone; injectable for tests.
        self.clock = clock
        #: role -> replica_id -> (replica, deadline).
        self.replicas: dict[str, dict[str, tuple[Replica, float]]] = {}
        #: session -> its pins.
        self.sessions: dict[str, _Session] = {}
        #: Replicas dropped because their deadline passed.
        self.evictions = 0

    def put(self, replica: Replica, ttl: float) -> None:
        role = self.replicas.setdefault(replica.role, {})
        role[replica.replica_id] = (replica, self.clock() + ttl)

    def remove(self, role: str, replica_id: str) -> None:
        self.replicas.get(role, {}).pop(replica_id, None)

    def live(self, role: str) -> list[Replica]:
        """Live replicas of ``role``; drops the expired ones."""
        now = self.clock()
        records = self.replicas.get(role, {})
        expired = [rid for rid, (_, deadline) in records.items() if deadline <= now]
        for rid in expired:
            del records[rid]
        self.evictions += len(expired)
        return [replica for replica, _ in records.values()]

    def session(self, session: str, ttl: float | None, *, create: bool) -> _Session | None:
        """The session's pins, refreshing its deadline; None if absent (and not ``create``)."""
        now = self.clock()
        entry = self.sessions.get(session)
        if entry is not None and entry.deadline is not None and entry.deadline <= now:
            del self.sessions[session]
            entry = None
        if entry is None:
            if not create:
                return None
            entry = self.sessions[session] = _Session()
        entry.deadline = None if ttl is None else now + ttl
        return entry

    def clear(self) -> None:
        """Forget everything, as a restarted Redis would."""
        self.replicas.clear()
        self.sessions.clear()

    def validate(self) -> None:
        """Invariants: records are filed under their own role and id; no empty pin tables."""
        for role, records in self.replicas.items():
            for rid, (replica, _) in records.items():
                assert (replica.role, replica.replica_id) == (role, rid), (role, rid, replica)
        for name, entry in self.sessions.items():
            assert entry.pins, f"session {name!r} has no pins but is kept"


class MemoryRegistry(ServiceRegistry):
    """A ServiceRegistry over a :class:`MemoryStore` (a private one unless one is passed)."""

    backend = "memory"

    def __init__(
        self,
        store: MemoryStore | None = None,
        **options: Unpack[RegistryOptions],
    ) -> None:
        super().__init__(**options)
        #: The shared state.
        self.store = store if store is not None else MemoryStore()

    async def _open(self) -> None:
        pass

    async def _close(self) -> None:
        pass

    async def _put(self, replicas: list[Replica]) -> None:
        for replica in replicas:
            self.store.put(replica, self.ttl)

    async def _remove(self, role: str, replica_id: str) -> None:
        self.store.remove(role, replica_id)

    async def _list(self, role: str) -> list[Replica]:
        return self.store.live(role)

    async def _get_affinity(self, session: str, role: str) -> str | None:
        entry = self.store.session(session, self.affinity_ttl, create=False)
        return None if entry is None else entry.pins.get(role)

    async def _set_affinity(self, session: str, role: str, replica_id: str) -> None:
        entry = self.store.session(session, self.affinity_ttl, create=True)
        assert entry is not None
        entry.pins[role] = replica_id

    async def _pin_affinity(
        self, session: str, role: str, replica_id: str, replace: str | None
    ) -> str:
        entry = self.store.session(session, self.affinity_ttl, create=True)
        assert entry is not None
        current = entry.pins.get(role)
        if current is None or current == replace:
            entry.pins[role] = current = replica_id
        return current

    async def _clear_affinity(self, session: str, role: str | None) -> None:
        entry = self.store.sessions.get(session)
        if entry is None:
            return
        if role is not None:
            entry.pins.pop(role, None)
        if role is None or not entry.pins:
            del self.store.sessions[session]

    def __repr__(self) -> str:
        return f"<MemoryRegistry {self.state.value}>"
