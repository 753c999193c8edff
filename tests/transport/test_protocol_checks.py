"""``decode_msg`` checks the exact type of every typed field of a message, and remembers the
shapes (the fields' types, in order) that passed, a bounded number per kind: whatever it has
seen before, a message is taken if and only if each typed field has an allowed type."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.transport import _protocol
from omniflow.transport._codec import encode
from omniflow.transport._protocol import (
    MESSAGES,
    Done,
    ProtocolError,
    decode_msg,
    encode_fields,
)

#: A value of each type msgpack carries (a tuple goes as a list, as it would on the wire).
_VALUES: list[Any] = ["s", 3, 2.5, True, None, [1, "a"], {"k": 1}, b"raw"]
_KINDS = sorted(k for k, (cls, _t) in MESSAGES.items() if cls._fields)


def _allowed(kind: str, body: list[Any]) -> bool:
    """The reference: every typed field of ``body`` has one of its allowed exact types."""
    _cls, types = MESSAGES[kind]
    for value, allowed in zip(body, types, strict=False):
        if allowed is not _protocol._ANY and type(value) not in allowed:
            return False
    return True


def _body(kind: str, data: st.DataObject) -> list[Any]:
    cls, types = MESSAGES[kind]
    fewest = len(types) - len(cls._field_defaults)
    n = data.draw(st.integers(fewest, len(types)), label="fields")
    return [data.draw(st.sampled_from(_VALUES), label=f"field {i}") for i in range(n)]


@settings(max_examples=300)
@given(kind=st.sampled_from(_KINDS), data=st.data())
def test_a_message_is_taken_iff_its_typed_fields_have_allowed_types(
    kind: str, data: st.DataObject
) -> None:
    # Whatever passed before (bodies of this kind decoded first, in any number) decides
    # nothing about this one.
    for _ in range(data.draw(st.integers(0, 3), label="before")):
        body = _body(kind, data)
        with contextlib.suppress(ProtocolError):
            decode_msg(encode(body, kind=kind, pickle=True))
    body = _body(kind, data)
    frames = encode(body, kind=kind, pickle=True)
    if _allowed(kind, body):
        msg = decode_msg(frames)
        assert type(msg) is MESSAGES[kind][0]
        assert list(msg)[: len(body)] == body
    else:
        with pytest.raises(ProtocolError) as err:
            decode_msg(frames)
        assert err.value.reason == "malformed" and kind in str(err.value)
    assert len(_protocol._GOOD[kind]) <= _protocol._GOOD_SHAPES


def test_a_bad_field_is_refused_after_good_messages_of_the_same_kind() -> None:
    good = encode_fields(Done, "c", 1, {"y": 1})
    for _ in range(3):
        assert decode_msg(good) == Done("c", 1, {"y": 1})
    with pytest.raises(ProtocolError, match="'aid' is a float"):
        decode_msg(encode(["c", 1.5, {"y": 1}], kind="done", pickle=True))
    with pytest.raises(ProtocolError, match="'call_id' is a int"):
        decode_msg(encode([7, 1, {"y": 1}], kind="done", pickle=True))


def test_the_shapes_remembered_per_kind_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_protocol, "_GOOD", {k: set() for k in _protocol._GOOD})
    # Good dones of many shapes: the frame is untyped, the rest optional or of two types.
    shapes = set()
    for a in (1, "w.0.0"):
        for f in _VALUES:
            for em in (None, "e"):
                for tb in (None, "t"):
                    for x in (None, [[0, "w.0.0"]]):
                        body = ["c", a, f, None, em, False, tb, x]
                        decode_msg(encode(body, kind="done", pickle=True))
                        shapes.add(tuple(map(type, body)))
    assert len(shapes) > _protocol._GOOD_SHAPES
    assert len(_protocol._GOOD["done"]) <= _protocol._GOOD_SHAPES
    # Past the bound a shape is still checked and taken, just not remembered.
    assert decode_msg(encode_fields(Done, "c", "w.0.0", {"y": 2})).aid == "w.0.0"
    with pytest.raises(ProtocolError):
        decode_msg(encode(["c", None, None], kind="done", pickle=True))
