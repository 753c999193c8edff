"""A cross-request LRU of encoder outputs, keyed by a hash of the raw payload (paper §5.1).

>>> cache = EncoderCache(maxsize=2)
>>> calls = []
>>> def encode(payload):
...     calls.append(payload)
...     return len(payload)
>>> cache.get_or_compute(b"image-bytes", encode), cache.get_or_compute(b"image-bytes", encode)
(11, 11)
>>> len(calls), cache.statistics()["hits"]
(1, 1)

The same image URL or base64 string coming back skips the encoder forward pass. Keys are BLAKE2b
digests of the payload (bytes, str, or a tensor's bytes), so a cache never holds the payloads.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from omniflow.compute._bytes import tensor_bytes

__all__ = ["EncoderCache", "payload_key"]

T = TypeVar("T")


def payload_key(payload: Any) -> str:
    """The cache key of a raw payload: bytes, str, a tensor/array, or a tuple of those."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, payload)
    return h.hexdigest()


def _feed(h: Any, payload: Any) -> None:
    if isinstance(payload, bytes | bytearray | memoryview):
        h.update(b"b" + bytes(payload))
    elif isinstance(payload, str):
        h.update(b"s" + payload.encode())
    elif isinstance(payload, tuple | list):
        h.update(b"(" + str(len(payload)).encode())
        for item in payload:
            _feed(h, item)
    elif hasattr(payload, "data_ptr") and hasattr(payload, "shape"):  # torch.Tensor
        kind = str((str(payload.dtype), tuple(payload.shape))).encode()
        h.update(b"t" + kind + tensor_bytes(payload))
    elif hasattr(payload, "tobytes") and hasattr(payload, "shape"):  # numpy array
        h.update(b"a" + str((payload.dtype.str, payload.shape)).encode() + payload.tobytes())
    else:
        raise TypeError(
            "EncoderCache keys raw payloads (bytes, str, tensors, arrays); "
            f"got {type(payload).__name__}"
        )


class EncoderCache:
    """LRU of ``maxsize`` encoder outputs; concurrent misses of one payload encode once."""

    def __init__(self, maxsize: int = 256) -> None:
        if maxsize < 1:
            raise ValueError("EncoderCache maxsize must be >= 1")
        self.maxsize = maxsize  #: entries kept; the least recently used is dropped
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self.hits = 0  #: lookups served from the cache
        self.misses = 0  #: lookups that ran the encoder

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, payload: Any) -> bool:
        return payload_key(payload) in self._data

    def get(self, payload: Any) -> Any | None:
        key = payload_key(payload)
        if key in self._data:
            self._data.move_to_end(key)
            self.hits += 1
            return self._data[key]
        return None

    def put(self, payload: Any, value: Any) -> None:
        self._store(payload_key(payload), value)

    def _store(self, key: str, value: Any) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def _lookup(self, key: str) -> tuple[bool, Any]:
        """(True, the cached output) counted as a hit and made most recent; (False, None)."""
        if key not in self._data:
            return False, None
        self._data.move_to_end(key)
        self.hits += 1
        return True, self._data[key]

    def get_or_compute(self, payload: Any, encode: Callable[[Any], T]) -> T:
        """The cached output for ``payload``, or ``encode(payload)`` stored and returned."""
        key = payload_key(payload)
        found, value = self._lookup(key)
        if found:
            cached: T = value
            return cached
        self.misses += 1
        out = encode(payload)
        self._store(key, out)
        return out

    async def aget_or_compute(self, payload: Any, encode: Callable[[Any], Awaitable[T]]) -> T:
        """Async form; concurrent callers with the same payload share one ``encode``."""
        key = payload_key(payload)
        found, value = self._lookup(key)
        if found:
            cached: T = value
            return cached
        pending = self._pending.get(key)
        if pending is not None:
            self.hits += 1
            shared: T = await asyncio.shield(pending)
            return shared
        self.misses += 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            out = await encode(payload)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, nobody logs it as unhandled
            raise
        finally:
            self._pending.pop(key, None)
        fut.set_result(out)
        self._store(key, out)
        return out

    def clear(self) -> None:
        self._data.clear()

    def stats(self) -> dict[str, int]:
        """``statistics()`` (the name it had first)."""
        return self.statistics()

    def statistics(self) -> dict[str, int]:
        """``{"size", "maxsize", "hits", "misses"}``."""
        return {"size": len(self._data), "maxsize": self.maxsize, "hits": self.hits,
                "misses": self.misses}  # fmt: skip
