"""Values back from the codec's msgpack ext types (``_codec``'s table of codes).

``ExtHook`` is the ``ext_hook`` msgpack calls for each ext value of a received header: it
rebuilds buffers over the received frames, arrays and tensors, tuples, big ints, ``of.Audio``
and ``of.Image``, and pickles only where the endpoint allows them. It raises CodecError for
anything malformed; numpy and torch are imported only when a message carries their values.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import msgpack  # type: ignore[import-untyped]

from omniflow._exceptions import CodecError
from omniflow._media import Audio, Image

__all__ = ["NO_OOB", "NO_OOB_PICKLE", "ExtHook", "frame_view"]

#: The ext type codes (the table in ``_codec``'s docstring).
EXT_BUFFER = 1
EXT_NDARRAY = 2
EXT_TENSOR = 3
EXT_TUPLE = 4
EXT_PICKLE = 5
EXT_BIGINT = 6
EXT_AUDIO = 7
EXT_IMAGE = 8


def frame_view(frame: Any) -> memoryview:
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view.toreadonly()


class ExtHook:
    """msgpack ext_hook that resolves frame indices against the received frames."""

    __slots__ = ("allow_pickle", "frames", "owned")

    def __init__(
        self, frames: list[memoryview], allow_pickle: bool = False, owned: bool = False
    ) -> None:
        self.frames = frames
        self.allow_pickle = allow_pickle
        self.owned = owned

    def __call__(self, code: int, payload: bytes) -> Any:
        if code == EXT_BUFFER:
            fields = msgpack.unpackb(payload)
            if not (isinstance(fields, list) and len(fields) == 2):
                raise CodecError("malformed buffer: expected [frame index, nbytes]")
            data = self._data(fields[0], fields[1], "buffer")
            return bytes(data) if self.owned else data
        if code == EXT_NDARRAY:
            return self._ndarray(*self._array_payload(payload, "ndarray"))
        if code == EXT_TENSOR:
            return self._tensor(*self._array_payload(payload, "tensor"))
        if code == EXT_TUPLE:
            items = msgpack.unpackb(payload, ext_hook=self, raw=False, strict_map_key=False)
            if not isinstance(items, list):
                raise CodecError("malformed tuple: expected an array")
            return tuple(items)
        if code == EXT_PICKLE:
            if not self.allow_pickle:
                raise CodecError("pickled values are refused on this endpoint")
            import pickle as _pickle

            return _pickle.loads(payload)
        if code in (EXT_AUDIO, EXT_IMAGE):
            return self._media(code, payload)
        if code == EXT_BIGINT:
            if not payload:
                raise CodecError("malformed bigint: no bytes")
            return int.from_bytes(payload, "big", signed=True)
        raise CodecError(f"unknown ext type {code}")

    def _media(self, code: int, payload: bytes) -> Any:
        fields = msgpack.unpackb(payload, ext_hook=self, raw=False)
        if code == EXT_AUDIO:
            if not (isinstance(fields, list) and len(fields) == 2 and type(fields[0]) is int):
                raise CodecError("malformed audio: expected [sample_rate, samples]")
            return Audio(fields[1], sample_rate=fields[0])  # a bad one: MediaError -> CodecError
        if not (isinstance(fields, list) and len(fields) == 1):
            raise CodecError("malformed image: expected [pixels]")
        return Image(fields[0])

    def _frame(self, index: Any) -> memoryview:
        if type(index) is not int or not 1 <= index <= len(self.frames):
            raise CodecError(
                f"buffer reference {index!r} names no frame (the message has "
                f"{len(self.frames)} buffer frames)"
            )
        return self.frames[index - 1]

    def _array_payload(self, payload: bytes, what: str) -> tuple[str, list[int], Any]:
        fields = msgpack.unpackb(payload, raw=False)
        if not (isinstance(fields, list) and len(fields) == 3):
            raise CodecError(f"malformed {what}: expected [dtype, shape, data]")
        dtype, shape, data = fields
        if not isinstance(dtype, str):
            raise CodecError(f"malformed {what}: dtype is not a str")
        if (
            not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape))
            or len(shape) > 64
        ):
            raise CodecError(f"malformed {what}: shape {shape!r} is not a list of sizes")
        if not isinstance(data, bytes | int):
            raise CodecError(f"malformed {what}: data is neither bytes nor a frame index")
        return dtype, shape, data

    def _ndarray(self, dtype_str: str, shape: list[int], data: bytes | int) -> Any:
        np = _require("numpy")
        dtype = np.dtype(dtype_str)
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype or not dtype.itemsize:
            raise CodecError(f"malformed ndarray: dtype {dtype_str!r} is not allowed")
        buf = self._data(data, math.prod(shape) * dtype.itemsize, "ndarray")
        if isinstance(buf, bytes) or self.owned:  # small (or asked): an owned, writable copy
            return np.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        arr.flags.writeable = False
        return arr

    def _tensor(self, dtype_name: str, shape: list[int], data: bytes | int) -> Any:
        torch = _require("torch")
        dtype = _torch_dtypes(torch).get(dtype_name)
        if dtype is None:
            raise CodecError(f"malformed tensor: unknown torch dtype {dtype_name!r}")
        buf = self._data(data, math.prod(shape) * dtype.itemsize, "tensor")
        if len(buf) == 0:
            return torch.empty(shape, dtype=dtype)
        if isinstance(buf, bytes) or self.owned:  # small (or asked): an owned, writable copy
            flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        else:
            with warnings.catch_warnings():
                # The frame is read-only memory; torch has no read-only tensors and says so.
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)

    def _data(self, data: bytes | int, nbytes: int, what: str) -> bytes | memoryview:
        buf = self._frame(data) if isinstance(data, int) else data
        if type(nbytes) is not int:
            raise CodecError(f"malformed {what}: size {nbytes!r} is not an int")
        if len(buf) != nbytes:
            raise CodecError(
                f"malformed {what}: {len(buf)} data bytes where {nbytes} were announced"
            )
        return buf


#: Hooks for messages without out-of-band frames (reused: they hold no per-message state).
NO_OOB = ExtHook([], False)
NO_OOB_PICKLE = ExtHook([], True)


def _require(module: str) -> Any:
    if module in sys.modules:
        return sys.modules[module]
    try:
        return __import__(module)
    except ImportError as exc:
        raise CodecError(
            f"the message carries a {module} value but {module} is not installed here"
        ) from exc


_TORCH_DTYPES: dict[str, Any] = {}


def _torch_dtypes(torch: Any) -> dict[str, Any]:
    if not _TORCH_DTYPES:
        for value in vars(torch).values():
            if isinstance(value, torch.dtype):
                _TORCH_DTYPES[str(value).removeprefix("torch.")] = value
    return _TORCH_DTYPES
