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

``evict`` applies the paper's three protections atomically: a replica with a reader lock is
refused; the last replica of a page in a running session's chain is refused; dropping the last
replica of a page removes the page from every chain (no chain points at an evicted page), so
each chain stays completely covered.
"""

from __future__ import annotations

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
    async def register(self, pool: str, node: str, info: dict[str, str]) -> None:
        """Announce ``node`` (a pool instance: host, shm prefix, pull address, layout)."""

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
        """Forget ``node``: every replica it provides and every lock it holds as a reader."""

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


class _PoolMeta:
    __slots__ = ("chains", "locks", "nodes", "providers", "runs", "sessions", "subs")

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, str]] = {}
        self.chains: dict[str, set[str]] = {}
        #: key -> chains holding it
        self.sessions: dict[str, set[str]] = {}
        self.providers: dict[str, dict[str, str]] = {}
        self.locks: dict[tuple[str, str], dict[str, int]] = {}
        self.runs: dict[str, int] = {}
        #: chain name -> nodes notified of its publishes
        self.subs: dict[str, set[str]] = {}


class MemoryMetadata(Metadata):
    """The metadata in this process's memory; every method is atomic (no await inside)."""

    def __init__(self) -> None:
        self._pools: dict[str, _PoolMeta] = {}
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

    async def register(self, pool: str, node: str, info: dict[str, str]) -> None:
        self._p(pool).nodes[node] = dict(info)

    async def nodes(self, pool: str, names: Sequence[str]) -> dict[str, dict[str, str]]:
        p = self._p(pool)
        return {n: dict(p.nodes[n]) for n in names if n in p.nodes}

    async def publish(
        self, pool: str, node: str, session: str | None, keys: Sequence[str], locs: Sequence[str]
    ) -> None:
        p = self._p(pool)
        name = chain_name(session)
        joined = []
        for key, loc in zip(keys, locs, strict=True):
            if loc:  # "": chain only (the page is provided by another node)
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
            ok = key in p.sessions  # a page already dropped everywhere stays dropped
            if ok:
                p.providers.setdefault(key, {})[node] = loc
            out.append(ok)
        return out

    async def match(
        self, pool: str, session: str | None, keys: Sequence[str], run: bool = False
    ) -> list[dict[str, str]]:
        p = self._p(pool)
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
        out: list[str | None] = []
        for key in keys:
            loc = p.providers.get(key, {}).get(provider)
            if loc == "m":  # being moved: nothing to lock in place
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
        p = self._p(pool)
        p.nodes.pop(node, None)
        self._listeners.pop((pool, node), None)
        for name in list(p.subs):
            p.subs[name].discard(node)
            if not p.subs[name]:
                del p.subs[name]
        for key in [k for k, prov in p.providers.items() if node in prov]:
            prov = p.providers[key]
            del prov[node]
            p.locks.pop((key, node), None)
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
