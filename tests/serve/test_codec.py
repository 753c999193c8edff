"""The JSON value encoding: bytes, numpy arrays, torch tensors, and what has no JSON form."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from omniflow.serve import ValueDecodingError, ValueEncodingError, dumps, loads


def roundtrip(value: Any) -> Any:
    return loads(dumps(value))


def test_json_types_are_themselves() -> None:
    value = {"s": "héllo ✓", "i": 3, "f": 1.5, "b": True, "n": None, "l": [1, [2]], "t": (1, 2)}
    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    assert roundtrip(value) == {**value, "t": [1, 2]}


def test_bytes() -> None:
    assert dumps(b"\x00\xff") == b'{"$bytes":"AP8="}'
    for v in (b"", b"\x00\xff" * 1000, bytearray(b"ab"), memoryview(b"cd")):
        out = roundtrip(v)
        assert isinstance(out, bytes)
        assert out == bytes(v)


@pytest.mark.parametrize(
    "dtype", ["uint8", "int16", "int64", "float16", "float32", "float64", "bool", "complex64"]
)
def test_numpy_roundtrip(dtype: str) -> None:
    a = (np.arange(24) % 5).astype(dtype).reshape(2, 3, 4)
    spec = json.loads(dumps(a))["$tensor"]
    assert (spec["dtype"], spec["shape"]) == (dtype, [2, 3, 4])
    out = roundtrip(a)
    assert out.dtype == a.dtype
    np.testing.assert_array_equal(out, a)
    assert out.flags.writeable


def test_numpy_layouts_scalars_and_byte_order() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(roundtrip(a.T), a.T)  # non-contiguous
    np.testing.assert_array_equal(roundtrip(a[:, ::2]), a[:, ::2])
    big = np.arange(4, dtype=">i4")
    spec = json.loads(dumps(big))["$tensor"]
    assert spec["dtype"] == "int32"
    assert base64.b64decode(spec["data"]) == np.arange(4, dtype="<i4").tobytes()
    zero_d = roundtrip(np.array(7, dtype=np.int32))
    assert zero_d.shape == ()
    assert int(zero_d) == 7
    assert roundtrip(np.zeros((0, 3), np.float32)).shape == (0, 3)
    assert roundtrip({"x": np.float32(1.5), "y": np.int64(3), "z": np.bool_(True)}) == {
        "x": 1.5,
        "y": 3,
        "z": True,
    }


def test_numpy_dtype_spelling_is_accepted_on_input() -> None:
    data = base64.b64encode(np.array([1.0, 2.0], "<f4").tobytes()).decode()
    out = loads(json.dumps({"$tensor": {"dtype": "<f4", "shape": [2], "data": data}}))
    np.testing.assert_array_equal(out, np.array([1.0, 2.0], np.float32))


def test_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = roundtrip(t)
    assert isinstance(out, np.ndarray)  # $tensor decodes to numpy when numpy has the dtype
    np.testing.assert_array_equal(out, t.numpy())
    np.testing.assert_array_equal(roundtrip(t.T), t.T.numpy())
    np.testing.assert_array_equal(roundtrip(t.requires_grad_()), t.detach().numpy())
    bf = torch.tensor([[1.0, -2.5], [3.0, 0.5]], dtype=torch.bfloat16)
    spec = json.loads(dumps(bf))["$tensor"]
    assert (spec["dtype"], spec["shape"]) == ("bfloat16", [2, 2])
    back = roundtrip(bf)
    assert isinstance(back, torch.Tensor)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, bf)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({1, 2}, "builtins.set"),
        (object(), "builtins.object"),
        ([float("nan")], "Out of range float"),
        ({"k": float("inf")}, "Out of range float"),
        ("\ud800", "surrogate"),
        (np.array(["a", "b"]), "dtype <U1"),
        (np.array([{}, 1], dtype=object), "dtype object"),
        ({(1, 2): 3}, "keys must be"),
    ],
)
def test_values_without_json_form(value: Any, needle: str) -> None:
    with pytest.raises(ValueEncodingError, match=needle):
        dumps(value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ('{"$bytes": 3}', "base64 string"),
        ('{"$bytes": "@@@"}', "not valid base64"),
        ('{"$tensor": [1]}', '"dtype": str'),
        ('{"$tensor": {"dtype": "float32", "shape": [2]}}', '"dtype": str'),
        ('{"$tensor": {"dtype": "float32", "shape": [2], "data": "AAAA"}}', "needs 8"),
        ('{"$tensor": {"dtype": "float32", "shape": [-1], "data": ""}}', "ints >= 0"),
        ('{"$tensor": {"dtype": "float32", "shape": "2", "data": ""}}', "ints >= 0"),
        ('{"$tensor": {"dtype": "object", "shape": [0], "data": ""}}', "not a bool or numeric"),
        ('{"$tensor": {"dtype": "nonsense", "shape": [0], "data": ""}}', "neither a numpy"),
        ('{"$tensor": {"dtype": 3, "shape": [0], "data": ""}}', "dtype must be a str"),
    ],
)
def test_malformed_inputs(text: str | bytes, needle: str) -> None:
    with pytest.raises(ValueDecodingError, match=needle):
        loads(text)


def test_markers_only_with_a_single_key() -> None:
    assert loads('{"$bytes": "AP8=", "x": 1}') == {"$bytes": "AP8=", "x": 1}
    assert loads('[{"$bytes": "AP8="}]') == [b"\x00\xff"]
