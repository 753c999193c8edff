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

Co-location is a placement fact: where the members are is read from the running placement
(``omniflow.dsl._context.colocation``, set around every ``setup()``). All of them in this
process (inproc, or one ``Deploy`` process group): the decision is this object's. Some in other
processes of the node (``placement="process"``, Ray actors of one bundle): they meet in a
``NodeBarrier`` (``_nodebarrier``) and each process sizes its instance of the graph's pool of
that name (its metadata is the deployment's) with its members' share of the minimum, its L1 in
shared memory so partners read its pages in place. A proposal is ``pages`` when given, else
measured (``propose_pages``: CUDA free memory, or on CPU a budget / ``MemAvailable``, minus a
margin). From its arrival until it proposes, a seat across processes leaves last words
(``Colocation.last_words``): a process that dies there fails its front's start with an error
naming the role and the pool. A pool on a GPU shared across processes would need CUDA IPC, which
is not implemented: such a seat is refused by name before any weight loads.

The decision itself (``_Decision``) is pure: members, proposals, outcome; the class is the async
shell around it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omniflow.compute._errors import EngineError
from omniflow.compute._nodebarrier import NodeBarrier, died_during_barrier
from omniflow.data.kv import PageLayout, ParamsPool
from omniflow.dsl._context import Colocation

__all__ = ["KvPoolBarrier", "PoolSeat", "free_bytes", "pages_that_fit", "propose_pages"]

#: A CPU node's memory budget for KV pages, in bytes, when set (else MemAvailable is measured).
BUDGET_ENV = "OMNIFLOW_KV_BUDGET"


def pages_that_fit(layout: PageLayout, free_bytes: int, utilization: float = 0.9) -> int:
    """How many pages of ``layout`` fit in ``utilization`` of ``free_bytes`` (a role's proposal).

    >>> lay = PageLayout(sub_names=("l0",), slices={"k": (2, 4)}, page_tokens=4, dtype="float32")
    >>> pages_that_fit(lay, 10 * lay.page_bytes, utilization=1.0)
    10
    """
    if not 0.0 < utilization <= 1.0:
        raise EngineError(f"pages_that_fit: utilization must be in (0, 1], got {utilization}")
    return max(0, int(free_bytes * utilization) // layout.page_bytes)


def _mem_available(meminfo: str = "/proc/meminfo") -> int:
    """``MemAvailable`` in bytes (the kernel's estimate of what can be had without swapping)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise EngineError(f"{meminfo} has no MemAvailable line; give the pool a budget")


def free_bytes(device: str | torch.device, budget: int | None = None) -> int:
    """What a role may still claim on ``device`` now: CUDA's free memory (``mem_get_info``) on
    a GPU; on the CPU ``budget``, else ``OMNIFLOW_KV_BUDGET``, else ``MemAvailable``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if budget is not None:
        return int(budget)
    env = os.environ.get(BUDGET_ENV)
    if env:
        return int(env)
    return _mem_available()


def propose_pages(
    page_bytes: int,
    device: str | torch.device,
    *,
    budget: int | None = None,
    margin: float = 0.1,
    max_pages: int | None = None,
) -> int:
    """A role's proposal once its weights are loaded: the pages of ``page_bytes`` that fit in
    what is free on ``device`` minus ``margin`` (a fraction), at most ``max_pages``.

    >>> propose_pages(1000, "cpu", budget=10_000, margin=0.1)
    9
    """
    if not 0.0 <= margin < 1.0:
        raise EngineError(f"propose_pages: margin must be in [0, 1), got {margin}")
    free = free_bytes(device, budget)
    pages = int(free * (1.0 - margin)) // page_bytes
    if max_pages is not None:
        pages = min(pages, max_pages)
    if pages < 1:
        raise EngineError(
            f"propose_pages: {free} bytes free on {device} leave no room for one KV page of "
            f"{page_bytes} bytes after a {margin:.0%} margin; free memory or give a budget"
        )
    return pages


def _pool_device(pool: ParamsPool) -> torch.device:
    """Where ``pool``'s L1 will live: its declared device, else the default it opens on."""
    from omniflow.data.kv._tiers import default_device

    given = pool._device
    return torch.device(given) if given is not None else default_device()


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
        layout: PageLayout | None,
        members: Iterable[str],
        *,
        capacity: Mapping[str, int] | None = None,
        timeout: float | None = 600.0,
        **pool_kwargs: Any,
    ) -> None:
        self.name = name
        self.layout = layout  #: the pool's layout (None: the graph's pool of this name has it)
        self.timeout = timeout  #: longest wait for the other members' proposals
        self._decision = _Decision(members)
        if not self._decision.members:
            raise EngineError(f"kv_pool_barrier '{name}': needs at least one co-located role")
        #: Lower tiers (l2/l3) are not sized by the barrier; l1 is.
        self._capacity = dict(capacity or {"l2": 0, "l3": 0})
        self._pool_kwargs = pool_kwargs
        self._done: asyncio.Future[ParamsPool] | None = None
        self._left: set[str] = set()  #: members done with the pool (stopped or failed)
        self.pool: ParamsPool | None = None  #: the shared pool once decided
        #: Decided at the first arrival: the graph's pool of this name (None: the barrier makes
        #: one), the node barrier when some members live in other processes, and how many
        #: members live in this one.
        self._graph_pool: ParamsPool | None = None
        self._node: NodeBarrier | None = None
        self._local = len(self._decision.members)
        self._placed = False
        #: This process's co-location facts (None: every role is in this process).
        self._facts: Colocation | None = None
        self.size: int | None = None  #: the node's pool size (L1 pages) once decided

    def arrive(self, member: str) -> None:
        """``member`` is about to load its weights here: find out where its partners are (the
        placement's co-location facts) and, across processes, take its place at the node's
        barrier so that its death is seen."""
        self._check_member(member)
        if not self._placed:
            self._place()
        if self._node is not None:
            self._node.arrive(member)
            # Should this process die before it proposes, its front says so, naming the pool.
            self._say(f"kv_pool_barrier '{self.name}': {died_during_barrier(member)}")

    def _say(self, words: str | None) -> None:
        say = self._facts.last_words if self._facts is not None else None
        if say is not None:
            say(words)

    def _place(self) -> None:
        from omniflow.dsl._context import colocation, role_pools

        try:
            pools = role_pools()
        except Exception:
            pools = {}
        graph_pool = pools.get(self.name)
        if graph_pool is not None and not isinstance(graph_pool, ParamsPool):
            graph_pool = None
        facts = self._facts = colocation()
        members = self._decision.members
        if facts is not None and not members <= facts.local:
            if graph_pool is None:
                raise EngineError(
                    f"kv_pool_barrier '{self.name}': roles {sorted(members - facts.local)} run "
                    "in other processes of this node; declare the pool in the graph "
                    f"(of.Graph(..., pools=[of.TorchEngine.pool(model_dir, {self.name!r})])) "
                    "so every process sizes its instance of it and shares its metadata"
                )
            device = _pool_device(graph_pool)
            if device.type != "cpu":
                raise EngineError(
                    f"kv_pool_barrier '{self.name}': roles {sorted(members - facts.local)} run in "
                    f"other processes of this node and would share the pool's L1 on "
                    f"{device} through CUDA IPC, which this build does not implement "
                    "(no GPU to test it on); put the co-located roles in one process (one Deploy "
                    "process group, e.g. of.Deploy({role: {'process': 'gpu0'}, ...})) or give "
                    "each its own pool"
                )
            self._node = NodeBarrier(facts.key, self.name, members)
            self._local = len(members & facts.local)
        self._graph_pool = graph_pool
        if self.layout is None:
            if graph_pool is None:
                raise EngineError(
                    f"kv_pool_barrier '{self.name}': no layout given and no pool of that name "
                    "in the role's graph; pass layout= or declare the pool in the graph"
                )
            self.layout = graph_pool.layout
        self._placed = True

    def _check_member(self, member: str) -> None:
        if member not in self._decision.members:
            raise EngineError(
                f"kv_pool_barrier '{self.name}': role {member!r} is not co-located here; members "
                f"are {sorted(self._decision.members)}"
            )

    def _make_pool(self, size: int) -> ParamsPool:
        """This process's pool of the decided ``size``: the graph's (its share) or our own."""
        self.size = size
        if self._graph_pool is not None:
            share = max(1, size * self._local // len(self._decision.members))
            self._graph_pool.colocate(share, shared=self._node is not None)
            return self._graph_pool
        assert self.layout is not None
        cap = {**self._capacity, "l1": size}
        return ParamsPool(self.name, self.layout, cap, **self._pool_kwargs)

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
        if not self._placed:
            self.arrive(member)
        self._decision.propose(member, pages)
        if self._node is not None:
            self._node.propose(member, pages)
            self._say(None)  # loaded and proposed: a death from here on is not the barrier's
            return
        size = self._decision.size
        if size is not None and not done.done():
            self.pool = self._make_pool(size)
            done.set_result(self.pool)

    async def wait(self, member: str = "?", *, timeout: float | None = None) -> ParamsPool:
        """The shared pool, once every member proposed (``timeout``: the barrier's)."""
        timeout = self.timeout if timeout is None else timeout
        if self._node is not None:
            done = self._future()
            if not done.done():
                size = await self._node.wait(member, timeout)
                if not done.done():
                    self.pool = self._make_pool(size)
                    done.set_result(self.pool)
            return await asyncio.shield(done)
        try:
            return await asyncio.wait_for(asyncio.shield(self._future()), timeout)
        except TimeoutError:
            raise EngineError(
                f"kv_pool_barrier '{self.name}': {member!r} waited {timeout}s for "
                f"{self._decision.missing} to finish loading weights; check those roles"
            ) from None

    async def join(self, member: str, pages: int, *, timeout: float | None = None) -> ParamsPool:
        """``propose`` then ``wait``: every member gets the same pool."""
        self.propose(member, pages)
        return await self.wait(member, timeout=timeout)

    def member(
        self,
        name: str,
        pages: int | None = None,
        *,
        budget: int | None = None,
        max_pages: int | None = None,
        margin: float = 0.1,
    ) -> PoolSeat:
        """A seat to hand an engine as ``pool=``: the engine proposes once its weights are
        loaded (``start()`` returns then) and serves requests once the pool is decided. It
        proposes ``pages``, or when None what ``propose_pages`` measures (``budget``,
        ``max_pages``, ``margin``)."""
        self._check_member(name)
        return PoolSeat(self, name, pages, budget, max_pages, margin)

    async def leave(self, member: str) -> None:
        """``member`` is done with the pool (its engine stopped); the last member of this
        process to leave closes a pool the barrier made, or this process's share of a graph's
        pool across processes (its shared memory goes now, not at exit), so a co-located pool
        lives exactly as long as its roles. A graph's pool shared in one process is the
        runtime's: another runtime of this process may size it again."""
        self._left.add(member)
        if self._node is not None:
            self._node.leave(member)
        if self.pool is None or len(self._left) < self._local:
            return
        if self.pool is not self._graph_pool or self._node is not None:
            await self.pool.aclose()

    def abort(self, member: str, exc: BaseException) -> None:
        """``member`` will never join (its weights failed to load): fail every waiter now."""
        self._left.add(member)
        if self._node is not None:
            self._node.abort(member, f"{type(exc).__name__}: {exc}")
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
    pages: int | None  #: the L1 pages this role proposes (None: measured after loading)
    budget: int | None = None  #: a CPU memory budget for the measurement (bytes)
    max_pages: int | None = None  #: the most a measured proposal asks for
    margin: float = 0.1  #: the fraction of free memory a measured proposal leaves alone

    def arrive(self) -> None:
        self.barrier.arrive(self.member)

    def propose(self, page_bytes: int = 0, device: str | torch.device = "cpu") -> int:
        """Propose (measured when ``pages`` is None) and return the proposal."""
        pages = self.pages
        if pages is None:
            pages = propose_pages(
                page_bytes, device, budget=self.budget, margin=self.margin,
                max_pages=self.max_pages,
            )  # fmt: skip
        self.barrier.propose(self.member, pages)
        return pages

    async def wait(self) -> ParamsPool:
        return await self.barrier.wait(self.member)

    def abort(self, exc: BaseException) -> None:
        self.barrier.abort(self.member, exc)

    async def leave(self) -> None:
        await self.barrier.leave(self.member)
