"""Metadata of the Params Pools: chains, providers, replica locks, run locks -- one truth.

Two backends with the same behaviour (``tests/data/test_kv_meta.py`` runs one suite on both):
``MemoryMetadata`` (one process, or hosted by the front) and ``RedisMetadata`` (``_redis.py``:
every write and every match one Lua script, other reads one pipeline). Per pool:

- *chains*: a session's set of published page hashes (``None``: the public chain). A hash
  covers its whole prefix, so the longest prefix of a query is the run of its hashes that are
  in the session's (or the public) set and still have a provider.
- *providers*: page hash -> {node: location}, location ``"tier:index:fill"``.
- *replica locks*: (page, provider) -> {reader: count}; a locked replica is neither moved nor
  dropped by its provider (another process reads it in place or pulls it).
- *run locks*: session -> count of calls of that session holding pages; while it is non-zero
  the session's pages may move down a tier but their last replica is not dropped.
- *leases*: node -> when it is forgotten unless it ``heartbeat`` s first. A pool registers with a
  lease and renews it; a node whose lease ran out is forgotten as by ``leave`` (its replicas,
  its reader locks, its record), so a provider that died leaves every chain within its lease.
  Every ``match``, ``lock`` and ``heartbeat`` forgets the expired nodes first, so no answer
  names a provider past its lease. A node registered without a lease is never expired.
  A node forgotten (expired, left, or proven gone) stays *expired* until it registers again:
  meanwhile it provides nothing (``publish`` adds its pages to chains only where another node
  provides them, ``provide`` refuses) and locks nothing, so a node that was only stalled
  cannot leave an unleased replica or lock behind if it dies before its next ``heartbeat``.
  Locks other nodes hold on a forgotten node's replicas stay until their readers unlock them:
  a stalled provider that comes back still finds the pages it lent protected.

``evict`` applies the paper's three protections atomically: a replica with a reader lock is
refused; the last replica of a page in a running session's chain is refused; dropping the last
replica of a page removes the page from every chain (no chain points at an evicted page), so
each chain stays completely covered.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omniflow.data.kv._notice import NoticeSeal

__all__ = ["PUBLIC", "MemoryMetadata", "Metadata", "Notify"]

#: A subscriber's callback: (pool, session, hashes published there in one batch).
Notify = Callable[[str, str | None, list[str]], None]

#: Chain name of pages published with ``session=None``.
PUBLIC = "\x00public"


def chain_name(session: str | None) -> str:
    return PUBLIC if session is None else f"s:{session}"


class Metadata(ABC):
    """What a ParamsPool asks of its metadata backend (all of it async, all of it atomic)."""

    #: Requests sent to the backend (a Redis pipeline or script counts one).
    round_trips: int = 0

    @abstractmethod
    async def register(self, pool: str, node: str, info: dict[str, str], ttl_ms: int = 0) -> None:
        """Announce ``node`` (a pool instance: host, shm prefix, pull address, layout); with
        ``ttl_ms`` > 0 under a lease of that many milliseconds (0: no lease, never expired)."""

    @abstractmethod
    async def heartbeat(self, pool: str, node: str, ttl_ms: int) -> bool:
        """Forget the nodes whose lease ran out, then renew ``node``'s lease for ``ttl_ms``
        from now; False (nothing renewed) when ``node`` is not registered any more: it was
        forgotten, and registers again."""

    @abstractmethod
    async def sweep(self, pool: str) -> list[str]:
        """Forget every node whose lease ran out (as ``leave``); their names, sorted."""

    @abstractmethod
    async def nodes(self, pool: str, names: Sequence[str]) -> dict[str, dict[str, str]]: ...

    @abstractmethod
    async def publish(
        self, pool: str, node: str, session: str | None, keys: Sequence[str], locs: Sequence[str]
    ) -> None:
        """Add ``keys`` to the session's chain and ``node`` as their provider (``locs``), and
        notify the chain's subscribers of the pages that joined it."""

    @abstractmethod
    async def provide(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str]
    ) -> list[bool]:
        """``node`` holds replicas of ``keys`` (pulled); False where the page left every chain."""

    @abstractmethod
    async def match(
        self, pool: str, session: str | None, keys: Sequence[str], run: bool = False
    ) -> list[dict[str, str]]:
        """Providers of the longest prefix of ``keys`` in the session's or the public chain;
        with ``run`` (and a session) the session's run lock is taken (+1) in the same step,
        so a caller's first match of a session is still one request."""

    @abstractmethod
    async def evict(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str | None]
    ) -> list[bool]:
        """Move (``loc``) or drop (``None``) ``node``'s replicas; False where refused."""

    @abstractmethod
    async def lock(
        self, pool: str, reader: str, provider: str, keys: Sequence[str]
    ) -> list[str | None]:
        """Lock ``provider``'s replicas for ``reader``; their locations (None: gone, unlocked)."""

    @abstractmethod
    async def unlock(self, pool: str, reader: str, provider: str, keys: Sequence[str]) -> None: ...

    @abstractmethod
    async def run(self, pool: str, session: str, delta: int) -> None:
        """Add ``delta`` (+1 or -1) to the session's run lock (never below zero)."""

    @abstractmethod
    async def leave(self, pool: str, node: str) -> None:
        """Forget ``node``: every replica it provides and every lock it holds as a reader.
        Also called by another node that has proof ``node`` is gone (its shared memory or its
        process vanished); a live node forgotten so learns it at its next ``heartbeat``."""

    @abstractmethod
    async def dump(self, pool: str) -> dict[str, object]:
        """Everything, for invariant checks in tests: chains, providers, locks, runs."""

    def use_seal(self, pool: str, node: str, seal: NoticeSeal) -> None:
        """The seal of ``node``'s notices where they cross an untrusted medium (Redis pub/sub):
        it seals what ``node`` publishes and opens what it is notified of. In memory and
        front-hosted, notices never leave trusted code: nothing to do."""
        return None

    @abstractmethod
    def listen(self, pool: str, node: str, callback: Notify) -> None:
        """Where ``node``'s notifications go in this process (``subscribe`` says which)."""

    @abstractmethod
    async def subscribe(self, pool: str, node: str, session: str | None, on: bool) -> None:
        """Notify ``node`` (``on``) or stop notifying it of pages published in the session's
        chain (None: the public one); one batch per publish, never its own publishes."""

    async def settle(self, pool: str) -> None:
        """Return once every notification of a publish that finished before this call has
        reached this client's listeners (in memory: at once, they are called in the publish)."""
        return None

    async def close(self) -> None:
        return None


#: Seconds a forgotten node stays marked expired (one that has not registered again by then
#: never will: it is long dead).
EXPIRED_FOR = 24 * 3600.0


class _PoolMeta:
    __slots__ = ("chains", "expired", "leases", "locks", "nodes", "providers", "runs",
                 "sessions", "subs")  # fmt: skip

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, str]] = {}
        #: node -> clock time its lease runs out (only nodes registered with a lease)
        self.leases: dict[str, float] = {}
        #: forgotten node -> clock time it was forgotten (until it registers again)
        self.expired: dict[str, float] = {}
        self.chains: dict[str, set[str]] = {}
        #: key -> chains holding it
        self.sessions: dict[str, set[str]] = {}
        self.providers: dict[str, dict[str, str]] = {}
        self.locks: dict[tuple[str, str], dict[str, int]] = {}
        self.runs: dict[str, int] = {}
        #: chain name -> nodes notified of its publishes
        self.subs: dict[str, set[str]] = {}


class MemoryMetadata(Metadata):
    """The metadata in this process's memory; every method is atomic (no await inside).

    ``clock`` (seconds, monotonic) times the leases; tests pass their own to expire one.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._pools: dict[str, _PoolMeta] = {}
        self._clock = clock
        self.round_trips = 0
        #: (pool, node) -> where its notifications go
        self._listeners: dict[tuple[str, str], Notify] = {}

    def listen(self, pool: str, node: str, callback: Notify) -> None:
        self._listeners[(pool, node)] = callback

    async def subscribe(self, pool: str, node: str, session: str | None, on: bool) -> None:
        p = self._p(pool)
        name = chain_name(session)
        if on:
            p.subs.setdefault(name, set()).add(node)
        elif name in p.subs:
            p.subs[name].discard(node)
            if not p.subs[name]:
                del p.subs[name]

    def _notify(
        self, pool: str, p: _PoolMeta, node: str, session: str | None, keys: list[str]
    ) -> None:
        """One batch per subscriber: the pages of this publish that joined the chain."""
        if not keys:
            return
        for sub in sorted(p.subs.get(chain_name(session), ())):
            callback = self._listeners.get((pool, sub))
            if sub != node and callback is not None:
                callback(pool, session, list(keys))

    def _p(self, pool: str) -> _PoolMeta:
        self.round_trips += 1
        return self._pools.setdefault(pool, _PoolMeta())

    async def register(self, pool: str, node: str, info: dict[str, str], ttl_ms: int = 0) -> None:
        p = self._p(pool)
        p.nodes[node] = dict(info)
        p.expired.pop(node, None)
        if ttl_ms > 0:
            p.leases[node] = self._clock() + ttl_ms / 1000
        else:
            p.leases.pop(node, None)

    async def heartbeat(self, pool: str, node: str, ttl_ms: int) -> bool:
        p = self._p(pool)
        self._sweep(pool, p)
        if node not in p.nodes:
            return False
        p.leases[node] = self._clock() + ttl_ms / 1000
        return True

    async def sweep(self, pool: str) -> list[str]:
        return self._sweep(pool, self._p(pool))

    def _sweep(self, pool: str, p: _PoolMeta) -> list[str]:
        if not p.leases:
            return []
        now = self._clock()
        dead = sorted(n for n, until in p.leases.items() if until <= now)
        for node in dead:
            self._forget(pool, p, node)
        for node in [n for n, when in p.expired.items() if when + EXPIRED_FOR <= now]:
            del p.expired[node]
        return dead

    async def nodes(self, pool: str, names: Sequence[str]) -> dict[str, dict[str, str]]:
        p = self._p(pool)
        return {n: dict(p.nodes[n]) for n in names if n in p.nodes}

    async def publish(
        self, pool: str, node: str, session: str | None, keys: Sequence[str], locs: Sequence[str]
    ) -> None:
        p = self._p(pool)
        name = chain_name(session)
        joined = []
        gone = node in p.expired
        for key, loc in zip(keys, locs, strict=True):
            if loc and not gone:  # "": chain only (the page is provided by another node)
                p.providers.setdefault(key, {})[node] = loc
            if p.providers.get(key):
                p.chains.setdefault(name, set()).add(key)
                p.sessions.setdefault(key, set()).add(name)
                joined.append(key)
        if p.subs:
            self._notify(pool, p, node, session, joined)

    async def provide(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str]
    ) -> list[bool]:
        p = self._p(pool)
        out = []
        for key, loc in zip(keys, locs, strict=True):
            ok = key in p.sessions and node not in p.expired  # a dropped page stays dropped
            if ok:
                p.providers.setdefault(key, {})[node] = loc
            out.append(ok)
        return out

    async def match(
        self, pool: str, session: str | None, keys: Sequence[str], run: bool = False
    ) -> list[dict[str, str]]:
        p = self._p(pool)
        self._sweep(pool, p)
        if run and session is not None:
            p.runs[chain_name(session)] = p.runs.get(chain_name(session), 0) + 1
        mine = p.chains.get(chain_name(session), set())
        public = p.chains.get(PUBLIC, set())
        out = []
        for key in keys:
            prov = p.providers.get(key)
            if not prov or (key not in mine and key not in public):
                break
            out.append(dict(prov))
        return out

    async def evict(
        self, pool: str, node: str, keys: Sequence[str], locs: Sequence[str | None]
    ) -> list[bool]:
        p = self._p(pool)
        done = []
        for key, loc in zip(keys, locs, strict=True):
            prov = p.providers.get(key, {})
            if node not in prov:
                done.append(True)  # nothing of ours to protect
                continue
            if p.locks.get((key, node)):
                done.append(False)
                continue
            if loc is not None:
                prov[node] = loc
                done.append(True)
                continue
            chains = p.sessions.get(key, set())
            last = len(prov) == 1
            if last and any(p.runs.get(c, 0) > 0 for c in chains):
                done.append(False)
                continue
            del prov[node]
            if not prov:
                self._drop_page(p, key)
            done.append(True)
        return done

    def _drop_page(self, p: _PoolMeta, key: str) -> None:
        p.providers.pop(key, None)
        for c in p.sessions.pop(key, set()):
            chain = p.chains.get(c)
            if chain is not None:
                chain.discard(key)
                if not chain:
                    del p.chains[c]

    async def lock(
        self, pool: str, reader: str, provider: str, keys: Sequence[str]
    ) -> list[str | None]:
        p = self._p(pool)
        self._sweep(pool, p)
        out: list[str | None] = []
        for key in keys:
            loc = p.providers.get(key, {}).get(provider)
            if loc == "m" or reader in p.expired:  # being moved, or a forgotten reader
                loc = None
            if loc is not None:
                held = p.locks.setdefault((key, provider), {})
                held[reader] = held.get(reader, 0) + 1
            out.append(loc)
        return out

    async def unlock(self, pool: str, reader: str, provider: str, keys: Sequence[str]) -> None:
        p = self._p(pool)
        for key in keys:
            held = p.locks.get((key, provider))
            if held is None or reader not in held:
                continue
            held[reader] -= 1
            if held[reader] <= 0:
                del held[reader]
            if not held:
                del p.locks[(key, provider)]

    async def run(self, pool: str, session: str, delta: int) -> None:
        p = self._p(pool)
        name = chain_name(session)
        n = max(0, p.runs.get(name, 0) + delta)
        if n:
            p.runs[name] = n
        else:
            p.runs.pop(name, None)

    async def leave(self, pool: str, node: str) -> None:
        self._forget(pool, self._p(pool), node)

    def _forget(self, pool: str, p: _PoolMeta, node: str) -> None:
        p.nodes.pop(node, None)
        p.leases.pop(node, None)
        p.expired[node] = self._clock()
        self._listeners.pop((pool, node), None)
        for name in list(p.subs):
            p.subs[name].discard(node)
            if not p.subs[name]:
                del p.subs[name]
        for key in [k for k, prov in p.providers.items() if node in prov]:
            prov = p.providers[key]
            del prov[node]  # (readers' locks on it stay until they unlock)
            if not prov:
                self._drop_page(p, key)
        for lk in list(p.locks):
            p.locks[lk].pop(node, None)
            if not p.locks[lk]:
                del p.locks[lk]

    async def dump(self, pool: str) -> dict[str, object]:
        p = self._p(pool)
        return {
            "chains": {c: sorted(k) for c, k in p.chains.items()},
            "providers": {k: dict(v) for k, v in p.providers.items()},
            "locks": {f"{k}|{n}": dict(v) for (k, n), v in p.locks.items()},
            "runs": dict(p.runs),
            "subs": {c: sorted(n) for c, n in p.subs.items()},
        }

    def validate(self, pool: str) -> None:
        """Check the pool's invariants; raises ``AssertionError`` (tests call it at every step)."""
        p = self._pools.get(pool)
        if p is None:
            return
        for name, chain in p.chains.items():
            assert chain, f"chain {name} is empty but kept"
            for key in chain:
                assert p.providers.get(key), f"chain {name} names {key}, which nobody provides"
                assert name in p.sessions.get(key, ()), f"{key} does not list its chain {name}"
        for key, names in p.sessions.items():
            assert names and all(key in p.chains.get(c, ()) for c in names), f"{key}: {names}"
        for key, prov in p.providers.items():
            assert prov, f"page {key} kept with no provider"
        for (key, node), held in p.locks.items():
            assert held and all(n > 0 for n in held.values()), f"lock {key}|{node}: {held}"
        for node in p.leases:
            assert node in p.nodes, f"lease of {node}, which is not registered"
        for node in p.expired:
            assert node not in p.nodes, f"{node} is registered and marked expired"
            assert not any(node in prov for prov in p.providers.values()), f"{node} provides"
            assert not any(node in held for held in p.locks.values()), f"{node} holds locks"
        assert all(n > 0 for n in p.runs.values()), f"run locks {p.runs}"
