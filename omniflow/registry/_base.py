"""The ServiceRegistry interface: replicas of roles, heartbeats, watches and session affinity.

>>> from omniflow.registry import MemoryRegistry
>>> async def main():
...     async with MemoryRegistry(heartbeat_interval=0.5) as registry:
...         await registry.register("llm", "llm-0", "tcp://10.0.0.5:7000", {"gpu": 0})
...         async with registry.watch("llm") as watch:
...             snapshot = await anext(watch)          # now; then once per change
...         return [r.replica_id for r in snapshot.replicas]
>>> asyncio.run(main())
['llm-0']

Each client (one per process) heartbeats the replicas *it* registered: every
``heartbeat_interval`` it rewrites them with a time-to-live of ``ttl`` (default three
intervals). A process that dies stops heartbeating and its replicas expire; every reader
evicts expired replicas. A heartbeat rewrites the whole record, so a backend that lost its data
(a Redis restart) has every live replica back within one interval.

Watches poll the backend every ``watch_interval`` (default: the heartbeat interval) and wake at
once on changes made through the same client; expiry shows within ``ttl + watch_interval``.

Session affinity maps (session, role) to a replica id in the backend, so every front process
routes a session the same way; ``pin_affinity`` is an atomic compare-and-set for that.

Subclasses implement the ``_``-prefixed storage primitives; this class owns the lifecycle
(NEW → OPEN → CLOSED; outside OPEN every call raises RuntimeClosedError), heartbeats, versions
and watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Self, TypedDict

from omniflow._exceptions import RegistryError, RuntimeClosedError

__all__ = [
    "RegistryOptions",
    "RegistryState",
    "Replica",
    "ServiceRegistry",
    "Snapshot",
    "Watch",
]


class RegistryOptions(TypedDict, total=False):
    """The keywords every backend passes on to ``ServiceRegistry`` (defaults there, once)."""

    heartbeat_interval: float
    ttl: float | None
    affinity_ttl: float | None
    watch_interval: float | None
    key: bytes | None


logger = logging.getLogger("omniflow.registry")


@dataclass(frozen=True, slots=True)
class Replica:
    """One live instance of a role, reachable at ``address``."""

    #: Role name (the key in Graph.roles).
    role: str
    #: Unique among the replicas of the role.
    replica_id: str
    #: Where its process listens, e.g. ``tcp://10.0.0.5:7000``.
    address: str
    #: JSON-safe extra facts (device, process name, ...).
    meta: dict[str, Any] = field(default_factory=dict, hash=False)
    #: HMAC-SHA256 (hex) of the record under the cluster key; "" when unsigned.
    sig: str = field(default="", hash=False, compare=False, repr=False)

    def record(self) -> str:
        """The canonical JSON text of the record (what its signature covers)."""
        return json.dumps(
            {"role": self.role, "id": self.replica_id, "address": self.address, "meta": self.meta},
            sort_keys=True,
            separators=(",", ":"),
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The replicas of a role as one client saw them; ``version`` grows on every change seen.

    Versions are per client and per role: compare them only with the same client's.
    """

    role: str
    version: int
    #: Sorted by replica_id.
    replicas: tuple[Replica, ...]

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(r.replica_id for r in self.replicas)


class RegistryState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class ServiceRegistry(ABC):
    """Registration, discovery, heartbeats and session affinity; see the module docstring."""

    #: What this backend is called in messages.
    backend = "registry"

    def __init__(
        self,
        *,
        heartbeat_interval: float = 1.0,
        ttl: float | None = None,
        affinity_ttl: float | None = 3600.0,
        watch_interval: float | None = None,
        key: bytes | None = None,
    ) -> None:
        ttl = 3 * heartbeat_interval if ttl is None else ttl
        if not 0 < heartbeat_interval < ttl:
            raise ValueError(
                f"need 0 < heartbeat_interval < ttl, got heartbeat_interval="
                f"{heartbeat_interval} and ttl={ttl}; a ttl of 3 intervals rides out 2 misses"
            )
        #: Seconds between two heartbeats of this client's replicas.
        self.heartbeat_interval = heartbeat_interval
        #: Seconds a replica stays listed after its last heartbeat.
        self.ttl = ttl
        #: Seconds a session's affinity outlives its last use (None: forever).
        self.affinity_ttl = affinity_ttl
        #: Seconds between two polls of a watch.
        self.watch_interval = heartbeat_interval if watch_interval is None else watch_interval
        #: NEW until started, OPEN while usable, CLOSED for good.
        self.state = RegistryState.NEW
        #: The replicas this client registered and keeps alive, by (role, replica_id).
        self._local: dict[tuple[str, str], Replica] = {}
        #: Last membership seen and its version, per role.
        self._seen: dict[str, Snapshot] = {}
        self._changed = asyncio.Event()
        #: Held by a heartbeat round and by deregister, so a round in flight cannot write back
        #: a replica that was just deregistered.
        self._write_lock = asyncio.Lock()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._heartbeats = 0
        self._heartbeat_failures = 0
        self._failing = False
        #: The cluster key: records are signed with it, and records read back without a valid
        #: signature are ignored (never routed to) and counted. None: no signing at all.
        self._key = key
        self._forged = 0

    # -------------------------------------------------------------------------------- lifecycle

    async def start(self) -> Self:
        if self.state is not RegistryState.NEW:
            raise RuntimeClosedError(f"{self!r}: start() called twice")
        await self._open()
        self.state = RegistryState.OPEN
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name=f"{self!r}")
        return self

    async def close(self, *, deregister: bool = True) -> None:
        """Stop heartbeats, deregister this client's replicas (unless ``deregister=False``,
        which leaves them to expire, as a crash would), end watches, close connections."""
        if self.state is RegistryState.CLOSED:
            return
        was_open = self.state is RegistryState.OPEN
        self.state = RegistryState.CLOSED
        self._notify()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        try:
            if was_open and deregister and self._local:
                try:
                    for role, replica_id in list(self._local):
                        await self._remove(role, replica_id)
                except RegistryError as exc:
                    logger.warning("%r: could not deregister at close: %s", self, exc)
        finally:
            self._local.clear()
            await self._close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ----------------------------------------------------------------------- replicas of roles

    async def register(
        self, role: str, replica_id: str, address: str, meta: Mapping[str, Any] | None = None
    ) -> Replica:
        """Add (or update) a replica and keep it alive with this client's heartbeats."""
        self._check_open("register")
        _check_name("role", role)
        _check_name("replica_id", replica_id)
        _check_name("address", address)
        replica = Replica(role, replica_id, address, _json_copy(meta or {}, role))
        if self._key is not None:
            replica = replace(replica, sig=self.sign(replica.record()))
        async with self._write_lock:
            await self._put([replica])
            self._local[(role, replica_id)] = replica
        self._notify()
        return replica

    async def deregister(self, role: str, replica_id: str) -> None:
        """Remove a replica now (no-op if absent); this client stops heartbeating it."""
        self._check_open("deregister")
        async with self._write_lock:
            self._local.pop((role, replica_id), None)
            await self._remove(role, replica_id)
        self._notify()

    async def replicas(self, role: str) -> list[Replica]:
        """The live replicas of ``role``, sorted by replica_id; expired ones are evicted."""
        self._check_open("replicas")
        found = await self._list(role)
        if self._key is not None:
            signed = [r for r in found if r.role == role and self.verify(r.record(), r.sig)]
            if len(signed) != len(found):
                self.forged(len(found) - len(signed), role)
            found = signed
        return sorted(found, key=lambda r: r.replica_id)

    def sign(self, text: str) -> str:
        """The signature (hex HMAC-SHA256 under the cluster key) of a record's text."""
        assert self._key is not None
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def verify(self, text: str | bytes, sig: str | bytes) -> bool:
        """Whether ``sig`` is the signature of ``text`` (constant-time comparison)."""
        if self._key is None:
            return True
        raw = text.encode() if isinstance(text, str) else text
        want = hmac.new(self._key, raw, hashlib.sha256).hexdigest().encode()
        return hmac.compare_digest(want, sig.encode() if isinstance(sig, str) else sig)

    def forged(self, n: int, role: str) -> None:
        """Count ``n`` records of ``role`` ignored for a missing or bad signature."""
        if self._forged == 0 or (self._forged + n) // 100 != self._forged // 100:
            logger.warning(
                "%r: ignored %d unsigned or forged record(s) of role '%s' (%d so far)",
                self,
                n,
                role,
                self._forged + n,
            )
        self._forged += n

    async def snapshot(self, role: str) -> Snapshot:
        """The live replicas of ``role`` with a version that changes when membership does."""
        replicas = tuple(await self.replicas(role))
        last = self._seen.get(role)
        if last is not None and last.replicas == replicas:
            return last
        snap = Snapshot(role, 0 if last is None else last.version + 1, replicas)
        self._seen[role] = snap
        return snap

    def watch(self, role: str) -> Watch:
        """An async iterator of snapshots of ``role``: the current one, then one per change."""
        self._check_open("watch")
        return Watch(self, role)

    # ------------------------------------------------------------------------ session affinity

    async def get_affinity(self, session: str, role: str) -> str | None:
        """The replica id ``session`` is pinned to for ``role``, if any (refreshes its ttl)."""
        self._check_open("get_affinity")
        return await self._get_affinity(session, role)

    async def set_affinity(self, session: str, role: str, replica_id: str) -> None:
        """Pin ``session`` to ``replica_id`` for ``role``, unconditionally."""
        self._check_open("set_affinity")
        _check_name("replica_id", replica_id)
        await self._set_affinity(session, role, replica_id)

    async def pin_affinity(
        self, session: str, role: str, replica_id: str, *, replace: str | None = None
    ) -> str:
        """Atomically pin ``session`` to ``replica_id`` unless it is already pinned to a replica
        other than ``replace``; returns the replica id the session is pinned to afterwards.

        Two front processes pinning a new session at once both get the winner's id; re-pinning
        away from a dead replica passes ``replace=<dead id>``.
        """
        self._check_open("pin_affinity")
        _check_name("replica_id", replica_id)
        return await self._pin_affinity(session, role, replica_id, replace)

    async def clear_affinity(self, session: str, role: str | None = None) -> None:
        """Forget ``session``'s pin for ``role``, or for every role when ``role`` is None."""
        self._check_open("clear_affinity")
        await self._clear_affinity(session, role)

    # ------------------------------------------------------------------------- introspection

    def statistics(self) -> dict[str, int]:
        """Replicas kept alive here, heartbeat rounds done and failed."""
        return {
            "local_replicas": len(self._local),
            "heartbeats": self._heartbeats,
            "heartbeat_failures": self._heartbeat_failures,
            "forged_records": self._forged,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.state.value}>"

    # ------------------------------------------------------------------------------- internals

    async def _heartbeat_loop(self) -> None:
        # Ends at the first look after ``close`` even if the cancel ``close`` sends is lost
        # (a client library can swallow a cancel that races one of its own timeouts, and
        # then ``close``, awaiting this task, would wait for good).
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self.state is not RegistryState.OPEN:
                return
            if not self._local:
                continue
            try:
                async with self._write_lock:
                    await self._heartbeat(list(self._local.values()))
            except RegistryError as exc:
                self._heartbeat_failures += 1
                if not self._failing:  # one line per outage, not one per interval
                    logger.warning(
                        "%r: heartbeat failed, retrying every %ss: %s",
                        self,
                        self.heartbeat_interval,
                        exc,
                    )
                self._failing = True
                continue
            self._heartbeats += 1
            if self._failing:
                logger.warning(
                    "%r: heartbeats restored, %d replicas re-registered", self, len(self._local)
                )
                self._failing = False

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()

    def _check_open(self, op: str) -> None:
        if self.state is not RegistryState.OPEN:
            hint = (
                "use `async with` or await start() first"
                if self.state is RegistryState.NEW
                else "it was closed"
            )
            raise RuntimeClosedError(f"{self!r}: cannot {op}; {hint}")

    # -------------------------------------------------------------------- storage primitives

    @abstractmethod
    async def _open(self) -> None: ...

    @abstractmethod
    async def _close(self) -> None: ...

    @abstractmethod
    async def _put(self, replicas: list[Replica]) -> None:
        """Write replicas with a fresh ttl (register)."""

    async def _heartbeat(self, replicas: list[Replica]) -> None:
        """Write replicas with a fresh ttl, from the heartbeat connection where there is one."""
        await self._put(replicas)

    @abstractmethod
    async def _remove(self, role: str, replica_id: str) -> None: ...

    @abstractmethod
    async def _list(self, role: str) -> list[Replica]:
        """Live replicas of a role, evicting expired ones."""

    @abstractmethod
    async def _get_affinity(self, session: str, role: str) -> str | None: ...

    @abstractmethod
    async def _set_affinity(self, session: str, role: str, replica_id: str) -> None: ...

    @abstractmethod
    async def _pin_affinity(
        self, session: str, role: str, replica_id: str, replace: str | None
    ) -> str: ...

    @abstractmethod
    async def _clear_affinity(self, session: str, role: str | None) -> None: ...


class Watch:
    """Snapshots of one role: the current one first, then one each time membership changes.

    >>> async with registry.watch("llm") as watch:      # doctest: +SKIP
    ...     async for snapshot in watch:
    ...         router.update(snapshot)

    Iteration ends when the watch or its registry closes. A backend error while polling is
    logged and retried at the next poll; the watch does not end on it.
    """

    def __init__(self, registry: ServiceRegistry, role: str) -> None:
        #: The registry polled.
        self.registry = registry
        #: The role watched.
        self.role = role
        #: The last snapshot handed out (None before the first).
        self.latest: Snapshot | None = None
        self._closed = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Snapshot:
        registry = self.registry
        while not self._closed and registry.state is RegistryState.OPEN:
            try:
                snap = await registry.snapshot(self.role)
            except RuntimeClosedError:
                break
            except RegistryError as exc:
                logger.warning(
                    "%r: watch of role '%s' could not poll: %s", registry, self.role, exc
                )
            else:
                if self.latest is None or snap.version != self.latest.version:
                    self.latest = snap
                    return snap
            await registry._wait_change(registry.watch_interval)
        raise StopAsyncIteration

    def close(self) -> None:
        self._closed = True
        self.registry._notify()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise RegistryError(f"{what} must be a non-empty str, got {value!r}")


def _json_copy(meta: Mapping[str, Any], role: str) -> dict[str, Any]:
    """Replica meta is stored as JSON by every backend, so the memory one checks it too."""
    try:
        copy = json.loads(json.dumps(dict(meta)))
    except (TypeError, ValueError) as exc:
        raise RegistryError(
            f"role '{role}': replica meta must be JSON-serializable: {exc}", role=role
        ) from exc
    assert isinstance(copy, dict)
    return copy
