"""JSON values over HTTP: what a frame or an input may hold, and how it is written.

>>> dumps({"image": b"\\x89PNG"})
b'{"image":{"$bytes":"iVBORw=="}}'
>>> loads(b'{"image": {"$bytes": "iVBORw=="}}')
{'image': b'\\x89PNG'}

JSON types (str, int, float, bool, None, list, dict with str keys; tuples become lists) travel
as themselves. Three more kinds of value travel as a one-key object, in both directions (frame
values the server sends, and call inputs it receives), and so do media values (``of.Audio`` as
``{"$audio": ...}``, ``of.Image`` as ``{"$image": ...}``: ``_media_json``, whose ``encode``
:func:`dumps` calls and whose ``decode_tree`` the call endpoint runs on a request's inputs):

    ======================  ===============================================================
    Python value            JSON
    ======================  ===============================================================
    bytes, bytearray,       ``{"$bytes": "<base64>"}`` (decoded as ``bytes``)
    memoryview
    numpy.ndarray,          ``{"$tensor": {"dtype": "float32", "shape": [2, 3],
    torch.Tensor              "data": "<base64 of the little-endian, C-order elements>"}}``
                            (decoded as a writable numpy array; dtypes numpy lacks, such as
                            ``bfloat16``, decode as a torch tensor and need torch installed)
    numpy scalar            its Python number (``np.float32(1.5)`` -> ``1.5``)
    ======================  ===============================================================

``dtype`` is a numpy dtype name (``"uint8"``, ``"float16"``, ``"int64"``, ``"bool"``,
``"complex64"``; numpy's ``"<f4"`` spelling is accepted on input) or a torch-only dtype name
(``"bfloat16"``, ``"float8_e4m3fn"``...). A JSON object whose only key is ``$bytes`` or
``$tensor`` is always read as such a value. torch is never imported to encode (a tensor can only
exist once torch is imported) and only imported to decode a torch-only dtype; numpy is imported
only to decode a ``$tensor``.

Anything else — a set, an object, NaN or an infinity, a string with lone surrogates, an array
of Python objects — cannot be written: :func:`dumps` raises :class:`ValueEncodingError`, which
the server turns into an entry of the call's error list (the frame is dropped, the call goes
on, its status becomes ``"error"``), never into a 500.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from typing import Any

from omniflow._exceptions import OmniflowError
from omniflow.serve import _media_json

__all__ = ["ValueDecodingError", "ValueEncodingError", "dumps", "loads"]

#: numpy dtype kinds that travel as $tensor: bool, signed, unsigned, float, complex.
_NUMERIC_KINDS = frozenset("biufc")


class ValueEncodingError(OmniflowError, TypeError):
    """A value has no JSON form (see the module docstring for what has one)."""


class ValueDecodingError(OmniflowError, ValueError):
    """A request body is not JSON, or holds a malformed ``$bytes`` / ``$tensor`` value."""


# -- encoding ------------------------------------------------------------------------------


def _b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(data).decode("ascii")


def _numpy_tensor(a: Any) -> dict[str, Any]:
    np = sys.modules["numpy"]
    if a.dtype.kind not in _NUMERIC_KINDS:
        raise ValueEncodingError(
            f"a numpy array of dtype {a.dtype} has no JSON form; only bool and numeric "
            "dtypes travel as $tensor (convert it with .tolist() if it holds plain values)"
        )
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)  # (not for 0-d arrays: it would make them 1-d)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return {"$tensor": {"dtype": a.dtype.name, "shape": list(a.shape), "data": _b64(a.data)}}


def _torch_tensor(t: Any) -> dict[str, Any]:
    torch = sys.modules["torch"]
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    try:
        return _numpy_tensor(t.numpy())
    except TypeError:  # bfloat16, float8...: numpy has no such dtype; ship the raw bytes
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return {"$tensor": {"dtype": name, "shape": list(t.shape), "data": _b64(raw.data)}}


def _default(o: Any) -> Any:
    """``json``'s hook for the values it cannot write itself."""
    if isinstance(o, bytes | bytearray | memoryview):
        return {"$bytes": _b64(o)}
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(o, np.ndarray):
            return _numpy_tensor(o)
        if isinstance(o, np.generic):
            return o.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(o, torch.Tensor):
        return _torch_tensor(o)
    tagged = _media_json.encode(o)
    if tagged is not None:
        return tagged
    raise ValueEncodingError(
        f"a value of type '{type(o).__module__}.{type(o).__qualname__}' has no JSON form; "
        "produce JSON types, bytes, a numpy array / torch tensor, or an of.Audio / of.Image"
    )


_ENCODER = json.JSONEncoder(
    default=_default, allow_nan=False, ensure_ascii=False, separators=(",", ":")
)


def dumps(value: Any) -> bytes:
    """The compact UTF-8 JSON of ``value``; raises ValueEncodingError when it has none."""
    if type(value) is int:  # a token id, a count: the common frame value, no encoder call
        return b"%d" % value
    try:
        return _ENCODER.encode(value).encode("utf-8")
    except ValueEncodingError:
        raise
    except (TypeError, ValueError, RecursionError) as exc:
        # TypeError: a dict key that is not str/int/float/bool/None; ValueError: NaN or
        # infinity; UnicodeEncodeError (a ValueError): a lone surrogate in a str.
        raise ValueEncodingError(f"value has no JSON form: {exc}") from exc


# -- decoding ------------------------------------------------------------------------------


def _unb64(text: Any, what: str) -> bytearray:
    if not isinstance(text, str):
        raise ValueDecodingError(f"{what} must be a base64 string, got {type(text).__name__}")
    try:
        return bytearray(base64.b64decode(text, validate=True))
    except binascii.Error as exc:
        raise ValueDecodingError(f"{what} is not valid base64: {exc}") from exc


def _decode_tensor(spec: Any) -> Any:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data"}:
        raise ValueDecodingError(
            '$tensor must be {"dtype": str, "shape": [int, ...], "data": base64 str}'
        )
    dtype, shape = spec["dtype"], spec["shape"]
    if not isinstance(dtype, str):
        raise ValueDecodingError(f"$tensor dtype must be a str, got {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueDecodingError(f"$tensor shape must be a list of ints >= 0, got {shape!r}")
    data = _unb64(spec["data"], "$tensor data")
    count = math.prod(shape)
    try:
        import numpy as np
    except ImportError as exc:  # pragma: no cover - numpy is everywhere we test
        raise ValueDecodingError("decoding a $tensor needs numpy installed") from exc
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None:
        if dt.kind not in _NUMERIC_KINDS:
            raise ValueDecodingError(f"$tensor dtype {dtype!r} is not a bool or numeric dtype")
        dt = dt.newbyteorder("<")
        if len(data) != count * dt.itemsize:
            raise ValueDecodingError(
                f"$tensor data holds {len(data)} bytes; shape {shape} of {dtype} needs "
                f"{count * dt.itemsize}"
            )
        return np.frombuffer(data, dtype=dt).reshape(shape)
    return _decode_torch(dtype, shape, data, count)


def _decode_torch(dtype: str, shape: list[int], data: bytearray, count: int) -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ValueDecodingError(
            f"$tensor dtype {dtype!r} is not a numpy dtype; decoding it needs torch installed"
        ) from exc
    tdt = getattr(torch, dtype, None)
    if not isinstance(tdt, torch.dtype):
        raise ValueDecodingError(f"$tensor dtype {dtype!r} is neither a numpy nor a torch dtype")
    size = tdt.itemsize
    if len(data) != count * size:
        raise ValueDecodingError(
            f"$tensor data holds {len(data)} bytes; shape {shape} of {dtype} needs {count * size}"
        )
    if count == 0:
        return torch.empty(shape, dtype=tdt)
    return torch.frombuffer(data, dtype=tdt).reshape(shape)


def _object_hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1:
        if "$bytes" in obj:
            return bytes(_unb64(obj["$bytes"], "$bytes"))
        if "$tensor" in obj:
            return _decode_tensor(obj["$tensor"])
    return obj


def _no_constant(name: str) -> Any:
    raise ValueDecodingError(
        f"{name} is not JSON (RFC 8259 has no NaN or infinities); send a finite number or null"
    )


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueDecodingError(f"number {text[:40]} overflows a float; send a finite number")
    return x


def loads(data: bytes | str) -> Any:
    """Parse JSON, turning ``$bytes`` / ``$tensor`` objects into values; ValueDecodingError.

    ``NaN``, ``Infinity``, ``-Infinity`` (which Python's json accepts) and numbers that overflow
    a float (``1e400``) are rejected: they are not JSON, and no other client could send them.
    """
    try:
        return json.loads(
            data,
            object_hook=_object_hook,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except ValueDecodingError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8
        raise ValueDecodingError(f"not valid JSON: {exc}") from exc
