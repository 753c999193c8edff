"""LoadBalance policies: which replicas of a role receive an activation.

>>> rr = RoundRobin()
>>> replicas = [Replica("llm", f"llm-{i}", f"inproc://llm-{i}") for i in range(2)]
>>> [rr.choose("llm", replicas).replica_id for _ in range(3)]
['llm-0', 'llm-1', 'llm-0']

Every policy answers ``await policy.select(role, replicas, session=...)`` with the replicas to
send to (one, or all for :class:`Broadcast`). ``replicas`` is what the router currently
believes is live (a :class:`~omniflow.registry.Snapshot`'s replicas); an empty list raises
RegistryError naming the role.

:class:`SessionLoadBalance` keeps a session on one replica of the role, recorded in an
:class:`AffinityStore` (the registry), so every front process routes the session alike. When
the pinned replica is not among the live ones, the session is re-pinned to a live one with a
compare-and-set, so two fronts noticing the death at once still agree. The choice of a new
replica (``SessionLoadBalance.pick``) is pure and tested without any store.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol

from omniflow._exceptions import RegistryError
from omniflow.registry._base import Replica

__all__ = [
    "AffinityStore",
    "Broadcast",
    "LoadBalance",
    "RoundRobin",
    "SessionLoadBalance",
    "load_balance",
]


class AffinityStore(Protocol):
    """Where session pins live; every :class:`~omniflow.registry.ServiceRegistry` is one."""

    async def get_affinity(self, session: str, role: str) -> str | None: ...

    async def pin_affinity(
        self, session: str, role: str, replica_id: str, *, replace: str | None = None
    ) -> str: ...


class LoadBalance(ABC):
    """A routing policy over the live replicas of a role."""

    #: The ``lb=`` name of ``of.interface`` that selects this policy.
    name: ClassVar[str]

    @abstractmethod
    async def select(
        self, role: str, replicas: Sequence[Replica], *, session: str | None = None
    ) -> list[Replica]:
        """The replicas that receive the activation (never empty)."""


class RoundRobin(LoadBalance):
    """Stateless dispatch: each role's replicas in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        #: Next position per role (taken modulo the current number of replicas).
        self._next: dict[str, int] = {}

    def choose(self, role: str, replicas: Sequence[Replica]) -> Replica:
        _require_some(role, replicas)
        position = self._next.get(role, 0)
        self._next[role] = position + 1
        return replicas[position % len(replicas)]

    async def select(
        self, role: str, replicas: Sequence[Replica], *, session: str | None = None
    ) -> list[Replica]:
        return [self.choose(role, replicas)]


class Broadcast(LoadBalance):
    """Every live replica gets the activation."""

    name = "broadcast"

    async def select(
        self, role: str, replicas: Sequence[Replica], *, session: str | None = None
    ) -> list[Replica]:
        _require_some(role, replicas)
        return list(replicas)


class SessionLoadBalance(LoadBalance):
    """Session affinity: all activations of a session for a role go to one replica.

    Calls without a session are spread round-robin. ``statistics()`` counts new pins and
    re-pins (a re-pin means the session's state on the lost replica is gone).
    """

    name = "session"

    #: How many compare-and-set rounds before giving up (only reached if the stores' view of
    #: the role keeps disagreeing with ours, e.g. replicas flapping).
    max_rounds = 4

    def __init__(self, store: AffinityStore) -> None:
        #: Where pins are kept (the registry).
        self.store = store
        self._fallback = RoundRobin()
        self._pinned = 0
        self._repinned = 0

    @staticmethod
    def pick(session: str, replicas: Sequence[Replica]) -> Replica:
        """The replica a new (or orphaned) session goes to: a stable hash of the session, so
        fronts racing to pin the same session usually propose the same replica."""
        return replicas[zlib.crc32(session.encode()) % len(replicas)]

    async def select(
        self, role: str, replicas: Sequence[Replica], *, session: str | None = None
    ) -> list[Replica]:
        if session is None:
            return [self._fallback.choose(role, replicas)]
        return [await self.route(session, role, replicas)]

    async def route(self, session: str, role: str, replicas: Sequence[Replica]) -> Replica:
        """The replica ``session`` is pinned to, pinning or re-pinning it as needed."""
        _require_some(role, replicas)
        live = {r.replica_id: r for r in replicas}
        current = await self.store.get_affinity(session, role)
        for _ in range(self.max_rounds):
            if current is not None and current in live:
                return live[current]
            candidate = self.pick(session, replicas).replica_id
            winner = await self.store.pin_affinity(session, role, candidate, replace=current)
            if winner in live:
                if current is None:
                    self._pinned += 1
                else:
                    self._repinned += 1
                return live[winner]
            current = winner  # pinned meanwhile to a replica we do not see as live
        raise RegistryError(
            f"role '{role}': could not pin session '{session}' to a live replica after "
            f"{self.max_rounds} attempts; the pin keeps naming replicas not in {sorted(live)}",
            role=role,
        )

    def statistics(self) -> dict[str, int]:
        return {"pinned": self._pinned, "repinned": self._repinned}


_POLICIES: dict[str, type[LoadBalance]] = {
    cls.name: cls for cls in (RoundRobin, Broadcast, SessionLoadBalance)
}


def load_balance(name: str, *, store: AffinityStore | None = None) -> LoadBalance:
    """The policy for an ``of.interface(lb=...)`` name; ``"session"`` needs the ``store``."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise RegistryError(f"unknown load-balance policy {name!r}; use one of {sorted(_POLICIES)}")
    if cls is SessionLoadBalance:
        if store is None:
            raise RegistryError("lb='session' needs an affinity store (the registry)")
        return SessionLoadBalance(store)
    return cls()


def _require_some(role: str, replicas: Sequence[Replica]) -> None:
    if not replicas:
        raise RegistryError(
            f"role '{role}' has no live replica; start one (omniflow worker ... --role {role}) "
            "or wait for a restarted one to register",
            role=role,
        )
