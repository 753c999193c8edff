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
from omniflow.data.kv._places import check_owner
from omniflow.data.kv._slots import L1, unindex

__all__ = ["PoolMatch"]


class PoolMatch(PoolFetch):
    """Match, pins and their release."""

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
        owner = check_owner(self.name, owner)
        _store, meta, _lock = await self._open()
        keys = list(hashes)
        bound = self._runs.get(owner, ())
        new_run = session is not None and session not in bound  # taken by the match's request
        providers = await meta.match(self.name, session, keys, new_run)
        if new_run:
            assert session is not None
            self._runs.setdefault(owner, set()).add(session)
        want = Want(chain_name(session), Budget(self.pull_timeout), local)
        providers = self._unshunned(want.chain, keys, providers)
        got: list[int] = []
        short = False  # the match ended where a fetch got nothing: the rest is missed
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
                    slots = await self._fetch(keys[i : i + n], providers[i : i + n], owner, want)
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
                s = self._core.lookup(key)
                if s is not None and owner in s.active:
                    self._core.unpin(s.slot, owner)
                short = True
                break
            if slot is None:
                short = True
                break
            got.append(slot)
            i += 1
        if short:  # each page of the rest is recomputed by the caller: a miss
            self.counters["misses"] += len(providers) - i
        return Match(len(got), tuple(got))

    def _unshunned(
        self, chain: str, keys: list[str], providers: list[dict[str, str]]
    ) -> list[dict[str, str]]:
        """``providers`` without those shunned for ``chain``, up to the first page that only
        shunned providers hold (and this pool does not): the rest counts as missed."""
        out = []
        for key, prov in zip(keys, providers, strict=False):
            live = self._shunned.usable(chain, prov)
            if not live and self._core.lookup(key) is None:
                break
            out.append(live)
        cut = len(providers) - len(out)
        if cut:
            self.counters["misses"] += cut
            self.counters["shunned_pages"] += cut
        return out

    async def _acquire(
        self, key: str, providers: dict[str, str], owner: str, want: Want
    ) -> int | None:
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
        slots = await self._fetch([key], [providers], owner, want)
        return slots[0] if slots else None

    async def release(self, owner: str) -> int:
        """Unpin every page ``owner`` holds (call end, cancel, error); returns how many."""
        owner = check_owner(self.name, owner)
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
        unindex(self._owner_foreign, owner, slot)
        if not f.owners:
            del self._foreign[slot]
            self._unlocked.discard(slot)
            _, meta, _ = self._ready()
            await meta.unlock(self.name, self.node, f.provider, [f.key])

    async def _bind_run(self, owner: str, session: str) -> None:
        runs = self._runs.setdefault(owner, set())
        if session not in runs:
            runs.add(session)
            _, meta, _ = self._ready()
            await meta.run(self.name, session, +1)

    async def close_session(self, session: str) -> None:
        """Drop the session's run locks (its chain may be dropped under pressure again)."""
        _, meta, _ = await self._open()
        for owner in list(self._runs):
            if session in self._runs[owner]:
                self._runs[owner].discard(session)
                if not self._runs[owner]:
                    del self._runs[owner]
                await meta.run(self.name, session, -1)
