"""The data plane: shared-memory buffers that carry tensors while control messages carry handles.

>>> import omniflow.data as ofd
>>> with ofd.SharedBufferPool(64 * 2**20) as pool:                 # doctest: +SKIP
...     handle = pool.put_tensor(latents, owner=call_id)         # send handle, not tensor
"""

from omniflow._exceptions import InvalidBlockError, PoolExhaustedError
from omniflow.data._alloc import Block, PoolCore
from omniflow.data._attach import PoolAttachment, PoolState
from omniflow.data._chunks import ChunkMap
from omniflow.data._handle import BlockHandle
from omniflow.data._pool import DEFAULT_CHUNK_SIZE, SharedBufferPool

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Block",
    "BlockHandle",
    "ChunkMap",
    "InvalidBlockError",
    "PoolAttachment",
    "PoolCore",
    "PoolExhaustedError",
    "PoolState",
    "SharedBufferPool",
]
