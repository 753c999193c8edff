"""The shared-memory shell: handles, typed blocks, lifecycle, and other processes reading them."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

# A sibling module (not this one), so spawned children import just numpy, omniflow and it.
import _pool_workers as workers
import msgpack
import numpy as np
import pytest

import omniflow as of
from omniflow.data import (
    BlockHandle,
    InvalidBlockError,
    PoolAttachment,
    PoolExhaustedError,
    SharedBufferPool,
)
from omniflow.data._pool import SEGMENT_PREFIX_ENV

MakePool = Callable[..., SharedBufferPool]
KB = 1024


def test_handles_ride_in_msgpack_and_pickle(make_pool: MakePool) -> None:
    pool = make_pool(64 * KB, chunk_size=KB)
    handle = pool.put_array(np.ones((2, 3), dtype=np.float32))
    assert handle == BlockHandle(pool.name, 1, 0, 24, "numpy", "<f4", (2, 3))
    assert BlockHandle.from_wire(msgpack.unpackb(msgpack.packb(handle))) == handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert len(msgpack.packb(handle)) < 64


def test_blocks_are_slices_of_one_slab(make_pool: MakePool) -> None:
    pool = make_pool(10 * KB, chunk_size=KB)
    a, b = pool.alloc(1500), pool.alloc(10)
    assert (a.offset, a.nbytes, b.offset) == (0, 1500, 2 * KB)
    pool.view(a)[:] = b"a" * 1500
    pool.view(b)[:] = b"b" * 10
    with PoolAttachment(pool.name) as slab:
        assert bytes(slab.view(a)) == b"a" * 1500 and bytes(slab.view(b)) == b"b" * 10
        slab.view(b)[:2] = b"xy"  # writes go both ways
    assert bytes(pool.view(b)[:3]) == b"xyb"
    stats = pool.statistics()
    assert stats["capacity"] == 10 * KB and stats["used_bytes"] == 3 * KB
    assert stats["live_blocks"] == 2


def test_stale_and_foreign_handles_are_refused(make_pool: MakePool) -> None:
    pool, other = make_pool(8 * KB, chunk_size=KB), make_pool(8 * KB, chunk_size=KB)
    handle = pool.alloc(100)
    assert pool.release(handle) == 0
    reused = pool.alloc(100)  # same offset, new block id
    assert reused.offset == handle.offset and reused.block_id != handle.block_id
    with pytest.raises(InvalidBlockError, match=r"block #1 is not live"):
        pool.view(handle)
    with pytest.raises(InvalidBlockError, match=f"belongs to pool '{other.name}'"):
        pool.release(other.alloc(10))
    with pytest.raises(InvalidBlockError, match="the block is at 0, 100 bytes"):
        pool.add_ref(reused._replace(nbytes=99))


def test_refcounts_owners_and_cache_through_the_shell(make_pool: MakePool) -> None:
    pool = make_pool(4 * KB, chunk_size=KB)
    emb = pool.put_array(np.arange(100, dtype=np.int16), cache_key=("vit", "img-1"), owner="c1")
    assert pool.refcount(emb) == 1
    lent = pool.lookup(("vit", "img-1"), owner="c2")
    assert lent == emb  # typed handle: dtype and shape come back with the lookup
    assert pool.add_ref(lent, owner="c2") == lent and pool.refcount(emb) == 3
    assert pool.release_owner("c1") == 1 and pool.release_owner("c2") == 2
    assert pool.statistics()["idle_cached"] == 1
    with pytest.raises(InvalidBlockError, match="below zero"):
        pool.release(emb)
    pool.alloc(4 * KB)  # pressure: the idle cached block goes
    assert pool.lookup(("vit", "img-1")) is None
    with pytest.raises(PoolExhaustedError, match="cannot allocate 1 bytes"):
        pool.alloc(1)


ARRAY_IDS = [
    f"{a.dtype}{list(a.shape)}{'' if a.flags.c_contiguous else '-view'}"
    for a in workers.sample_arrays()
]


@pytest.mark.parametrize("index", range(len(ARRAY_IDS)), ids=ARRAY_IDS)
def test_array_round_trip_is_bit_identical_and_zero_copy(make_pool: MakePool, index: int) -> None:
    pool = make_pool(64 * KB, chunk_size=KB)
    array = workers.sample_arrays()[index]
    handle = pool.put_array(array)
    back = pool.get_array(handle)
    assert (back.dtype, back.shape) == (array.dtype, array.shape)
    assert back.tobytes() == array.tobytes() and back.flags.c_contiguous
    assert not back.flags.writeable  # views are read-only unless asked for
    if array.size:
        assert pool.find_alloc_by_ptr(pool.offset_of(back)) == handle  # a view, not a copy
    del back


def test_array_views_copies_and_slice_provenance(make_pool: MakePool) -> None:
    pool = make_pool(64 * KB, chunk_size=KB)
    pool.alloc(3000)
    handle = pool.put_array(np.arange(1000, dtype=np.float64))  # 8000 bytes at 3 KB
    view = pool.get_array(handle, writable=True)
    copy = pool.get_array(handle, copy=True)
    view[0] = -1.0
    assert pool.get_array(handle)[0] == -1.0 and copy[0] == 0.0
    for piece in (view[:1], view[500:], view[-1:]):  # first, middle and last byte's elements
        assert pool.find_alloc_by_ptr(pool.offset_of(piece)) == handle
    assert pool.find_alloc_by_ptr(3 * KB + 8000 - 1) == handle
    with pytest.raises(InvalidBlockError, match="lies in free space"):
        pool.find_alloc_by_ptr(11 * KB)
    with pytest.raises(TypeError, match="address of a str"):
        pool.offset_of("x")
    del view, piece


def test_arrays_that_bytes_cannot_carry_are_refused(make_pool: MakePool) -> None:
    pool = make_pool(8 * KB, chunk_size=KB)
    for array in (np.array([object()]), np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])):
        with pytest.raises(ValueError, match="do not round-trip"):
            pool.put_array(array)
    handle = pool.alloc(8)
    with pytest.raises(of.DataError, match="holds 'bytes' data, not a numpy array"):
        pool.get_array(handle)
    with pytest.raises(of.DataError, match="do not fit a block of 8 bytes"):
        pool.write_array(handle, np.zeros(2, dtype=np.float64))
    assert pool.statistics()["live_blocks"] == 1  # the refused puts left nothing behind


def test_tensor_round_trip_every_dtype(make_pool: MakePool) -> None:
    torch = pytest.importorskip("torch")
    pool = make_pool(256 * KB, chunk_size=KB)
    for tensor in workers.sample_tensors():
        handle = pool.put_tensor(tensor)
        back = pool.get_tensor(handle)
        assert (back.dtype, back.shape) == (tensor.dtype, tensor.shape)
        assert workers.tensor_bytes(back) == workers.tensor_bytes(tensor)
        if tensor.numel():
            assert pool.find_alloc_by_ptr(pool.offset_of(back)) == handle
    zero_copy = pool.get_tensor(pool.put_tensor(torch.zeros(4, dtype=torch.bfloat16)))
    zero_copy.add_(1)
    handle = pool.find_alloc_by_ptr(pool.offset_of(zero_copy))
    assert pool.get_tensor(handle, copy=True).tolist() == [1.0] * 4
    with pytest.raises(of.DataError, match="not a torch tensor"):
        pool.get_tensor(pool.alloc(4))
    del back, zero_copy


def test_use_after_close_raises_and_nothing_leaks(
    make_pool: MakePool, no_leaked_segments: list[str]
) -> None:
    pool = make_pool(8 * KB, chunk_size=KB)
    handle = pool.put_array(np.arange(10))
    survivor = pool.get_array(handle)  # a live view does not block close()
    pool.close()
    pool.close()  # idempotent
    assert pool.closed and not os.path.exists(f"/dev/shm/{pool.name}")
    assert survivor.sum() == 45  # the mapping lives as long as its views
    calls = [
        lambda: pool.alloc(1),
        lambda: pool.add_ref(handle),
        lambda: pool.release(handle),
        lambda: pool.release_owner("c"),
        lambda: pool.lookup("k"),
        lambda: pool.find_alloc_by_ptr(0),
        lambda: pool.get_array(handle),
        lambda: pool.put_array(np.zeros(1)),
        lambda: pool.refcount(handle),
    ]
    closed = f"SharedBufferPool '{pool.name}' is closed"
    for call in calls:
        with pytest.raises(of.RuntimeClosedError, match=closed):
            call()
    with pytest.raises(of.DataError, match="no shared-memory segment named"):
        PoolAttachment(pool.name)
    assert no_leaked_segments == [pool.name]
    del survivor


async def test_async_context_manager_and_attachment_close(make_pool: MakePool) -> None:
    async with SharedBufferPool(4 * KB, chunk_size=KB) as pool:
        handle = pool.alloc(10)
        async with PoolAttachment(pool.name) as slab:
            slab.view(handle)[:1] = b"z"
        with pytest.raises(of.RuntimeClosedError, match="PoolAttachment"):
            slab.view(handle)
        too_long = handle._replace(nbytes=9999)
        with PoolAttachment(pool.name) as slab, pytest.raises(InvalidBlockError, match="9999"):
            slab.view(too_long)
    assert pool.closed


@pytest.mark.slow
def test_a_forgotten_pool_warns_and_unlinks() -> None:
    with warnings.catch_warnings():  # what an earlier, failed test left is its own failure
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    pool = SharedBufferPool(4 * KB, chunk_size=KB)
    name = pool.name
    with pytest.warns(ResourceWarning, match="without close"):
        del pool
        gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}")


# -- other processes --------------------------------------------------------------------------


def spawn_executor() -> ProcessPoolExecutor:
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


@pytest.mark.slow
def test_another_process_reads_and_writes_arrays_bit_identically(make_pool: MakePool) -> None:
    pool = make_pool(256 * KB, chunk_size=KB)
    arrays = workers.sample_arrays()
    handles = [pool.put_array(a, owner="call") for a in arrays]
    blanks = [pool.alloc(a.nbytes, owner="call") for a in arrays]
    with spawn_executor() as executor:
        read = executor.submit(workers.read_arrays, pool.name, handles).result(timeout=30)
        written = executor.submit(workers.write_arrays, pool.name, blanks).result(timeout=30)
    for array, (dtype, shape, data) in zip(arrays, read, strict=True):
        assert (dtype, shape, data) == (array.dtype.str, array.shape, array.tobytes())
    for array, handle in zip(arrays, written, strict=True):
        assert pool.get_array(handle).tobytes() == array.tobytes()
    assert pool.release_owner("call") == 2 * len(arrays)


@pytest.mark.slow
def test_another_process_reads_and_writes_tensors_bit_identically(make_pool: MakePool) -> None:
    pytest.importorskip("torch")
    pool = make_pool(512 * KB, chunk_size=KB)
    tensors = workers.sample_tensors()
    handles = [pool.put_tensor(t) for t in tensors]
    blanks = [pool.alloc(t.numel() * t.element_size()) for t in tensors]
    with spawn_executor() as executor:
        read = executor.submit(workers.read_tensors, pool.name, handles).result(timeout=30)
        written = executor.submit(workers.write_tensors, pool.name, blanks).result(timeout=30)
    for tensor, (dtype, shape, data) in zip(tensors, read, strict=True):
        assert (dtype, shape) == (str(tensor.dtype), tuple(tensor.shape))
        assert data == workers.tensor_bytes(tensor)
    for tensor, handle in zip(tensors, written, strict=True):
        assert workers.tensor_bytes(pool.get_tensor(handle)) == workers.tensor_bytes(tensor)


def test_an_unrelated_process_attaching_does_not_unlink_the_segment(make_pool: MakePool) -> None:
    # Before Python 3.13, SharedMemory(name) in a process with its own resource tracker
    # unlinks the segment when that process exits; our attach must not.
    pool = make_pool(4 * KB, chunk_size=KB)
    handle = pool.put_array(np.arange(4, dtype=np.int8))
    script = (
        "import sys; from omniflow.data import BlockHandle, PoolAttachment; "
        f"h = BlockHandle.from_wire({list(handle)!r}); "
        "s = PoolAttachment(h.pool); print(s.get_array(h).tolist())"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "[0, 1, 2, 3]", "")
    assert os.path.exists(f"/dev/shm/{pool.name}")
    assert pool.get_array(handle).tolist() == [0, 1, 2, 3]


def test_segment_names_take_the_environment_prefix(
    make_pool: MakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert make_pool(4096).name.startswith("omniflow_")
    monkeypatch.setenv(SEGMENT_PREFIX_ENV, "omniflow_t42")
    pool = make_pool(4096)
    assert pool.name.startswith("omniflow_t42_") and os.path.exists(f"/dev/shm/{pool.name}")
    for bad in ("", "../etc", "a b", "x" * 65):
        monkeypatch.setenv(SEGMENT_PREFIX_ENV, bad)
        with pytest.raises(ValueError, match=r"SHM_PREFIX=.* is not a segment name prefix"):
            SharedBufferPool(4096)
