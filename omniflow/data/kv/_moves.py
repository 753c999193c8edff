"""Moving a pool's pages: plans cleared with the metadata, allocation, readback to L1.

A plan of the slot engine (``SlotCore.plan_room`` / ``plan_readback``) is carried out here:
published replicas that would move are marked moving (or dropped) by one metadata ``evict``,
a refusal (another process holds a replica lock, or the last replica of a running session's
page) aborts the plan and replans around the page, the bytes are copied in one batch, the plan
is committed and the new places are written by one more ``evict``. A matched run's lower-tier
pages come back to L1 this way in one plan (``take_local``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from omniflow._exceptions import DataError, PoolExhaustedError
from omniflow.data.kv._places import check_owner, loc
from omniflow.data.kv._shell import PoolShell
from omniflow.data.kv._slots import L1, Plan

__all__ = ["PoolMoves"]

#: Plans retried when the metadata refuses a move (a reader holds the replica) before giving up.
_MAX_REPLANS = 8


class PoolMoves:
    """Allocation, readback and every other move of pages between tiers."""

    def __init__(self, pool: PoolShell) -> None:
        #: The pool whose pages move (its state: slots, tiers, metadata, lock).
        self.pool = pool

    async def alloc(self, owner: str, n: int) -> list[int]:
        """``n`` new L1 pages pinned for ``owner``; ``PoolExhaustedError`` at once if they cannot
        be had without evicting pages that have an owner."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise DataError(f"pool '{self.pool.name}': alloc needs a page count >= 0, got {n!r}")
        owner = check_owner(self.pool.name, owner)
        if n > self.pool.capacity["l1"]:
            raise PoolExhaustedError(
                f"pool '{self.pool.name}': cannot allocate {n} pages, l1 holds "
                f"{self.pool.capacity['l1']}; create the pool with a larger capacity['l1']",
                pool=self.pool.name,
                requested=n,
                capacity=self.pool.capacity["l1"],
            )
        _store, _meta, lock = await self.pool._open()
        async with lock:
            plan = await self.planned(
                lambda ex, nd: self.pool._core.plan_room(L1, n, exclude=ex, nodrop=nd)
            )
            return self.pool._core.new_slots(owner, plan)

    async def planned(self, make: Callable[[set[int], set[int]], Plan]) -> Plan:
        """Make a plan, clear its moves with the metadata, copy the bytes, commit it (lock held).

        Replicas leave their place in two steps: first marked moving (``"m"``) or dropped by
        one ``evict`` (refused where another process holds a replica lock, or where the last
        replica of a running session's page would go), then, once copied, given their new place.
        """
        store, meta, _ = self.pool._ready()
        exclude: set[int] = set()
        nodrop: set[int] = set()
        for _ in range(_MAX_REPLANS):
            plan = make(exclude, nodrop)
            keyed = [m for m in plan.moves if m.key is not None and self._provides(m.slot)]
            if keyed:
                ok = await meta.evict(
                    self.pool.name, self.pool.node, [m.key or "" for m in keyed],
                    ["m" if m.dst_tier is not None else None for m in keyed],
                )  # fmt: skip
                refused = [m for m, good in zip(keyed, ok, strict=True) if not good]
                if refused:
                    # Put back what was cleared, forget the plan, plan again around the refusals.
                    back = [m for m, good in zip(keyed, ok, strict=True) if good]
                    await self._relocate(back, current=True)
                    self.pool._core.abort(plan)
                    for m in back:  # dropped from the metadata already: drop it here too
                        has = m.dst_tier is None and self.pool._core.has(m.slot)
                        if has and self.pool._core.slot(m.slot).movable:
                            self.pool._core.forget(m.slot)
                    for m in refused:
                        (exclude if m.dst_tier is not None else nodrop).add(m.slot)
                    continue
            try:
                self.pool.counters["bytes_moved"] += store.copy(plan.moves)
            except BaseException:
                self.pool._core.abort(plan)
                await self._relocate(keyed, current=True)
                raise
            self.pool._core.commit(plan)
            await self._relocate([m for m in keyed if m.dst_tier is not None], current=False)
            return plan
        raise PoolExhaustedError(
            f"pool '{self.pool.name}': no room after {_MAX_REPLANS} plans: other processes hold "
            "replica locks on the pages that could move; retry, or give the pool more capacity",
            pool=self.pool.name,
        )

    async def _relocate(self, moves: Sequence[Any], *, current: bool) -> None:
        if not moves:
            return
        _, meta, _ = self.pool._ready()
        keys, locs = [], []
        for m in moves:
            if current:
                tier, index = m.src_tier, m.src_index
            else:
                tier, index = m.dst_tier, m.dst_index
            if m.dst_tier is None and current:
                continue  # a granted drop stays dropped
            keys.append(m.key)
            locs.append(loc(tier, index, self.pool._core.slot(m.slot).fill))
        if keys:
            await meta.evict(self.pool.name, self.pool.node, keys, locs)

    def _provides(self, slot: int) -> bool:
        s = self.pool._core.slot(slot)
        return s.key is not None and self.pool._core.lookup(s.key) is s

    async def take_local(self, keys: list[str], owner: str) -> tuple[list[int], bool]:
        """The leading run of ``keys`` held here, pinned and touched for ``owner`` in one step,
        its lower-tier pages read back to L1 in one batched plan (one copy per contiguous run
        and (sub, slice), one metadata call to mark them moving and one to place them).
        Returns the pages pinned and whether that is the whole run (False: L1 could not take
        more pinned pages, the rest are unpinned again)."""
        _, _, lock = self.pool._ready()
        async with lock:  # no plan is half done while the lock is held: every slot is settled
            run = []
            for key in keys:
                s = self.pool._core.lookup(key)
                if s is None:
                    break
                run.append(s.slot)
            if not run:
                return [], True
            held = {sid for sid in run if owner in self.pool._core.slot(sid).active}
            self.pool._core.take(run, owner)
            down = [sid for sid in run if self.pool._core.slot(sid).tier != L1]
            whole = True
            if down:
                try:
                    await self.planned(self._readback_plan(down))
                except PoolExhaustedError:  # not all at once: page by page, up to the first
                    run, whole = await self._readback_each(run, owner, held), False
            self.pool.counters["hits"] += len(run)
            return run, whole

    def _readback_plan(self, slots: list[int]) -> Callable[[set[int], set[int]], Plan]:
        return lambda ex, nd: self.pool._core.plan_readback(slots, exclude=ex, nodrop=nd)

    async def _readback_each(self, run: list[int], owner: str, held: set[int]) -> list[int]:
        """Read ``run``'s pages back one at a time (lock held); at the first that L1 cannot
        take, unpin it and the rest for ``owner`` (except those it ``held`` before) and
        return the prefix read back."""
        for j, sid in enumerate(run):
            if self.pool._core.slot(sid).tier == L1:
                continue
            try:
                await self.planned(self._readback_plan([sid]))
            except PoolExhaustedError:
                for rest in run[j:]:
                    if rest not in held:
                        self.pool._core.unpin(rest, owner)
                return run[:j]
        return run

    async def readback(self, slot: int) -> None:
        _, _, lock = self.pool._ready()
        async with lock:
            s = self.pool._core.slot(slot)
            if s.tier == L1:
                return
            await self.planned(self._readback_plan([slot]))
