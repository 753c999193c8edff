"""Matching a chain and the pins it leaves: ``match``, ``release``, run locks.

A match asks the metadata once (the session's run lock taken in the same request), then walks
the chain: a run of pages held here is taken in one step (read back in one plan), a run nobody
here holds is fetched from one provider, a page another task is fetching is awaited. It ends at
the first page nobody can provide, or that L1 cannot pin.

Misses count the pages of the published prefix this pool did not hold: those fetched from
another process, and, where the match ends at a page nobody could give (a provider that
vanished, ``_fetch``), that page and every page after it, which the caller recomputes.
Providers shunned for the chain are not asked at all; a page only they hold ends the prefix
(counted in ``shunned_pages``). All of a match's pulls wait out of one ``Budget``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from omniflow._exceptions import PoolExhaustedError
from omniflow.data.kv._fetch import PoolFetch, Want
from omniflow.data.kv._layout import Match
from omniflow.data.kv._lease import Budget
from omniflow.data.kv._meta import chain_name
from omniflow.data.kv._moves import PoolMoves
from omniflow.data.kv._places import check_owner
from omniflow.data.kv._shell import PoolShell
from omniflow.data.kv._slots import L1, unindex

__all__ = ["PoolMatch"]


class PoolMatch:
    """Match, pins and their release."""

    def __init__(self, pool: PoolShell, moves: PoolMoves, fetcher: PoolFetch) -> None:
        #: The pool matched, how its pages come back to L1, how others' pages are fetched.
        self.pool = pool
        self.moves = moves
        self.fetcher = fetcher

    async def match(
        self, session: str | None, hashes: Sequence[str], owner: str, local: bool = False
    ) -> Match:
        """``ParamsPool.match``; with ``local`` (a preload), pages of other processes are pulled
        (copied), not viewed in their L2."""
        owner = check_owner(self.pool.name, owner)
        _store, meta, _lock = await self.pool._open()
        keys = list(hashes)
        bound = self.pool._runs.get(owner, ())
        new_run = session is not None and session not in bound  # taken by the match's request
        providers = await meta.match(self.pool.name, session, keys, new_run)
        if new_run:
            assert session is not None
            self.pool._runs.setdefault(owner, set()).add(session)
        want = Want(chain_name(session), Budget(self.pool.pull_timeout), local)
        providers = self._unshunned(want.chain, keys, providers)
        got: list[int] = []
        short = False  # the match ended where a fetch got nothing: the rest is missed
        i = 0
        while i < len(providers):
            key = keys[i]
            run, whole = await self.moves.take_local(keys[i : len(providers)], owner)
            got.extend(run)
            i += len(run)
            if not whole:  # L1 cannot take more pinned pages: the prefix ends here
                break
            if run:
                continue
            if key not in self.pool._inflight:
                n = 1
                while (
                    i + n < len(providers)
                    and self.pool._core.lookup(keys[i + n]) is None
                    and keys[i + n] not in self.pool._inflight
                ):
                    n += 1
                try:
                    slots = await self.fetcher.fetch(
                        keys[i : i + n], providers[i : i + n], owner, want
                    )
                except PoolExhaustedError:
                    short = True
                    break
                got.extend(slots)
                i += len(slots)
                if not slots:  # nobody could give the page: the prefix ends here
                    short = True
                    break
                continue  # (a shorter run: one provider's; the next run may be another's)
            try:
                slot = await self._acquire(key, providers[i], owner, want)
            except PoolExhaustedError:
                s = self.pool._core.lookup(key)
                if s is not None and owner in s.active:
                    self.pool._core.unpin(s.slot, owner)
                short = True
                break
            if slot is None:
                short = True
                break
            got.append(slot)
            i += 1
        if short:  # each page of the rest is recomputed by the caller: a miss
            self.pool.counters["misses"] += len(providers) - i
        return Match(len(got), tuple(got))

    def _unshunned(
        self, chain: str, keys: list[str], providers: list[dict[str, str]]
    ) -> list[dict[str, str]]:
        """``providers`` without those shunned for ``chain``, up to the first page that only
        shunned providers hold (and this pool does not): the rest counts as missed."""
        out = []
        for key, prov in zip(keys, providers, strict=False):
            live = self.pool._shunned.usable(chain, prov)
            if not live and self.pool._core.lookup(key) is None:
                break
            out.append(live)
        cut = len(providers) - len(out)
        if cut:
            self.pool.counters["misses"] += cut
            self.pool.counters["shunned_pages"] += cut
        return out

    async def _acquire(
        self, key: str, providers: dict[str, str], owner: str, want: Want
    ) -> int | None:
        """One page of a match, pinned for ``owner``; concurrent misses share one future."""
        while True:
            s = self.pool._core.lookup(key)
            if s is not None:
                self.pool._core.pin(s.slot, owner)
                self.pool._core.touch(s.slot)
                if s.tier != L1:
                    await self.moves.readback(s.slot)
                self.pool.counters["hits"] += 1
                return s.slot
            pending = self.pool._inflight.get(key)
            if pending is None:
                break
            got = await asyncio.shield(pending)  # a concurrent miss: reuse its result
            f = self.pool._foreign.get(got) if got is not None else None
            if f is not None and got is not None:
                f.owners.add(owner)
                self.pool._owner_foreign.setdefault(owner, set()).add(got)
                return got
            if got is None:
                return None
        slots = await self.fetcher.fetch([key], [providers], owner, want)
        return slots[0] if slots else None

    async def release(self, owner: str) -> int:
        """Unpin every page ``owner`` holds (call end, cancel, error); returns how many."""
        owner = check_owner(self.pool.name, owner)
        if self.pool._store is None:
            return 0
        _, meta, _ = self.pool._ready()
        held = self.pool._core.owned(owner) | self.pool._owner_foreign.get(owner, set())
        for slot in sorted(held):
            await self.unpin(slot, owner)
        for session in sorted(self.pool._runs.pop(owner, set())):
            await meta.run(self.pool.name, session, -1)
        return len(held)

    def holds(self, owner: str) -> bool:
        """Whether ``owner`` pins anything here (cheap: the runtime asks at every call end)."""
        return bool(self.pool._core._by_owner.get(owner) or self.pool._owner_foreign.get(owner)
                    or self.pool._runs.get(owner))  # fmt: skip

    async def unpin(self, slot: int, owner: str) -> None:
        f = self.pool._foreign.get(slot)
        if f is None:
            self.pool._core.unpin(slot, owner)
            return
        f.owners.discard(owner)
        unindex(self.pool._owner_foreign, owner, slot)
        if not f.owners:
            del self.pool._foreign[slot]
            self.pool._unlocked.discard(slot)
            _, meta, _ = self.pool._ready()
            await meta.unlock(self.pool.name, self.pool.node, f.provider, [f.key])

    async def bind_run(self, owner: str, session: str) -> None:
        runs = self.pool._runs.setdefault(owner, set())
        if session not in runs:
            runs.add(session)
            _, meta, _ = self.pool._ready()
            await meta.run(self.pool.name, session, +1)

    async def close_session(self, session: str) -> None:
        """Drop the session's run locks (its chain may be dropped under pressure again)."""
        _, meta, _ = await self.pool._open()
        for owner in list(self.pool._runs):
            if session in self.pool._runs[owner]:
                self.pool._runs[owner].discard(session)
                if not self.pool._runs[owner]:
                    del self.pool._runs[owner]
                await meta.run(self.pool.name, session, -1)
