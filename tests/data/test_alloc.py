"""The allocator core alone: chunks, references, owners, the LRU cache and eviction, no memory."""

from __future__ import annotations

import pickle

import pytest

from omniflow import DataError
from omniflow.data import ChunkMap, InvalidBlockError, PoolCore, PoolExhaustedError

CS = 100  # chunk size: small numbers keep the arithmetic readable


@pytest.fixture
def core() -> PoolCore:
    return PoolCore(capacity=10 * CS, chunk_size=CS, name="t")


def idle_cached(core: PoolCore, nbytes: int, key: str) -> int:
    block = core.alloc(nbytes, cache_key=key)
    core.release(block.block_id)
    return block.block_id


def test_alloc_rounds_up_to_whole_chunks(core: PoolCore) -> None:
    a, b, c = core.alloc(1), core.alloc(CS), core.alloc(CS + 1)
    assert (a.nchunks, b.nchunks, c.nchunks) == (1, 1, 2)
    assert (a.start, b.start, c.start) == (0, 1, 2)
    assert core.alloc(0).nchunks == 1  # a zero-byte block still has an address
    stats = core.statistics()
    assert stats["used_bytes"] == 5 * CS and stats["requested_bytes"] == 2 * CS + 2
    assert stats["free_bytes"] == 5 * CS and stats["allocs"] == 4
    with pytest.raises(ValueError, match="-1 bytes"):
        core.alloc(-1)
    core.validate()


def test_refcount_lifecycle(core: PoolCore) -> None:
    block = core.alloc(250)
    assert block.refs == 1
    core.add_ref(block.block_id)
    assert core.release(block.block_id) == 1
    assert core.release(block.block_id) == 0
    assert core.statistics()["frees"] == 1 and core.statistics()["free_bytes"] == 10 * CS
    with pytest.raises(InvalidBlockError, match=r"block #1 is not live") as info:
        core.release(block.block_id)
    assert info.value.block_id == 1 and info.value.pool == "t"
    core.validate()


def test_release_below_zero_names_the_block(core: PoolCore) -> None:
    block_id = idle_cached(core, 50, "k")
    with pytest.raises(InvalidBlockError, match=r"release of block #1 \(offset 0\) below zero"):
        core.release(block_id)
    assert core.block(block_id).refs == 0  # unchanged, still cached
    core.validate()


def test_release_needs_the_owner_that_holds_the_reference(core: PoolCore) -> None:
    block = core.alloc(50, owner="call-1")
    with pytest.raises(InvalidBlockError, match=r"owner None: held by \{'call-1': 1\}"):
        core.release(block.block_id)
    core.add_ref(block.block_id, owner="call-2")
    assert block.owners == {"call-1": 1, "call-2": 1}
    assert core.release(block.block_id, owner="call-1") == 1
    core.validate()


def test_add_ref_of_an_idle_cached_block_points_to_lookup(core: PoolCore) -> None:
    block_id = idle_cached(core, 50, "k")
    with pytest.raises(InvalidBlockError, match=r"lookup\(key\)"):
        core.add_ref(block_id)


def test_lookup_lends_without_popping(core: PoolCore) -> None:
    block = core.alloc(150, cache_key="img")
    assert core.lookup("img") is block and core.lookup("img") is block
    assert block.refs == 3
    assert core.statistics()["cached_blocks"] == 1 and core.statistics()["cache_hits"] == 2
    assert core.lookup("nope") is None and core.statistics()["cache_misses"] == 1
    for _ in range(3):
        core.release(block.block_id)
    stats = core.statistics()
    assert (stats["idle_cached"], stats["live_blocks"], stats["frees"]) == (1, 1, 0)
    assert core.lookup("img") is block and block.refs == 1  # resident while idle
    core.validate()


def test_pressure_evicts_only_idle_cached_blocks_lru_first(core: PoolCore) -> None:
    a = idle_cached(core, 2 * CS, "a")
    held = core.alloc(2 * CS, cache_key="held")  # cached but referenced
    c = idle_cached(core, 2 * CS, "c")
    plain = core.alloc(2 * CS)  # never cached
    d = idle_cached(core, 2 * CS, "d")
    lent = core.lookup("a")  # "a" is now the most recently used
    assert lent is not None
    core.release(lent.block_id)
    assert core.statistics()["free_bytes"] == 0
    new = core.alloc(2 * CS)  # must evict exactly one idle block: the LRU one, "c"
    assert new.start == 4
    assert core.statistics()["evictions"] == 1
    assert core.lookup("c") is None
    for key in ("a", "held", "d"):
        block = core.lookup(key)
        assert block is not None
        core.release(block.block_id)
    assert core.block(held.block_id).refs == 1 and core.block(plain.block_id).refs == 1
    assert {a, d} <= {b.block_id for b in core.blocks()} and c not in core._blocks
    core.validate()


def test_eviction_coalesces_neighbours_into_one_run(core: PoolCore) -> None:
    first = idle_cached(core, 3 * CS, "x")
    second = idle_cached(core, 3 * CS, "y")
    keep = core.alloc(4 * CS)
    big = core.alloc(6 * CS)  # needs both idle blocks gone and their runs merged
    assert big.start == 0 and core.statistics()["evictions"] == 2
    assert {first, second}.isdisjoint(b.block_id for b in core.blocks())
    assert keep.refs == 1
    core.validate()


def test_exhaustion_is_typed_and_leaves_the_cache_intact(core: PoolCore) -> None:
    core.alloc(4 * CS)
    idle_cached(core, 2 * CS, "k")  # chunks 4-5
    core.alloc(CS)  # chunk 6; free: 7-9
    with pytest.raises(PoolExhaustedError) as info:
        core.alloc(6 * CS)
    err = info.value
    assert (err.requested, err.free, err.largest_free, err.capacity) == (600, 300, 300, 1000)
    assert str(err) == (
        "pool 't': cannot allocate 600 bytes (6 chunks of 100): 300 bytes free, largest free run"
        " 300 bytes, and evicting all 1 idle cached blocks would give at most 300 contiguous "
        "bytes; release blocks (or their owners) or create the pool with a larger capacity "
        "(now 1,000 bytes)"
    )
    assert isinstance(err, DataError)
    assert core.lookup("k") is not None  # the failed alloc evicted nothing
    assert core.statistics()["evictions"] == 0
    with pytest.raises(PoolExhaustedError, match="cannot allocate 1,001 bytes"):
        PoolCore(1000, CS).alloc(1001)
    core.validate()


def test_pool_errors_survive_pickling() -> None:
    err = PoolExhaustedError("full", pool="p", requested=5, free=1, largest_free=1, capacity=9)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.requested, back.largest_free) == ("full", 5, 1)
    bad = pickle.loads(pickle.dumps(InvalidBlockError("gone", pool="p", block_id=3, offset=7)))
    assert (bad.block_id, bad.offset) == (3, 7)


def test_find_maps_every_byte_of_a_block_to_it(core: PoolCore) -> None:
    core.alloc(CS)
    block = core.alloc(2 * CS + 30)  # chunks 1-3: bytes 100..399
    core.alloc(10)
    first, middle, last = 100, 250, 100 + block.nbytes - 1
    assert all(core.find(off) is block for off in (first, middle, last, 399))  # 399: padding
    core.release(core.find(0).block_id)
    with pytest.raises(InvalidBlockError, match="byte offset 50 lies in free space"):
        core.find(50)
    with pytest.raises(InvalidBlockError, match="outside the pool"):
        core.find(1000)
    with pytest.raises(InvalidBlockError, match="outside the pool"):
        core.find(-1)


def test_release_owner_drops_every_reference_of_a_call(core: PoolCore) -> None:
    a = core.alloc(50, owner="call-1")
    core.add_ref(a.block_id, owner="call-1")
    b = core.alloc(50, owner="call-1", cache_key="emb")
    shared = core.alloc(50, owner="call-2")
    core.add_ref(shared.block_id, owner="call-1")
    assert core.statistics()["owners"] == 2
    assert core.release_owner("call-1") == 4
    assert a.block_id not in core._blocks  # freed
    assert core.block(b.block_id).refs == 0  # cached: stays resident, idle
    assert shared.owners == {"call-2": 1}
    assert core.release_owner("call-1") == 0 and core.statistics()["owners"] == 1
    with pytest.raises(ValueError, match="needs an owner tag"):
        core.release_owner(None)
    core.validate()


def test_caching_a_key_again_replaces_the_old_entry(core: PoolCore) -> None:
    old_idle = idle_cached(core, 50, "k")
    new = core.alloc(50, cache_key="k")
    assert old_idle not in core._blocks  # idle and no longer cached: freed
    held_old = core.lookup("k")
    assert held_old is new
    newer = core.alloc(50, cache_key="k")
    assert new.cache_key is None and new.refs == 2  # still held, just no longer cached
    core.release(new.block_id)
    core.release(new.block_id)
    assert new.block_id not in core._blocks
    assert core.lookup("k") is newer
    core.validate()


def test_validate_names_a_broken_invariant(core: PoolCore) -> None:
    block = core.alloc(50)
    block.refs = -1
    with pytest.raises(AssertionError, match="block #1 has -1 references"):
        core.validate()
    block.refs = 1
    core._chunks.give_back(0, 1)  # the block's chunk is now also free
    with pytest.raises(AssertionError, match="overlaps"):
        core.validate()


def test_chunk_map_first_fit_and_merge() -> None:
    chunks = ChunkMap(10)
    starts = [chunks.take(2) for _ in range(5)]
    assert starts == [0, 2, 4, 6, 8] and chunks.take(1) is None
    assert chunks.give_back(2, 2) == (2, 2)
    assert chunks.give_back(6, 2) == (6, 2)
    assert chunks.give_back(4, 2) == (2, 6)  # merged with both neighbours
    assert chunks.largest_free() == 6 and chunks.largest_free([(8, 2)]) == 8
    assert chunks.take(5) == 2
