"""What a replica sent about runs the front has not bound yet waits for the end of the loop
turn (``Intake._later``), behind the other connections read in it, instead of being kept and
replayed by the front (``FastPathCore``'s early messages): in order per connection, nothing
lost, each handled once, and at most ``LATE_TURNS`` turns in a row."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omniflow.cluster import _fleet_intake
from omniflow.cluster._fleet import Fleet, Replica
from omniflow.cluster._remote import RemoteRoles
from omniflow.transport import EndpointState
from omniflow.transport._auth import Sealer
from omniflow.transport._protocol import Dones, Frame, Message, batch, encode_msg

KEY = b"late-reads-test-key-0123456789ab"

#: One turn: deliveries, each (replica index, its next n messages, batched or one per packet).
_TURNS = st.lists(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.booleans()), max_size=4),
    min_size=1,
    max_size=8,
)


def _replica(name: str) -> Replica:
    rep = Replica(name, [name], f"uds://{name}")
    rep.endpoint = SimpleNamespace(state=EndpointState.OPEN)
    return rep


def _messages(name: str, n: int, deps: list[int | None]) -> list[Frame]:
    """Replica ``name``'s messages; ``deps[i]``: the index of the message of replica "r0"
    that message ``i`` is about (it "binds" it), or None."""
    return [
        Frame("c", f"{name}.{i}", None if deps[i] is None else f"r0.{deps[i]}", None)
        for i in range(n)
    ]


async def _run(
    turns: list[list[tuple[int, int, bool]]],
    deps: list[list[int | None]],
    ticks: dict[str, int] | None = None,
) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """Deliver ``turns`` to a fleet whose ``on_message`` hands back a message whose binding
    message was not handled yet (as the front does); what was handled, in order, the turn
    each message was delivered in, and each handled message's "early" flag count.

    With ``ticks``, a message of "r0" that is handled says so (``Intake.known``, as the front's
    binding of a forwarded run does), and ``ticks`` gets the loop turn (counted from the
    start) each message was delivered in ("+name") and handled in ("name")."""
    handled: list[str] = []
    seen: set[str] = set()
    early: dict[str, int] = {}
    tick = [0]

    def on_message(rep: Replica, msg: Message, may_wait: bool) -> Message | None:
        assert type(msg) is Frame
        dep = msg.frame
        if dep is not None and dep not in seen:
            if may_wait:
                return msg
            early[msg.aid] = 1
        assert msg.aid not in seen, f"{msg.aid} handled twice"
        seen.add(msg.aid)
        handled.append(msg.aid)
        if ticks is not None:
            ticks[msg.aid] = tick[0]
            if msg.aid.startswith("r0."):
                fleet.intake.known = True
        return None

    fleet = Fleet([], on_message=on_message, on_lost=lambda rep, why: None, cluster_key=KEY)
    reps = [_replica(f"r{i}") for i in range(3)]
    sealers = [Sealer(KEY) for _ in reps]
    sent = [0, 0, 0]
    delivered_in: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def turn(t: int) -> None:
        if t == len(turns):
            done.set_result(None)
            return
        for r, n, batched in turns[t]:
            name = reps[r].replica_id
            msgs = _messages(name, sent[r] + n, deps[r])[sent[r] :]
            sent[r] += n
            for m in msgs:
                delivered_in[m.aid] = t
                if ticks is not None:
                    ticks["+" + m.aid] = tick[0]
            envelopes = [encode_msg(m) for m in msgs]
            packets = batch(envelopes) if batched else envelopes
            fleet.intake.receive(reps[r], [(None, sealers[r].seal(p)) for p in packets])
        loop.call_soon(turn, t + 1)

    def count() -> None:  # once per loop turn
        tick[0] += 1
        if not done.done():
            loop.call_soon(count)

    try:
        loop.call_soon(count)
        loop.call_soon(turn, 0)
        await done
        for _ in range(_fleet_intake.LATE_TURNS + 2):  # what still waits is handled by then
            if all(rep.late is None for rep in reps):
                break
            await asyncio.sleep(0)
        assert all(rep.late is None for rep in reps)
    finally:
        await fleet.close()
    want = {f"r{r}.{i}" for r in range(3) for i in range(sent[r])}
    assert set(handled) == want  # nothing lost (and nothing twice: on_message checks)
    return handled, delivered_in, early


def _totals_and_deps(
    turns: list[list[tuple[int, int, bool]]], data: st.DataObject
) -> tuple[list[int], list[list[int | None]]]:
    """How many messages each replica sends over ``turns``, and what each message of "r1"
    and "r2" is about: a message of "r0" (drawn), or nothing."""
    total = [sum(n for t in turns for r, n, _b in t if r == i) for i in range(3)]
    deps: list[list[int | None]] = [[None] * total[0]]
    for i in (1, 2):
        deps.append([
            data.draw(st.none() | st.integers(0, max(0, total[0] - 1))) if total[0] else None
            for _ in range(total[i])
        ])  # fmt: skip
    return total, deps


@given(turns=_TURNS, data=st.data())
def test_what_waits_keeps_each_connections_order_and_comes_after_what_binds_it(
    turns: list[list[tuple[int, int, bool]]], data: st.DataObject
) -> None:
    """Any deliveries over loop turns: every message is handled once, each connection's in
    the order it sent them, and a message whose binding message was delivered in the same
    turn or before (on another connection, in whatever order) is handled after it."""
    total, deps = _totals_and_deps(turns, data)
    with _late_turns(3):  # (the bound itself is not what is checked here)
        handled, delivered_in, early = asyncio.run(_run(turns, deps))
    for r in range(3):
        mine = [a for a in handled if a.startswith(f"r{r}.")]
        assert mine == [f"r{r}.{i}" for i in range(total[r])]
    at = {a: k for k, a in enumerate(handled)}
    for r in (1, 2):
        for i, dep in enumerate(deps[r]):
            a = f"r{r}.{i}"
            if dep is not None and delivered_in[f"r0.{dep}"] <= delivered_in[a]:
                assert at[f"r0.{dep}"] < at[a], (a, f"r0.{dep}")
                assert a not in early


@given(turns=_TURNS, data=st.data())
def test_what_waits_for_a_run_is_handled_in_the_loop_turn_the_run_becomes_known(
    turns: list[list[tuple[int, int, bool]]], data: st.DataObject
) -> None:
    """When the front learns of runs (``Intake.known``), what waits is tried again at once:
    a message is handled in the loop turn it could first be (it arrived, its binding message
    was handled, and the message its connection sent before it was), not a turn later."""
    total, deps = _totals_and_deps(turns, data)
    ticks: dict[str, int] = {}
    with _late_turns(_fleet_intake.LATE_TURNS):
        _handled, _delivered, early = asyncio.run(_run(turns, deps, ticks))
    for r in range(3):
        for i in range(total[r]):
            a = f"r{r}.{i}"
            if a in early or (i and f"r{r}.{i - 1}" in early):
                continue  # (one that waited its bound out: handled whatever it said)
            first = ticks["+" + a]
            dep = deps[r][i]
            if dep is not None:
                first = max(first, ticks[f"r0.{dep}"])
            if i:
                first = max(first, ticks[f"r{r}.{i - 1}"])
            assert ticks[a] == first, (a, ticks[a], first)


@contextlib.contextmanager
def _late_turns(n: int) -> Iterator[None]:
    was = _fleet_intake.LATE_TURNS
    _fleet_intake.LATE_TURNS = n
    try:
        yield
    finally:
        _fleet_intake.LATE_TURNS = was


def test_a_message_whose_binding_never_comes_waits_a_bounded_number_of_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing binds r1.0: it waits LATE_TURNS turns in a row, then is handled (early), and
    what r1 sent after it comes after it."""
    monkeypatch.setattr(_fleet_intake, "LATE_TURNS", 3)
    handled, _at, early = asyncio.run(_run([[(1, 2, True)]], [[], [5, None], []]))
    assert handled == ["r1.0", "r1.1"]
    assert early == {"r1.0": 1}


async def _front() -> tuple[RemoteRoles, Replica]:
    remote = RemoteRoles(
        [],
        registry=None,
        on_frame=lambda *a: None,
        on_done=lambda *a: None,
        on_return=lambda *a: None,
        cluster_key=KEY,
    )
    rep = _replica("m2")
    remote._fast.started("c", "1.0.0")  # (a running parent)
    return remote, rep


async def _front_hands_back() -> None:
    remote, rep = await _front()
    try:
        # "9.0.0.0.0" is an orphan's (its parent is not running: dropped at once); the two
        # after it are of runs forwarded by the running "1.0.0", not bound yet.
        dones = Dones(["c"] * 3, ["9.0.0.0.0", "1.0.0.0.0", "1.0.0.1.0"], [None] * 3, [None] * 3)
        rest = remote._on_message(rep, dones, True)
        assert rest == Dones(["c"] * 2, ["1.0.0.0.0", "1.0.0.1.0"], [None] * 2, [None] * 2)
        assert not remote._fast.core.early  # nothing kept to replay
        # Without leave to wait (the fleet's second look, or a replay), they are kept.
        assert rest is not None
        assert remote._on_message(rep, rest, False) is None
        assert len(remote._fast.core.early["c"]) == 2
        remote._fast.core.validate()
    finally:
        await remote.fleet.close()


def test_the_front_hands_back_the_rest_of_a_dones_from_its_first_unbound_record() -> None:
    asyncio.run(_front_hands_back())
