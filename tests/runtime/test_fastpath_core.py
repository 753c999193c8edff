"""The fast-path machine event by event (``cluster.fastpath.FastPathCore``): for each order of
events, the exact instructions it returns and where each forwarded run then stands
(docs/fast-path.md). ``validate()`` runs after every event (``core`` fixture)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omniflow.cluster.fastpath import LEGAL, FastPathCore, RunState
from omniflow.cluster.fastpath._events import (
    WAIT,
    AskClaims,
    Bind,
    CallEnded,
    ClaimAnswer,
    Deliver,
    Drop,
    Ended,
    Fail,
    FastPathTransitionError,
    Handled,
    Lost,
    Made,
    Malformed,
    Reported,
    SendCancel,
    SendClaim,
    Started,
    Unbound,
)
from omniflow.cluster.fastpath._waiting import parent_of, wire_id
from tests.runtime.fastpath_world import Rep, frame, made, route

EARLY, EXPECTED, BOUND, ORPHAN = (
    RunState.EARLY, RunState.EXPECTED, RunState.BOUND, RunState.ORPHAN,
)  # fmt: skip


class Checked(FastPathCore):
    """The machine with ``validate()`` after every event."""

    def handle(self, event):  # type: ignore[no-untyped-def]
        out = super().handle(event)
        self.validate()
        return out


@pytest.fixture
def core() -> Iterator[FastPathCore]:
    fp = Checked()
    yield fp
    fp.validate()


@pytest.fixture
def reps() -> tuple[Rep, Rep, Rep]:
    return Rep("r1"), Rep("r2"), Rep("r3")


def test_bound_at_its_frame_with_nothing_early(core: FastPathCore, reps: tuple[Rep, ...]) -> None:
    r1, r2, _ = reps
    m = route("m.run", r2)
    assert core.handle(Started("c", 1)) == []
    reported, binds, handled = frame(core, r1, "c", 1, 0, (m,), [made("c", "m.run")])
    assert (reported, binds, handled) == ([], [[Bind("1.0.0", m, r1)]], [])
    assert core.state("c", "1.0.0") is BOUND and core.forwarded == 1
    assert core.handle(Ended("c", "1.0.0")) == []
    assert core.state("c", "1.0.0") is None and not core.bound
    assert core.handle(Ended("c", 1)) == [] and not core.running
    assert [(d["from"], d["to"]) for d in core.story("c", "1.0.0")] == [
        ("gone", "expected"), ("expected", "bound"), ("bound", "gone"),
    ]  # fmt: skip


def test_early_messages_wait_then_replay_in_order_after_the_binding(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, _ = reps
    m = route("m.run", r2)
    core.handle(Started("c", 1))
    # The fleet may still hold it back for the end of the loop turn: then nothing is kept.
    assert core.handle(Unbound(r2, "c", "1.0.0", "frame", False, True)) == [WAIT]
    assert core.state("c", "1.0.0") is None
    # Past the fleet's turns (or in a replay), it is kept; so is what follows.
    assert core.handle(Unbound(r2, "c", "1.0.0", "frame", False, False)) == []
    assert core.handle(Unbound(r2, "c", "1.0.0", "done", True, False)) == []
    assert core.state("c", "1.0.0") is EARLY and core.waiting() == 1
    # Still early, a later message may wait at the fleet again.
    assert core.handle(Unbound(r2, "c", "1.0.0", "more", False, True)) == [WAIT]
    _, binds, handled = frame(core, r1, "c", 1, 0, (m,), [made("c", "m.run")])
    assert binds == [[Bind("1.0.0", m, r1)]]
    assert handled == [Deliver(r2, "frame"), Deliver(r2, "done")]
    assert core.state("c", "1.0.0") is BOUND and core.waiting() == 0


def test_two_runs_bound_by_one_frame_replay_last_bound_first(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, r3 = reps
    m, n = route("m.run", r2), route("n.run", r3)
    core.handle(Started("c", 1))
    core.handle(Unbound(r2, "c", "1.0.0", "m's", False, False))
    core.handle(Unbound(r3, "c", "1.0.1", "n's", False, False))
    _, binds, handled = frame(core, r1, "c", 1, 0, (m, n), [made("c", "m.run"), made("c", "n.run")])
    assert binds == [[Bind("1.0.0", m, r1)], [Bind("1.0.1", n, r1)]]
    assert handled == [Deliver(r3, "n's"), Deliver(r2, "m's")]


def test_a_run_the_core_does_not_make_is_cancelled_and_what_it_sends_dropped(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """The call is cancelled (closing): the core makes no activation of M for the frame."""
    r1, r2, _ = reps
    core.handle(Started("c", 1))
    _, _, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2),), [])
    assert handled == [SendCancel(r2, "c", "1.0.0")]
    assert core.state("c", "1.0.0") is ORPHAN and core.orphaned == 1
    assert core.handle(Unbound(r2, "c", "1.0.0", "frame", False, True)) == [Drop("frame")]
    assert core.handle(Unbound(r2, "c", "1.0.0", "done", True, True)) == [Drop("done")]
    assert core.state("c", "1.0.0") is None and core.waiting() == 0
    assert core.orphaned == 1  # (counted once)


@pytest.mark.parametrize(
    "act",
    [
        made("c", "m.run", q=1),  # another SeqId index
        made("c", "m.run", group=1),  # another OR group
        made("c", "m.run", field="y"),  # another argument
        Made("c", "m.run", 0, 0, {"x": 1, "y": 2}),  # more arguments
    ],
)
def test_an_activation_unlike_the_forwarded_run_goes_the_slow_way_and_orphans_it(
    core: FastPathCore, reps: tuple[Rep, ...], act: Made
) -> None:
    r1, r2, _ = reps
    core.handle(Started("c", 1))
    core.handle(Unbound(r2, "c", "1.0.0", "frame", False, False))
    _, binds, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2),), [act])
    assert binds == [[]]  # (the router sends the core's activation itself)
    assert handled == [SendCancel(r2, "c", "1.0.0"), Drop("frame")]
    assert core.forwarded == 0 and core.state("c", "1.0.0") is ORPHAN


def test_a_replica_that_no_longer_takes_runs_is_not_bound(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, _ = reps
    r2.routable = False  # (leaving: alive, but no new runs)
    core.handle(Started("c", 1))
    _, binds, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2),), [made("c", "m.run")])
    assert binds == [[]] and handled == [SendCancel(r2, "c", "1.0.0")]


def test_an_unbound_run_that_ended_before_its_frame_was_handled_is_not_cancelled(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, _ = reps
    core.handle(Started("c", 1))
    core.handle(Unbound(r2, "c", "1.0.0", "frame", False, False))
    core.handle(Unbound(r2, "c", "1.0.0", "done", True, False))
    _, _, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2),), [])
    assert handled == [Drop("frame"), Drop("done")]
    assert core.state("c", "1.0.0") is None and core.orphaned == 1


def test_when_an_activation_ends_its_unbound_runs_and_their_descendants_are_orphans(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    _, r2, r3 = reps
    core.handle(Started("c", 1))
    core.handle(Unbound(r2, "c", "1.0.0", "m's", False, False))
    core.handle(Unbound(r3, "c", "1.0.0.0.0", "n's", False, False))
    core.handle(Unbound(r3, "c", "1.1.0", "done", True, False))
    out = core.handle(Ended("c", 1))
    # Each run's instructions together, a run before its descendants (siblings in the
    # index's set order).
    groups = {
        "1.0.0": [SendCancel(r2, "c", "1.0.0"), Drop("m's")],
        "1.0.0.0.0": [SendCancel(r3, "c", "1.0.0.0.0"), Drop("n's")],
        "1.1.0": [Drop("done")],
    }
    starts = {out.index(g[0]): w for w, g in groups.items()}
    assert out == [i for at in sorted(starts) for i in groups[starts[at]]]
    assert out.index(groups["1.0.0"][0]) < out.index(groups["1.0.0.0.0"][0])
    assert core.runs == {("c", "1.0.0"): ORPHAN, ("c", "1.0.0.0.0"): ORPHAN}
    assert core.waiting() == 2 and core.orphaned == 3


def test_a_message_of_a_run_whose_parent_ended_is_an_orphans_at_once(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    _, r2, _ = reps
    core.handle(Started("c", 1))
    core.handle(Ended("c", 1))
    assert core.handle(Unbound(r2, "c", "1.0.0", "frame", False, True)) == [
        SendCancel(r2, "c", "1.0.0"), Drop("frame"),
    ]  # fmt: skip
    assert core.handle(Unbound(r2, "c", "1.2.0", "done", True, True)) == [Drop("done")]
    assert core.orphaned == 1  # (a done alone is not counted: nothing more comes)
    assert core.handle(Unbound(r2, "c", "7.0.0", "frame", False, True)) == [
        SendCancel(r2, "c", "7.0.0"), Drop("frame"),
    ]  # (a parent never started: nothing can bind it)  # fmt: skip


def test_an_early_run_found_orphaned_at_its_next_message_goes_whole(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """``1.0.0.0.0`` is early under ``1.0.0`` (itself never heard of) while 1 runs; 1 ends
    (its index has nothing under 1 itself); the next message finds it orphaned: it is
    cancelled, and what it kept is dropped with it."""
    _, _, r3 = reps
    core.handle(Started("c", 1))
    core.handle(Unbound(r3, "c", "1.0.0.0.0", "first", False, False))
    assert core.handle(Ended("c", 1)) == []
    assert core.state("c", "1.0.0.0.0") is EARLY
    assert core.handle(Unbound(r3, "c", "1.0.0.0.0", "second", False, True)) == [
        SendCancel(r3, "c", "1.0.0.0.0"), Drop("first"), Drop("second"),
    ]  # fmt: skip


def test_a_run_below_an_activation_cut_with_its_replica_is_an_orphan(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """``1.0.0`` (bound, with routes, on r2) is lost with r2 while 1 runs on: a run it
    forwarded that turns up later can never be bound (its frames may never come)."""
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    m = route("m.run", r2, sub=(route("n.run", r3),))
    frame(core, r1, "c", 1, 0, (m,), [made("c", "m.run")])
    r2.lose()
    assert core.handle(Lost(r2, (("c", "1.0.0"),))) == []
    assert core.handle(Ended("c", "1.0.0")) == []
    assert core.handle(Unbound(r3, "c", "1.0.0.0.0", "frame", False, True)) == [
        SendCancel(r3, "c", "1.0.0.0.0"), Drop("frame"),
    ]  # fmt: skip
    assert core.handle(AskClaims(r2)) == []
    assert core.handle(CallEnded("c")) == [] and core.waiting() == 0


def test_a_lost_replica_takes_what_it_sent_early_and_its_orphans(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """r2 sent early messages, then is lost; its frame's report then finds r2 not routable:
    the run is an orphan, and nothing is sent to a replica that is gone."""
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    core.handle(Unbound(r2, "c", "1.0.0", "frame", False, False))
    frame(core, r1, "c", 1, 1, (route("n.run", r3),), [])  # (r3's 1.1.0: an orphan)
    r2.lose()
    r3.lose()
    assert core.handle(Lost(r2, ())) == [] and core.handle(Lost(r3, ())) == []
    assert core.state("c", "1.0.0") is None and core.state("c", "1.1.0") is None
    _, binds, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2),), [made("c", "m.run")])
    assert binds == [[]] and handled == []  # (gone: no cancel to send)
    assert core.waiting() == 0


def test_a_lost_forwarders_bound_runs_are_claimed_and_the_missing_ones_fail(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """The fork-server and lone-run races: the frame that reported a forward reached the
    front, the forward did not reach its replica, then the forwarder was lost."""
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    frame(core, r1, "c", 1, 0, (route("m.run", r2), route("n.run", r3)),
          [made("c", "m.run"), made("c", "n.run")])  # fmt: skip
    frame(core, r1, "c", 1, 1, (route("m.run", r2), route("n.run", r3)),
          [made("c", "m.run"), made("c", "n.run")])  # fmt: skip
    r1.lose()
    assert core.handle(Lost(r1, (("c", 1),))) == []
    assert core.handle(Ended("c", 1)) == []
    r3.lose()  # (lost too, its runs failed with it: not asked)
    assert core.handle(AskClaims(r1)) == [SendClaim(r2, 1, "c", ["1.0.0", "1.1.0"], r1)]
    # 1.1.0 arrived there and runs on; 1.0.0 never did: it fails, and is an orphan.
    assert core.handle(ClaimAnswer(r2, 1, "c", ["1.0.0"])) == [Fail(r2, "c", "1.0.0", r1)]
    assert core.state("c", "1.0.0") is ORPHAN and core.state("c", "1.1.0") is BOUND
    assert core.handle(Ended("c", "1.0.0")) == []  # (the shell fails it: still an orphan)
    assert core.handle(Unbound(r2, "c", "1.0.0", "done", True, False)) == [Drop("done")]
    assert core.state("c", "1.0.0") is None and core.claims == {}


def test_answers_not_asked_for_or_naming_runs_not_asked_about_are_dropped(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    frame(core, r1, "c", 1, 0, (route("m.run", r2),), [made("c", "m.run")])
    frame(core, r1, "c", 1, 1, (route("m.run", r2),), [made("c", "m.run")])
    r1.lose()
    core.handle(Lost(r1, ()))
    assert core.handle(AskClaims(r1)) == [SendClaim(r2, 1, "c", ["1.0.0", "1.1.0"], r1)]
    assert core.handle(ClaimAnswer(r3, 1, "c", [])) == [
        Malformed(r3, "foreign", "an answer to claim 1, not its")
    ]
    assert core.handle(ClaimAnswer(r2, 1, "d", [])) == [
        Malformed(r2, "foreign", "an answer to claim 1, not its")
    ]
    # 1.1.0 ended before the answer came (its done first on the same connection).
    assert core.handle(Ended("c", "1.1.0")) == []
    assert core.handle(ClaimAnswer(r2, 1, "c", ["1.1.0", "9.0.0", 5])) == [
        Malformed(r2, "malformed", "a claimed '9.0.0'"),
        Malformed(r2, "malformed", "a claimed 5"),
    ]
    assert core.state("c", "1.0.0") is BOUND  # (refused: it is there, it runs on)
    assert core.handle(ClaimAnswer(r2, 1, "c", [])) == [
        Malformed(r2, "foreign", "an answer to claim 1, not its")
    ]  # (answered already)


def test_a_claim_to_a_replica_then_lost_is_forgotten(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, _ = reps
    core.handle(Started("c", 1))
    frame(core, r1, "c", 1, 0, (route("m.run", r2),), [made("c", "m.run")])
    r1.lose()
    core.handle(Lost(r1, ()))
    assert len(core.handle(AskClaims(r1))) == 1
    r2.lose()
    assert core.handle(Lost(r2, ())) == [] and core.claims == {}
    assert core.handle(Ended("c", "1.0.0")) == []


def test_a_message_held_back_past_the_fleets_turns_is_kept_and_replayed(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """LATE_TURNS: the fleet handed a message back turn after turn; at the last it must be
    taken (``may_wait`` False): it is kept, and replayed at the binding."""
    r1, r2, _ = reps
    core.handle(Started("c", 1))
    for _turn in range(3):
        assert core.handle(Unbound(r2, "c", "1.0.0", "done", True, True)) == [WAIT]
    assert core.handle(Unbound(r2, "c", "1.0.0", "done", True, False)) == []
    _, _, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2),), [made("c", "m.run")])
    assert handled == [Deliver(r2, "done")]


def test_dones_of_a_chain_read_last_first_bind_hop_by_hop(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """The late-read race: w3's done, then w2's, are read before w1's frame that reports
    w2's run. Both wait at the fleet (nothing kept); w1's frame binds 1.0.0; w2's done,
    tried again at once, reports and binds 1.0.0.0.0; w3's done is then its bound run's."""
    r1, r2, r3 = reps
    n = route("n.run", r3)
    m = route("m.run", r2, sub=(n,))
    core.handle(Started("c", 1))
    assert core.handle(Unbound(r3, "c", "1.0.0.0.0", "w3 done", True, True)) == [WAIT]
    assert core.handle(Unbound(r2, "c", "1.0.0", "w2 done", True, True)) == [WAIT]
    _, binds, handled = frame(core, r1, "c", 1, 0, (m,), [made("c", "m.run")])
    assert binds == [[Bind("1.0.0", m, r1)]] and handled == []
    _, binds, handled = frame(core, r2, "c", "1.0.0", 0, (n,), [made("c", "n.run")])
    assert binds == [[Bind("1.0.0.0.0", n, r2)]] and handled == []
    assert core.handle(Ended("c", "1.0.0")) == []
    assert core.handle(Ended("c", "1.0.0.0.0")) == []
    assert core.handle(Ended("c", 1)) == []
    assert core.runs == {} and not core.running and core.waiting() == 0


def test_the_seq_index_a_run_must_have_follows_its_route(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, _ = reps
    core.handle(Started("c", 1))
    by_frame = route("m.run", r2, qk=True)  # (1 starts a SeqId stream: frame k is index k)
    _, binds, _ = frame(core, r1, "c", 1, 3, (by_frame,), [made("c", "m.run", q=3)], seq=9)
    assert binds == [[Bind("1.3.0", by_frame, r1)]]
    own = route("m.run", r2)  # (else its parent's own index)
    _, binds, _ = frame(core, r1, "c", 1, 4, (own,), [made("c", "m.run", q=9)], seq=9)
    assert binds == [[Bind("1.4.0", own, r1)]]


def test_bad_forward_notes_are_dropped_alone(core: FastPathCore, reps: tuple[Rep, ...]) -> None:
    r1, r2, _ = reps
    m = route("m.run", r2)
    core.handle(Started("c", 1))
    x = [[0, "1.0.0"], "junk", [1, "1.0.1"], [0, "1.9.0"], [0, "1.0.0"]]
    assert core.handle(Reported(r1, "c", 1, 0, x, (m,), 0)) == [
        Malformed(r1, "malformed", "a forward note 'junk'"),
        Malformed(r1, "malformed", "a forward note [1, '1.0.1']"),
        Malformed(r1, "malformed", "a forward note [0, '1.9.0']"),
        Malformed(r1, "malformed", "a forward note [0, '1.0.0']"),  # (reported twice)
    ]
    assert core.handle(Made("c", "other.run", 0, 0, {})) == []  # (not a forwarded node)
    assert core.handle(made("c", "m.run")) == [Bind("1.0.0", m, r1)]
    assert core.handle(made("c", "m.run")) == []  # (one activation binds it)
    assert core.handle(Handled("c")) == []
    # A second report of a bound run is not believed.
    assert core.handle(Reported(r1, "c", 1, 0, [[0, "1.0.0"]], (m,), 0)) == [
        Malformed(r1, "malformed", "a forward note [0, '1.0.0']")
    ]
    assert core.handle(Handled("c")) == []
    assert core.handle(made("c", "m.run")) == []  # (no frame in the core)


def test_a_message_of_a_run_bound_elsewhere_is_foreign(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    frame(core, r1, "c", 1, 0, (route("m.run", r2),), [made("c", "m.run")])
    assert core.handle(Unbound(r3, "c", "1.0.0", "forged", True, False)) == [
        Malformed(r3, "foreign", "a message of ('c', 1.0.0), not its run")
    ]


def test_the_calls_end_leaves_nothing_of_it(core: FastPathCore, reps: tuple[Rep, ...]) -> None:
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    core.handle(Started("d", 1))
    core.handle(Unbound(r2, "c", "1.0.0", "frame", False, False))
    core.handle(Unbound(r3, "c", "1.1.0", "done", True, False))
    frame(core, r1, "c", 1, 2, (route("m.run", r2),), [])  # (an orphan)
    core.handle(Lost(r1, (("c", 1),)))
    core.handle(Unbound(r2, "d", "1.0.0", "d's", False, False))
    assert core.handle(CallEnded("c")) == [
        SendCancel(r2, "c", "1.0.0"), Drop("frame"), Drop("done"),
    ]  # fmt: skip
    assert all(c == "d" for c, _ in core.runs) and core.waiting() == 1
    assert core.handle(CallEnded("d")) == [SendCancel(r2, "d", "1.0.0"), Drop("d's")]
    assert core.waiting() == 0 and core.runs == {}


def test_an_illegal_move_names_the_run_both_states_and_its_story(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    _, r2, _ = reps
    core.handle(Started("c", 1))
    core.handle(Unbound(r2, "c", "1.0.0", "frame", False, False))
    with pytest.raises(FastPathTransitionError) as err:
        core._move("c", "1.0.0", BOUND, "test")
    text = str(err.value)
    assert "call c: forwarded run 1.0.0 cannot move early -> bound on test" in text
    assert "'from': 'gone', 'to': 'early'" in text
    assert err.value.state is EARLY and err.value.to is BOUND
    assert all(to in LEGAL for moves in LEGAL.values() for to in moves)
    core.handle(CallEnded("c"))


def test_frames_reported_out_of_order_are_a_bug(core: FastPathCore, reps: tuple[Rep, ...]) -> None:
    r1, _, _ = reps
    with pytest.raises(AssertionError, match="handled that was never reported"):
        core.handle(Handled("c"))
    core.handle(Reported(r1, "c", 1, 0, [], (), 0))
    with pytest.raises(AssertionError, match="reported inside another's"):
        core.handle(Reported(r1, "c", 1, 1, [], (), 0))
    core.handle(Handled("c"))


def test_the_story_can_be_off() -> None:
    fp = FastPathCore(story=0)
    fp.handle(Started("c", 1))
    fp.handle(Unbound(Rep("r"), "c", "1.0.0", "m", False, False))
    assert fp.story("c") == [] and fp.state("c", "1.0.0") is EARLY


def test_a_run_not_made_takes_its_early_descendants_with_it(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    core.handle(Unbound(r3, "c", "1.0.0.0.0", "grandchild", False, False))
    core.handle(Unbound(r3, "c", "1.0.1", "sibling", False, False))  # (stays early)
    _, _, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2),), [])
    assert handled == [
        SendCancel(r2, "c", "1.0.0"), SendCancel(r3, "c", "1.0.0.0.0"), Drop("grandchild"),
    ]  # fmt: skip
    assert core.state("c", "1.0.1") is EARLY


def test_a_bound_run_with_nothing_early_replays_nothing_while_others_wait(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    core.handle(Started("c", 2))
    core.handle(Unbound(r3, "c", "2.0.0", "another parent's", False, False))
    core.handle(Unbound(r3, "c", "1.0.0.0.0", "below", False, False))
    m = route("m.run", r2, sub=(route("n.run", r3),))
    _, binds, handled = frame(core, r1, "c", 1, 0, (m,), [made("c", "m.run")])
    assert binds == [[Bind("1.0.0", m, r1)]] and handled == []
    # Ending 1.0.0 orphans what waits below it, and nothing else.
    assert core.handle(Ended("c", "1.0.0")) == [SendCancel(r3, "c", "1.0.0.0.0"), Drop("below")]
    assert core.state("c", "2.0.0") is EARLY
    # An early run found orphaned at its next message, while another run still waits.
    core.handle(Unbound(r3, "c", "1.0.0.0.1", "w", False, False))
    assert core.handle(Ended("c", 1)) == []
    assert core.handle(Unbound(r3, "c", "1.0.0.0.1", "x", True, False)) == [Drop("w"), Drop("x")]
    assert core.state("c", "2.0.0") is EARLY
    core.handle(CallEnded("c"))


def test_a_message_from_a_replica_already_gone_cancels_nothing(
    core: FastPathCore, reps: tuple[Rep, ...]
) -> None:
    """A message read before a lost replica's socket closed, of a run nothing can bind."""
    _, r2, _ = reps
    r2.lose()
    assert core.handle(Unbound(r2, "c", "1.0.0", "frame", False, False)) == [Drop("frame")]
    assert core.orphaned == 1 and core.runs == {}


def test_wire_ids_name_their_parent() -> None:
    assert wire_id(wire_id(7, 2, 1), 0, 0) == "7.2.1.0.0"
    assert parent_of("7.2.1.0.0") == "7.2.1" and parent_of("7.2.1") == 7


def test_orphans_end_one_by_one_with_their_dones(core: FastPathCore, reps: tuple[Rep, ...]) -> None:
    r1, r2, r3 = reps
    core.handle(Started("c", 1))
    _, _, handled = frame(core, r1, "c", 1, 0, (route("m.run", r2), route("n.run", r3)), [])
    assert handled == [SendCancel(r2, "c", "1.0.0"), SendCancel(r3, "c", "1.0.1")]
    assert core.handle(Unbound(r2, "c", "1.0.0", "done", True, False)) == [Drop("done")]
    assert core.runs == {("c", "1.0.1"): ORPHAN}
    assert core.handle(Unbound(r3, "c", "1.0.1", "done", True, False)) == [Drop("done")]
    assert core.runs == {} and core.orphans == {}


def test_validate_names_each_breach(reps: tuple[Rep, ...]) -> None:
    """validate() is not vacuous: each table out of step with the runs' states is named."""
    r1, r2, _ = reps

    def broken(how: str) -> FastPathCore:
        fp = FastPathCore()
        fp.handle(Started("c", 1))
        fp.handle(Unbound(r2, "c", "1.0.0", "m", False, False))
        frame(fp, r1, "c", 1, 1, (route("m.run", r2),), [made("c", "m.run")])
        frame(fp, r1, "c", 1, 2, (route("m.run", r2),), [])
        fp.validate()
        if how == "early state":
            fp.runs[("c", "1.0.0")] = BOUND
        elif how == "index":
            fp.early["c"].kids[1] = set()
        elif how == "orphan":
            fp.runs[("c", "1.2.0")] = EARLY
        elif how == "bound":
            fp.runs[("c", "1.1.0")] = ORPHAN
        elif how == "expected":
            fp.runs[("c", "9.0.0")] = EXPECTED
        elif how == "outside":
            fp._bound.append(("c", "1.1.0"))
        elif how == "claim":
            fp.claims[1] = (r2, "c", [], r1)
        elif how == "empty":
            fp.cut["c"] = set()
        return fp

    for how, says in [
        ("early state", "has early messages but is bound"),
        ("index", "parent index is stale"),
        ("orphan", "kept as an orphan"),
        ("bound", "bound but orphan"),
        ("expected", "expected by no frame"),
        ("outside", "expectations outside a frame"),
        ("claim", "claim 1 of call c"),
        ("empty", "an empty cut kept"),
    ]:
        with pytest.raises(AssertionError, match=says):
            broken(how).validate()
