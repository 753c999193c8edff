"""``ParamsPool``: the Global Params Pool (docs/contract.md §7), its public surface.

>>> import asyncio
>>> from omniflow.data.kv import PageLayout, chain_hashes
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

A ``ParamsPool`` is its state and lifecycle (``_shell.PoolShell``: tiers, metadata, keys,
lease) and owns its parts, each one responsibility over that state: ``PoolMoves`` (``_moves``:
plans cleared with the metadata, alloc, readback), ``PoolFetch`` (``_fetch``: pages of other
processes, viewed in place or pulled), ``PoolMatch`` (``_match``: match, pins, release) and
``PoolSubscriptions`` (``_subscribe``: notifications and preload). This module adds views of
the pages, publish, copy-on-write and observability, and hands the rest to the parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import DataError
from omniflow.data.kv._fetch import PoolFetch
from omniflow.data.kv._layout import Match, chain_hashes
from omniflow.data.kv._match import PoolMatch
from omniflow.data.kv._moves import PoolMoves
from omniflow.data.kv._places import check_owner, loc
from omniflow.data.kv._shell import PoolShell
from omniflow.data.kv._slots import L1, TIERS
from omniflow.data.kv._subscribe import PoolSubscriptions

if TYPE_CHECKING:  # torch is imported when a pool opens, not with omniflow
    import torch


__all__ = ["ParamsPool", "chain_hashes", "opened_pool_statistics"]


class ParamsPool(PoolShell):
    """Paged, tiered KV storage shared by roles, processes and nodes (docs/contract.md §7)."""

    # -- the parts (they hold no state of their own: the constructor is the shell's) ---------

    @cached_property
    def _moves(self) -> PoolMoves:
        return PoolMoves(self)

    @cached_property
    def _fetcher(self) -> PoolFetch:
        return PoolFetch(self, self._moves)

    @cached_property
    def _matcher(self) -> PoolMatch:
        return PoolMatch(self, self._moves, self._fetcher)

    @cached_property
    def _subscriptions(self) -> PoolSubscriptions:
        return PoolSubscriptions(self, self._matcher)

    # -- pages: alloc, match, release (``_moves``, ``_match``) --------------------------------

    async def alloc(self, owner: str, n: int) -> list[int]:
        """``n`` new L1 pages pinned for ``owner``; ``PoolExhaustedError`` at once if they cannot
        be had without evicting pages that have an owner."""
        return await self._moves.alloc(owner, n)

    async def match(self, session: str | None, hashes: Sequence[str], owner: str) -> Match:
        """The longest published prefix of ``hashes`` for ``session``, pinned for ``owner``:
        local pages (read back to L1), another local process's L2 pages (viewed in place) or
        pages pulled from another node (a run of them in one request)."""
        return await self._matcher.match(session, hashes, owner)

    async def release(self, owner: str) -> int:
        """Unpin every page ``owner`` holds (call end, cancel, error); returns how many."""
        return await self._matcher.release(owner)

    def holds(self, owner: str) -> bool:
        """Whether ``owner`` pins anything here (cheap: the runtime asks at every call end)."""
        return self._matcher.holds(owner)

    async def close_session(self, session: str) -> None:
        """Drop the session's run locks (its chain may be dropped under pressure again)."""
        await self._matcher.close_session(session)

    # -- notifications (``_subscribe``) -------------------------------------------------------

    async def subscribe(self, session: str | None, *, preload: bool = False) -> None:
        """Be notified (in batches: one per publish) of pages another process publishes in
        the session's chain (None: the public chain); with ``preload`` copy them into this
        pool's own tiers at once, so a later ``match`` is a local hit with no fetch. Through
        Redis the notices are pub/sub messages sealed with the cluster key; forged ones are
        dropped and counted (``stats()["wire"]["notice_dropped_*"]``)."""
        await self._subscriptions.subscribe(session, preload=preload)

    async def unsubscribe(self, session: str | None) -> None:
        await self._subscriptions.unsubscribe(session)

    async def preloads(self) -> None:
        """Wait until the notices of every publish finished so far have arrived and every
        preload they started has finished."""
        await self._subscriptions.preloads()

    async def _rejoined(self) -> None:
        await self._subscriptions.rejoined()

    # -- access -------------------------------------------------------------------------------

    def view(self, slot: int, sub_name: str, slice_name: str) -> torch.Tensor:
        """Zero-copy ``(page_tokens, *slice_shape)`` tensor of one page of one (sub, slice)."""
        store, _, _ = self._ready_or_raise()
        self.layout.check_coord(sub_name, slice_name)
        f = self._foreign.get(slot)
        if f is not None:
            return self._attached[f.provider].view(f.index, sub_name, slice_name, f.tier)
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

    # -- publish, copy-on-write ---------------------------------------------------------------

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
                    held = s if self._core.publish(slot, key, fill) else self._core.lookup(key)
                    keys.append(key)
                    # Another slot here may hold the key already: this pool provides it there
                    # (say so again: the metadata may have forgotten this node meanwhile).
                    locs.append(loc(held.tier, held.index, held.fill) if held else "")
                    owners = s.active
                if session is not None:
                    for owner in owners:
                        await self._matcher.bind_run(owner, session)
            await meta.publish(self.name, self.node, session, keys, locs)

    async def writable(self, owner: str, slot: int) -> int:
        """A slot ``owner`` may append to: ``slot`` itself when only ``owner`` holds it and it is
        unpublished, else a private copy (copy-on-write; ``owner``'s pin moves to the copy)."""
        owner = check_owner(self.name, owner)
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
        await self._matcher.unpin(slot, owner)
        return new

    # -- observability ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``statistics()`` under the name the contract gives it (``pool.stats()``)."""
        return self.statistics()

    def statistics(self) -> dict[str, Any]:
        """Pages per tier, pins, hits, misses, moves, segments, providers and the wire's
        counters (what ``rt.params_pool_stats()`` and a worker's ``StatsReply.pools`` carry)."""
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
            # Shared-memory segments: this pool's own shared L1, and the other pools' tiers it
            # viewed pages in without a copy (a co-located partner's L1 names are its l1_segments).
            "l1_segments": [] if self._store is None else list(self._store.l1_segments),
            "foreign_segments": sorted(self._foreign_segments),
            "notified": self.counters["notified"],
            "preloaded": self.counters["preloaded"],
            "tasks": counts["tasks"],
            "owners": counts["owners"] + len(self._owner_foreign),
            "inflight": len(self._inflight),
            "providers": {
                "vanished": self.counters["vanished"],
                "proven_gone": self.counters["proven_gone"],
                "shunned": len(self._shunned),
                "shunned_pages": self.counters["shunned_pages"],
                "leases_lost": self.counters["leases_lost"],
            },
            "wire": {
                **self.wire.statistics(),
                "pull_failures": self.counters["pull_failures"],
                "forged_records": self.counters["forged_records"],
                **{f"notice_{k}": v for k, v in self.notice_wire.statistics().items()},
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
            assert f.provider in self._attached, f"foreign slot {slot}: {f.provider} unmapped"
        self._shunned.validate()
        assert self._unlocked <= set(self._foreign), "an unlocked view that is not held"

    def __repr__(self) -> str:
        return f"<ParamsPool '{self.name}' {self.layout.layout_id} {self.capacity}>"


def opened_pool_statistics(pools: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """``{name: pool.statistics()}`` of the pools in ``pools`` that are open (a process's
    ``StatsReply.pools``; ``rt.params_pool_stats()``)."""
    return {p.name: p.statistics() for p in pools if isinstance(p, ParamsPool) and p.opened}
