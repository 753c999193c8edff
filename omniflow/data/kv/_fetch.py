"""Pages a pool does not hold: viewed in another process's L2 on this host, or pulled.

The first requester of a missing page fetches it, concurrent ones await its future. A run of
pages is fetched from one provider: on the same host, if the provider holds it in L2, the pages
are locked there and viewed in place (*foreign* slots: no byte copied); otherwise a
search-transfer-release pull (lock, reserve L1 slots, one sealed request, write, unlock,
``provide``). ``serve_pages`` is the other side of a pull.

A provider that vanished is a miss, never an error: one on this host whose process is gone or
whose shared memory is gone is *proven* gone and forgotten in the metadata at once (``leave``);
one whose pull fails or times out is shunned for the chain (``_lease.Shunned``) until its lease
would have run out. Either way no replica lock of the attempt is left held, and the match
returns the prefix it had, so the caller recomputes the rest. Pulls wait out of the match's
one ``Budget``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from omniflow._exceptions import DataError, DataTimeoutError, PoolExhaustedError
from omniflow.data.kv._lease import Budget
from omniflow.data.kv._moves import PoolMoves
from omniflow.data.kv._places import Foreign, loc, parse_loc
from omniflow.data.kv._shell import PoolShell
from omniflow.data.kv._slots import L1, L2

logger = logging.getLogger("omniflow.kv")

__all__ = ["PoolFetch", "Want"]


@dataclass(slots=True)
class Want:
    """What one match asks of the fetches it makes."""

    #: The chain matched (``_meta.chain_name``): a vanished provider is shunned for it.
    chain: str
    #: The match's time for waiting on other nodes.
    budget: Budget
    #: Copy pages of other processes on this host instead of viewing them in place.
    local: bool = False


def _pid_gone(pid: str | None) -> bool:
    """Whether no process ``pid`` runs on this host (False when unsure)."""
    try:
        os.kill(int(pid or ""), 0)
    except ProcessLookupError:
        return True
    except (ValueError, OverflowError, OSError):
        return False  # no pid, or one we may not signal: it runs
    return False


class PoolFetch:
    """Fetching pages of other processes and serving this one's."""

    def __init__(self, pool: PoolShell, moves: PoolMoves) -> None:
        #: The pool the pages come into, and how its pages move (room for a pull).
        self.pool = pool
        self.moves = moves

    async def fetch(
        self, keys: list[str], providers: list[dict[str, str]], owner: str, want: Want
    ) -> list[int]:
        """Pages this process does not hold, as a prefix of ``keys``: viewed in place from
        another process's L2 on this host, or pulled (one request) from another node. The
        first requester of a page fetches it; concurrent ones await its future."""
        futs: dict[str, asyncio.Future[int | None]] = {}
        loop = asyncio.get_running_loop()
        for key in keys:
            futs[key] = self.pool._inflight[key] = loop.create_future()
        got: list[int] = []
        try:
            got = await self._fetch_from_one(keys, providers, owner, want)
            self.pool.counters["misses"] += len(got)  # (the rest: by the match, if it ends here)
        except PoolExhaustedError:
            raise
        except (DataError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise DataError(
                f"pool '{self.pool.name}': fetching {len(keys)} pages failed: {exc!r}"
            ) from exc
        finally:
            for j, key in enumerate(keys):
                futs[key].set_result(got[j] if j < len(got) else None)
                if self.pool._inflight.get(key) is futs[key]:
                    del self.pool._inflight[key]
        return got

    async def _fetch_from_one(
        self, keys: list[str], providers: list[dict[str, str]], owner: str, want: Want
    ) -> list[int]:
        usable = {
            n: loc
            for n, loc in self.pool._shunned.usable(want.chain, providers[0]).items()
            if loc[:1].isdigit() and n != self.pool.node
        }
        if not usable:
            return []
        infos = await self.pool._node_infos(sorted(usable))
        ranked = sorted(usable, key=lambda n: (infos.get(n, {}).get("host") != self.pool.host, n))
        for provider in ranked:
            info = infos.get(provider)
            if info is None or info.get("lid") != self.pool.layout.layout_id:
                continue
            # The run this provider can serve: every page it is listed for, in order.
            n = 1
            while n < len(keys) and providers[n].get(provider, "m")[:1].isdigit():
                n += 1
            try:
                tier, _, _ = parse_loc(usable[provider])
            except ValueError:  # a malformed location in the metadata: not a provider
                continue
            here = info.get("host") == self.pool.host
            if here and _pid_gone(info.get("pid")):
                await self._vanished(provider, want, "its process is gone", proven=True)
                continue
            shared = info.get("shm") if tier == L2 else info.get("shm1") if tier == L1 else ""
            if not want.local and here and shared:
                got = await self._share(keys[:n], provider, info, owner, want)
            elif info.get("addr") and self.pool._client is not None:
                if want.budget.left() <= 0:
                    break  # the match has waited all it may: the rest is a miss
                got = await self._pull(keys[:n], provider, info, owner, want)
            else:
                continue
            if got:
                return got
        return []

    async def _vanished(self, provider: str, want: Want, why: str, *, proven: bool) -> None:
        """``provider`` did not give what the metadata said it holds: shun it for the chain;
        ``proven`` gone (its process or its shared memory vanished from this host), forget it
        in the metadata too, so no pool pays for it again."""
        _, meta, _ = self.pool._ready()
        self.pool._shunned.add(want.chain, provider)
        self.pool.counters["vanished"] += 1
        if proven:
            self.pool.counters["proven_gone"] += 1
            logger.info("pool '%s': provider %s is gone (%s)", self.pool.name, provider, why)
            await meta.leave(self.pool.name, provider)
            self.pool._infos.pop(provider, None)
            att = self.pool._attached.get(provider)
            if att is not None and not any(
                f.provider == provider for f in self.pool._foreign.values()
            ):
                del self.pool._attached[provider]
                att.close()
        else:
            logger.warning("pool '%s': provider %s vanished (%s)", self.pool.name, provider, why)

    async def _share(
        self, keys: list[str], provider: str, info: dict[str, str], owner: str, want: Want
    ) -> list[int]:
        """Lock the provider's L2 replicas and view them in place (no copy of page bytes)."""
        _, meta, _ = self.pool._ready()
        if provider not in self.pool._attached:  # mapped before any lock: a failure holds none
            from omniflow.data.kv._tiers import ForeignL2

            try:
                l1 = int(info["l1"]) if info.get("shm1") else 0
                prefix = info.get("shm") or info.get("shm1", "")
                self.pool._attached[provider] = ForeignL2(
                    self.pool.layout, prefix, int(info["l2"]), l1
                )
            except (DataError, ValueError, OSError) as exc:
                gone = isinstance(exc.__cause__, FileNotFoundError)
                await self._vanished(provider, want, str(exc), proven=gone)
                return []
        locs = await meta.lock(self.pool.name, self.pool.node, provider, keys)
        pages = [self._shared_page(loc, info) for loc in locs]
        n = 0
        while n < len(pages) and pages[n] is not None:  # in this provider's l2 (and in range)
            n += 1
        extra = [k for k, loc in zip(keys[n:], locs[n:], strict=True) if loc is not None]
        if extra:  # moved since the match or past the run: not ours to hold
            await meta.unlock(self.pool.name, self.pool.node, provider, extra)
        out = []
        for key, page in zip(keys[:n], pages[:n], strict=True):
            assert page is not None
            tier, index, fill = page
            slot = next(self.pool._foreign_ids)
            f = self.pool._foreign[slot] = Foreign(provider, index, key, fill, tier)
            f.owners.add(owner)
            self.pool._owner_foreign.setdefault(owner, set()).add(slot)
            out.append(slot)
            self.pool._foreign_segments.update(self.pool._attached[provider].segments[tier])
        self.pool.counters["shared"] += n
        return out

    def _shared_page(self, loc: str | None, info: Mapping[str, str]) -> tuple[int, int, int] | None:
        """``(tier, index, fill)`` of a location in a provider's shared tier (its L2, or its L1
        when shared) that lies inside it, else None (locations come from the metadata: never
        index past the mapped segment)."""
        try:
            tier, index, fill = parse_loc(loc or "")
            size = int(info.get("l2", "0")) if tier == L2 else 0
            if tier == L1 and info.get("shm1"):
                size = int(info.get("l1", "0"))
        except ValueError:
            return None
        ok = 0 <= index < size and 0 <= fill <= self.pool.layout.page_tokens
        return (tier, index, fill) if ok else None

    async def _pull(
        self, keys: list[str], provider: str, info: dict[str, str], owner: str, want: Want
    ) -> list[int]:
        """Search-transfer-release: lock the remote replicas, pull their bytes into L1 in one
        request, unlock, and register this pool as a provider too."""
        store, meta, lock = self.pool._ready()
        locs = await meta.lock(self.pool.name, self.pool.node, provider, keys)
        n = 0
        while n < len(locs) and locs[n] is not None:
            n += 1
        locked = [k for k, loc in zip(keys, locs, strict=True) if loc is not None]
        slots: list[int] = []
        k = 0
        task = self.pool._core.new_task("pull")
        try:
            if not n:
                return []
            async with lock:
                plan = await self.moves.planned(
                    lambda ex, nd: self.pool._core.plan_room(L1, n, exclude=ex, nodrop=nd)
                )
                slots = self.pool._core.new_slots(owner, plan)
                for slot in slots:
                    self.pool._core.mark(slot, "writes", task)
            assert self.pool._client is not None
            try:
                fills, data = await self.pool._client.pull(
                    info["addr"], self.pool.name, provider, keys[:n], timeout=want.budget.left()
                )
                if not all(0 <= f <= self.pool.layout.page_tokens for f in fills):
                    raise DataError(
                        f"pool '{self.pool.name}': a pull answer has fills out of range"
                    )
                if fills:
                    indices = [self.pool._core.slot(s).index for s in slots[: len(fills)]]
                    self.pool.counters["bytes_moved"] += store.write_in(L1, indices, data)
                    for slot, fill in zip(slots, fills, strict=False):
                        self.pool._core.slot(slot).fill = fill
                k = len(fills)
            except Exception as exc:
                # No authentic, well-formed answer (a provider without this cluster key, gone,
                # or refusing): nothing of it is used; the pages are a miss, recomputed.
                self.pool.counters["pull_failures"] += 1
                if isinstance(exc, DataTimeoutError):
                    want.budget.spend()
                await self._vanished(provider, want, f"pull failed: {exc}", proven=False)
        finally:
            for slot in slots:
                self.pool._core.unmark(slot, "writes", task)
            if locked:
                await meta.unlock(self.pool.name, self.pool.node, provider, locked)
        ok, extra = slots[:k], slots[k:]
        for slot in extra:  # the provider lost them in between: give the slots back
            self.pool._core.unpin(slot, owner)
        mine = [
            s
            for s, key in zip(ok, keys, strict=False)
            if self.pool._core.publish(s, key, self.pool._core.slot(s).fill)
        ]
        if mine:
            placed = [self.pool._core.slot(s) for s in mine]
            await meta.provide(
                self.pool.name, self.pool.node, [p.key or "" for p in placed],
                [loc(L1, p.index, p.fill) for p in placed],
            )  # fmt: skip
        self.pool.counters["pulled"] += len(ok)
        return ok
