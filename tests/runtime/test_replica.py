"""The replica lifecycle (``cluster/_replica.py``): its transition table and restart backoff."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from omniflow.cluster._replica import (
    GONE,
    RESPAWN_CAP,
    ROUTABLE,
    TRANSITIONS,
    Backoff,
    Lifecycle,
    ReplicaEvent,
    ReplicaState,
    ReplicaStateError,
    transition,
)

S, E = ReplicaState, ReplicaEvent


def test_a_replica_goes_through_its_life() -> None:
    life = Lifecycle("r-0")
    assert life.state is S.STARTING and life.alive and not life.routable
    for event, state in [
        (E.READY, S.READY),
        (E.MISSING, S.SUSPECT),
        (E.PRESENT, S.READY),
        (E.BYE, S.LEAVING),
        (E.BYE, S.LEAVING),
        (E.LOST, S.LEFT),
    ]:
        assert life.apply(event, "why") is state
    assert not life.alive
    assert life.story()[-1] == "leaving --lost (why)--> left"


def test_a_dead_replica_is_restarted_once() -> None:
    life = Lifecycle("r-0")
    life.apply(E.READY)
    assert life.apply(E.LOST, "its process exited with code -9") is S.DEAD
    assert life.apply(E.RESPAWN) is S.RESTARTING
    with pytest.raises(ReplicaStateError) as info:
        life.apply(E.RESPAWN)
    text = str(info.value)
    assert "replica 'r-0'" in text and "'respawn'" in text and "'restarting'" in text
    assert "ready --lost (its process exited with code -9)--> dead" in text


def test_illegal_pairs_name_both_states() -> None:
    with pytest.raises(ReplicaStateError, match=r"event 'lost' is not allowed in state 'dead'"):
        transition("r-1", S.DEAD, E.LOST)
    with pytest.raises(ReplicaStateError, match=r"its story: nothing yet"):
        transition("r-1", S.READY, E.RESPAWN)


def test_the_table_has_no_way_back_from_gone_and_every_live_state_can_be_lost() -> None:
    for (state, _event), nxt in TRANSITIONS.items():
        if state in GONE:
            assert nxt in GONE
    for state in set(S) - GONE:
        assert TRANSITIONS[(state, E.LOST)] in GONE
    assert ROUTABLE.isdisjoint(GONE)


class LifecycleMachine(RuleBasedStateMachine):
    """Random event sequences: a legal event moves as the table says, an illegal one raises
    and leaves the state alone; routable implies alive."""

    def __init__(self) -> None:
        super().__init__()
        self.life = Lifecycle("r")

    @rule(event=st.sampled_from(list(E)))
    def send(self, event: ReplicaEvent) -> None:
        before = self.life.state
        expected = TRANSITIONS.get((before, event))
        if expected is None:
            with pytest.raises(ReplicaStateError):
                self.life.apply(event)
            assert self.life.state is before
        else:
            assert self.life.apply(event) is expected

    @invariant()
    def routable_is_alive(self) -> None:
        assert not self.life.routable or self.life.alive
        assert len(self.life.story()) <= Lifecycle.STORY


TestLifecycleMachine = LifecycleMachine.TestCase


def test_backoff_doubles_caps_and_resets() -> None:
    b = Backoff()
    slot = ("g", 0)
    delays = [b.after_death(slot, lived=1.0) for _ in range(12)]
    assert delays[:4] == [0.1, 0.2, 0.4, 0.8] and delays[-1] == RESPAWN_CAP
    assert b.after_death(("g", 1), lived=1.0) == 0.1  # slots are independent
    assert b.after_death(slot, lived=61.0) == 0.1  # it lived long: start over
    assert b.after_failed_start(slot) == 0.4  # a failed start counts as a quick death
    assert b.restarts(slot) == 2


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 200)), max_size=40))
def test_backoff_stays_within_bounds(deaths: list[tuple[bool, float]]) -> None:
    b = Backoff()
    for failed_start, lived in deaths:
        delay = b.after_failed_start(("g", 0)) if failed_start else b.after_death(("g", 0), lived)
        assert 0.1 <= delay <= RESPAWN_CAP
