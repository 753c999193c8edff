"""The uds wire's reader (``Conn.read``): whatever way the bytes of a run of messages are cut
into reads, the messages come out whole, in order, byte for byte, each once. Messages of one
small frame take a shortcut in ``Conn._parse``; a run that mixes them with multi-frame
messages and big frames, cut anywhere (inside a header too), must read the same."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.transport._udswire import _SMALL, Conn, Outbox, pack

#: A frame: empty, small, at the small-frame limit, or big (read into a slab of its own).
_FRAME = st.one_of(
    st.binary(max_size=64),
    st.integers(0, 3).map(lambda i: bytes([i]) * (_SMALL - 1 + i)),  # around the limit
    st.integers(1, 2).map(lambda i: bytes([65 + i]) * (_SMALL * i + 7)),
)
_MESSAGES = st.lists(st.lists(_FRAME, min_size=1, max_size=3), min_size=1, max_size=8)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Conn]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    try:
        yield theirs, Conn(ours, Outbox(8))
    finally:
        ours.close()
        theirs.close()


def _wire(messages: list[list[bytes]]) -> bytes:
    out = bytearray()
    for frames in messages:
        parts, size = pack("uds://test", frames)
        data = b"".join(bytes(p) for p in parts)
        assert len(data) == size
        out += data
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(messages=_MESSAGES, data=st.data())
def test_messages_come_out_whole_in_order_however_the_bytes_are_cut(
    messages: list[list[bytes]], data: st.DataObject
) -> None:
    wire = _wire(messages)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(wire) - 1)), max_size=8)))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ours.setblocking(False)
        theirs.setblocking(False)
        conn = Conn(ours, Outbox(8))
        got: list[list[bytes]] = []
        at = 0
        for cut in [*cuts, len(wire)]:
            chunk = wire[at:cut]
            at = cut
            while chunk:  # (a chunk bigger than the socket buffer goes in turns)
                with contextlib.suppress(BlockingIOError):
                    chunk = chunk[theirs.send(chunk) :]
                done, broken = conn.read()
                assert broken is None
                got += [[bytes(f) for f in frames] for frames in done]
        while len(got) < len(messages):  # (what the last read left in the socket)
            done, broken = conn.read()
            assert broken is None and done, "a message never came out"
            got += [[bytes(f) for f in frames] for frames in done]
        assert got == messages
        # Nothing is left half-read: the next message reads on its own.
        theirs.sendall(_wire([[b"next"]]))
        done, broken = conn.read()
        assert broken is None and [[bytes(f) for f in m] for m in done] == [[b"next"]]
    finally:
        ours.close()
        theirs.close()


def test_a_burst_of_one_frame_messages_reads_in_one_call(
    pair: tuple[socket.socket, Conn],
) -> None:
    theirs, conn = pair
    sent = [[b"m%04d" % i] for i in range(500)]
    theirs.sendall(_wire(sent))
    done, broken = conn.read()
    assert broken is None
    assert [[bytes(f) for f in m] for m in done] == sent


def test_a_one_frame_header_cut_before_its_frame_waits_for_the_rest(
    pair: tuple[socket.socket, Conn],
) -> None:
    theirs, conn = pair
    wire = _wire([[b"first"], [b"second message"]])
    theirs.sendall(wire[: 12 + 5 + 12 + 3])  # the first whole, the second's header and 3 bytes
    done, broken = conn.read()
    assert broken is None and [[bytes(f) for f in m] for m in done] == [[b"first"]]
    theirs.sendall(wire[12 + 5 + 12 + 3 :])
    done, broken = conn.read()
    assert broken is None and [[bytes(f) for f in m] for m in done] == [[b"second message"]]
