from __future__ import annotations

import contextlib
import enum
import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniflow import TransportError
from omniflow.transport import OOB_THRESHOLD, CodecError, Message, decode, decode_message, encode
from omniflow.transport._codec import MAGIC, MAX_DEPTH, VERSION

# --------------------------------------------------------------------------- plain messages

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
trees = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=5)
    ),
    max_leaves=30,
)


@given(trees, st.text(min_size=1, max_size=10))
def test_nested_messages_round_trip(body: Any, kind: str) -> None:
    frames = encode(body, kind=kind)
    assert len(frames) == 1
    assert decode_message(frames) == Message(kind, body)


def test_tuples_come_back_as_tuples_and_enums_as_values() -> None:
    class Op(enum.IntEnum):
        CALL = 3

    got = decode(encode({"t": (1, (2, [3, (4,)])), "l": [1], "op": Op.CALL}))
    assert got == {"t": (1, (2, [3, (4,)])), "l": [1], "op": 3}
    assert type(got["t"]) is tuple and type(got["t"][1][1]) is list


class _Point:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Point) and other.x == self.x


def test_other_objects_need_pickle_on_both_sides() -> None:
    body = {"p": _Point(3), "s": {1, 2}, "nested": (_Point(4), np.zeros(2))}
    with pytest.raises(CodecError, match="not supported"):
        encode(body)
    frames = encode(body, pickle=True)
    with pytest.raises(CodecError, match="pickled values are refused"):
        decode(frames)
    got = decode(frames, allow_pickle=True)
    assert got["p"] == _Point(3) and got["s"] == {1, 2} and got["nested"][0] == _Point(4)
    assert isinstance(got["nested"], tuple)


def test_header_is_magic_version_then_msgpack() -> None:
    [header] = encode({"op": "ping"}, kind="ctl")
    assert header[:3] == MAGIC + bytes([VERSION])
    assert msgpack.unpackb(header[3:]) == ["ctl", 0, {"op": "ping"}]


def test_numpy_scalars_become_python_values() -> None:
    body = {"f": np.float32(1.5), "i": np.int64(-3), "b": np.bool_(True), "u": np.uint8(7)}
    assert decode(encode(body)) == {"f": 1.5, "i": -3, "b": True, "u": 7}


# ------------------------------------------------------------------------------ bytes-like


@pytest.mark.parametrize("size", [0, 10, OOB_THRESHOLD - 1, OOB_THRESHOLD, 3 * OOB_THRESHOLD])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_bytes_like_inline_or_out_of_band(size: int, kind: type) -> None:
    raw = bytes(range(256)) * (size // 256) + bytes(size % 256)
    value = kind(raw) if kind is not memoryview else memoryview(bytearray(raw))
    frames = encode({"blob": value})
    out = decode(frames)["blob"]
    if size < OOB_THRESHOLD:
        assert len(frames) == 1
        assert type(out) is bytes and out == raw
    else:
        assert len(frames) == 2 and len(frames[0]) < 64
        assert isinstance(out, memoryview) and out.readonly and out == raw


def test_out_of_band_bytes_are_views_of_the_sender_memory() -> None:
    blob = bytearray(b"x" * OOB_THRESHOLD)
    frames = encode([blob])
    assert isinstance(frames[1], memoryview) and frames[1].obj is blob  # no copy on send
    out = decode(frames)[0]
    blob[0] = ord("y")  # only to prove it is a view; real senders must not do this
    assert out[0] == ord("y")


def test_non_contiguous_memoryview_is_made_contiguous() -> None:
    base = bytearray(range(200)) * 1000
    view = memoryview(base)[::2]
    assert bytes(decode(encode(view))) == bytes(base[::2])
    assert decode(encode(view[:10])) == bytes(base[:20:2])


# ------------------------------------------------------------------------------ numpy


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    big = rng.standard_normal((256, 300))  # 600 KiB: out of band
    return [
        np.array(3.5, dtype=np.float32),
        np.arange(10, dtype=np.int8),
        np.arange(12, dtype=">i4").reshape(3, 4),
        np.array([1.5, np.nan, -np.inf], dtype=np.float16),
        np.array([[1 + 2j, 3 - 4j]], dtype=np.complex128),
        np.array([True, False, True]),
        np.array(["a", "bcd"]),
        np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[ns]"),
        np.zeros((0, 5), dtype=np.uint16),
        np.zeros((3, 0, 2)),
        big,
        big.T,  # non-contiguous, out of band
        big[::3, 1::7],  # strided
        big[::-1],  # negative strides
        np.asfortranarray(big[:10, :10]),
        np.arange(24, dtype=np.uint64).reshape(2, 3, 4).transpose(2, 0, 1),
        np.broadcast_to(np.arange(4.0), (1000, 4)),  # zero strides, 32 KB
        rng.integers(0, 255, size=(512, 512, 3), dtype=np.uint8),
    ]


@pytest.mark.parametrize("arr", _arrays(), ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_numpy_round_trip_is_bit_identical(arr: np.ndarray) -> None:
    out = decode(encode({"x": arr}))["x"]
    assert out.dtype == arr.dtype
    assert out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()
    assert out.flags.c_contiguous


def test_big_array_travels_out_of_band_zero_copy() -> None:
    arr = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    frames = encode({"op": "frame", "x": arr, "y": arr[:10]})
    assert len(frames) == 2
    assert len(frames[0]) < 200  # header: small, whatever the payload
    assert memoryview(frames[1]).nbytes == arr.nbytes
    out = decode(frames)
    assert np.shares_memory(out["x"], arr)  # in-process: the very same memory
    assert not out["x"].flags.writeable
    assert out["y"].flags.writeable and not np.shares_memory(out["y"], arr)  # small: a copy


def test_array_from_received_bytes_frames_is_a_view() -> None:
    arr = np.arange(100_000, dtype=np.int64)
    frames = [bytes(f) for f in encode(arr)]  # what a copying transport delivers
    out = decode(frames)
    assert np.array_equal(out, arr)
    assert out.base is not None and not out.flags.owndata


def test_threshold_is_configurable() -> None:
    arr = np.arange(100, dtype=np.int64)
    assert len(encode(arr, threshold=100)) == 2
    assert len(encode(arr)) == 1


@pytest.mark.parametrize(
    "arr",
    [np.array([object()]), np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])],
    ids=["object", "structured"],
)
def test_unsupported_dtypes_are_codec_errors(arr: np.ndarray) -> None:
    with pytest.raises(CodecError, match=r"\['a'\]: numpy arrays of dtype"):
        encode({"a": arr})


def test_unsupported_values_name_their_path() -> None:
    with pytest.raises(CodecError, match=r"message\['calls'\]\[1\]\['x'\]: .*object"):
        encode({"calls": [{}, {"x": object()}]})
    with pytest.raises(CodecError, match="dict key"):
        encode({(1, 2): "tuple keys do not survive msgpack"})
    with pytest.raises(CodecError, match="kind must be a str"):
        encode({}, kind=1)  # type: ignore[arg-type]


def test_depth_limit() -> None:
    deep: Any = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(CodecError, match="nested deeper"):
        encode(deep)
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(CodecError, match="nested deeper"):
        encode(cyclic)


@pytest.mark.parametrize("n", [2**64, -(2**63) - 1, 2**200, -(2**200), 2**64 - 1, -(2**63)])
def test_ints_beyond_64_bits_round_trip(n: int) -> None:
    assert decode(encode({"n": n, "l": [n, (n,)]})) == {"n": n, "l": [n, (n,)]}


@pytest.mark.parametrize("depth", [MAX_DEPTH - 3, MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH])
def test_long_plain_bodies_near_the_depth_limit_encode_as_the_walker_would(depth: int) -> None:
    """Over 128 bytes the one-call path checks nesting itself: what it takes round-trips, and
    what nests too deep is still refused (or pickled), never packed past the decoder's limit."""
    deep: Any = ["x" * 200]  # long: the byte count alone no longer bounds the depth
    for _ in range(depth):
        deep = [deep]
    body = {"k": deep, "s": "y" * 100}
    if depth + 2 <= MAX_DEPTH:
        assert decode(encode(body)) == body
    else:
        with pytest.raises(CodecError, match="deeper"):
            encode(body)
        assert decode(encode(body, pickle=True), allow_pickle=True) == body
    assert len(encode({"long": "z" * 500, "l": [[1, 2], {"a": [3]}]})) == 1


def test_nesting_deeper_than_the_walker_needs_pickle() -> None:
    deep: list[Any] = []
    cur = deep
    for _ in range(200):
        cur.append([])
        cur = cur[0]
    with pytest.raises(CodecError, match="deeper"):
        encode(deep)
    assert decode(encode(deep, pickle=True), allow_pickle=True) == deep


def test_owned_decoding_gives_writable_arrays_and_bytes() -> None:
    arr = np.arange(100_000, dtype="f8")
    frames = encode({"a": arr, "b": b"x" * 100_000})
    out = decode(frames, owned=True)
    assert out["a"].flags.writeable and not np.shares_memory(out["a"], arr)
    assert type(out["b"]) is bytes and out["b"] == b"x" * 100_000


def test_codec_error_is_a_transport_error_and_pickles() -> None:
    try:
        decode([b"nope"])
    except CodecError as exc:
        assert isinstance(exc, TransportError)
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is CodecError and str(again) == str(exc)
    else:
        pytest.fail("no CodecError")


# ------------------------------------------------------------------------------ torch


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "complex64"]
)
@pytest.mark.parametrize("shape", [(), (0, 3), (7, 5), (300, 200)])
def test_torch_round_trip(torch: Any, dtype: str, shape: tuple[int, ...]) -> None:
    t = (torch.arange(int(np.prod(shape))).reshape(shape) % 7).to(getattr(torch, dtype))
    out = decode(encode({"t": t}))["t"]
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_torch_non_contiguous_and_grad(torch: Any) -> None:
    t = torch.randn(400, 300, requires_grad=True)
    view = t.T[::2]
    frames = encode(view)
    assert len(frames) == 2 and len(frames[0]) < 100
    out = decode(frames)
    assert out.is_contiguous() and not out.requires_grad
    assert torch.equal(out, view.detach())


def test_torch_out_of_band_is_zero_copy(torch: Any) -> None:
    t = torch.ones(1 << 18)  # 1 MiB
    frames = encode(t)
    out = decode(frames)
    assert out.data_ptr() == t.data_ptr()
    small = torch.ones(10)
    assert decode(encode(small)).data_ptr() != small.data_ptr()


# ------------------------------------------------------------------------------ malformed input


def _ext(code: int, fields: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(fields))


def _message(body: Any, n_buffers: int = 0, *, kind: Any = "msg") -> bytes:
    return MAGIC + bytes([VERSION]) + msgpack.packb([kind, n_buffers, body])


def _assert_only_codec_error(frames: list[Any]) -> None:
    with contextlib.suppress(CodecError):
        decode(frames)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.lists(st.binary(max_size=50), max_size=3))
def test_fuzz_random_bytes(header: bytes, rest: list[bytes]) -> None:
    _assert_only_codec_error([header, *rest])
    _assert_only_codec_error([MAGIC + bytes([VERSION]) + header, *rest])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    code=st.integers(0, 127),
    payload=st.binary(max_size=64)
    | st.builds(
        msgpack.packb,
        st.lists(
            st.text(max_size=8)
            | st.integers(-3, 2**40)
            | st.binary(max_size=16)
            | st.none()
            | st.lists(st.integers(-2, 2**62), max_size=4),
            max_size=4,
        ),
    ),
    frames=st.lists(st.binary(max_size=64), max_size=2),
)
def test_fuzz_ext_payloads(code: int, payload: bytes, frames: list[bytes]) -> None:
    header = _message({"x": msgpack.ExtType(code, payload)}, len(frames))
    _assert_only_codec_error([header, *frames])


@settings(max_examples=200)
@given(
    dtype=st.sampled_from(["<f4", "O", "|O", "V0", "V8", "(2,)i4", "i4,f8", "<U0", "zz", "S0"])
    | st.text(max_size=6),
    shape=st.lists(st.integers(-1, 2**40), max_size=4)
    | st.integers(-(2**63), 2**63)
    | st.text(max_size=3),
    data=st.binary(max_size=64) | st.integers(-1, 3),
    code=st.sampled_from([2, 3]),
)
def test_fuzz_array_headers(dtype: str, shape: Any, data: Any, code: int) -> None:
    frames: list[Any] = [_message(_ext(code, [dtype, shape, data]), 1), b"\x00" * 16]
    _assert_only_codec_error(frames)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no header"),
        ([b""], "not an omniflow message"),
        ([b"OF"], "not an omniflow message"),
        ([b"XY\x01\x90"], "not an omniflow message"),
        ([MAGIC + bytes([VERSION + 1]) + msgpack.packb(["msg", 0, None])], "wire version 2"),
        ([MAGIC + bytes([0])], "wire version 0"),
        ([_message(None)[:-1] + b"\xc1"], "malformed message"),
        ([MAGIC + bytes([VERSION]) + msgpack.packb({"not": "a list"})], "envelope"),
        ([_message(None, kind=3)], "kind is a int"),
        ([_message(None, 2), b"x"], "announces 2 buffer frames, 1 arrived"),
        ([_message(None, 0), b"x"], "announces 0 buffer frames, 1 arrived"),
        ([_message(_ext(1, [2, 1]), 1), b"x"], "names no frame"),
        ([_message(_ext(1, [0, 1]), 1), b"x"], "names no frame"),
        ([_message(_ext(1, [1, 2]), 1), b"x"], "1 data bytes where 2 were announced"),
        ([_message(_ext(1, 1), 1), b"x"], r"expected \[frame index, nbytes\]"),
        ([_message(msgpack.ExtType(9, b""))], "unknown ext type 9"),
        ([_message(_ext(2, ["<f4", [2], b"\x00" * 7]))], "7 data bytes where 8 were announced"),
        ([_message(_ext(2, ["<f4", [3], 1]), 1), b"\x00" * 8], "8 data bytes"),
        ([_message(_ext(2, ["|O", [1], b"\x00" * 8]))], "dtype '|O' is not allowed"),
        ([_message(_ext(2, ["<f4", [-1], b""]))], "shape"),
        ([_message(_ext(2, ["<f4", [1]]))], r"expected \[dtype, shape, data\]"),
        ([_message(_ext(3, ["load", [1], b"\x00"]))], "unknown torch dtype 'load'"),
    ],
)
def test_malformed_messages(frames: list[Any], match: str) -> None:
    if any(b"load" in bytes(f) for f in frames):
        pytest.importorskip("torch")
    with pytest.raises(CodecError, match=match):
        decode(frames)


def test_truncated_and_dropped_frames() -> None:
    frames = [bytes(f) for f in encode({"a": np.arange(50_000.0), "b": b"z" * 100_000})]
    assert len(frames) == 3
    for cut in range(len(frames[0])):
        with pytest.raises(CodecError):
            decode([frames[0][:cut], *frames[1:]])
    for i in (1, 2):
        with pytest.raises(CodecError, match=r"data bytes|announces"):
            decode([*frames[:i], frames[i][:-1], *frames[i + 1 :]])
    with pytest.raises(CodecError, match="names no frame"):
        decode(frames[:2])
    with pytest.raises(CodecError, match="announces 2 buffer frames, 3 arrived"):
        decode([*frames, b""])


def test_an_encode_nested_in_another_packs_with_a_packer_of_its_own() -> None:
    """The fast path's per-thread packer is taken while it packs: an encode that runs in the
    middle (a finalizer the garbage collector runs then) must not write into its buffer."""
    from omniflow.transport import _codec

    nested: list[bytes] = []

    class Busy:
        def pack(self, obj: Any) -> bytes:
            nested.append(_codec._fast_pack(["nested", 1]))
            return b"outer"

    busy = Busy()
    saved = getattr(_codec._PACKERS, "packer", None)
    _codec._PACKERS.packer = busy
    try:
        assert _codec._fast_pack(["outer"]) == b"outer"
        assert nested == [msgpack.packb(["nested", 1])]
        assert _codec._PACKERS.packer is busy  # given back once done
    finally:
        _codec._PACKERS.packer = saved


# ---------------------------------------------------------------- media values (ext 7, ext 8)


def test_media_values_round_trip_with_their_array_out_of_band() -> None:
    import omniflow as of

    clip = of.Audio(np.arange(6, dtype=np.int16), sample_rate=8000)  # 12 bytes: still a frame
    pic = of.Image(np.arange(2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 3)[:, ::-1])  # strided
    frames = encode({"clip": clip, "nested": [pic]})
    assert len(frames) == 3  # header + one frame per media array, however small
    assert clip.samples.tobytes() not in bytes(frames[0])
    body = decode(frames)
    assert type(body["clip"]) is of.Audio and body["clip"] == clip
    assert type(body["nested"][0]) is of.Image and body["nested"][0] == pic
    assert not body["clip"].samples.flags.writeable  # a view of the frame, like big arrays
    owned = decode(frames, owned=True)
    assert owned["clip"].samples.flags.writeable and owned["nested"][0].pixels.flags.writeable


@pytest.mark.parametrize(
    ("code", "fields", "match"),
    [
        (7, [8000], "malformed audio"),
        (7, ["8000", b""], "malformed audio"),
        (8, [], "malformed image"),
        (8, [b"not an array"], "malformed message"),  # MediaError inside: still a CodecError
    ],
)
def test_malformed_media_are_codec_errors(code: int, fields: list[Any], match: str) -> None:
    body = msgpack.ExtType(code, msgpack.packb(fields))
    header = MAGIC + bytes([VERSION]) + msgpack.packb(["msg", 0, body])
    with pytest.raises(CodecError, match=match):
        decode([header])
