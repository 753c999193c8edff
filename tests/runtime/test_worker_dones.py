"""A worker's good ends to one front, handled together, leave as one ``dones`` (unit level)."""

from __future__ import annotations

import threading
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.cluster._worker import Worker
from omniflow.transport._protocol import (
    MAX_BATCH,
    Batch,
    Done,
    Dones,
    Frame,
    Hello,
    decode_inner,
    decode_msg,
)

KEY = b"test-cluster-key-0123456789abcdef"
A, B = b"front-a", b"front-b"


def worker() -> Worker:
    w = Worker([], ["r"], "ipc:///nowhere", cluster_key=KEY, owner="token-a")
    w._handle(A, Hello("token-a", 1.0))
    w._handle(B, Hello("token-b", 1.0))
    while not w._out.empty():  # the readies
        w._out.get_nowait()
    return w


def sent(w: Worker) -> list[tuple[bytes | None, Any]]:
    """(peer, message) of everything the worker sent, batches unpacked, in order."""
    out: list[tuple[bytes | None, Any]] = []
    while not w._out.empty():
        peer, frames = w._out.get_nowait()
        msg = decode_msg(frames)
        if type(msg) is Batch:
            out.extend((peer, decode_inner(m)) for m in msg.messages)
        else:
            out.append((peer, msg))
    return out


def ends(msgs: list[tuple[bytes | None, Any]]) -> list[tuple[bytes | None, Any]]:
    """Each ``Dones`` record as the ``Done`` it stands for."""
    out: list[tuple[bytes | None, Any]] = []
    for peer, msg in msgs:
        if type(msg) is Dones:
            assert len(msg.call_ids) > 1  # (one end goes as a done)
            for c, a, f, x in zip(*msg, strict=True):
                out.append((peer, Done(c, a, f, forwarded=x)))
        else:
            out.append((peer, msg))
    return out


#: What a handled batch of messages makes: a good end with a returned frame, one without, a
#: failure, a frame of a generator, each to front A or B.
_EVENTS = st.lists(
    st.tuples(st.sampled_from(["returned", "ended", "failed", "frame"]), st.sampled_from([A, B])),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(events=_EVENTS)
def test_held_ends_leave_per_front_in_order_good_ones_together(
    events: list[tuple[str, bytes]],
) -> None:
    w = worker()
    try:
        w._reading = True
        expected: dict[bytes | None, list[Any]] = {A: [], B: []}
        for i, (what, peer) in enumerate(events):
            if what == "returned":
                w._done(peer, "c", i, None, {"y": i})
                expected[peer].append(Done("c", i, {"y": i}))
            elif what == "ended":
                w._done(peer, "c", i, None)
                expected[peer].append(Done("c", i))
            elif what == "failed":
                w._done(peer, "c", i, ValueError(f"boom {i}"))
                expected[peer].append(("ValueError", f"boom {i}"))
            else:
                w._send(peer, Frame("c", i, {"z": i}))
                expected[peer].append(Frame("c", i, {"z": i}))
        w._reading = False
        w._flush_held()
        msgs = sent(w)
        for peer in (A, B):
            got = [m for p, m in ends(msgs) if p == peer]
            assert [
                (m.error_type, m.error_message) if type(m) is Done and m.error_type else m
                for m in got
            ] == expected[peer]
        # consecutive good ends to one front are one message
        for peer in (A, B):
            kinds = [type(m) for p, m in msgs if p == peer]
            runs = [k for k, prev in zip(kinds, [None, *kinds], strict=False) if k is not prev]
            assert runs.count(Dones) == kinds.count(Dones)
    finally:
        w.plane.close()


def test_more_than_max_batch_ends_take_more_than_one_dones() -> None:
    w = worker()
    try:
        w._reading = True
        for i in range(MAX_BATCH + 3):
            w._done(A, "c", i, None, {"y": i})
        w._reading = False
        w._flush_held()
        msgs = sent(w)
        assert [len(m.call_ids) if type(m) is Dones else 1 for _, m in msgs] == [MAX_BATCH, 3]
        assert [m.aid for _, m in ends(msgs)] == list(range(MAX_BATCH + 3))
    finally:
        w.plane.close()


def test_a_frame_the_wire_cannot_carry_fails_its_activation_alone() -> None:
    w = worker()
    try:
        w._reading = True
        w._done(A, "c", 1, None, {"y": 1})
        w._done(A, "c", 2, None, {"y": threading.Lock()})  # cannot be pickled
        w._done(A, "c", 3, None, {"y": 3})
        w._reading = False
        w._flush_held()
        got = [m for _, m in ends(sent(w))]
        assert got[0] == Done("c", 1, {"y": 1}) and got[2] == Done("c", 3, {"y": 3})
        failed = got[1]
        assert (failed.call_id, failed.aid, failed.frame, failed.error_type) == (
            "c",
            2,
            None,
            "_Unsendable",
        )
        assert "could not be sent to the front" in (failed.error_message or "")
    finally:
        w.plane.close()
