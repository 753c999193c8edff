"""Block handles, and how numpy arrays and torch tensors are laid into a block and read back.

A handle is what rides in control messages instead of the tensor (a plain tuple: picklable and
msgpack-able); the bytes stay in the shared slab.

>>> import msgpack
>>> h = BlockHandle("omniflow_1a2b", block_id=7, offset=65536, nbytes=4096)
>>> BlockHandle.from_wire(msgpack.unpackb(msgpack.packb(h))) == h
True

Arrays are stored C-contiguous with their dtype and shape in the handle; a reader gets a
zero-copy view of the block. numpy and torch are imported only when used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from omniflow._exceptions import DataError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["BlockHandle"]


class BlockHandle(NamedTuple):
    """The name of one block: enough for any process to attach the slab and find the bytes."""

    #: Name of the pool's shared-memory segment, to attach by.
    pool: str
    #: Id of the block in that pool; never reused, so the owner detects stale handles.
    block_id: int
    #: Byte offset of the block in the slab.
    offset: int
    #: Bytes of the block.
    nbytes: int
    #: How the bytes are typed: ``"bytes"``, ``"numpy"`` or ``"torch"``.
    kind: str = "bytes"
    #: numpy dtype string (``"<f4"``) or torch dtype name (``"bfloat16"``); empty for bytes.
    dtype: str = ""
    #: Array shape, C order.
    shape: tuple[int, ...] = ()

    @classmethod
    def from_wire(cls, data: Sequence[Any]) -> BlockHandle:
        """Rebuild a handle from its msgpack form (a list, with the shape as a list)."""
        pool, block_id, offset, nbytes, kind, dtype, shape = data
        return cls(str(pool), int(block_id), int(offset), int(nbytes), str(kind), str(dtype),
                   tuple(int(n) for n in shape))  # fmt: skip


# -- numpy ------------------------------------------------------------------------------------


def array_layout(array: np.ndarray) -> tuple[str, tuple[int, ...], int]:
    """(dtype string, shape, bytes) of an array, refusing what bytes cannot carry."""
    import numpy as np

    dtype = array.dtype
    if dtype.hasobject or np.dtype(dtype.str) != dtype:
        raise ValueError(
            f"cannot place an array of dtype {dtype} in a buffer pool: object and structured "
            "dtypes do not round-trip as raw bytes; place array.view(np.uint8) instead"
        )
    return dtype.str, tuple(array.shape), array.nbytes


def write_array(view: memoryview, array: np.ndarray) -> None:
    """Copy ``array`` (any strides) into the start of ``view``, C-contiguous, in one pass."""
    import numpy as np

    dtype, shape, nbytes = array_layout(array)
    _fits(nbytes, view)
    dst = np.ndarray(shape, dtype=dtype, buffer=view)
    np.copyto(dst, array, casting="no")


def read_array(view: memoryview, handle: BlockHandle, *, copy: bool, writable: bool) -> np.ndarray:
    """The array a handle describes: a view of the block, or a private copy."""
    import numpy as np

    if handle.kind != "numpy":
        raise DataError(f"block #{handle.block_id} holds {handle.kind!r} data, not a numpy array")
    dtype = np.dtype(handle.dtype)
    _fits(dtype.itemsize * math.prod(handle.shape), view)
    array = np.ndarray(handle.shape, dtype=dtype, buffer=view)
    if copy:
        return array.copy()
    array.flags.writeable = writable
    return array


# -- torch ------------------------------------------------------------------------------------


def tensor_layout(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    """(dtype name, shape, bytes) of a tensor."""
    name = str(tensor.dtype).removeprefix("torch.")
    return name, tuple(tensor.shape), tensor.numel() * tensor.element_size()


def write_tensor(view: memoryview, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` (any strides, any device) into the start of ``view`` in one pass."""
    import torch

    _, shape, nbytes = tensor_layout(tensor)
    _fits(nbytes, view)
    if nbytes:
        dst = torch.frombuffer(view, dtype=tensor.dtype, count=tensor.numel()).view(shape)
        with torch.no_grad():
            dst.copy_(tensor.detach())


def read_tensor(view: memoryview, handle: BlockHandle, *, copy: bool) -> torch.Tensor:
    """The tensor a handle describes: a view of the block, or a private copy."""
    import torch

    dtype = getattr(torch, handle.dtype, None) if handle.kind == "torch" else None
    if not isinstance(dtype, torch.dtype):
        what = f"dtype {handle.dtype!r}" if handle.kind == "torch" else f"{handle.kind!r} data"
        raise DataError(f"block #{handle.block_id} holds {what}, not a torch tensor")
    numel = math.prod(handle.shape)
    _fits(numel * dtype.itemsize, view)
    if numel == 0:  # torch.frombuffer refuses an empty buffer
        return torch.empty(handle.shape, dtype=dtype)
    tensor = torch.frombuffer(view, dtype=dtype, count=numel).view(handle.shape)
    return tensor.clone() if copy else tensor


def _fits(nbytes: int, view: memoryview) -> None:
    if nbytes > view.nbytes:
        raise DataError(f"{nbytes} bytes of array data do not fit a block of {view.nbytes} bytes")
