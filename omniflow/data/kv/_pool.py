"""``ParamsPool``: the Global Params Pool's shell over the slot engine, tiers and metadata.

>>> kv = ParamsPool("kv", PageLayout(("l0",), {"k": (2, 4)}, page_tokens=4, dtype="float32"),
...                 capacity={"l1": 8, "l2": 8, "l3": 0})
>>> async def turn():
...     slots = await kv.alloc("call-1", 2)
...     kv.view(slots[0], "l0", "k").fill_(1.0)
...     await kv.publish("chat-7", chain_hashes([[1, 2, 3, 4], [5, 6, 7, 8]]), slots)
...     await kv.release("call-1")                   # the runtime does this at call end
...     m = await kv.match("chat-7", chain_hashes([[1, 2, 3, 4], [5, 6, 7, 8]]), "call-2")
...     await kv.release("call-2")
...     return m.pages, kv.stats()["pinned"]
>>> asyncio.run(turn())
(2, 0)
>>> asyncio.run(kv.aclose())

The shell owns everything with a side effect: the tensors (``_tiers``), the metadata backend
(``_meta`` / ``_redis``), the pull server and client (``_pull``), the asyncio lock that makes
each plan-copy-commit atomic, the in-flight futures that deduplicate concurrent misses, and the
zero-copy attachments of other processes' L2 on this host.
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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import DataError, PoolExhaustedError, RuntimeClosedError
from omniflow.data.kv._layout import Match, PageLayout, chain_hashes
from omniflow.data.kv._meta import MemoryMetadata, Metadata
from omniflow.data.kv._notice import NoticeSeal
from omniflow.data.kv._slots import L1, L2, TIERS, Plan, SlotCore
from omniflow.transport._auth import KEY_ENV, WireStats, generate_key, resolve_key

if TYPE_CHECKING:  # torch is imported when a pool opens, not with omniflow
    import torch

    from omniflow.data.kv._tiers import ForeignL2, TierStore

__all__ = ["ParamsPool", "chain_hashes"]

logger = logging.getLogger("omniflow.kv")

HOST = socket.gethostname()
logger = logging.getLogger("omniflow.kv")
#: Plans retried when the metadata refuses a move (a reader holds the replica) before giving up.
_MAX_REPLANS = 8
#: Foreign slots (another process's L2 page, viewed in place) get ids from here up.
_FOREIGN_BASE = 1 << 40


def _loc(tier: int, index: int, fill: int) -> str:
    return f"{tier}:{index}:{fill}"


def _parse_loc(loc: str) -> tuple[int, int, int]:
    tier, index, fill = loc.split(":")
    return int(tier), int(index), int(fill)


class _Foreign:
    __slots__ = ("fill", "index", "key", "owners", "provider")

    def __init__(self, provider: str, index: int, key: str, fill: int) -> None:
        self.provider = provider
        self.index = index
        self.key = key
        self.fill = fill
        self.owners: set[str] = set()


class ParamsPool:
    """Paged, tiered KV storage shared by roles, processes and nodes (CONTRACT section 7)."""

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
        self.name = name
        self.layout = layout
        self.capacity = {t: int(cap.get(t, 0)) for t in TIERS}
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
        self._foreign: dict[int, _Foreign] = {}
        self._foreign_ids = iter(range(_FOREIGN_BASE, 1 << 62))
        self._attached: dict[str, ForeignL2] = {}
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
        }  # fmt: skip
        #: Subscribed chains (session; None: public) -> preload their published pages.
        self._subs: dict[str | None, bool] = {}
        #: The latest notification batches (session, hashes), newest last.
        self.notices: collections.deque[tuple[str | None, list[str]]] = collections.deque(maxlen=64)
        self._preloads: set[asyncio.Task[None]] = set()
        #: Longest wait for a pull's answer before the pages count as a miss.
        self.pull_timeout = pull_timeout
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

    # -- lifecycle ----------------------------------------------------------------------------

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
                "addr": address,
                "layout": self.layout.canonical_json(),
                "lid": self.layout.layout_id,
            }
            self._info = info
            self._seal = NoticeSeal(self.name, self.node, self._cluster_key(), self.notice_wire)
            await self._meta.register(self.name, self.node, self._signed(info))
            self._store = store
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
            await self._meta.register(self.name, self.node, self._signed(self._info))
        return self._ready()

    # -- allocation ---------------------------------------------------------------------------

    async def alloc(self, owner: str, n: int) -> list[int]:
        """``n`` new L1 pages pinned for ``owner``; ``PoolExhaustedError`` at once if they cannot
        be had without evicting pages that have an owner."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise DataError(f"pool '{self.name}': alloc needs a page count >= 0, got {n!r}")
        owner = _owner(self.name, owner)
        if n > self.capacity["l1"]:
            raise PoolExhaustedError(
                f"pool '{self.name}': cannot allocate {n} pages, l1 holds "
                f"{self.capacity['l1']}; create the pool with a larger capacity['l1']",
                pool=self.name,
                requested=n,
                capacity=self.capacity["l1"],
            )
        _store, _meta, lock = await self._open()
        async with lock:
            plan = await self._planned(
                lambda ex, nd: self._core.plan_room(L1, n, exclude=ex, nodrop=nd)
            )
            return self._core.new_slots(owner, plan)

    async def _planned(self, make: Callable[[set[int], set[int]], Plan]) -> Plan:
        """Make a plan, clear its moves with the metadata, copy the bytes, commit it (lock held).

        Replicas leave their place in two steps: first marked moving (``"m"``) or dropped by
        one ``evict`` (refused where another process holds a replica lock, or where the last
        replica of a running session's page would go), then, once copied, given their new place.
        """
        store, meta, _ = self._ready()
        exclude: set[int] = set()
        nodrop: set[int] = set()
        for _ in range(_MAX_REPLANS):
            plan = make(exclude, nodrop)
            keyed = [m for m in plan.moves if m.key is not None and self._provides(m.slot)]
            if keyed:
                ok = await meta.evict(
                    self.name, self.node, [m.key or "" for m in keyed],
                    ["m" if m.dst_tier is not None else None for m in keyed],
                )  # fmt: skip
                refused = [m for m, good in zip(keyed, ok, strict=True) if not good]
                if refused:
                    # Put back what was cleared, forget the plan, plan again around the refusals.
                    back = [m for m, good in zip(keyed, ok, strict=True) if good]
                    await self._relocate(back, current=True)
                    self._core.abort(plan)
                    for m in back:  # dropped from the metadata already: drop it here too
                        has = m.dst_tier is None and self._core.has(m.slot)
                        if has and self._core.slot(m.slot).movable:
                            self._core.forget(m.slot)
                    for m in refused:
                        (exclude if m.dst_tier is not None else nodrop).add(m.slot)
                    continue
            try:
                self.counters["bytes_moved"] += store.copy(plan.moves)
            except BaseException:
                self._core.abort(plan)
                await self._relocate(keyed, current=True)
                raise
            self._core.commit(plan)
            await self._relocate([m for m in keyed if m.dst_tier is not None], current=False)
            return plan
        raise PoolExhaustedError(
            f"pool '{self.name}': no room after {_MAX_REPLANS} plans: other processes hold "
            "replica locks on the pages that could move; retry, or give the pool more capacity",
            pool=self.name,
        )

    async def _relocate(self, moves: Sequence[Any], *, current: bool) -> None:
        if not moves:
            return
        _, meta, _ = self._ready()
        keys, locs = [], []
        for m in moves:
            if current:
                tier, index = m.src_tier, m.src_index
            else:
                tier, index = m.dst_tier, m.dst_index
            if m.dst_tier is None and current:
                continue  # a granted drop stays dropped
            keys.append(m.key)
            locs.append(_loc(tier, index, self._core.slot(m.slot).fill))
        if keys:
            await meta.evict(self.name, self.node, keys, locs)

    def _provides(self, slot: int) -> bool:
        s = self._core.slot(slot)
        return s.key is not None and self._core.lookup(s.key) is s

    # -- access -------------------------------------------------------------------------------

    def view(self, slot: int, sub_name: str, slice_name: str) -> torch.Tensor:
        """Zero-copy ``(page_tokens, *slice_shape)`` tensor of one page of one (sub, slice)."""
        store, _, _ = self._ready_or_raise()
        self.layout.check_coord(sub_name, slice_name)
        f = self._foreign.get(slot)
        if f is not None:
            return self._attached[f.provider].view(f.index, sub_name, slice_name)
        s = self._slot(slot)
        return store.store(s.tier, sub_name, slice_name)[s.index]

    def gather(
        self, sub_names: Sequence[str], slots: Sequence[int], slices: Sequence[str]
    ) -> dict[tuple[str, str], torch.Tensor]:
        """Every (sub_name, slice) of ``slots`` in one call: ``(len(slots), page_tokens, *shape)``
        per coordinate (a gathered copy; ``storage`` + ``block_table`` give the in-place form)."""
        store, _, _ = self._ready_or_raise()
        out: dict[tuple[str, str], torch.Tensor] = {}
        local = all(s in self._core._slots and self._core.slot(s).tier == L1 for s in slots)
        idx = self.block_table(slots) if local else None
        for sub in sub_names:
            for sl in slices:
                self.layout.check_coord(sub, sl)
                if idx is not None:
                    out[(sub, sl)] = store.store(L1, sub, sl).index_select(0, idx)
                else:
                    import torch

                    out[(sub, sl)] = torch.stack([self.view(s, sub, sl) for s in slots])
        return out

    def storage(self, sub_name: str, slice_name: str) -> torch.Tensor:
        """The whole L1 array of one (sub_name, slice): ``(l1 pages, page_tokens, *shape)``."""
        store, _, _ = self._ready_or_raise()
        self.layout.check_coord(sub_name, slice_name)
        return store.store(L1, sub_name, slice_name)

    def block_table(self, slots: Sequence[int]) -> torch.Tensor:
        """L1 indices of ``slots`` (pinned local pages), for paged attention over ``storage``."""
        store, _, _ = self._ready_or_raise()
        out = []
        for slot in slots:
            s = self._slot(slot)
            if s.tier != L1:
                raise DataError(
                    f"pool '{self.name}': slot {slot} is in {TIERS[s.tier]}, not l1; pin it "
                    "with match() (which reads it back) before using it from l1"
                )
            out.append(s.index)
        import torch

        return torch.tensor(out, dtype=torch.long, device=store.device)

    def fill(self, slot: int) -> int:
        f = self._foreign.get(slot)
        return f.fill if f is not None else self._slot(slot).fill

    def set_fill(self, slot: int, tokens: int) -> None:
        """Record how many tokens of the page are written (published with it)."""
        if not 0 <= tokens <= self.layout.page_tokens:
            raise DataError(
                f"pool '{self.name}': fill {tokens} outside 0..{self.layout.page_tokens}"
            )
        if slot in self._foreign:
            raise DataError(f"pool '{self.name}': slot {slot} is shared read-only; writable() it")
        self._slot(slot).fill = tokens

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

    # -- publish / match ----------------------------------------------------------------------

    async def publish(
        self, session: str | None, hashes: Sequence[str], slots: Sequence[int]
    ) -> None:
        """The pages become the session's cached chain (``None``: public) and this pool a
        provider of each. A partially filled page is kept whole with its fill level."""
        if len(hashes) != len(slots):
            raise DataError(
                f"pool '{self.name}': publish got {len(hashes)} hashes for {len(slots)} slots"
            )
        _store, meta, lock = await self._open()
        keys, locs = [], []
        async with lock:
            for key, slot in zip(hashes, slots, strict=True):
                if not isinstance(key, str) or not key:
                    raise DataError(f"pool '{self.name}': page hashes must be non-empty strs")
                f = self._foreign.get(slot)
                if f is not None:
                    keys.append(key)
                    locs.append("")  # chain only: its provider is the other process
                    owners = f.owners
                else:
                    s = self._slot(slot)
                    fill = s.fill or self.layout.page_tokens
                    mine = self._core.publish(slot, key, fill)
                    keys.append(key)
                    locs.append(_loc(s.tier, s.index, fill) if mine else "")
                    owners = s.active
                if session is not None:
                    for owner in owners:
                        await self._bind_run(owner, session)
            await meta.publish(self.name, self.node, session, keys, locs, self._seal)

    async def match(self, session: str | None, hashes: Sequence[str], owner: str) -> Match:
        """The longest published prefix of ``hashes`` for ``session``, pinned for ``owner``:
        local pages (read back to L1), another local process's L2 pages (viewed in place) or
        pages pulled from another node (a run of them in one request)."""
        return await self._match(session, hashes, owner)

    async def _match(
        self, session: str | None, hashes: Sequence[str], owner: str, local: bool = False
    ) -> Match:
        """``match``; with ``local``, pages of other processes are pulled (copied), not
        viewed in their L2."""
        owner = _owner(self.name, owner)
        _store, meta, _lock = await self._open()
        keys = list(hashes)
        bound = self._runs.get(owner, ())
        new_run = session is not None and session not in bound  # taken by the match's request
        providers = await meta.match(self.name, session, keys, new_run)
        if new_run:
            assert session is not None
            self._runs.setdefault(owner, set()).add(session)
        got: list[int] = []
        i = 0
        while i < len(providers):
            key = keys[i]
            run, whole = await self._take_local(keys[i : len(providers)], owner)
            got.extend(run)
            i += len(run)
            if not whole:  # L1 cannot take more pinned pages: the prefix ends here
                break
            if run:
                continue
            if key not in self._inflight:
                n = 1
                while (
                    i + n < len(providers)
                    and self._core.lookup(keys[i + n]) is None
                    and keys[i + n] not in self._inflight
                ):
                    n += 1
                try:
                    slots = await self._fetch(keys[i : i + n], providers[i : i + n], owner, local)
                except PoolExhaustedError:
                    break
                got.extend(slots)
                i += len(slots)
                if len(slots) < n:
                    break
                continue
            try:
                slot = await self._acquire(key, providers[i], owner)
            except PoolExhaustedError:
                s = self._core.lookup(key)
                if s is not None and owner in s.active:
                    self._core.unpin(s.slot, owner)
                break
            if slot is None:
                break
            got.append(slot)
            i += 1
        return Match(len(got), tuple(got))

    async def _take_local(self, keys: list[str], owner: str) -> tuple[list[int], bool]:
        """The leading run of ``keys`` held here, pinned and touched for ``owner`` in one step,
        its lower-tier pages read back to L1 in one batched plan (one copy per contiguous run
        and (sub, slice), one metadata call to mark them moving and one to place them).
        Returns the pages pinned and whether that is the whole run (False: L1 could not take
        more pinned pages, the rest are unpinned again)."""
        _, _, lock = self._ready()
        async with lock:  # no plan is half done while the lock is held: every slot is settled
            run = []
            for key in keys:
                s = self._core.lookup(key)
                if s is None:
                    break
                run.append(s.slot)
            if not run:
                return [], True
            held = {sid for sid in run if owner in self._core.slot(sid).active}
            self._core.take(run, owner)
            down = [sid for sid in run if self._core.slot(sid).tier != L1]
            whole = True
            if down:
                try:
                    await self._planned(self._readback_plan(down))
                except PoolExhaustedError:  # not all at once: page by page, up to the first
                    run, whole = await self._readback_each(run, owner, held), False
            self.counters["hits"] += len(run)
            return run, whole

    def _readback_plan(self, slots: list[int]) -> Callable[[set[int], set[int]], Plan]:
        return lambda ex, nd: self._core.plan_readback(slots, exclude=ex, nodrop=nd)

    async def _readback_each(self, run: list[int], owner: str, held: set[int]) -> list[int]:
        """Read ``run``'s pages back one at a time (lock held); at the first that L1 cannot
        take, unpin it and the rest for ``owner`` (except those it ``held`` before) and
        return the prefix read back."""
        for j, sid in enumerate(run):
            if self._core.slot(sid).tier == L1:
                continue
            try:
                await self._planned(self._readback_plan([sid]))
            except PoolExhaustedError:
                for rest in run[j:]:
                    if rest not in held:
                        self._core.unpin(rest, owner)
                return run[:j]
        return run

    async def _acquire(self, key: str, providers: dict[str, str], owner: str) -> int | None:
        """One page of a match, pinned for ``owner``; concurrent misses share one future."""
        while True:
            s = self._core.lookup(key)
            if s is not None:
                self._core.pin(s.slot, owner)
                self._core.touch(s.slot)
                if s.tier != L1:
                    await self._readback(s.slot)
                self.counters["hits"] += 1
                return s.slot
            pending = self._inflight.get(key)
            if pending is None:
                break
            got = await asyncio.shield(pending)  # a concurrent miss: reuse its result
            f = self._foreign.get(got) if got is not None else None
            if f is not None and got is not None:
                f.owners.add(owner)
                self._owner_foreign.setdefault(owner, set()).add(got)
                return got
            if got is None:
                return None
        slots = await self._fetch([key], [providers], owner)
        return slots[0] if slots else None

    async def _readback(self, slot: int) -> None:
        _, _, lock = self._ready()
        async with lock:
            s = self._core.slot(slot)
            if s.tier == L1:
                return
            await self._planned(self._readback_plan([slot]))

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

    async def _fetch(
        self, keys: list[str], providers: list[dict[str, str]], owner: str, local: bool = False
    ) -> list[int]:
        """Pages this process does not hold, as a prefix of ``keys``: viewed in place from
        another process's L2 on this host, or pulled (one request) from another node. The
        first requester of a page fetches it; concurrent ones await its future."""
        futs: dict[str, asyncio.Future[int | None]] = {}
        loop = asyncio.get_running_loop()
        for key in keys:
            futs[key] = self._inflight[key] = loop.create_future()
        self.counters["misses"] += len(keys)
        got: list[int] = []
        try:
            got = await self._fetch_from_one(keys, providers, owner, local)
        except PoolExhaustedError:
            raise
        except (DataError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise DataError(
                f"pool '{self.name}': fetching {len(keys)} pages failed: {exc!r}"
            ) from exc
        finally:
            for j, key in enumerate(keys):
                futs[key].set_result(got[j] if j < len(got) else None)
                if self._inflight.get(key) is futs[key]:
                    del self._inflight[key]
        return got

    async def _fetch_from_one(
        self, keys: list[str], providers: list[dict[str, str]], owner: str, local: bool = False
    ) -> list[int]:
        usable = {n: loc for n, loc in providers[0].items() if loc[:1].isdigit() and n != self.node}
        if not usable:
            return []
        infos = await self._node_infos(sorted(usable))
        ranked = sorted(usable, key=lambda n: (infos.get(n, {}).get("host") != self.host, n))
        for provider in ranked:
            info = infos.get(provider)
            if info is None or info.get("lid") != self.layout.layout_id:
                continue
            # The run this provider can serve: every page it is listed for, in order.
            n = 1
            while n < len(keys) and providers[n].get(provider, "m")[:1].isdigit():
                n += 1
            try:
                tier, _, _ = _parse_loc(usable[provider])
            except ValueError:  # a malformed location in the metadata: not a provider
                continue
            if not local and info.get("host") == self.host and info.get("shm") and tier == L2:
                got = await self._share(keys[:n], provider, info, owner)
            elif info.get("addr") and self._client is not None:
                got = await self._pull(keys[:n], provider, info, owner)
            else:
                continue
            if got:
                return got
        return []

    async def _share(
        self, keys: list[str], provider: str, info: dict[str, str], owner: str
    ) -> list[int]:
        """Lock the provider's L2 replicas and view them in place (no copy of page bytes)."""
        _, meta, _ = self._ready()
        locs = await meta.lock(self.name, self.node, provider, keys)
        pages = [self._l2_page(loc, info) for loc in locs]
        n = 0
        while n < len(pages) and pages[n] is not None:  # in this provider's l2 (and in range)
            n += 1
        extra = [k for k, loc in zip(keys[n:], locs[n:], strict=True) if loc is not None]
        if extra:  # moved since the match or past the run: not ours to hold
            await meta.unlock(self.name, self.node, provider, extra)
        if provider not in self._attached and n:
            from omniflow.data.kv._tiers import ForeignL2

            self._attached[provider] = ForeignL2(self.layout, info["shm"], int(info["l2"]))
        out = []
        for key, page in zip(keys[:n], pages[:n], strict=True):
            assert page is not None
            index, fill = page
            slot = next(self._foreign_ids)
            f = self._foreign[slot] = _Foreign(provider, index, key, fill)
            f.owners.add(owner)
            self._owner_foreign.setdefault(owner, set()).add(slot)
            out.append(slot)
        self.counters["shared"] += n
        return out

    def _l2_page(self, loc: str | None, info: Mapping[str, str]) -> tuple[int, int] | None:
        """``(index, fill)`` of a location in a provider's L2 that lies inside it, else None
        (locations come from the metadata: never index past the mapped segment)."""
        try:
            tier, index, fill = _parse_loc(loc or "")
            l2 = int(info.get("l2", "0"))
        except ValueError:
            return None
        ok = tier == L2 and 0 <= index < l2 and 0 <= fill <= self.layout.page_tokens
        return (index, fill) if ok else None

    async def _pull(
        self, keys: list[str], provider: str, info: dict[str, str], owner: str
    ) -> list[int]:
        """Search-transfer-release: lock the remote replicas, pull their bytes into L1 in one
        request, unlock, and register this pool as a provider too."""
        store, meta, lock = self._ready()
        locs = await meta.lock(self.name, self.node, provider, keys)
        n = 0
        while n < len(locs) and locs[n] is not None:
            n += 1
        locked = [k for k, loc in zip(keys, locs, strict=True) if loc is not None]
        slots: list[int] = []
        k = 0
        task = self._core.new_task("pull")
        try:
            if not n:
                return []
            async with lock:
                plan = await self._planned(
                    lambda ex, nd: self._core.plan_room(L1, n, exclude=ex, nodrop=nd)
                )
                slots = self._core.new_slots(owner, plan)
                for slot in slots:
                    self._core.mark(slot, "writes", task)
            assert self._client is not None
            try:
                fills, data = await self._client.pull(info["addr"], self.name, provider, keys[:n])
                if not all(0 <= f <= self.layout.page_tokens for f in fills):
                    raise DataError(f"pool '{self.name}': a pull answer has fills out of range")
                if fills:
                    indices = [self._core.slot(s).index for s in slots[: len(fills)]]
                    self.counters["bytes_moved"] += store.write_in(L1, indices, data)
                    for slot, fill in zip(slots, fills, strict=False):
                        self._core.slot(slot).fill = fill
                k = len(fills)
            except Exception as exc:
                # No authentic, well-formed answer (a provider without this cluster key, gone,
                # or refusing): nothing of it is used; the pages are a miss, recomputed.
                self.counters["pull_failures"] += 1
                logger.warning("pool '%s': pull from %s failed: %s", self.name, provider, exc)
        finally:
            for slot in slots:
                self._core.unmark(slot, "writes", task)
            if locked:
                await meta.unlock(self.name, self.node, provider, locked)
        ok, extra = slots[:k], slots[k:]
        for slot in extra:  # the provider lost them in between: give the slots back
            self._core.unpin(slot, owner)
        mine = [
            s
            for s, key in zip(ok, keys, strict=False)
            if self._core.publish(s, key, self._core.slot(s).fill)
        ]
        if mine:
            await meta.provide(
                self.name, self.node, [self._core.slot(s).key or "" for s in mine],
                [_loc(L1, self._core.slot(s).index, self._core.slot(s).fill) for s in mine],
            )  # fmt: skip
        self.counters["pulled"] += len(ok)
        return ok

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

    # -- copy-on-write, release ---------------------------------------------------------------

    async def writable(self, owner: str, slot: int) -> int:
        """A slot ``owner`` may append to: ``slot`` itself when only ``owner`` holds it and it is
        unpublished, else a private copy (copy-on-write; ``owner``'s pin moves to the copy)."""
        owner = _owner(self.name, owner)
        f = self._foreign.get(slot)
        if f is None:
            s = self._slot(slot)
            if owner not in s.active:
                raise DataError(f"pool '{self.name}': {owner} does not hold slot {slot}")
            if s.key is None and s.active == {owner}:
                return slot
        elif owner not in f.owners:
            raise DataError(f"pool '{self.name}': {owner} does not hold slot {slot}")
        (new,) = await self.alloc(owner, 1)
        for sub, sl in self.layout.coords():
            self.view(new, sub, sl).copy_(self.view(slot, sub, sl))
        self._core.slot(new).fill = self.fill(slot)
        await self._unpin(slot, owner)
        return new

    async def release(self, owner: str) -> int:
        """Unpin every page ``owner`` holds (call end, cancel, error); returns how many."""
        owner = _owner(self.name, owner)
        if self._store is None:
            return 0
        _, meta, _ = self._ready()
        held = self._core.owned(owner) | self._owner_foreign.get(owner, set())
        for slot in sorted(held):
            await self._unpin(slot, owner)
        for session in sorted(self._runs.pop(owner, set())):
            await meta.run(self.name, session, -1)
        return len(held)

    def holds(self, owner: str) -> bool:
        """Whether ``owner`` pins anything here (cheap: the runtime asks at every call end)."""
        return bool(self._core._by_owner.get(owner) or self._owner_foreign.get(owner)
                    or self._runs.get(owner))  # fmt: skip

    async def _unpin(self, slot: int, owner: str) -> None:
        f = self._foreign.get(slot)
        if f is None:
            self._core.unpin(slot, owner)
            return
        f.owners.discard(owner)
        mine = self._owner_foreign.get(owner)
        if mine is not None:
            mine.discard(slot)
            if not mine:
                del self._owner_foreign[owner]
        if not f.owners:
            del self._foreign[slot]
            _, meta, _ = self._ready()
            await meta.unlock(self.name, self.node, f.provider, [f.key])

    async def _bind_run(self, owner: str, session: str) -> None:
        runs = self._runs.setdefault(owner, set())
        if session not in runs:
            runs.add(session)
            _, meta, _ = self._ready()
            await meta.run(self.name, session, +1)

    # -- publish notifications and preload ----------------------------------------------------

    async def subscribe(self, session: str | None, *, preload: bool = False) -> None:
        """Be notified (in batches: one per publish) of pages another process publishes in
        the session's chain (None: the public chain); with ``preload`` copy them into this
        pool's own tiers at once, so a later ``match`` is a local hit with no fetch. Through
        Redis the notices are pub/sub messages sealed with the cluster key; forged ones are
        dropped and counted (``stats()["wire"]["notice_dropped_*"]``)."""
        _store, meta, _lock = await self._open()
        meta.listen(self.name, self.node, self._notified, self._seal)
        self._subs[session] = preload
        await meta.subscribe(self.name, self.node, session, True)

    async def unsubscribe(self, session: str | None) -> None:
        _store, meta, _lock = await self._open()
        if self._subs.pop(session, None) is not None:
            await meta.subscribe(self.name, self.node, session, False)

    def _notified(self, pool: str, session: str | None, keys: list[str]) -> None:
        if pool != self.name or session not in self._subs or self._closed:
            return
        self.counters["notified"] += 1
        self.notices.append((session, list(keys)))
        if self._subs[session]:
            task = asyncio.get_running_loop().create_task(self._preload(session, list(keys)))
            self._preloads.add(task)
            task.add_done_callback(self._preloads.discard)

    async def _preload(self, session: str | None, keys: list[str]) -> None:
        """Fetch a published batch into this pool's tiers (copied, never viewed in place),
        then unpin it: it stays cached here, and this pool becomes one more provider."""
        owner = self._core.new_task("preload-")
        try:
            m = await self._match(session, keys, owner, local=True)
            self.counters["preloaded"] += sum(1 for s in m.slots if s not in self._foreign)
        except (DataError, PoolExhaustedError, RuntimeClosedError) as exc:
            logger.warning("pool '%s': preloading %d pages failed: %s", self.name, len(keys), exc)
        finally:
            if not self._closed:
                await self.release(owner)

    async def preloads(self) -> None:
        """Wait until the notices of every publish finished so far have arrived and every
        preload they started has finished."""
        if self._subs and self._meta is not None and not self._closed:
            await self._meta.settle(self.name)
        while self._preloads:
            await asyncio.gather(*list(self._preloads), return_exceptions=True)

    async def close_session(self, session: str) -> None:
        """Drop the session's run locks (its chain may be dropped under pressure again)."""
        _, meta, _ = await self._open()
        for owner in list(self._runs):
            if session in self._runs[owner]:
                self._runs[owner].discard(session)
                if not self._runs[owner]:
                    del self._runs[owner]
                await meta.run(self.name, session, -1)

    # -- observability ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        counts = self._core.counts()
        return {
            "pages": {t: counts[t] for t in TIERS},
            "pinned": counts["pinned"] + len(self._foreign),
            "hits": self.counters["hits"],
            "misses": self.counters["misses"],
            "evictions": self._core.evictions,
            "bytes_moved": self.counters["bytes_moved"],
            "moves": self._core.moved,
            "pulled": self.counters["pulled"],
            "shared": self.counters["shared"],
            "notified": self.counters["notified"],
            "preloaded": self.counters["preloaded"],
            "tasks": counts["tasks"],
            "owners": counts["owners"] + len(self._owner_foreign),
            "inflight": len(self._inflight),
            "wire": {
                **self.wire.snapshot(),
                "pull_failures": self.counters["pull_failures"],
                "forged_records": self.counters["forged_records"],
                **{f"notice_{k}": v for k, v in self.notice_wire.snapshot().items()},
            },
        }

    def validate(self) -> None:
        """Check the slot engine's and the shell's invariants; raises ``AssertionError``."""
        self._core.validate()
        for owner, slots in self._owner_foreign.items():
            for slot in slots:
                assert owner in self._foreign[slot].owners, f"foreign {slot}: {owner} not held"
        for slot, f in self._foreign.items():
            assert f.owners, f"foreign slot {slot} held by nobody (leaked lock)"

    def __repr__(self) -> str:
        return f"<ParamsPool '{self.name}' {self.layout.layout_id} {self.capacity}>"


_PROCESS_KEY: list[bytes] = []


def _process_key() -> bytes:
    """The key of pools given none, with no ``$OMNIFLOW_CLUSTER_KEY`` and no runtime: one per
    process (its pools pull from each other; no other process knows it)."""
    if not _PROCESS_KEY:
        _PROCESS_KEY.append(generate_key())
    return _PROCESS_KEY[0]


def _owner(pool: str, owner: Any) -> str:
    if not isinstance(owner, str) or not owner:
        raise DataError(
            f"pool '{pool}': an owner must be a non-empty str (a call id), got {owner!r}"
        )
    return owner
