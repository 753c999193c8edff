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

logger = logging.getLogger("omniflow.kv")

__all__ = ["PoolSubscriptions"]


class PoolSubscriptions(PoolMatch):
    """Subscriptions, notifications and preloads."""

    async def subscribe(self, session: str | None, *, preload: bool = False) -> None:
        """Be notified (in batches: one per publish) of pages another process publishes in
        the session's chain (None: the public chain); with ``preload`` copy them into this
        pool's own tiers at once, so a later ``match`` is a local hit with no fetch. Through
        Redis the notices are pub/sub messages sealed with the cluster key; forged ones are
        dropped and counted (``stats()["wire"]["notice_dropped_*"]``)."""
        _store, meta, _lock = await self._open()
        meta.listen(self.name, self.node, self._notified)
        self._subs[session] = preload
        await meta.subscribe(self.name, self.node, session, True)

    async def unsubscribe(self, session: str | None) -> None:
        _store, meta, _lock = await self._open()
        if self._subs.pop(session, None) is not None:
            await meta.subscribe(self.name, self.node, session, False)

    async def _rejoined(self) -> None:
        """Forgetting the node ended its subscriptions: take them again."""
        _store, meta, _lock = self._ready()
        if self._subs:
            meta.listen(self.name, self.node, self._notified)
        for session in list(self._subs):
            await meta.subscribe(self.name, self.node, session, True)

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
