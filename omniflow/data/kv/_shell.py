"""The Params Pool's state and lifecycle: open, keys, signed node records, serving pulls.

``ParamsPool`` (``_pool``) is this shell and owns its parts, each one responsibility over the
shell's state: ``PoolMoves`` (``_moves``: plans cleared with the metadata, allocation,
readback), ``PoolFetch`` (``_fetch``: pages of other processes, viewed in place or pulled),
``PoolMatch`` (``_match``: match, pins, release) and ``PoolSubscriptions`` (``_subscribe``:
publish notifications and preload).

The shell owns everything with a side effect: the tensors (``_tiers``), the metadata backend
(``_meta`` / ``_redis`` / ``_hosted``), the pull server and client (``_pull``), the asyncio
lock that makes each plan-copy-commit atomic, the in-flight futures that deduplicate concurrent
misses, and the zero-copy attachments of other processes' L2 on this host.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import DataError, RuntimeClosedError
from omniflow.data.kv._layout import PageLayout
from omniflow.data.kv._lease import Shunned
from omniflow.data.kv._meta import MemoryMetadata, Metadata
from omniflow.data.kv._notice import NoticeSeal
from omniflow.data.kv._places import Foreign, loc
from omniflow.data.kv._slots import TIERS, SlotCore
from omniflow.transport._auth import KEY_ENV, WireStats, generate_key, resolve_key

if TYPE_CHECKING:  # torch is imported when a pool opens, not with omniflow
    import torch

    from omniflow.data.kv._tiers import ForeignL2, TierStore


__all__ = ["HOST", "PoolShell"]

logger = logging.getLogger("omniflow.kv")

HOST = socket.gethostname()
#: Foreign slots (another process's L2 page, viewed in place) get ids from here up.
_FOREIGN_BASE = 1 << 40


class PoolShell:
    """State, open/close and keys of a ``ParamsPool`` (its constructor is this one)."""

    def __init__(
        self,
        name: str,
        layout: PageLayout,
        capacity: Mapping[str, int] | None = None,
        l3_dir: str | None = None,
        metadata: str | Metadata | None = None,
        *,
        device: str | torch.device | None = None,
        serve_pulls: bool | None = None,
        pull_bind: str = "tcp://127.0.0.1:0",
        host: str | None = None,
        cluster_key: str | bytes | None = None,
        pull_timeout: float = 30.0,
        provider_ttl: float | None = 30.0,
        shared_l1: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise DataError(f"ParamsPool name must be a non-empty str, got {name!r}")
        if not isinstance(layout, PageLayout):
            raise DataError(f"pool '{name}': layout must be an omniflow.PageLayout")
        cap = dict(capacity or {"l1": 512, "l2": 4096, "l3": 0})
        unknown = set(cap) - set(TIERS)
        if unknown:
            raise DataError(f"pool '{name}': capacity has unknown tiers {sorted(unknown)}")
        if metadata is not None and not isinstance(metadata, Metadata | str):
            raise DataError(f"pool '{name}': metadata must be None or a 'redis://' URL")
        if isinstance(metadata, str) and not metadata.startswith(("redis://", "rediss://")):
            raise DataError(f"pool '{name}': metadata must be a redis:// URL, got {metadata!r}")
        for what, value in (("pull_timeout", pull_timeout), ("provider_ttl", provider_ttl)):
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise DataError(f"pool '{name}': {what} must be seconds > 0, got {value!r}")
        self.name = name
        self.layout = layout
        self.capacity = {t: int(cap.get(t, 0)) for t in TIERS}
        #: L1 in named host shared memory: co-located processes read its pages in place.
        self.shared_l1 = bool(shared_l1)
        self.l3_dir = l3_dir
        self.metadata = metadata
        self._device = device
        #: Where the pull server binds (loopback unless told; port 0: any free port).
        self.pull_bind = pull_bind
        self._serve = serve_pulls if serve_pulls is not None else metadata is not None
        self._serve_said = serve_pulls
        #: The backend used when ``metadata`` is None (``use_metadata``: the front's).
        self._hosted: Metadata | None = None
        #: The node this pool says it runs on: pools on one node share L2 in place, others pull.
        self.host = host or HOST
        #: This pool instance's id in the metadata (host, process, random).
        self.node = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self._core = SlotCore(self.capacity, name=name)
        self._store: TierStore | None = None
        self._meta: Metadata | None = None
        self._lock: asyncio.Lock | None = None
        self._opening: asyncio.Future[None] | None = None
        self._closed = False
        self._inflight: dict[str, asyncio.Future[int | None]] = {}
        self._foreign: dict[int, Foreign] = {}
        self._foreign_ids = iter(range(_FOREIGN_BASE, 1 << 62))
        self._attached: dict[str, ForeignL2] = {}
        #: Names of the other pools' shared segments this pool has viewed pages in, in place.
        self._foreign_segments: set[str] = set()
        #: Node records of other pools (immutable per node id), cached.
        self._infos: dict[str, dict[str, str]] = {}
        self._owner_foreign: dict[str, set[int]] = {}
        #: owner -> sessions whose run lock the owner holds.
        self._runs: dict[str, set[str]] = {}
        self._server: Any = None
        self._client: Any = None
        self.counters = {
            "hits": 0, "misses": 0, "bytes_moved": 0, "pulled": 0, "shared": 0,
            "notified": 0, "preloaded": 0, "pull_failures": 0, "forged_records": 0,
            "vanished": 0, "proven_gone": 0, "shunned_pages": 0, "leases_lost": 0,
        }  # fmt: skip
        #: Subscribed chains (session; None: public) -> preload their published pages.
        self._subs: dict[str | None, bool] = {}
        #: The latest notification batches (session, hashes), newest last.
        self.notices: collections.deque[tuple[str | None, list[str]]] = collections.deque(maxlen=64)
        self._preloads: set[asyncio.Task[None]] = set()
        #: Longest wait of one match for other nodes' answers (all its pulls together) before
        #: the pages not yet had count as a miss.
        self.pull_timeout = pull_timeout
        #: Seconds of this node's lease in the metadata (renewed every third of it; None: no
        #: lease, the node is forgotten only when it leaves or is proven gone).
        self.provider_ttl = provider_ttl
        #: Providers found vanished, per chain: skipped by matches until a lease has passed.
        self._shunned = Shunned(provider_ttl or 2 * pull_timeout)
        #: Views of other processes' pages whose replica lock is missing (both leases ran out).
        self._unlocked: set[int] = set()
        #: The task renewing the lease (started at open).
        self._heartbeat: asyncio.Task[None] | None = None
        #: The cluster key that seals pulls (None: resolved at open, see ``set_cluster_key``).
        self._key: bytes | None = resolve_key(cluster_key)[0] if cluster_key is not None else None
        self._key_given = cluster_key is not None
        #: This node's record (signed when registered) and whether a new key must re-sign it.
        self._info: dict[str, str] | None = None
        self._resign = False
        #: Pull requests and answers accepted and dropped (bad MAC, replay, malformed, ...).
        self.wire = WireStats()
        #: Publish notifications (through Redis) accepted and dropped, likewise.
        self.notice_wire = WireStats()
        #: Seals the notices of this pool's publishes, opens those it gets (made at open).
        self._seal: NoticeSeal | None = None

    def colocate(self, l1_pages: int, *, shared: bool) -> None:
        """Size this process's share of a co-located pool before it opens (``KvPoolBarrier``):
        ``l1_pages`` L1 pages, in shared memory when ``shared`` (partners in other processes of
        this node then view its pages in place)."""
        if self._store is not None or self._opening is not None:
            if self.capacity["l1"] == l1_pages and self.shared_l1 == shared:
                return
            raise DataError(
                f"pool '{self.name}' is already open with {self.capacity['l1']} L1 pages; a "
                "co-located pool is sized by its barrier before anyone opens it: let the engines "
                "open it (do not use it in setup() before they started)"
            )
        if isinstance(l1_pages, bool) or not isinstance(l1_pages, int) or l1_pages < 1:
            raise DataError(f"pool '{self.name}': l1_pages must be an int >= 1, got {l1_pages!r}")
        self.capacity["l1"] = l1_pages
        self.shared_l1 = shared
        self._core = SlotCore(self.capacity, name=self.name)

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def opened(self) -> bool:
        """Whether the tiers are allocated (``open()`` done, ``aclose()`` not)."""
        return self._store is not None

    async def open(self) -> None:
        """Allocate the tiers and register with the metadata (done by the first call anyway)."""
        if self._closed:
            raise RuntimeClosedError(f"pool '{self.name}' is closed")
        if self._store is not None:
            return
        if self._opening is not None:
            return await asyncio.shield(self._opening)
        self._opening = asyncio.get_running_loop().create_future()
        try:
            self._lock = asyncio.Lock()
            meta = self.metadata
            if meta is None:
                self._meta = self._hosted or MemoryMetadata()
            elif isinstance(meta, str):
                from omniflow.data.kv._redis import RedisMetadata

                self._meta = RedisMetadata(meta)
            else:
                self._meta = meta
            from omniflow.data.kv._tiers import TierStore

            prefix = f"ofkv_{self.name[:16]}_{secrets.token_hex(5)}"
            store = TierStore(
                self.layout,
                [self.capacity[t] for t in TIERS],
                prefix=prefix,
                l3_dir=self.l3_dir,
                device=self._device,
                shared_l1=self.shared_l1,
            )
            address = ""
            if self._serve:
                from omniflow.data.kv._pull import PullClient, PullServer

                key = self._cluster_key()
                self._server = PullServer(self, key, self.wire)
                address = await self._server.start(self.pull_bind)
                self._client = PullClient(key, self.wire, timeout=self.pull_timeout)
            info = {
                "host": self.host,
                "pid": str(os.getpid()),
                "shm": prefix if self.capacity["l2"] else "",
                "l2": str(self.capacity["l2"]),
                "shm1": prefix if self.shared_l1 and self.capacity["l1"] else "",
                "l1": str(self.capacity["l1"]),
                "addr": address,
                "layout": self.layout.canonical_json(),
                "lid": self.layout.layout_id,
            }
            self._info = info
            self._seal = NoticeSeal(self.name, self.node, self._cluster_key(), self.notice_wire)
            self._meta.use_seal(self.name, self.node, self._seal)
            await self._meta.register(self.name, self.node, self._signed(info), self._ttl_ms())
            self._store = store
            if self.provider_ttl is not None:
                self._heartbeat = asyncio.get_running_loop().create_task(self._keep_lease())
            self._opening.set_result(None)
        except BaseException as exc:
            self._opening.set_exception(exc)
            self._opening.exception()  # retrieved: the caller gets it raised
            self._opening = None
            raise

    def set_cluster_key(self, key: str | bytes) -> None:
        """Seal pulls with ``key``: the runtime (or worker) hosting this pool gives it the
        deployment's cluster key. A key given to the pool itself wins; a different one is an
        error, since its pulls with the runtime's workers would all fail."""
        raw = resolve_key(key)[0]
        if self._key_given:
            if raw != self._key:
                raise DataError(
                    f"pool '{self.name}' was given a cluster_key that is not the one of the "
                    "runtime hosting it; give the pool none (it takes the runtime's) or the same"
                )
            return
        if raw == self._key:
            return
        self._key = raw
        self._resign = self._info is not None
        if self._server is not None:
            self._server.rekey(raw)
        if self._client is not None:
            self._client.rekey(raw)
        if self._seal is not None:
            self._seal.rekey(raw)

    def _cluster_key(self) -> bytes:
        if self._key is None:
            env = os.environ.get(KEY_ENV)
            self._key = resolve_key(env)[0] if env else _process_key()
        return self._key

    async def aclose(self) -> None:
        """Leave the metadata, stop serving pulls, free every tier."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._preloads):
            task.cancel()
        await asyncio.gather(*list(self._preloads), return_exceptions=True)
        beat, self._heartbeat = self._heartbeat, None
        if beat is not None and not beat.done():
            beat.cancel()
            if beat.get_loop() is asyncio.get_running_loop():  # (a closed loop ended it)
                await asyncio.gather(beat, return_exceptions=True)
        if self._server is not None:
            await self._server.close()
        if self._client is not None:
            self._client.close()
        try:
            if self._meta is not None:
                try:
                    await self._meta.leave(self.name, self.node)
                finally:
                    if isinstance(self.metadata, str):
                        await self._meta.close()
        finally:  # the memory is freed even when the metadata is unreachable
            for att in self._attached.values():
                att.close()
            self._attached.clear()
            if self._store is not None:
                self._store.close()
                self._store = None

    def use_metadata(self, meta: Metadata) -> bool:
        """Use ``meta`` (the metadata its runtime's front hosts) where ``metadata`` is None;
        the pool then serves pulls to other processes unless ``serve_pulls`` said otherwise.
        Takes effect when the pool opens; False (nothing changed) for an open pool or one
        with its own metadata."""
        if self.metadata is not None or self._store is not None or self._opening is not None:
            return False
        self._hosted = meta
        if self._serve_said is None:
            self._serve = True
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def _ready(self) -> tuple[TierStore, Metadata, asyncio.Lock]:
        if self._closed:
            raise RuntimeClosedError(f"pool '{self.name}' is closed")
        assert self._store is not None and self._meta is not None and self._lock is not None
        return self._store, self._meta, self._lock

    async def _open(self) -> tuple[TierStore, Metadata, asyncio.Lock]:
        if self._store is None:
            await self.open()
        if (
            self._resign and self._meta is not None and self._info is not None
        ):  # rekeyed: sign the node record again
            self._resign = False
            self._infos.clear()
            await self._meta.register(
                self.name, self.node, self._signed(self._info), self._ttl_ms()
            )
        return self._ready()

    def _ready_or_raise(self) -> tuple[TierStore, Metadata, asyncio.Lock]:
        if self._store is None and not self._closed:
            raise DataError(f"pool '{self.name}': no page allocated yet (alloc or match first)")
        return self._ready()

    def _slot(self, slot: int) -> Any:
        try:
            return self._core.slot(slot)
        except KeyError:
            raise DataError(
                f"pool '{self.name}': slot {slot} is not live (released and evicted, or never "
                "allocated); match the chain again to get a live slot"
            ) from None

    # -- the lease: this node stays a provider while it lives ---------------------------------

    def _ttl_ms(self) -> int:
        return 0 if self.provider_ttl is None else max(1, round(self.provider_ttl * 1000))

    async def _keep_lease(self) -> None:
        """Renew the lease every third of it; an unreachable metadata is logged and retried
        (the lease may run out meanwhile: ``renew_lease`` then registers again)."""
        assert self.provider_ttl is not None
        failing = False
        while True:
            await asyncio.sleep(self.provider_ttl / 3)
            try:
                await self.renew_lease()
                failing = False
            except (DataError, RuntimeClosedError) as exc:
                if self._closed:
                    return
                if not failing:
                    logger.warning("pool '%s': renewing its lease failed: %s", self.name, exc)
                failing = True

    async def renew_lease(self) -> bool:
        """Renew this node's lease now (the pool does it every third of ``provider_ttl``).

        When the metadata had forgotten the node (its lease ran out while this process was
        stalled, or another node took it for dead), the node registers again, provides again
        every page it holds that is still in a chain, and locks again the replicas it views in
        other processes' memory. Returns False in that case."""
        _, meta, lock = await self._open()
        if await meta.heartbeat(self.name, self.node, self._ttl_ms()):
            if self._unlocked:
                await self._relock(sorted(self._unlocked))
            return True
        self.counters["leases_lost"] += 1
        assert self._info is not None
        await meta.register(self.name, self.node, self._signed(self._info), self._ttl_ms())
        async with lock:  # no plan is half done: every place read here is settled
            mine = [s for s in self._core.slots() if s.key is not None
                    and self._core.lookup(s.key) is s and not s.writes]  # fmt: skip
            if mine:
                await meta.provide(
                    self.name, self.node, [s.key or "" for s in mine],
                    [loc(s.tier, s.index, s.fill) for s in mine],
                )  # fmt: skip
        await self._relock(sorted(self._foreign))
        await self._rejoined()
        logger.warning("pool '%s': its lease had run out; registered again", self.name)
        return False

    async def _relock(self, slots: list[int]) -> None:
        """Take again the replica locks of the views ``slots`` (exactly one each: what was
        kept is given back first, never below zero). A view whose provider is not listed now
        (forgotten too, not back yet) stays in ``_unlocked`` and is retried at each renewal."""
        _, meta, _ = self._ready()
        by_provider: dict[str, list[int]] = {}
        for slot in slots:
            f = self._foreign.get(slot)
            if f is None:
                self._unlocked.discard(slot)
            else:
                by_provider.setdefault(f.provider, []).append(slot)
        for provider, views in sorted(by_provider.items()):
            keys = [self._foreign[v].key for v in views]
            await meta.unlock(self.name, self.node, provider, keys)
            locs = await meta.lock(self.name, self.node, provider, keys)
            for view, got in zip(views, locs, strict=True):
                if got is None:
                    self._unlocked.add(view)
                else:
                    self._unlocked.discard(view)
        if self._unlocked:
            logger.warning(
                "pool '%s': %d pages it views in other processes' memory are not locked (their "
                "provider's lease ran out too); retried at each renewal", self.name,
                len(self._unlocked),
            )  # fmt: skip

    async def _rejoined(self) -> None:
        """The node registered again after the metadata forgot it (subscriptions renew here)."""
        return None

    # -- signed node records ------------------------------------------------------------------

    async def _node_infos(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        """Node records of ``names`` whose MAC under the cluster key holds (the others are
        counted as forged and never used: no pull to their address, no view of their shm)."""
        _, meta, _ = self._ready()
        missing = [n for n in names if n not in self._infos]
        if missing:
            for node, info in (await meta.nodes(self.name, missing)).items():
                record = dict(info)
                mac = record.pop("mac", "")
                if hmac.compare_digest(mac, self._record_mac(node, record)):
                    self._infos[node] = record
                else:
                    self.counters["forged_records"] += 1
        return {n: self._infos[n] for n in names if n in self._infos}

    def _record_mac(self, node: str, info: Mapping[str, str]) -> str:
        doc = json.dumps([self.name, node, sorted(info.items())], separators=(",", ":"))
        return hmac.new(self._cluster_key(), doc.encode(), hashlib.sha256).hexdigest()

    def _signed(self, info: dict[str, str]) -> dict[str, str]:
        """This node's record with its MAC under the cluster key (checked by every reader)."""
        return {**info, "mac": self._record_mac(self.node, info)}

    # -- serving pulls -----------------------------------------------------------------------

    def serve_pages(self, keys: Sequence[str]) -> tuple[list[int], list[memoryview]]:
        """The bytes of the local pages ``keys`` (a pull from another node); stops at a miss."""
        store, _, _ = self._ready()
        found = []
        for key in keys:
            s = self._core.lookup(key)
            if s is None:
                break
            found.append(s)
        if not found:
            return [], []
        by_tier: dict[int, list[int]] = {}
        for s in found:
            by_tier.setdefault(s.tier, []).append(s.index)
        if len(by_tier) == 1:
            ((tier, indices),) = by_tier.items()
            data = store.read_out(tier, indices)
        else:
            data = store.read_mixed([(s.tier, s.index) for s in found])
        return [s.fill for s in found], data


_PROCESS_KEY: list[bytes] = []


def _process_key() -> bytes:
    """The key of pools given none, with no ``$OMNIFLOW_CLUSTER_KEY`` and no runtime: one per
    process (its pools pull from each other; no other process knows it)."""
    if not _PROCESS_KEY:
        _PROCESS_KEY.append(generate_key())
    return _PROCESS_KEY[0]
