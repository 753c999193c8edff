"""Publish notifications and preload: the middle step of the data-flow loop.

A subscribed pool is told (one batch per publish) of pages another process publishes in the
chain; with ``preload`` it copies them into its own tiers at once, so a later ``match`` is a
local hit. The metadata carries the batches (``Metadata.listen`` / ``subscribe``; through Redis
as sealed pub/sub messages, ``_notice``).
"""

from __future__ import annotations

import asyncio
import logging

from omniflow._exceptions import DataError, PoolExhaustedError, RuntimeClosedError
from omniflow.data.kv._match import PoolMatch
from omniflow.data.kv._shell import PoolShell

logger = logging.getLogger("omniflow.kv")

__all__ = ["PoolSubscriptions"]


class PoolSubscriptions:
    """Subscriptions, notifications and preloads."""

    def __init__(self, pool: PoolShell, matcher: PoolMatch) -> None:
        #: The pool subscribed, and how a preload matches (copies) a published batch.
        self.pool = pool
        self.matcher = matcher

    async def subscribe(self, session: str | None, *, preload: bool = False) -> None:
        """Be notified (in batches: one per publish) of pages another process publishes in
        the session's chain (None: the public chain); with ``preload`` copy them into this
        pool's own tiers at once, so a later ``match`` is a local hit with no fetch. Through
        Redis the notices are pub/sub messages sealed with the cluster key; forged ones are
        dropped and counted (``stats()["wire"]["notice_dropped_*"]``)."""
        _store, meta, _lock = await self.pool._open()
        meta.listen(self.pool.name, self.pool.node, self.notified)
        self.pool._subs[session] = preload
        await meta.subscribe(self.pool.name, self.pool.node, session, True)

    async def unsubscribe(self, session: str | None) -> None:
        _store, meta, _lock = await self.pool._open()
        if self.pool._subs.pop(session, None) is not None:
            await meta.subscribe(self.pool.name, self.pool.node, session, False)

    async def rejoined(self) -> None:
        """Forgetting the node ended its subscriptions: take them again."""
        _store, meta, _lock = self.pool._ready()
        if self.pool._subs:
            meta.listen(self.pool.name, self.pool.node, self.notified)
        for session in list(self.pool._subs):
            await meta.subscribe(self.pool.name, self.pool.node, session, True)

    def notified(self, pool: str, session: str | None, keys: list[str]) -> None:
        if pool != self.pool.name or session not in self.pool._subs or self.pool._closed:
            return
        self.pool.counters["notified"] += 1
        self.pool.notices.append((session, list(keys)))
        if self.pool._subs[session]:
            task = asyncio.get_running_loop().create_task(self._preload(session, list(keys)))
            self.pool._preloads.add(task)
            task.add_done_callback(self.pool._preloads.discard)

    async def _preload(self, session: str | None, keys: list[str]) -> None:
        """Fetch a published batch into this pool's tiers (copied, never viewed in place),
        then unpin it: it stays cached here, and this pool becomes one more provider."""
        owner = self.pool._core.new_task("preload-")
        try:
            m = await self.matcher.match(session, keys, owner, local=True)
            self.pool.counters["preloaded"] += sum(
                1 for s in m.slots if s not in self.pool._foreign
            )
        except (DataError, PoolExhaustedError, RuntimeClosedError) as exc:
            logger.warning(
                "pool '%s': preloading %d pages failed: %s", self.pool.name, len(keys), exc
            )
        finally:
            if not self.pool._closed:
                await self.matcher.release(owner)

    async def preloads(self) -> None:
        """Wait until the notices of every publish finished so far have arrived and every
        preload they started has finished."""
        if self.pool._subs and self.pool._meta is not None and not self.pool._closed:
            await self.pool._meta.settle(self.pool.name)
        while self.pool._preloads:
            await asyncio.gather(*list(self.pool._preloads), return_exceptions=True)
