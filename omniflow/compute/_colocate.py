"""One KV pool for co-located roles, sized after all of them loaded their weights.

>>> # barrier = KvPoolBarrier("kv", layout, members=("llm", "dit"))
>>> # pool = await barrier.join("llm", pages=pages_that_fit(layout, free_bytes()))
>>> # engine = TorchEngine(llm_dir, pool=barrier.member("llm", pages=300))  # or let an engine join

Roles placed in one process group on one node (``of.Deploy({... "process": "gpu0"})``) share one
``ParamsPool``. Each role proposes how many L1 pages it thinks fit *after* it loaded its weights
and calls ``join``; the pool is created only when every member has joined (the paper's
``kv_pool_barrier``), with the minimum of the proposals. A role that finished loading early saw
memory the others had not claimed yet; its larger proposal loses to the later, smaller ones, and
since nobody gets a pool before the last join, nobody can allocate from an over-sized one. A
member whose load failed calls ``abort`` so the others fail at once instead of waiting.

The decision itself (``_Decision``) is pure: members, proposals, outcome; the class is the async
shell around it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omniflow.compute._errors import EngineError
from omniflow.data.kv import PageLayout, ParamsPool

__all__ = ["KvPoolBarrier", "PoolSeat", "pages_that_fit"]


def pages_that_fit(layout: PageLayout, free_bytes: int, utilization: float = 0.9) -> int:
    """How many pages of ``layout`` fit in ``utilization`` of ``free_bytes`` (a role's proposal).

    >>> lay = PageLayout(sub_names=("l0",), slices={"k": (2, 4)}, page_tokens=4, dtype="float32")
    >>> pages_that_fit(lay, 10 * lay.page_bytes, utilization=1.0)
    10
    """
    if not 0.0 < utilization <= 1.0:
        raise EngineError(f"pages_that_fit: utilization must be in (0, 1], got {utilization}")
    return max(0, int(free_bytes * utilization) // layout.page_bytes)


class _Decision:
    """Pure state: who proposed what; the size once everyone did."""

    __slots__ = ("failed", "members", "proposals")

    def __init__(self, members: Iterable[str]) -> None:
        self.members = frozenset(members)
        self.proposals: dict[str, int] = {}
        self.failed: tuple[str, BaseException] | None = None

    def propose(self, member: str, pages: int) -> None:
        if member not in self.members:
            raise EngineError(
                f"kv_pool_barrier: role {member!r} is not co-located here; members are "
                f"{sorted(self.members)}"
            )
        if member in self.proposals:
            raise EngineError(f"kv_pool_barrier: role {member!r} joined twice")
        if not isinstance(pages, int) or pages <= 0:
            raise EngineError(
                f"kv_pool_barrier: role {member!r} proposed {pages!r} pages; propose a positive "
                "int (see pages_that_fit)"
            )
        self.proposals[member] = pages

    @property
    def missing(self) -> list[str]:
        return sorted(self.members - set(self.proposals))

    @property
    def size(self) -> int | None:
        """The pool's L1 pages once every member proposed, else None."""
        if self.missing:
            return None
        return min(self.proposals.values())

    def validate(self) -> None:
        assert set(self.proposals) <= self.members
        assert all(p > 0 for p in self.proposals.values())


class KvPoolBarrier:
    """The co-located roles' shared pool: created at the last ``join``, sized by the minimum."""

    def __init__(
        self,
        name: str,
        layout: PageLayout,
        members: Iterable[str],
        *,
        capacity: Mapping[str, int] | None = None,
        **pool_kwargs: Any,
    ) -> None:
        self.name = name
        self.layout = layout
        self._decision = _Decision(members)
        if not self._decision.members:
            raise EngineError(f"kv_pool_barrier '{name}': needs at least one co-located role")
        #: Lower tiers (l2/l3) are not sized by the barrier; l1 is.
        self._capacity = dict(capacity or {"l2": 0, "l3": 0})
        self._pool_kwargs = pool_kwargs
        self._done: asyncio.Future[ParamsPool] | None = None
        self._left: set[str] = set()  #: members done with the pool (stopped or failed)
        self.pool: ParamsPool | None = None  #: the shared pool once decided

    def _future(self) -> asyncio.Future[ParamsPool]:
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        return self._done

    @property
    def proposals(self) -> dict[str, int]:
        return dict(self._decision.proposals)

    def propose(self, member: str, pages: int) -> None:
        """Record ``member``'s proposal (after its weights are loaded) without waiting; the last
        proposal creates the pool. For roles whose ``setup()`` runs one after another (the
        in-process runtime awaits setups in turn), propose in ``setup`` and ``await wait()`` at
        first use: awaiting the barrier inside ``setup`` would wait for a role not set up yet."""
        done = self._future()
        if self._decision.failed is not None:
            who, exc = self._decision.failed
            raise EngineError(f"kv_pool_barrier '{self.name}': role {who!r} failed: {exc}")
        self._decision.propose(member, pages)
        size = self._decision.size
        if size is not None and not done.done():
            cap = {**self._capacity, "l1": size}
            self.pool = ParamsPool(self.name, self.layout, cap, **self._pool_kwargs)
            done.set_result(self.pool)

    async def wait(self, member: str = "?", *, timeout: float | None = 600.0) -> ParamsPool:
        """The shared pool, once every member proposed."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._future()), timeout)
        except TimeoutError:
            raise EngineError(
                f"kv_pool_barrier '{self.name}': {member!r} waited {timeout}s for "
                f"{self._decision.missing} to finish loading weights; check those roles"
            ) from None

    async def join(self, member: str, pages: int, *, timeout: float | None = 600.0) -> ParamsPool:
        """``propose`` then ``wait``: every member gets the same pool."""
        self.propose(member, pages)
        return await self.wait(member, timeout=timeout)

    def member(self, name: str, pages: int) -> PoolSeat:
        """A seat to hand an engine as ``pool=``: the engine proposes ``pages`` once its weights
        are loaded (``start()`` returns then) and serves requests once the pool is decided."""
        if name not in self._decision.members:
            raise EngineError(
                f"kv_pool_barrier '{self.name}': role {name!r} is not co-located here; members "
                f"are {sorted(self._decision.members)}"
            )
        return PoolSeat(self, name, pages)

    async def leave(self, member: str) -> None:
        """``member`` is done with the pool (its engine stopped); the last member to leave
        closes the pool, so a co-located pool lives exactly as long as its roles."""
        self._left.add(member)
        if self._left >= self._decision.members and self.pool is not None:
            await self.pool.aclose()

    def abort(self, member: str, exc: BaseException) -> None:
        """``member`` will never join (its weights failed to load): fail every waiter now."""
        self._left.add(member)
        self._decision.failed = (member, exc)
        done = self._future()
        if not done.done():
            done.set_exception(
                EngineError(f"kv_pool_barrier '{self.name}': role {member!r} failed: {exc}")
            )
            done.exception()  # retrieved here; waiters get it re-raised


@dataclass(frozen=True, slots=True)
class PoolSeat:
    """One member's place at a ``KvPoolBarrier``, handed to an engine as its ``pool``."""

    barrier: KvPoolBarrier  #: the co-located roles' barrier
    member: str  #: this role's name among the barrier's members
    pages: int  #: the L1 pages this role proposes (after its weights are loaded)

    def propose(self) -> None:
        self.barrier.propose(self.member, self.pages)

    async def wait(self) -> ParamsPool:
        return await self.barrier.wait(self.member)

    def abort(self, exc: BaseException) -> None:
        self.barrier.abort(self.member, exc)

    async def leave(self) -> None:
        await self.barrier.leave(self.member)
