"""Sealed messages (HMAC over every frame, per-sender counters) and the typed protocol."""

from __future__ import annotations

import hashlib
import hmac
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow import RuntimeClosedError, TransportError
from omniflow.transport import encode
from omniflow.transport._auth import (
    BULK_BYTES,
    KEY_ENV,
    TAG_BYTES,
    Opener,
    Sealer,
    _HmacSha256,
    load_key_file,
    resolve_key,
    send_sealed_now,
)
from omniflow.transport._protocol import (
    MAX_BATCH,
    MESSAGES,
    Batch,
    Bye,
    Cancel,
    Done,
    Dones,
    Frame,
    Hello,
    ProtocolError,
    Run,
    Stop,
    batch,
    decode_inner,
    decode_msg,
    encode_msg,
)

KEY = b"k" * 32
_FRAMES = st.lists(st.binary(max_size=64), min_size=1, max_size=4)


@given(_FRAMES)
def test_a_sealed_message_opens_to_its_frames(frames: list[bytes]) -> None:
    sealed = Sealer(KEY).seal(frames)
    assert len(sealed) == len(frames) and len(sealed[0]) == TAG_BYTES + len(frames[0])
    assert [bytes(f) for f in Opener(KEY).open(sealed) or []] == frames


@given(_FRAMES, st.data())
def test_any_change_to_a_sealed_message_is_refused(frames: list[bytes], data: Any) -> None:
    sealed = [bytes(f) for f in Sealer(KEY).seal(frames)]
    i = data.draw(st.integers(0, len(sealed) - 1))
    how = data.draw(st.sampled_from(["flip", "cut", "grow", "drop", "add", "swap"]))
    bad = list(sealed)
    if how == "flip" and bad[i]:
        j = data.draw(st.integers(0, len(bad[i]) - 1))
        bad[i] = bad[i][:j] + bytes([bad[i][j] ^ 1]) + bad[i][j + 1 :]
    elif how == "cut" and bad[i]:
        bad[i] = bad[i][:-1]
    elif how == "grow":
        bad[i] = bad[i] + b"\0"
    elif how == "drop" and len(bad) > 1 and i > 0:
        del bad[i]
    elif how == "add":
        bad.append(b"")
    elif how == "swap" and len(bad) > 2 and bad[1] != bad[-1]:  # two buffer frames
        bad[1], bad[-1] = bad[-1], bad[1]
    else:
        return
    opener = Opener(KEY)
    assert opener.open(bad) is None
    assert opener.stats.dropped["bad_mac"] == 1 and opener.stats.accepted == 0


@given(st.binary(max_size=200), st.binary(max_size=300))
def test_the_mac_is_hmac_sha256(key: bytes, data: bytes) -> None:
    mac = _HmacSha256(key).copy()
    mac.update(data[:7])
    mac.update(data[7:])
    assert mac.digest() == hmac.new(key, data, hashlib.sha256).digest()


# Bulk messages (BULK_BYTES and more in all): GMAC under a one-time key per message.
_SIZES = st.lists(
    st.one_of(st.integers(0, 64), st.integers(BULK_BYTES - 80, BULK_BYTES + 80),
              st.integers(0, 3 * BULK_BYTES)),
    min_size=1, max_size=4,
)  # fmt: skip


def _frames(sizes: list[int], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def _reference_mac(key: bytes, sealed: list[bytes]) -> bytes:
    """The MAC field, computed from the module docstring with hmac and AESGCM only."""
    head, body = sealed[0][:18], [sealed[0][TAG_BYTES:], *sealed[1:]]
    covered = head + b"".join(len(f).to_bytes(8, "big") + f for f in body)
    if sum(map(len, body)) < BULK_BYTES:
        return hmac.new(key, covered, hashlib.sha256).digest()
    bulk_key = hmac.new(key, b"omniflow bulk-mac key v1", hashlib.sha256).digest()
    one_time = hmac.new(bulk_key, head, hashlib.sha256).digest()
    return AESGCM(one_time).encrypt(bytes(12), b"", covered) + bytes(16)


@settings(max_examples=150, deadline=None)
@given(_SIZES, st.integers(0, 2**32))
def test_the_mac_is_hmac_below_bulk_bytes_and_one_time_gmac_above(
    sizes: list[int], seed: int
) -> None:
    frames = _frames(sizes, seed)
    sealed = [bytes(f) for f in Sealer(KEY).seal(frames)]
    assert sealed[0][:2] == b"OA" and len(sealed[0]) == TAG_BYTES + sizes[0]
    assert sealed[0][18:TAG_BYTES] == _reference_mac(KEY, sealed)
    assert [bytes(f) for f in Opener(KEY).open(sealed) or [None]] == frames


@settings(max_examples=150, deadline=None)
@given(_SIZES, st.integers(0, 2**32), st.data())
def test_a_changed_byte_anywhere_in_a_bulk_message_is_refused(
    sizes: list[int], seed: int, data: Any
) -> None:
    frames = _frames(sizes, seed)
    sealed = [bytearray(f) for f in Sealer(KEY).seal(frames)]
    i = data.draw(st.sampled_from([k for k, f in enumerate(sealed) if f]))
    j = data.draw(st.integers(0, len(sealed[i]) - 1))
    sealed[i][j] ^= 1 << data.draw(st.integers(0, 7))
    opener = Opener(KEY)
    assert opener.open([bytes(f) for f in sealed]) is None
    assert opener.stats.dropped["bad_mac"] == 1 and opener.stats.accepted == 0


def test_a_reused_counter_is_refused_in_bulk_messages_too() -> None:
    sealer, opener = Sealer(KEY), Opener(KEY)
    big = [b"h", bytes(range(256)) * 64]
    first = sealer.seal(big)
    assert opener.open(first) is not None
    assert opener.open(first) is None  # the same message again
    sealer._counter = 0  # a sender that starts its counter over (a bug, or a forged clone)
    assert opener.open(sealer.seal(big)) is None  # counter 1 again, same bytes
    sealer._counter = 0
    assert opener.open(sealer.seal([b"other", b"x" * BULK_BYTES])) is None  # other bytes
    assert opener.stats.dropped["replay"] == 3 and opener.stats.dropped["bad_mac"] == 0
    # A tag moved onto another message, or a head given another counter, fails the MAC: the
    # one-time key belongs to the head it was derived from.
    other = [b"h", bytes(reversed(big[1]))]
    a, b = bytes(sealer.seal(big)[0]), bytes(sealer.seal(other)[0])
    assert opener.open([a[:TAG_BYTES] + b[TAG_BYTES:], other[1]]) is None  # a's tag on b
    assert opener.open([b[:10] + a[10:18] + b[18:], other[1]]) is None  # b under a's counter
    assert opener.open([b[:10] + (9).to_bytes(8, "big") + b[18:], other[1]]) is None
    assert opener.stats.dropped["bad_mac"] == 3
    assert opener.open([b, other[1]]) is not None


def test_a_bulk_message_with_an_hmac_tag_is_refused() -> None:
    """The MAC is chosen by length on both ends: no sender can pick the other one."""
    frames = [b"h", b"z" * BULK_BYTES]
    sealed = [bytes(f) for f in Sealer(KEY).seal(frames)]
    head, body = sealed[0][:18], [sealed[0][TAG_BYTES:], *sealed[1:]]
    covered = head + b"".join(len(f).to_bytes(8, "big") + f for f in body)
    wrong = hmac.new(KEY, covered, hashlib.sha256).digest()
    opener = Opener(KEY)
    assert opener.open([head + wrong + body[0], body[1]]) is None
    assert opener.open(sealed) is not None


def test_bulk_frames_of_any_buffer_type_are_covered_without_a_copy() -> None:
    import zmq

    image = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    frames = [b"header", memoryview(image), np.zeros((0, 3)), memoryview(image.tobytes())]
    sealed = Sealer(KEY).seal(frames)
    received = [bytes(sealed[0]), *(zmq.Frame(image.tobytes()) for _ in range(2))]
    received.insert(2, zmq.Frame(b""))
    opened = Opener(KEY).open(received)
    assert opened is not None and [bytes(f) for f in opened][1] == image.tobytes()
    image[0, 0] = -1  # the same bytes as sent? no longer: the receiver refuses them
    assert Opener(KEY).open([bytes(sealed[0]), *(bytes(memoryview(f)) for f in frames[1:])]) is None


def test_a_wrong_key_and_a_missing_tag_are_refused() -> None:
    opener = Opener(KEY)
    assert opener.open(Sealer(b"w" * 32).seal([b"x"])) is None
    assert opener.open([b"x"]) is None
    assert opener.open([b"", b"x"]) is None
    assert opener.stats.dropped["bad_mac"] == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=40))
def test_replays_and_reorders_are_refused_per_sender(plan: list[tuple[int, int]]) -> None:
    """A model of the replay rule: from each sender, only counters above the last accepted."""
    senders = [Sealer(KEY) for _ in range(3)]
    sent: list[list[list[Any]]] = [[], [], []]
    opener = Opener(KEY)
    last = [0, 0, 0]
    for who, back in plan:
        # Either a fresh message, or one sent earlier by that sender (``back`` steps back).
        if back == 0 or back > len(sent[who]):
            msg = senders[who].seal([b"m"])
            sent[who].append(msg)
            index = len(sent[who])
        else:
            index = len(sent[who]) - back + 1
            msg = sent[who][index - 1]
        expected = index > last[who]
        assert (opener.open(msg) is not None) == expected
        if expected:
            last[who] = index
    assert opener.stats.accepted + opener.stats.dropped["replay"] == len(plan)


def test_send_sealed_now_leaves_refusals_and_errors_to_the_callers_writer() -> None:
    """The front's runs, the worker's answers and its forward links send through this: True
    only when the endpoint took the sealed message; a full endpoint or a failing one leaves
    the message to the caller's queue (whose writer meets the error and handles the loss)."""
    key = b"k" * 32
    sealer, opener = Sealer(key), Opener(key)
    sent: list[tuple[Any, bytes | None]] = []
    outcome: list[Any] = [True]

    class Endpoint:
        def try_send(self, frames: Any, peer: bytes | None = None) -> bool:
            if isinstance(outcome[0], BaseException):
                raise outcome[0]
            sent.append((frames, peer))
            return bool(outcome[0])

    ep = Endpoint()
    assert send_sealed_now(ep, sealer, [b"a"], b"peer-1") is True
    outcome[0] = False
    assert send_sealed_now(ep, sealer, [b"b"]) is False  # full: queued by the caller
    for error in (TransportError("gone"), RuntimeClosedError("closed")):
        outcome[0] = error
        assert send_sealed_now(ep, sealer, [b"c"]) is False
    outcome[0] = True
    assert send_sealed_now(ep, sealer, [b"d"]) is True
    assert [peer for _, peer in sent] == [b"peer-1", None, None]
    # Each try used a counter; the receiver accepts the gaps the refused tries left.
    opened = [opener.open(frames) for frames, _ in sent]
    assert [[bytes(f) for f in frames or []] for frames in opened] == [[b"a"], [b"b"], [b"d"]]


def test_cluster_keys_come_from_the_argument_the_env_or_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    key, generated = resolve_key()
    assert generated and len(key) == 64
    assert resolve_key("x" * 16) == (b"x" * 16, False)
    with pytest.raises(TransportError, match="at least 16"):
        resolve_key("short")
    with pytest.raises(TransportError, match=KEY_ENV):
        resolve_key(generate=False)
    monkeypatch.setenv(KEY_ENV, "e" * 20)
    assert resolve_key() == (b"e" * 20, False)
    path = tmp_path / "key"
    path.write_text("f" * 32 + "\n")
    assert load_key_file(path) == b"f" * 32
    with pytest.raises(TransportError, match="cannot read"):
        load_key_file(tmp_path / "missing")


@pytest.mark.parametrize(
    "msg",
    [
        Hello("front-1", 0.5),
        Run("c", 1, "n.run", {"x": (1, 2)}, None, 0, 3, "g"),
        Run("c", 1, "n.run", {}, "s", 1, 0, "g", ["y"], 1024, {"a.b": "shm"}),
        Cancel("c", 2),
        Frame("c", 2, {"y": [1.5]}),
        Done("c", 2, None, "ValueError", "boom", False, "Traceback ..."),
        Dones(["c", "c"], [2, "0.1.0"], [{"y": 1}, None], [None, [[0, "0.1.0.0.0"]]]),
        Stop(),
    ],
)
def test_every_message_round_trips(msg: Any) -> None:
    assert decode_msg(encode_msg(msg)) == msg


_WRONG = [
    ("run", ["c", 1.5, "n", {}, None, 0, 0, "g"], "'aid' is a float"),
    ("run", ["c", True, "n", {}, None, 0, 0, "g"], "'aid' is a bool"),
    ("run", ["c", 1, "n", {}, None, 0], "6 fields"),
    ("cancel", ["c", 1, 2], "3 fields"),
    ("done", ["c", 1, None, None, None, 1], "'cancelled' is a int"),
    ("dones", [["c"], [1], [None]], "3 fields"),
    ("dones", [["c"], 1, [None], [None]], "'aids' is a int"),
    ("dones", [["c"], [1], [None], None], "'forwarded' is a NoneType"),
    ("hello", {"front": "f"}, "no fields"),
    ("launch", [], "unknown message kind"),
]


@pytest.mark.parametrize(("kind", "body", "match"), _WRONG)
def test_messages_of_the_wrong_shape_are_protocol_errors(kind: str, body: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match) as info:
        decode_msg(encode(body, kind=kind))
    assert info.value.reason == ("unknown_kind" if kind == "launch" else "malformed")


def test_every_kind_is_one_type() -> None:
    kinds = list(MESSAGES)
    assert len(kinds) == len(set(kinds)) == len({cls for cls, _ in MESSAGES.values()})
    for cls, types in MESSAGES.values():
        assert len(cls._fields) == len(types)


# ---------------------------------------------------------------- batches


def _unbatch(sent: list[list[Any]]) -> list[list[bytes]]:
    """What a receiver hands on, message by message, from what ``batch`` made."""
    out: list[list[bytes]] = []
    for frames in sent:
        msg = decode_msg(frames)
        if type(msg) is Batch:
            out.extend([[bytes(m)] for m in msg.messages])
            assert all(type(decode_inner(m)) is not Batch for m in msg.messages)
        else:
            out.append([bytes(f) for f in frames])
    return out


@given(
    sizes=st.lists(st.sampled_from(["small", "big"]), max_size=MAX_BATCH * 2 + 5),
)
def test_batch_keeps_every_message_in_order(sizes: list[str]) -> None:
    items = [
        encode_msg(Frame("c", i, {"v": i} if kind == "small" else {"v": np.zeros(20_000)}))
        for i, kind in enumerate(sizes)
    ]
    sent = batch(items)
    assert _unbatch(sent) == [[bytes(f) for f in frames] for frames in items]
    # singles ride together (at most MAX_BATCH per batch); out-of-band messages go alone
    assert len(sent) <= len(items)
    for frames in sent:
        msg = decode_msg(frames)
        if type(msg) is Batch:
            assert 2 <= len(msg.messages) <= MAX_BATCH


def test_a_batch_item_must_be_one_plain_message() -> None:
    with pytest.raises(ProtocolError, match="batch inside a batch"):
        decode_inner(bytes(encode_msg(Batch([bytes(encode_msg(Bye())[0])]))[0]))
    with pytest.raises(ProtocolError, match="an item is a int"):
        decode_inner(5)
    with pytest.raises(ProtocolError):
        decode_inner(b"not an envelope")
