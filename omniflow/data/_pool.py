"""The shared-memory buffer pool: the allocator core (``_alloc.py``) behind a thin shell.

The owning process creates the slab and keeps all bookkeeping (references, cache, owners);
control messages carry ``BlockHandle``s, and any process on the host maps the slab by name
(``PoolAttachment``) to read or write a block in place.

>>> import numpy as np
>>> from omniflow.data import PoolAttachment, SharedBufferPool
>>> with SharedBufferPool(16 * 2**20) as pool:                      # owner process
...     handle = pool.put_array(np.arange(6.0).reshape(2, 3), owner="call-1")
...     with PoolAttachment(handle.pool) as slab:                   # any process, by name
...         print(slab.get_array(handle).sum())                      # zero-copy view
...     pool.release_owner("call-1")                                # call over: drop its refs
15.0
1
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import warnings
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from omniflow._exceptions import InvalidBlockError
from omniflow.data import _handle
from omniflow.data._alloc import Block, PoolCore
from omniflow.data._attach import PoolState, _BlockIO
from omniflow.data._handle import BlockHandle
from omniflow.data._shm import Segment

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["DEFAULT_CHUNK_SIZE", "SEGMENT_PREFIX_ENV", "SharedBufferPool", "segment_prefix"]

#: Default allocation unit: large enough that a 512 MB tensor is 8192 chunks, small enough that a
#: short prompt's embeddings waste little.
DEFAULT_CHUNK_SIZE = 64 * 1024

#: Names the prefix of new pools' segment names (``<prefix>_<12 hex>``; default ``omniflow``).
#: Inherited by spawned workers, so a test run (or one deployment among several on a host) can
#: tell its own ``/dev/shm`` segments from everyone else's.
SEGMENT_PREFIX_ENV = "OMNIFLOW_SHM_PREFIX"
_PREFIX = re.compile(r"[A-Za-z0-9_]{1,64}")


def segment_prefix() -> str:
    """The prefix of new segment names: ``$OMNIFLOW_SHM_PREFIX`` or ``omniflow``."""
    prefix = os.environ.get(SEGMENT_PREFIX_ENV, "omniflow")
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"{SEGMENT_PREFIX_ENV}={prefix!r} is not a segment name prefix: use 1-64 letters, "
            "digits or '_' (or unset it for the default 'omniflow')"
        )
    return prefix


class SharedBufferPool(_BlockIO):
    """A slab of ``capacity`` bytes in shared memory, carved into ``chunk_size`` chunks.

    Thread-safe: bookkeeping runs under one lock; copies into and out of blocks run outside it.
    """

    def __init__(
        self, capacity: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE, name: str | None = None
    ) -> None:
        if capacity <= 0 or chunk_size <= 0:
            raise ValueError(f"need capacity > 0 and chunk_size > 0, got {capacity}, {chunk_size}")
        nchunks = -(-capacity // chunk_size)
        #: Name of the shared-memory segment; handles carry it.
        self.name = name or f"{segment_prefix()}_{secrets.token_hex(6)}"
        #: OPEN until ``close()``.
        self.state = PoolState.OPEN
        self._core = PoolCore(nchunks * chunk_size, chunk_size, name=self.name)
        self._segment = Segment.create(self.name, nchunks * chunk_size)
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _unlink_leaked, self._segment)

    @property
    def capacity(self) -> int:
        return self._core.nchunks * self._core.chunk_size

    @property
    def chunk_size(self) -> int:
        return self._core.chunk_size

    # -- references -------------------------------------------------------------------------

    def alloc(
        self, nbytes: int, cache_key: Hashable | None = None, *, owner: Hashable = None
    ) -> BlockHandle:
        """A block of ``nbytes`` with one reference for ``owner``; cached under ``cache_key``.

        A cached block is shared read-only: write it before anyone can look the key up, or use
        ``put_array``/``put_tensor``, which publish the key only after writing.
        """
        with self._lock:
            self._check_open()
            return self._handle(self._core.alloc(nbytes, cache_key, owner))

    def add_ref(self, handle: BlockHandle, *, owner: Hashable = None) -> BlockHandle:
        """One more reference (for another consumer) to a block someone already holds."""
        with self._lock:
            self._check_open()
            self._core.add_ref(self._block(handle).block_id, owner)
        return handle

    def release(self, handle: BlockHandle, *, owner: Hashable = None) -> int:
        """Give back one reference held by ``owner``; returns the references left."""
        with self._lock:
            self._check_open()
            return self._core.release(self._block(handle).block_id, owner)

    def release_owner(self, owner: Hashable) -> int:
        """Drop every reference held under ``owner`` (a failed or cancelled call)."""
        with self._lock:
            self._check_open()
            return self._core.release_owner(owner)

    def lookup(self, cache_key: Hashable, *, owner: Hashable = None) -> BlockHandle | None:
        """Borrow the block cached under ``cache_key`` (one reference; it stays cached)."""
        with self._lock:
            self._check_open()
            block = self._core.lookup(cache_key, owner)
            return None if block is None else self._handle(block)

    def refcount(self, handle: BlockHandle) -> int:
        with self._lock:
            self._check_open()
            return self._block(handle).refs

    # -- typed blocks -----------------------------------------------------------------------

    def put_array(
        self, array: np.ndarray, *, cache_key: Hashable | None = None, owner: Hashable = None
    ) -> BlockHandle:
        """Allocate a block for ``array``, copy it in, and publish ``cache_key`` (if any)."""
        return self._put(array, _handle.array_layout(array)[2], cache_key, owner)

    def put_tensor(
        self, tensor: torch.Tensor, *, cache_key: Hashable | None = None, owner: Hashable = None
    ) -> BlockHandle:
        """Allocate a block for ``tensor``, copy it in, and publish ``cache_key`` (if any)."""
        return self._put(tensor, _handle.tensor_layout(tensor)[2], cache_key, owner)

    def write_array(self, handle: BlockHandle, array: np.ndarray) -> BlockHandle:
        return self._typed(super().write_array(handle, array))

    def write_tensor(self, handle: BlockHandle, tensor: torch.Tensor) -> BlockHandle:
        return self._typed(super().write_tensor(handle, tensor))

    # -- provenance and checks --------------------------------------------------------------

    def find_alloc_by_ptr(self, offset: int) -> BlockHandle:
        """The block containing byte ``offset`` of the slab (e.g. a slice's start), O(log N)."""
        with self._lock:
            self._check_open()
            return self._handle(self._core.find(offset))

    def offset_of(self, obj: Any) -> int:
        """Byte offset in the slab of a numpy array's or torch tensor's first element."""
        if hasattr(obj, "data_ptr"):
            address = obj.data_ptr()
        elif hasattr(obj, "__array_interface__"):
            address = obj.__array_interface__["data"][0]
        else:
            raise TypeError(f"cannot take the address of a {type(obj).__name__}")
        return int(address) - self._segment.address

    def validate(self) -> None:
        """Check the allocator's invariants; raises ``AssertionError``."""
        with self._lock:
            self._core.validate()

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return self._core.statistics()

    def close(self) -> None:
        """Unlink the segment. Views still alive stay readable; the pool itself is unusable."""
        with self._lock:
            if self.state is PoolState.CLOSED:
                return
            self.state = PoolState.CLOSED
            self._finalizer.detach()
            self._segment.close()
            self._segment.unlink()

    def __repr__(self) -> str:
        return f"<SharedBufferPool '{self.name}' {self.state.value} {self.capacity:,} bytes>"

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.state is PoolState.CLOSED:
            raise self._closed_error()

    def _put(
        self, data: Any, nbytes: int, cache_key: Hashable | None, owner: Hashable
    ) -> BlockHandle:
        handle = self.alloc(nbytes, owner=owner)
        try:
            is_array = hasattr(data, "__array_interface__") and not hasattr(data, "data_ptr")
            handle = self.write_array(handle, data) if is_array else self.write_tensor(handle, data)
            if cache_key is not None:
                with self._lock:
                    self._core.cache(handle.block_id, cache_key)
        except BaseException:
            self.release(handle, owner=owner)
            raise
        return handle

    def _typed(self, handle: BlockHandle) -> BlockHandle:
        with self._lock:
            self._check_open()
            self._block(handle).meta = (handle.kind, handle.dtype, handle.shape)
        return handle

    def _view(self, handle: BlockHandle) -> memoryview:
        with self._lock:
            self._check_open()
            block = self._block(handle)
            assert self._segment.buf is not None
            offset = block.start * self._core.chunk_size
            return self._segment.buf[offset : offset + block.nbytes]

    def _block(self, handle: BlockHandle) -> Block:
        if handle.pool != self.name:
            raise InvalidBlockError(
                f"pool '{self.name}': handle of block #{handle.block_id} belongs to pool "
                f"'{handle.pool}'",
                pool=self.name,
                block_id=handle.block_id,
            )
        block = self._core.block(handle.block_id)
        if block.start * self._core.chunk_size != handle.offset or block.nbytes != handle.nbytes:
            raise InvalidBlockError(
                f"pool '{self.name}': handle of block #{handle.block_id} says offset "
                f"{handle.offset}, {handle.nbytes} bytes; the block is at "
                f"{block.start * self._core.chunk_size}, {block.nbytes} bytes",
                pool=self.name,
                block_id=handle.block_id,
                offset=handle.offset,
            )
        return block

    def _handle(self, block: Block) -> BlockHandle:
        kind, dtype, shape = block.meta or ("bytes", "", ())
        offset = block.start * self._core.chunk_size
        return BlockHandle(self.name, block.block_id, offset, block.nbytes, kind, dtype, shape)


def _unlink_leaked(segment: Segment) -> None:
    segment.close()
    segment.unlink()
    warnings.warn(
        f"buffer pool '{segment.name}' was garbage-collected without close(); unlinked its "
        "shared memory",
        ResourceWarning,
        stacklevel=1,
    )
