"""Typed, zero-copy access to pool blocks by handle, and the consumer side of a pool.

``PoolAttachment`` maps the slab of a pool owned by another process by its name; the owner
(``SharedBufferPool``, which shares the same typed accessors) keeps all the bookkeeping.

>>> with PoolAttachment(handle.pool) as slab:                    # doctest: +SKIP
...     image = slab.get_array(handle)                           # zero-copy, read-only view
...     latents = slab.get_tensor(other_handle, copy=True)       # private copy
"""

from __future__ import annotations

import enum
from types import TracebackType
from typing import TYPE_CHECKING, Self

from omniflow._exceptions import InvalidBlockError, RuntimeClosedError
from omniflow.data import _handle
from omniflow.data._handle import BlockHandle
from omniflow.data._shm import Segment

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["PoolAttachment", "PoolState"]


class PoolState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class _BlockIO:
    """Typed, zero-copy access to blocks by handle; subclasses say how a handle maps to bytes."""

    name: str
    state: PoolState

    def _view(self, handle: BlockHandle) -> memoryview:
        raise NotImplementedError

    def _closed_error(self) -> RuntimeClosedError:
        kind = type(self).__name__
        return RuntimeClosedError(f"{kind} '{self.name}' is closed; open a new one to use it")

    @property
    def closed(self) -> bool:
        return self.state is PoolState.CLOSED

    def view(self, handle: BlockHandle) -> memoryview:
        """A writable memoryview of the block's ``nbytes``, sharing the slab's memory."""
        return self._view(handle)

    def get_array(
        self, handle: BlockHandle, *, copy: bool = False, writable: bool = False
    ) -> np.ndarray:
        """The numpy array in the block: a read-only view unless ``writable`` or ``copy``."""
        return _handle.read_array(self._view(handle), handle, copy=copy, writable=writable)

    def get_tensor(self, handle: BlockHandle, *, copy: bool = False) -> torch.Tensor:
        """The CPU tensor in the block: a view sharing the slab, or a private copy."""
        return _handle.read_tensor(self._view(handle), handle, copy=copy)

    def write_array(self, handle: BlockHandle, array: np.ndarray) -> BlockHandle:
        """Copy ``array`` into the block (C order); returns the handle typed with dtype/shape."""
        _handle.write_array(self._view(handle), array)
        dtype, shape, _ = _handle.array_layout(array)
        return handle._replace(kind="numpy", dtype=dtype, shape=shape)

    def write_tensor(self, handle: BlockHandle, tensor: torch.Tensor) -> BlockHandle:
        """Copy ``tensor`` into the block; returns the handle typed with dtype/shape."""
        _handle.write_tensor(self._view(handle), tensor)
        dtype, shape, _ = _handle.tensor_layout(tensor)
        return handle._replace(kind="torch", dtype=dtype, shape=shape)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class PoolAttachment(_BlockIO):
    """The slab of a pool owned by another process, mapped by name; no bookkeeping.

    The owner keeps every reference count: a consumer reads a block while the owner holds a
    reference for it (granted before the handle was sent) and tells the owner when it is done.
    """

    def __init__(self, name: str, *, private: bool = False) -> None:
        #: Name of the segment (``BlockHandle.pool``).
        self.name = name
        #: OPEN until ``close()``.
        self.state = PoolState.OPEN
        #: Mapped copy-on-write: writes through views stay in this process (pages never
        #: written still show the owner's bytes, zero-copy).
        self.private = private
        self._segment = Segment.attach(name, private=private)

    def close(self) -> None:
        """Unmap (deferred while views are alive); the owner's segment is untouched."""
        self.state = PoolState.CLOSED
        self._segment.close()

    def _view(self, handle: BlockHandle) -> memoryview:
        buf = self._segment.buf
        if buf is None:
            raise self._closed_error()
        start, end = handle.offset, handle.offset + handle.nbytes
        if handle.pool != self.name or not 0 <= start <= end <= buf.nbytes:
            raise InvalidBlockError(
                f"attachment '{self.name}' ({buf.nbytes:,} bytes): handle of block "
                f"#{handle.block_id} names pool '{handle.pool}', bytes {start}..{end}",
                pool=self.name,
                block_id=handle.block_id,
                offset=handle.offset,
            )
        return buf[start:end]
