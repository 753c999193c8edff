"""LoadBalance policies: which replicas of a role receive an activation.

>>> rr = RoundRobin()
>>> replicas = [Replica("llm", f"llm-{i}", f"inproc://llm-{i}") for i in range(2)]
>>> [rr.choose("llm", replicas).replica_id for _ in range(3)]
['llm-0', 'llm-1', 'llm-0']

Every policy answers ``await policy.select(role, replicas, session=...)`` with the replicas to
send to (one, or all for :class:`Broadcast`), and ``policy.select_now(...)`` with the same
answer when it needs no store round trip (None otherwise: only a session whose pin must first
be settled in the shared store waits). ``replicas`` is what the router currently believes is
live: a :class:`~omniflow.registry.Snapshot`'s replicas, or the runtime's own replica records
(anything with a ``replica_id``); an empty list raises RegistryError naming the role.

:class:`SessionLoadBalance` keeps a session on one replica of the role, recorded in an
:class:`AffinityStore` (the registry), so every front process routes the session alike; a
local copy of each pin spares later activations the round trip. Without a store (one front)
pins are kept here only. When the pinned replica is not among the live ones, the session is
re-pinned to a live one with a compare-and-set, so two fronts noticing the death at once still
agree. The choice of a new replica (``SessionLoadBalance.pick``, a rendezvous hash) is pure
and tested without any store.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, Protocol, TypeVar

from omniflow._exceptions import RegistryError
from omniflow.registry._base import Replica  # noqa: F401 (the module example uses it)

__all__ = [
    "AffinityStore",
    "Broadcast",
    "LoadBalance",
    "RoundRobin",
    "Routable",
    "SessionLoadBalance",
    "load_balance",
    "no_live_replica",
]


class AffinityStore(Protocol):
    """Where session pins live; every :class:`~omniflow.registry.ServiceRegistry` is one."""

    async def get_affinity(self, session: str, role: str) -> str | None: ...

    async def pin_affinity(
        self, session: str, role: str, replica_id: str, *, replace: str | None = None
    ) -> str: ...


class Routable(Protocol):
    """What a policy needs of a replica: its id (a registry :class:`Replica`, or a runtime's
    own record of a connected replica)."""

    @property
    def replica_id(self) -> str: ...


R = TypeVar("R", bound=Routable)

#: A router's live replicas, or a function that says them anew each time it is called.
LiveReplicas = Sequence[R] | Callable[[], Sequence[R]]


class LoadBalance(ABC):
    """A routing policy over the live replicas of a role."""

    #: The ``lb=`` name of ``of.interface`` that selects this policy.
    name: ClassVar[str]

    @abstractmethod
    def select_now(
        self, role: str, replicas: Sequence[R], *, session: str | None = None
    ) -> list[R] | None:
        """The replicas that receive the activation (never empty), or None when the answer
        needs :meth:`select` (a round trip to the affinity store)."""

    async def select(
        self, role: str, replicas: Sequence[R], *, session: str | None = None
    ) -> list[R]:
        """The replicas that receive the activation (never empty)."""
        now = self.select_now(role, replicas, session=session)
        assert now is not None, f"{type(self).__name__} always answers at once"
        return now


class RoundRobin(LoadBalance):
    """Stateless dispatch: each role's replicas in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        #: Next position per role (taken modulo the current number of replicas).
        self._next: dict[str, int] = {}

    def choose(self, role: str, replicas: Sequence[R]) -> R:
        _require_some(role, replicas)
        position = self._next.get(role, 0)
        self._next[role] = position + 1
        return replicas[position % len(replicas)]

    def select_now(
        self, role: str, replicas: Sequence[R], *, session: str | None = None
    ) -> list[R]:
        return [self.choose(role, replicas)]


class Broadcast(LoadBalance):
    """Every live replica gets the activation."""

    name = "broadcast"

    def select_now(
        self, role: str, replicas: Sequence[R], *, session: str | None = None
    ) -> list[R]:
        _require_some(role, replicas)
        return list(replicas)


class SessionLoadBalance(LoadBalance):
    """Session affinity: all activations of a session for a role go to one replica.

    Calls without a session are spread round-robin (by ``fallback``, which a router may share
    with its ``round_robin`` policy). ``statistics()`` counts new pins and re-pins (a re-pin
    means the session's state on the lost replica is gone).
    """

    name = "session"

    #: How many compare-and-set rounds before giving up (only reached if the stores' view of
    #: the role keeps disagreeing with ours, e.g. replicas flapping).
    max_rounds = 4

    def __init__(
        self, store: AffinityStore | None = None, *, fallback: RoundRobin | None = None
    ) -> None:
        #: Where pins are kept for every front (the registry); None: in this process only.
        self.store = store
        self._fallback = fallback if fallback is not None else RoundRobin()
        #: (session, role) -> replica id: this front's copy of each pin it used.
        self._pins: dict[tuple[str, str], str] = {}
        self._pinned = 0
        self._repinned = 0

    @staticmethod
    def pick(session: str, replicas: Sequence[R]) -> R:
        """The replica a new (or orphaned) session goes to: the highest-random-weight choice,
        so every front that sees the same replicas proposes the same one, whatever the order
        it learnt them in (fewer pin conflicts to settle)."""
        return max(replicas, key=lambda r: zlib.crc32(f"{session}\0{r.replica_id}".encode()))

    def pinned(self, session: str, role: str, replicas: Sequence[R]) -> R | None:
        """The live replica of this front's copy of the session's pin, if any."""
        rid = self._pins.get((session, role))
        if rid is not None:
            for rep in replicas:
                if rep.replica_id == rid:
                    return rep
        return None

    def pin_here(self, session: str, role: str, replicas: Sequence[R]) -> R:
        """Pin ``session`` in this process only (no store, or the store is unreachable)."""
        _require_some(role, replicas)
        rep = self.pick(session, replicas)
        self._record(session, role, rep.replica_id, self._pins.get((session, role)))
        return rep

    def select_now(
        self, role: str, replicas: Sequence[R], *, session: str | None = None
    ) -> list[R] | None:
        if session is None:
            return [self._fallback.choose(role, replicas)]
        _require_some(role, replicas)
        rep = self.pinned(session, role, replicas)
        if rep is None and self.store is None:
            rep = self.pin_here(session, role, replicas)
        return None if rep is None else [rep]

    async def select(
        self, role: str, replicas: Sequence[R], *, session: str | None = None
    ) -> list[R]:
        now = self.select_now(role, replicas, session=session)
        if now is not None:
            return now
        assert session is not None
        return [await self.route(session, role, replicas)]

    async def route(
        self,
        session: str,
        role: str,
        replicas: LiveReplicas[R],
        *,
        find: Callable[[str], Awaitable[R | None]] | None = None,
    ) -> R:
        """The replica ``session`` is pinned to, pinning or re-pinning it as needed.

        ``replicas`` may be a function, asked again each round (the live set can change while
        the store answers). ``find(replica_id)`` is asked about a pin to a replica not among
        them (registered by another front, not yet connected here): it returns that replica
        once it can take work, or None to move the session.
        """
        live_now = replicas if callable(replicas) else _fixed(replicas)
        live = live_now()
        _require_some(role, live)
        rep = self.pinned(session, role, live)
        if rep is not None:
            return rep
        if self.store is None:
            return self.pin_here(session, role, live)
        current = await self.store.get_affinity(session, role)
        for _ in range(self.max_rounds):
            if current is not None:
                rep = await _resolve(current, live_now, find)
                if rep is not None:
                    self._pins[(session, role)] = current
                    return rep
            candidate = self.pick(session, live).replica_id
            winner = await self.store.pin_affinity(session, role, candidate, replace=current)
            rep = await _resolve(winner, live_now, find)
            if rep is not None:
                self._record(session, role, winner, current)
                return rep
            current = winner  # pinned meanwhile to a replica we do not see as live
            live = live_now()
            _require_some(role, live)
        raise RegistryError(
            f"role '{role}': could not pin session '{session}' to a live replica after "
            f"{self.max_rounds} attempts; the pin keeps naming replicas not in "
            f"{sorted(r.replica_id for r in live)}",
            role=role,
        )

    def forget(self, session: str) -> None:
        """Drop this front's copies of ``session``'s pins (the session was closed)."""
        for key in [k for k in self._pins if k[0] == session]:
            del self._pins[key]

    def _record(self, session: str, role: str, replica_id: str, before: str | None) -> None:
        """A pin this front made: new (``before`` None) or moved away from ``before``."""
        if before is None:
            self._pinned += 1
        elif before != replica_id:
            self._repinned += 1
        self._pins[(session, role)] = replica_id

    def statistics(self) -> dict[str, int]:
        return {"pinned": self._pinned, "repinned": self._repinned}


_POLICIES: dict[str, type[LoadBalance]] = {
    cls.name: cls for cls in (RoundRobin, Broadcast, SessionLoadBalance)
}


def load_balance(name: str, *, store: AffinityStore | None = None) -> LoadBalance:
    """The policy for an ``of.interface(lb=...)`` name; ``"session"`` pins sessions in
    ``store`` (the registry), or in this process only without one."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise RegistryError(f"unknown load-balance policy {name!r}; use one of {sorted(_POLICIES)}")
    if cls is SessionLoadBalance:
        return SessionLoadBalance(store)
    return cls()


def no_live_replica(role: str) -> str:
    """The one wording of "this role has no replica to run on" (the registry's error and the
    runtime's NodeError say it alike)."""
    return (
        f"no live replica of role '{role}' (every worker of it is gone); start one "
        f"(omniflow worker ... --role {role}) or wait for a restarted one to register"
    )


async def _resolve(
    replica_id: str,
    live_now: Callable[[], Sequence[R]],
    find: Callable[[str], Awaitable[R | None]] | None,
) -> R | None:
    """The live replica ``replica_id`` names: among the live ones, else what ``find`` says
    (checked against the live ones again: it may have waited)."""
    rep = next((r for r in live_now() if r.replica_id == replica_id), None)
    if rep is None and find is not None:
        found = await find(replica_id)
        if found is not None and any(r is found for r in live_now()):
            rep = found
    return rep


def _fixed(replicas: Sequence[R]) -> Callable[[], Sequence[R]]:
    return lambda: replicas


def _require_some(role: str, replicas: Sequence[Routable]) -> None:
    if not replicas:
        raise RegistryError(no_live_replica(role), role=role)
