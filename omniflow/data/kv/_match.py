"""Matching a chain and the pins it leaves: ``match``, ``release``, run locks.

A match asks the metadata once (the session's run lock taken in the same request), then walks
the chain: a run of pages held here is taken in one step (read back in one plan), a run nobody
here holds is fetched from one provider, a page another task is fetching is awaited. It ends at
the first page nobody can provide, or that L1 cannot pin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from omniflow._exceptions import PoolExhaustedError
from omniflow.data.kv._fetch import PoolFetch
from omniflow.data.kv._layout import Match
from omniflow.data.kv._shell import check_owner
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
