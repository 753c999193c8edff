"""The wire format of control messages: msgpack in a versioned envelope, big buffers out of band.

>>> import numpy as np
>>> frames = encode({"op": "frame", "seq": 3, "image": np.zeros((512, 512), "f4")})
>>> len(frames), len(frames[0]) < 200          # a small header + one out-of-band buffer
(2, True)
>>> decode(frames)["image"].shape
(512, 512)

A message is a list of frames::

    frame 0   b"OF" | version (1 byte) | msgpack([kind, n_buffers, body])
    frame 1.. raw buffers, each referenced by index from an ext value inside ``body``

``body`` is a tree of str / int / float / bool / None / list / dict plus three ext types:

    ====  ========  ===================================================================
    code  type      payload (msgpack)
    ====  ========  ===================================================================
    1     buffer    ``[frame index, nbytes]`` of an out-of-band bytes-like value
    2     ndarray   ``[dtype.str, shape, data]``; data is inline bytes or a frame index
    3     tensor    ``[dtype name, shape, data]``; data is inline bytes or a frame index
    4     tuple     the items, as a msgpack array (so tuples come back as tuples)
    5     pickle    a pickled object, only with ``encode(pickle=True)`` and decoded only
                    with ``decode(allow_pickle=True)`` (the worker protocol, once the
                    message's MAC held); with ``pickle=True`` a value nested deeper than
                    MAX_DEPTH rides as one pickle too
    6     bigint    an int outside msgpack's 64-bit range: its two's-complement bytes
    7     audio     ``[sample_rate, samples]`` of an ``of.Audio`` (samples: an ext 2)
    8     image     ``[pixels]`` of an ``of.Image`` (pixels: an ext 2)
    ====  ========  ===================================================================

Values of at least ``threshold`` bytes (64 KiB by default) travel as their own frame: ``encode``
hands out a memoryview of the value's memory (no copy; a non-contiguous array is made contiguous
first) and ``decode`` rebuilds the value over the received frame, again without a copy. So a
buffer passed to ``encode`` must not be written to until the message is sent, and what ``decode``
returns for a large value is a view of the frame: numpy arrays come back read-only, bytes-like
values as a read-only ``memoryview``, torch tensors share the frame's memory (``clone()`` before
writing in place). Small values are copied into the header and come back as ordinary ``bytes``,
arrays and tensors. Tuples come back as tuples, other sequences as lists; tensors come back on
the CPU, detached. ``of.Audio`` and ``of.Image`` come back as themselves around their array
(read-only like any big array unless ``owned``). Anything else is refused unless the sender
opts into ``pickle=True`` and the receiver into ``allow_pickle=True``: the runtime's own
worker protocol does both, because every process of one deployment runs the same code (bind
``tcp://`` only on a private network).

Decoding raises :class:`~omniflow.CodecError` and nothing else, whatever the input.
numpy and torch are imported only when a message carries their values.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

import msgpack  # type: ignore[import-untyped]

from omniflow._exceptions import CodecError
from omniflow._media import Audio, Image
from omniflow.transport._unpack import (
    EXT_AUDIO,
    EXT_BIGINT,
    EXT_BUFFER,
    EXT_IMAGE,
    EXT_NDARRAY,
    EXT_PICKLE,
    EXT_TENSOR,
    EXT_TUPLE,
    NO_OOB,
    NO_OOB_PICKLE,
    ExtHook,
    frame_view,
)

__all__ = [
    "MAGIC",
    "OOB_THRESHOLD",
    "VERSION",
    "Buffer",
    "Message",
    "decode",
    "decode_message",
    "encode",
]

#: The first two bytes of every header frame.
MAGIC = b"OF"
#: The wire version; bumped on any incompatible change of the envelope or the ext payloads.
VERSION = 1
#: Buffers of at least this many bytes travel out of band, as frames of their own.
OOB_THRESHOLD = 64 * 1024
#: Deepest nesting of lists and dicts that ``encode`` accepts (msgpack's own limit is 511).
MAX_DEPTH = 128

#: One frame of a message, as produced by ``encode`` or received from a transport (a
#: ``zmq.Frame`` works too: anything with the buffer protocol).
Buffer: TypeAlias = bytes | bytearray | memoryview

_PREFIX = MAGIC + bytes([VERSION])
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SCALARS = frozenset({str, int, float, bool, type(None)})
_KEY_TYPES = (str, int, float, bytes, type(None))
_BYTES_LIKE = (bytes, bytearray, memoryview)


class Message(NamedTuple):
    """A decoded message: its ``kind`` (set by the sender) and its ``body``."""

    kind: str
    body: Any


def encode(
    body: Any, *, kind: str = "msg", threshold: int = OOB_THRESHOLD, pickle: bool = False
) -> list[Buffer]:
    """Encode ``body`` as ``[header, *buffers]``; buffers are views of the caller's memory.

    >>> encode({"op": "ping"})
    [b'OF\\x01\\x93\\xa3msg\\x00\\x81\\xa2op\\xa4ping']

    Raises :class:`~omniflow.CodecError` naming the path of a value it cannot encode.
    """
    if not isinstance(kind, str):
        raise CodecError(f"message kind must be a str, got {type(kind).__name__}")
    # Fast path for small control messages: a body of plain msgpack types only (no tuples,
    # arrays, subclasses) packs in C in one call. Without ``pickle`` only a result of at most
    # MAX_DEPTH bytes is kept as is (every nesting level costs a byte, so it cannot be nested
    # deeper than the walker allows), a longer one only once its nesting was checked; with
    # ``pickle`` the walker would pickle what nests deeper, which decodes to the same value,
    # so the packed body is kept at any depth msgpack packs. Anything else takes the walker
    # below (out-of-band frames, precise errors).
    try:
        packed = _fast_pack([kind, 0, body])
    except (_NotPlain, ValueError, TypeError, OverflowError, BufferError):
        packed = None
    if (
        packed is not None
        and len(packed) < threshold
        and (pickle or len(packed) <= MAX_DEPTH or _shallow_plain(body))
    ):
        return [_PREFIX + packed]
    packer = _Packer(threshold, pickle)
    try:
        tree = packer.walk(body, 0)
        header = _PREFIX + msgpack.packb([kind, len(packer.buffers), tree], use_bin_type=True)
    except _Unsupported as exc:
        where = "".join(f"[{key!r}]" for key in reversed(exc.path))
        raise CodecError(f"cannot encode message{where}: {exc.reason}") from None
    except (ValueError, TypeError, OverflowError) as exc:  # msgpack: int too big, ...
        raise CodecError(f"cannot encode message: {exc}") from exc
    return [header, *packer.buffers]


def decode(frames: Sequence[Any], *, allow_pickle: bool = False, owned: bool = False) -> Any:
    """Decode the frames of one message into its body (see :func:`decode_message`)."""
    return decode_message(frames, allow_pickle=allow_pickle, owned=owned).body


def decode_message(
    frames: Sequence[Any], *, allow_pickle: bool = False, owned: bool = False
) -> Message:
    """Decode ``[header, *buffers]`` into a :class:`Message`, rebuilding big values zero-copy.

    ``owned=True`` copies big values out of the frames instead: arrays and tensors come back
    writable and bytes as ``bytes``, like the sender's values (the worker protocol does this,
    so a method gets the same kind of value in every placement).

    Raises :class:`~omniflow.CodecError` (and only that) for anything but a well-formed
    message of this wire version.
    """
    try:
        return _decode(frames, allow_pickle, owned)
    except CodecError:
        raise
    except Exception as exc:  # untrusted input: every failure is a CodecError
        raise CodecError(f"malformed message: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------- encoding


class _NotPlain(Exception):
    """Raised by the fast path's ``default`` hook: this body needs the walker."""


def _not_plain(obj: Any) -> Any:
    raise _NotPlain


#: Each thread's packer for the fast path (a Packer is not safe to share between threads;
#: making one per message costs more than the packing of a small one).
_PACKERS = threading.local()


def _fast_pack(obj: Any) -> bytes:
    """``obj`` packed as plain msgpack types only (``_NotPlain`` for anything else), with this
    thread's packer. It is taken while it packs: a nested call (a finalizer the garbage
    collector runs mid-pack that encodes too) makes a packer of its own."""
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = msgpack.Packer(use_bin_type=True, strict_types=True, default=_not_plain)
    _PACKERS.packer = None
    try:
        packed: bytes = packer.pack(obj)
    finally:
        _PACKERS.packer = packer
    return packed


def _shallow_plain(body: Any) -> bool:
    """Whether a body that msgpack packed as plain types (exact lists and dicts, no tuples)
    is what the walker would also pack as is: nested at most MAX_DEPTH - 2 levels under the
    envelope, and every dict key of a type the walker takes. Looks at containers only."""
    stack = [(body, 0)]
    limit = MAX_DEPTH - 2
    while stack:
        obj, depth = stack.pop()
        if type(obj) is list:
            if depth >= limit:
                return False
            stack.extend((v, depth + 1) for v in obj if type(v) is list or type(v) is dict)
        elif type(obj) is dict:
            if depth >= limit:
                return False
            for key, value in obj.items():
                if not isinstance(key, _KEY_TYPES):
                    return False
                if type(value) is list or type(value) is dict:
                    stack.append((value, depth + 1))
    return True


class _Unsupported(Exception):
    """A value ``encode`` cannot carry; ``path`` is filled in while unwinding."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path: list[Any] = []


class _Packer:
    """Walks a body once, replacing arrays and big buffers by ext values."""

    __slots__ = ("buffers", "pickle", "threshold")

    def __init__(self, threshold: int, pickle: bool = False) -> None:
        #: Out-of-band frames, in index order (frame i + 1 of the message).
        self.buffers: list[Buffer] = []
        #: Size from which a buffer leaves the header.
        self.threshold = threshold
        #: Pickle values of other types instead of refusing them.
        self.pickle = pickle

    def walk(self, obj: Any, depth: int) -> Any:
        cls = type(obj)
        if cls in _SCALARS:
            if cls is int and not _INT_MIN <= obj <= _INT_MAX:
                return _bigint(obj)
            return obj
        if depth >= MAX_DEPTH:
            if self.pickle:
                return self._pickled(obj)
            raise _Unsupported(f"nested deeper than {MAX_DEPTH} levels")
        if cls is dict or isinstance(obj, dict):
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                if not isinstance(key, _KEY_TYPES):
                    raise _Unsupported(f"dict key {key!r} is a {type(key).__name__}")
                try:
                    out[key] = self.walk(value, depth + 1)
                except _Unsupported as exc:
                    exc.path.append(key)
                    raise
            return out
        if cls is list or cls is tuple or (isinstance(obj, list | tuple) and not self.pickle):
            items = []
            for index, value in enumerate(obj):
                try:
                    items.append(self.walk(value, depth + 1))
                except _Unsupported as exc:
                    exc.path.append(index)
                    raise
            if cls is tuple:
                return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
            return items
        if isinstance(obj, _BYTES_LIKE):
            return self._bytes(obj)
        if cls is Audio or cls is Image:
            # Its array is always a frame of its own, whatever its size: media never ride
            # inside the header of a control message (contract §9).
            numpy = sys.modules["numpy"]  # an Audio or Image holds a numpy array
            if cls is Audio:
                fields = [obj.sample_rate, self._ndarray(obj.samples, numpy, oob=True)]
                return msgpack.ExtType(EXT_AUDIO, msgpack.packb(fields))
            pixels = self._ndarray(obj.pixels, numpy, oob=True)
            return msgpack.ExtType(EXT_IMAGE, msgpack.packb([pixels]))
        if isinstance(obj, (str, int, float)):  # subclasses: IntEnum, StrEnum, np.float64
            if isinstance(obj, int) and not _INT_MIN <= obj <= _INT_MAX:
                return self._pickled(obj) if self.pickle else _bigint(int(obj))
            return obj
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray):
                return self._ndarray(obj, np)
            if isinstance(obj, np.generic):
                return self.walk(obj.item(), depth + 1)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._tensor(obj, torch)
        if self.pickle:
            return self._pickled(obj)
        raise _Unsupported(f"values of type {cls.__module__}.{cls.__qualname__} are not supported")

    def _pickled(self, obj: Any) -> Any:
        import pickle as _pickle

        try:
            payload = _pickle.dumps(obj, protocol=5)
        except RecursionError:
            raise _Unsupported("nested too deeply to pickle") from None
        except Exception as exc:
            raise _Unsupported(f"cannot pickle {type(obj).__qualname__}: {exc}") from None
        return msgpack.ExtType(EXT_PICKLE, payload)

    def _out_of_band(self, view: memoryview) -> int:
        self.buffers.append(view)
        return len(self.buffers)

    def _bytes(self, obj: Buffer) -> Any:
        view = obj if isinstance(obj, memoryview) else memoryview(obj)
        if view.nbytes < self.threshold:
            return obj if type(obj) is bytes else view.tobytes()
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        elif view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        index = self._out_of_band(view)
        return msgpack.ExtType(EXT_BUFFER, msgpack.packb([index, view.nbytes]))

    def _ndarray(self, arr: Any, np: Any, oob: bool = False) -> Any:
        dtype = arr.dtype
        if dtype.hasobject or dtype.fields is not None:
            raise _Unsupported(f"numpy arrays of dtype {dtype} are not supported")
        shape = list(arr.shape)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        data: Any
        if arr.nbytes < self.threshold and not oob:
            data = arr.tobytes()
        else:
            data = self._out_of_band(memoryview(arr.reshape(-1).view(np.uint8)))
        return msgpack.ExtType(EXT_NDARRAY, msgpack.packb([dtype.str, shape, data]))

    def _tensor(self, tensor: Any, torch: Any) -> Any:
        if tensor.layout is not torch.strided or tensor.is_quantized:
            raise _Unsupported(f"torch tensors with layout {tensor.layout} are not supported")
        shape = list(tensor.shape)
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        data: Any
        if flat.numel() < self.threshold:
            data = flat.numpy().tobytes()
        else:
            data = self._out_of_band(memoryview(flat.numpy()))
        name = str(tensor.dtype).removeprefix("torch.")
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb([name, shape, data]))


def _bigint(n: int) -> Any:
    return msgpack.ExtType(EXT_BIGINT, n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True))


# --------------------------------------------------------------------------------- decoding


def unpack_small(frames: Sequence[Any], allow_pickle: bool = False) -> tuple[str, Any] | None:
    """(kind, body) of a one-frame message with no out-of-band buffers (a small control
    message as received), or None for any other shape (``decode_message`` takes those).
    Bytes msgpack cannot unpack raise what it raises: the caller, like ``decode_message``,
    treats any exception as a malformed message. The hot path's decoding, without a
    ``Message``."""
    if len(frames) != 1:
        return None
    first = frames[0]
    if (type(first) is not bytes and type(first) is not memoryview) or first[:3] != _PREFIX:
        return None
    unpacked = msgpack.unpackb(
        first[3:],
        ext_hook=NO_OOB_PICKLE if allow_pickle else NO_OOB,
        raw=False,
        strict_map_key=False,
    )
    if (
        type(unpacked) is list
        and len(unpacked) == 3
        and type(unpacked[0]) is str
        and unpacked[1] == 0
        and type(unpacked[1]) is int
    ):
        return unpacked[0], unpacked[2]
    return None


def _decode(frames: Sequence[Any], allow_pickle: bool = False, owned: bool = False) -> Message:
    small = unpack_small(frames, allow_pickle)
    if small is not None:
        return Message(*small)
    if len(frames) == 0:
        raise CodecError("empty message: no header frame")
    header = frame_view(frames[0])
    if header.nbytes < 3 or header[:2].tobytes() != MAGIC:
        raise CodecError("not an omniflow message: the header does not start with b'OF'")
    if header[2] != VERSION:
        raise CodecError(
            f"wire version {header[2]} is not supported (this omniflow speaks version "
            f"{VERSION}); run the same omniflow version in every process"
        )
    oob = [frame_view(frame) for frame in frames[1:]]
    unpacked = msgpack.unpackb(
        header[3:],
        ext_hook=ExtHook(oob, allow_pickle, owned),
        raw=False,
        strict_map_key=False,
        use_list=True,
    )
    if not (isinstance(unpacked, list) and len(unpacked) == 3):
        raise CodecError("malformed envelope: expected [kind, n_buffers, body]")
    kind, n_buffers, body = unpacked
    if not isinstance(kind, str):
        raise CodecError(f"malformed envelope: kind is a {type(kind).__name__}, not a str")
    if n_buffers != len(oob) or type(n_buffers) is not int:
        raise CodecError(
            f"truncated or padded message: the header announces {n_buffers!r} buffer frames, "
            f"{len(oob)} arrived"
        )
    return Message(kind, body)
