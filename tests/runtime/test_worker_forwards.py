"""A worker's forwards to one link that differ only in wire id, value and SeqId index leave as
one ``forwards``, and a worker serves each of its records as the ``forward`` it stands for
(unit level)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.cluster._forward import Route
from omniflow.cluster._worker import Worker
from omniflow.cluster._worker_held import Fw, FwdBatch, Link
from omniflow.transport._auth import PlainOpener, PlainSealer
from omniflow.transport._base import Packet
from omniflow.transport._protocol import (
    MAX_BATCH,
    Batch,
    Done,
    Forward,
    Forwards,
    Run,
    SourceLost,
    decode_inner,
    decode_msg,
    encode_msg,
)

from .test_worker_dones import A, B, worker

ADDR1, ADDR2 = "uds:///nowhere/w1.sock", "uds:///nowhere/w2.sock"
ROUTE1 = Route("y", "m1", 0, ADDR1, "m1-0", None, None, None, False, None)
ROUTE2 = Route("y", "m2", 0, ADDR2, "m2-0", ["y"], 1000, {"n": "shm"}, True, [["sub"]])


def unbatched(frames: list[Any]) -> list[Any]:
    """The messages ``frames`` carries (a ``Batch`` unpacked)."""
    msg = decode_msg(frames)
    return [decode_inner(m) for m in msg.messages] if type(msg) is Batch else [msg]


def forwarding(
    w: Worker, out: list[tuple[str, Any]] | None = None, tag: str = ""
) -> list[tuple[str, Any]]:
    """Make ``w``'s links fakes; the (``tag`` + address, message) it sends down them, in
    order (appended to ``out`` if given)."""
    out = [] if out is None else out

    def link_send(address: str, frames: list[Any]) -> None:
        out.extend((tag + address, m) for m in unbatched(frames))

    w._link = lambda address: None  # type: ignore[method-assign,assignment,return-value]
    w._link_send = link_send  # type: ignore[method-assign]
    return out


def records(msgs: list[tuple[str, Any]]) -> list[tuple[str, Forward]]:
    """Each ``Forwards`` record as the ``Forward`` it stands for."""
    out: list[tuple[str, Forward]] = []
    for address, msg in msgs:
        if type(msg) is Forwards:
            assert len(msg.aids) > 1  # (one alone goes as a forward)
            ft, rid, c, n, f, s, g, gr, as_, vs, qs, off, th, conn, fw, _tp = msg
            for a, v, q in zip(as_, vs, qs, strict=True):
                out.append((address, Forward(ft, rid, c, a, n, {f: v}, s, g, q, gr, off, th,
                                             conn, fw)))  # fmt: skip
        else:
            assert type(msg) is Forward
            out.append((address, msg))
    return out


def running(w: Worker, peer: bytes, a: int, routes: tuple[Route, ...], c: str = "c") -> None:
    """Activation ``a`` of call ``c`` from ``peer`` runs here with fast-path ``routes``."""
    front = w._fronts[peer]
    w._fw[(peer, c, a)] = Fw(routes, Run(c, a, "n0", {}, "sess", 0, 7, "g"), front)


#: What a handled batch makes: (front, call, route, value) of activations that return a frame.
_VALUES = st.one_of(
    st.integers(), st.text(max_size=3), st.none(), st.lists(st.integers(), max_size=2)
)
_EVENTS = st.lists(
    st.tuples(
        st.sampled_from([A, B]),
        st.sampled_from(["c", "d"]),
        st.sampled_from([ROUTE1, ROUTE2]),
        _VALUES,
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(events=_EVENTS)
def test_held_forwards_leave_per_link_in_order_alike_ones_together(
    events: list[tuple[bytes, str, Route, Any]],
) -> None:
    w = worker()
    try:
        out = forwarding(w)
        w._reading = True
        expected: dict[str, list[Forward]] = {ADDR1: [], ADDR2: []}
        for i, (peer, c, route, value) in enumerate(events):
            running(w, peer, i, (route,), c)
            w._done(peer, c, i, None, {"y": value})
            expected[route.address].append(Forward(
                w._fronts[peer], route.replica, c, f"{i}.0.0", route.node, {"y": value}, "sess",
                route.group, 0 if route.seq_from_frame else 7, "g", route.offload, route.threshold,
                route.connectors, route.subroutes,
            ))  # fmt: skip
        w._reading = False
        w._flush_held()
        got = records(out)
        for address in (ADDR1, ADDR2):
            assert [m for ad, m in got if ad == address] == expected[address]
        # consecutive alike forwards to one link (scalar values, same front and call: the
        # route is the link's one) leave in one message
        for address in (ADDR1, ADDR2):
            tagged = [(i, m) for i, (ad, msg) in enumerate(out) if ad == address
                      for _, m in records([(ad, msg)])]  # fmt: skip
            for (i, m), (j, nxt) in itertools.pairwise(tagged):
                alike = (m.front, m.call_id) == (nxt.front, nxt.call_id)
                if alike and type(m.kwargs["y"]) is not list and type(nxt.kwargs["y"]) is not list:
                    assert i == j
    finally:
        w.plane.close()


def test_a_batch_of_scalar_forwards_to_one_link_is_one_message() -> None:
    w = worker()
    try:
        out = forwarding(w)
        w._reading = True
        for i in range(MAX_BATCH + 3):
            running(w, A, i, (ROUTE1,))
            w._done(A, "c", i, None, {"y": i})
        w._reading = False
        w._flush_held()
        assert [(type(m), len(m.aids)) for _, m in out] == [(Forwards, MAX_BATCH), (Forwards, 3)]
        assert [m.kwargs["y"] for _, m in records(out)] == list(range(MAX_BATCH + 3))
    finally:
        w.plane.close()


def test_forwards_of_other_calls_or_a_list_value_break_the_run_in_place() -> None:
    w = worker()
    try:
        out = forwarding(w)
        w._reading = True
        for i, (c, value) in enumerate([("c", 1), ("c", 2), ("c", [3]), ("c", 4), ("c", 5),
                                        ("d", 6), ("d", 7)]):  # fmt: skip
            running(w, A, i, (ROUTE1,), c)
            w._done(A, c, i, None, {"y": value})
        w._reading = False
        w._flush_held()
        assert [(type(m).__name__, m.call_id) for _, m in out] == [
            ("Forwards", "c"), ("Forward", "c"), ("Forwards", "c"), ("Forwards", "d"),
        ]  # fmt: skip
        assert [m.kwargs["y"] for _, m in records(out)] == [1, 2, [3], 4, 5, 6, 7]
    finally:
        w.plane.close()


def test_a_value_the_wire_cannot_carry_is_not_forwarded_the_others_are() -> None:
    fw = Fw((ROUTE1,), Run("c", 1, "n0", {}, None, 0, 0, "g"), "token-a")
    held = FwdBatch(fw, ROUTE1, "1.0.0", 1, 0)
    held.as_ += ["1.1.0", "1.2.0"]
    held.vs += ["\ud800", 3]  # (a lone surrogate: not UTF-8)
    held.qs += [0, 0]
    got = [decode_msg(frames) for frames in held.encoded()]
    assert [(type(m), m.aid, m.kwargs) for m in got] == [(Forward, "1.0.0", {"y": 1}),
                                                  (Forward, "1.2.0", {"y": 3})]  # fmt: skip


def serving(w: Worker) -> list[tuple[bytes | None, Run]]:
    """The runs ``w`` starts (not run: captured)."""
    started: list[tuple[bytes | None, Run]] = []
    w._start = lambda peer, run: started.append((peer, run))  # type: ignore[method-assign]
    return started


def forwards(ft: str = "token-a", rid: str = "r-0", **lists: Any) -> Forwards:
    base = {"as_": ["1.0.0", "1.1.0"], "vs": [10, 11], "qs": [0, 1]}
    base.update(lists)
    return Forwards(ft, rid, "c", "m1", "y", "s", 0, "g", base["as_"], base["vs"], base["qs"],
                    None, None, None, [["sub"]])  # fmt: skip


def test_each_record_is_served_as_its_forward_from_the_front_it_names() -> None:
    w = worker()
    try:
        w.replica_id = "r-0"
        started = serving(w)
        w._handle(B, forwards())  # (which worker sent it does not matter: its front does)
        assert started == [
            (A, Run("c", "1.0.0", "m1", {"y": 10}, "s", 0, 0, "g", None, None, None, [["sub"]])),
            (A, Run("c", "1.1.0", "m1", {"y": 11}, "s", 0, 1, "g", None, None, None, [["sub"]])),
        ]
    finally:
        w.plane.close()


def test_a_bad_record_is_dropped_alone_a_bad_message_whole() -> None:
    w = worker()
    try:
        w.replica_id = "r-0"
        started = serving(w)
        w._handle(B, forwards(as_=["1.0.0", 5, "1.2.0"], vs=[1, 2, 3], qs=[0, 1, "x"]))
        assert [run.aid for _, run in started] == ["1.0.0"]
        assert w.wire.statistics()["dropped_malformed"] == 2
        w._handle(B, forwards(vs=[1]))  # lists of unlike lengths
        assert w.wire.statistics()["dropped_malformed"] == 3
        w._handle(B, forwards(rid="another"))
        w._handle(B, forwards(ft="never-said-hello"))
        assert w.wire.statistics()["dropped_foreign"] == 2
        assert len(started) == 1
    finally:
        w.plane.close()


def test_a_record_whose_start_fails_stops_none_of_the_others() -> None:
    w = worker()
    try:
        w.replica_id = "r-0"
        started = serving(w)
        take = w._start

        def start(peer: bytes | None, run: Run) -> None:
            if run.aid == "1.0.0":
                raise RuntimeError("boom")
            take(peer, run)

        w._start = start  # type: ignore[method-assign]
        w._handle(B, forwards())
        assert [run.aid for _, run in started] == ["1.1.0"]
        assert w.wire.statistics()["dropped_malformed"] == 1
    finally:
        w.plane.close()


def test_forwards_held_for_a_worker_lost_in_the_same_batch_are_dropped_not_linked() -> None:
    """A batch that forwards to a worker and then says it is lost (``SourceLost``): at the
    flush nothing goes to the lost address, and no link to it is made again (one would hold
    what it queued for good; the front orphans those runs), while the other link still gets
    its forward."""
    w = worker()
    linked: list[str] = []
    sent: list[str] = []

    class FakeEndpoint:
        def __init__(self, address: str) -> None:
            self.address = address

        def try_send(self, frames: list[Any], peer: bytes | None = None) -> bool:
            sent.append(self.address)
            return True

        def close(self) -> None:
            pass

    def link(address: str) -> Link:
        linked.append(address)
        return w._links.setdefault(address, Link(FakeEndpoint(address), PlainSealer()))

    w._link = link  # type: ignore[method-assign]
    try:
        w._reading = True
        running(w, A, 1, (ROUTE1, ROUTE2))
        w._done(A, "c", 1, None, {"y": 5})
        w._handle(A, SourceLost(ADDR1, 4242))
        w._reading = False
        w._flush_held()
        assert sent == [ADDR2]
        assert ADDR1 not in w._links and ADDR1 in w._gone
        assert linked.count(ADDR1) == 1  # (made at the forward, dropped by SourceLost)
    finally:
        w.plane.close()


# ------------------------------------------------------------------- a batch of one run


def hop_worker(returns: Any) -> tuple[Worker, list[tuple[str, Any]]]:
    """A worker hosting node ``n0`` (a coroutine returning ``returns(x)``) whose links are
    fakes and whose front messages are recorded: (``"link:" + address`` or ``"front"``,
    message), batches unpacked, in the order they were sent."""
    w = worker()
    w.replica_id = "r-0"
    w._opener = PlainOpener(w.wire)  # (the messages below are not sealed)
    events: list[tuple[str, Any]] = []

    async def n0(x: Any) -> Any:
        return returns(x)

    w._methods["n0"] = n0

    class FrontEndpoint:
        def try_send(self, frames: list[Any], peer: bytes | None = None) -> bool:
            events.extend(("front", m) for m in unbatched(frames))
            return True

    w._endpoint = FrontEndpoint()
    w._sealer = PlainSealer()
    forwarding(w, events, "link:")
    return w, events


def a_run(a: int, x: Any, routes: tuple[Route, ...], forwarded: bool) -> Run | Forward:
    raw = [r.wire() for r in routes] or None
    if forwarded:
        return Forward("token-a", "r-0", "c", f"{a}.0.0", "n0", {"x": x}, None, 0, a, "g",
                       None, None, None, raw)  # fmt: skip
    return Run("c", a, "n0", {"x": x}, None, 0, a, "g", None, None, None, raw)


async def test_a_batch_of_one_run_sends_its_done_then_its_forward_at_once() -> None:
    modes: list[tuple[bool, bool]] = []
    w, events = hop_worker(lambda x: modes.append((w._reading, w._direct)) or {"y": x + 1})
    try:
        w._take([Packet(A, encode_msg(a_run(1, 41, (ROUTE1,), False)))])
        assert modes == [(False, True)]  # (what it makes is not held for a flush)
        assert events == [
            ("front", Done("c", 1, {"y": 42}, forwarded=[[0, "1.0.0"]])),
            ("link:" + ADDR1, Forward("token-a", "m1-0", "c", "1.0.0", "m1", {"y": 42}, None,
                                      0, 1, "g")),
        ]  # fmt: skip
        assert not w._held and not w._held_links and not w._fw and not w._direct
        assert not w._after_end
    finally:
        w.plane.close()


async def test_runs_of_a_bigger_batch_still_leave_gathered() -> None:
    modes: list[tuple[bool, bool]] = []
    w, events = hop_worker(lambda x: modes.append((w._reading, w._direct)) or {"y": x + 1})
    try:
        w._take([Packet(A, encode_msg(a_run(i, i, (ROUTE1,), False))) for i in range(3)])
        assert modes == [(True, False)] * 3
        assert [type(m).__name__ for _, m in events] == ["Forwards", "Dones"]
    finally:
        w.plane.close()


async def test_a_run_while_forwards_wait_for_the_turns_end_goes_behind_them() -> None:
    """A generator's forwards held to the end of the loop turn leave before those of a run
    that arrives alone in that turn (the batch of one is then handled the held way)."""
    w, events = hop_worker(lambda x: {"y": x + 1})
    try:
        running(w, A, 9, (ROUTE1,), "d")
        w._done(A, "d", 9, None, {"y": 0})  # (not reading: held to the end of the turn)
        assert w._held_links
        w._take([Packet(A, encode_msg(a_run(1, 41, (ROUTE1,), False)))])
        assert [(where, type(m).__name__, m.call_id) for where, m in events] == [
            ("link:" + ADDR1, "Forward", "d"), ("link:" + ADDR1, "Forward", "c"),
            ("front", "Done", "d"), ("front", "Done", "c"),
        ]  # fmt: skip
    finally:
        w.plane.close()


@settings(max_examples=80, deadline=None)
@given(
    value=st.one_of(st.integers(), st.text(max_size=3), st.none(), st.lists(st.integers())),
    shape=st.sampled_from(["frame", "no-y", "none", "not-a-dict", "raises", "unsendable"]),
    routes=st.sampled_from([(), (ROUTE1,), (ROUTE1, ROUTE2)]),
    forwarded=st.booleans(),
)
def test_a_batch_of_one_sends_what_the_held_way_sends(
    value: Any, shape: str, routes: tuple[Route, ...], forwarded: bool
) -> None:
    """Whatever one run makes (a frame, one without the routed field, none, a bad return, a
    failure, a value the wire cannot carry; with no, one or two routes; from a front or
    forwarded), sent at once it is the same messages, in the same order on each connection,
    as held and flushed; at once, the front's come before the forwards (the flush sends
    forwards first)."""

    def returns(x: Any) -> Any:
        if shape == "raises":
            raise ValueError("boom")
        return {
            "frame": {"y": x}, "no-y": {"z": x}, "none": None, "not-a-dict": [x],
            "unsendable": {"y": "\ud800"},
        }[shape]  # fmt: skip

    run = a_run(3, value, routes, forwarded)
    direct, direct_events = hop_worker(returns)
    held, held_events = hop_worker(returns)

    async def take_both() -> None:  # (a method runs in a task: inside an event loop)
        direct._take([Packet(B, encode_msg(run))])
        held._reading = True
        held._handle(B, run)
        held._reading = False
        held._flush_held()

    try:
        asyncio.run(take_both())

        def comparable(events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            # (a failure's traceback differs in its frames' lines: compare what it says)
            return [(where, m._replace(traceback=bool(m.traceback)) if type(m) is Done else m)
                    for where, m in events]  # fmt: skip

        def on(where: str, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            return [e for e in comparable(events) if e[0].startswith(where)]

        for where in ("front", "link:"):
            assert on(where, direct_events) == on(where, held_events)
        assert len(direct_events) == len(held_events)
        assert direct_events  # (every run ends: at least its done)
        kinds = [where for where, _ in direct_events]
        assert kinds == sorted(kinds)  # ("front" < "link:...": the end first)
        for w in (direct, held):
            assert not w._held and not w._held_links and not w._fw and not w._offload
            assert not w._after_end
    finally:
        direct.plane.close()
        held.plane.close()
