"""Stateful property test of the buffer pool against a plain model of its blocks.

The model keeps, per live block, its handle, reference counts by owner and cache key, plus the
cache's LRU order. It never computes placements: it checks the pool's choices (no overlap, the
exact set of evictions, exhaustion only when even evicting every idle block cannot help) from
block extents alone. Every block carries a unique byte pattern written through the shared
memory, so any write landing in the wrong block shows up in the next check.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omniflow.data import BlockHandle, InvalidBlockError, PoolExhaustedError, SharedBufferPool

CS = 64  # chunk size
NCHUNKS = 24
KEYS = ("k0", "k1", "k2", "k3", "k4", "k5")
OWNERS = (None, "call-a", "call-b")


def pattern(block_id: int, version: int, nbytes: int) -> bytes:
    return (struct.pack("<II", block_id, version) * (nbytes // 8 + 1))[:nbytes]


def largest_free_run(extents: list[tuple[int, int]]) -> int:
    best, cursor = 0, 0
    for start, length in sorted([*extents, (NCHUNKS, 0)]):
        best = max(best, start - cursor)
        cursor = start + length
    return best


@dataclass
class Model:
    handle: BlockHandle
    key: str | None
    owners: Counter[str | None] = field(default_factory=Counter)
    version: int = 0

    @property
    def refs(self) -> int:
        return sum(self.owners.values())

    @property
    def extent(self) -> tuple[int, int]:
        return self.handle.offset // CS, max(1, -(-self.handle.nbytes // CS))


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = SharedBufferPool(NCHUNKS * CS, chunk_size=CS)
        self.blocks: dict[int, Model] = {}
        #: Cached block ids by key, least recently used first.
        self.lru: OrderedDict[str, int] = OrderedDict()
        self.dead: list[BlockHandle] = []

    def teardown(self) -> None:
        self.pool.close()

    # -- helpers ------------------------------------------------------------------------------

    def fill(self, model: Model) -> None:
        model.version += 1
        data = pattern(model.handle.block_id, model.version, model.handle.nbytes)
        self.pool.view(model.handle)[:] = data

    def drop(self, block_id: int) -> None:
        model = self.blocks.pop(block_id)
        if model.key is not None and self.lru.get(model.key) == block_id:
            del self.lru[model.key]
        self.dead.append(model.handle)

    def idle_lru(self) -> list[int]:
        return [i for i in self.lru.values() if self.blocks[i].refs == 0]

    def unref(self, model: Model, owner: str | None, count: int) -> None:
        model.owners[owner] -= count
        model.owners += Counter()  # drop zero counts
        if model.refs == 0 and model.key is None:
            self.drop(model.handle.block_id)

    # -- rules --------------------------------------------------------------------------------

    @rule(
        nbytes=st.integers(0, 3 * CS) | st.integers(6 * CS, 12 * CS),
        key=st.none() | st.sampled_from(KEYS),
        owner=st.sampled_from(OWNERS),
    )
    def alloc(self, nbytes: int, key: str | None, owner: str | None) -> None:
        need = max(1, -(-nbytes // CS))
        idle = self.idle_lru()
        extents = {i: m.extent for i, m in self.blocks.items()}

        def fits_after_evicting(k: int) -> bool:
            return largest_free_run([e for i, e in extents.items() if i not in idle[:k]]) >= need

        try:
            handle = self.pool.alloc(nbytes, key, owner=owner)
        except PoolExhaustedError as exc:
            assert not fits_after_evicting(len(idle)), "refused an alloc that eviction could fit"
            assert exc.requested == nbytes
            event("alloc: pool exhausted")
            return
        # Exactly the fewest least-recently-used idle blocks were evicted.
        k = next(k for k in range(len(idle) + 1) if fits_after_evicting(k))
        event(f"alloc: evicted {min(k, 2)}{'+' if k > 2 else ''} idle blocks")
        for block_id in idle[:k]:
            self.drop(block_id)
        old = self.lru.get(key) if key is not None else None
        if old is not None:  # the key moves to the new block
            del self.lru[key]  # type: ignore[arg-type]
            self.blocks[old].key = None
            if self.blocks[old].refs == 0:
                self.drop(old)
        start, length = handle.offset // CS, need
        assert start + length <= NCHUNKS
        for other in self.blocks.values():
            o_start, o_len = other.extent
            assert start + length <= o_start or o_start + o_len <= start, "overlapping blocks"
        model = Model(handle, key, Counter({owner: 1}))
        self.blocks[handle.block_id] = model
        if key is not None:
            self.lru[key] = handle.block_id
        self.fill(model)

    @precondition(lambda self: any(m.refs for m in self.blocks.values()))
    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def add_ref(self, data: st.DataObject, owner: str | None) -> None:
        model = data.draw(st.sampled_from([m for m in self.blocks.values() if m.refs]))
        assert self.pool.add_ref(model.handle, owner=owner) == model.handle
        model.owners[owner] += 1

    @precondition(lambda self: any(m.refs for m in self.blocks.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = [(m, o) for m in self.blocks.values() for o, n in m.owners.items() if n]
        model, owner = data.draw(st.sampled_from(held))
        assert self.pool.release(model.handle, owner=owner) == model.refs - 1
        self.unref(model, owner, 1)

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data(), owner=st.sampled_from(OWNERS))
    def release_without_a_reference(self, data: st.DataObject, owner: str | None) -> None:
        model = data.draw(st.sampled_from(list(self.blocks.values())))
        if model.owners[owner] == 0:
            with pytest.raises(InvalidBlockError, match=f"block #{model.handle.block_id}"):
                self.pool.release(model.handle, owner=owner)

    @rule(owner=st.sampled_from(OWNERS[1:]))
    def release_owner(self, owner: str) -> None:
        held = [(m, m.owners[owner]) for m in self.blocks.values() if m.owners[owner]]
        assert self.pool.release_owner(owner) == sum(n for _, n in held)
        for model, count in held:
            self.unref(model, owner, count)

    @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS))
    def lookup(self, key: str, owner: str | None) -> None:
        handle = self.pool.lookup(key, owner=owner)
        if key not in self.lru:
            assert handle is None
            return
        assert handle is not None and handle.block_id == self.lru[key]
        self.blocks[handle.block_id].owners[owner] += 1
        self.lru.move_to_end(key)  # lent, not popped

    @precondition(lambda self: any(m.key is None for m in self.blocks.values()))
    @rule(data=st.data())
    def rewrite_a_private_block(self, data: st.DataObject) -> None:
        self.fill(data.draw(st.sampled_from([m for m in self.blocks.values() if m.key is None])))

    @rule(offset=st.integers(-CS, (NCHUNKS + 1) * CS))
    def find_alloc_by_ptr(self, offset: int) -> None:
        owners = [m for m in self.blocks.values() if 0 <= offset // CS - m.extent[0] < m.extent[1]]
        if offset < 0 or not owners:
            with pytest.raises(InvalidBlockError, match=f"byte offset {offset} lies"):
                self.pool.find_alloc_by_ptr(offset)
        else:
            assert self.pool.find_alloc_by_ptr(offset).block_id == owners[0].handle.block_id

    @precondition(lambda self: bool(self.dead))
    @rule(data=st.data())
    def stale_handle(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.dead))
        with pytest.raises(InvalidBlockError, match="stale"):
            self.pool.refcount(handle)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def pool_is_valid(self) -> None:
        self.pool.validate()

    @invariant()
    def pool_agrees_with_the_model(self) -> None:
        stats = self.pool.statistics()
        assert stats["live_blocks"] == len(self.blocks)
        assert stats["cached_blocks"] == len(self.lru)
        assert stats["idle_cached"] == len(self.idle_lru())
        for model in self.blocks.values():
            assert self.pool.refcount(model.handle) == model.refs >= 0

    @invariant()
    def every_block_keeps_its_pattern(self) -> None:
        for model in self.blocks.values():
            expected = pattern(model.handle.block_id, model.version, model.handle.nbytes)
            assert bytes(self.pool.view(model.handle)) == expected


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.pytestmark = [pytest.mark.slow]
