"""Replica lifecycle: one enum of states, one transition table, and the restart backoff.

>>> life = Lifecycle("llm-0")
>>> life.apply(ReplicaEvent.READY, "ready")
<ReplicaState.READY: 'ready'>
>>> life.apply(ReplicaEvent.MISSING, "gone from the registry")
<ReplicaState.SUSPECT: 'suspect'>
>>> life.routable
True

Pure: no I/O, no event loop. The I/O shell (``_remote.RemoteRoles``) reports what it sees
(a ``ready`` or ``bye`` message, a registry snapshot, a failed send, an exited process) as a
:class:`ReplicaEvent`; :func:`transition` says the next state or raises
:class:`ReplicaStateError` naming the replica, both states and its story::

    STARTING --ready--> READY <--present-- SUSPECT      (SUSPECT: absent from the registry,
        |                 |  --missing-->    |           on probation, still routable)
        |                 |                  |
        +------bye--------+-------bye--------+--> LEAVING (drains what it holds)
        |                 |                  |       |
        +------lost-------+-------lost-------+       +--lost--> LEFT   (as it said: no respawn)
                          v
                        DEAD --respawn--> RESTARTING   (a new replica takes its slot)
"""

from __future__ import annotations

import enum
from collections import deque

from omniflow._exceptions import OmniflowError

__all__ = [
    "RESPAWN_BASE",
    "RESPAWN_CAP",
    "RESPAWN_RESET",
    "Backoff",
    "Lifecycle",
    "ReplicaEvent",
    "ReplicaState",
    "ReplicaStateError",
    "transition",
]

#: Respawn backoff: the first delay, the cap, and how long a replica must have lived for its
#: slot's backoff to start over.
RESPAWN_BASE = 0.1
RESPAWN_CAP = 30.0
RESPAWN_RESET = 60.0


class ReplicaState(enum.Enum):
    #: Started (or found in the registry) and connecting; not ready for work yet.
    STARTING = "starting"
    #: Answered ``hello`` with ``ready``: routable.
    READY = "ready"
    #: Absent from the registry's last snapshot: on probation, still routable.
    SUSPECT = "suspect"
    #: Said ``bye`` (scale-down): gets nothing new, finishes what it holds.
    LEAVING = "leaving"
    #: Gone after saying ``bye``: nothing to respawn.
    LEFT = "left"
    #: Lost (exited, killed, silent, unreachable): what it held failed.
    DEAD = "dead"
    #: Dead, and a new replica is being started in its slot.
    RESTARTING = "restarting"

    # Members are singletons: hash them by identity, in C (``Enum.__hash__`` is Python code,
    # and ``routable`` is asked on every run and every forwarded binding).
    __hash__ = object.__hash__


class ReplicaEvent(enum.Enum):
    READY = "ready"
    MISSING = "missing"
    PRESENT = "present"
    BYE = "bye"
    LOST = "lost"
    RESPAWN = "respawn"


_S, _E = ReplicaState, ReplicaEvent

#: (state, event) -> next state; a pair not listed is illegal. Events a gone replica may
#: still see (a message read before its socket closed, a registry snapshot) leave it as is.
TRANSITIONS: dict[tuple[ReplicaState, ReplicaEvent], ReplicaState] = {
    (_S.STARTING, _E.READY): _S.READY,
    (_S.STARTING, _E.MISSING): _S.STARTING,  # judged by its probation once ready
    (_S.STARTING, _E.PRESENT): _S.STARTING,
    (_S.STARTING, _E.BYE): _S.LEAVING,
    (_S.STARTING, _E.LOST): _S.DEAD,
    (_S.READY, _E.MISSING): _S.SUSPECT,
    (_S.READY, _E.PRESENT): _S.READY,
    (_S.READY, _E.BYE): _S.LEAVING,
    (_S.READY, _E.LOST): _S.DEAD,
    (_S.SUSPECT, _E.MISSING): _S.SUSPECT,
    (_S.SUSPECT, _E.PRESENT): _S.READY,
    (_S.SUSPECT, _E.BYE): _S.LEAVING,
    (_S.SUSPECT, _E.LOST): _S.DEAD,
    (_S.LEAVING, _E.READY): _S.LEAVING,  # said bye before its ready arrived
    (_S.LEAVING, _E.MISSING): _S.LEAVING,  # deregistered on purpose
    (_S.LEAVING, _E.PRESENT): _S.LEAVING,
    (_S.LEAVING, _E.BYE): _S.LEAVING,  # repeated while it drains: it lives
    (_S.LEAVING, _E.LOST): _S.LEFT,
    (_S.DEAD, _E.RESPAWN): _S.RESTARTING,
    **{(s, e): s for s in (_S.LEFT, _S.DEAD, _S.RESTARTING) for e in (_E.READY, _E.BYE)},
}

#: States in which a replica may be sent new work.
ROUTABLE = frozenset({_S.READY, _S.SUSPECT})
#: States of a replica that is gone for good.
GONE = frozenset({_S.LEFT, _S.DEAD, _S.RESTARTING})


class ReplicaStateError(OmniflowError):
    """An event that the replica lifecycle does not allow in the replica's state (a bug in the
    runtime, not in user code); the message names the replica, both states and its story."""


def transition(
    replica_id: str, state: ReplicaState, event: ReplicaEvent, story: list[str] | None = None
) -> ReplicaState:
    """The state after ``event``; ReplicaStateError if the pair is not in TRANSITIONS."""
    nxt = TRANSITIONS.get((state, event))
    if nxt is None:
        told = "; ".join(story or []) or "nothing yet"
        raise ReplicaStateError(
            f"replica '{replica_id}': event '{event.value}' is not allowed in state "
            f"'{state.value}' (it leads nowhere from there); its story: {told}"
        )
    return nxt


class Lifecycle:
    """One replica's state with the story of how it got there (bounded)."""

    __slots__ = ("_story", "replica_id", "state")

    #: How many transitions the story keeps.
    STORY = 32

    def __init__(self, replica_id: str) -> None:
        #: The replica, for messages.
        self.replica_id = replica_id
        #: Where it is in its life.
        self.state = ReplicaState.STARTING
        #: "state --event (why)--> state" lines, oldest first.
        self._story: deque[str] = deque(maxlen=self.STORY)

    def apply(self, event: ReplicaEvent, why: str = "") -> ReplicaState:
        old = self.state
        self.state = transition(self.replica_id, old, event, list(self._story))
        if self.state is not old:
            note = f" ({why})" if why else ""
            self._story.append(f"{old.value} --{event.value}{note}--> {self.state.value}")
        return self.state

    def story(self) -> list[str]:
        return list(self._story)

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE

    @property
    def alive(self) -> bool:
        return self.state not in GONE

    def __repr__(self) -> str:
        return f"Lifecycle({self.replica_id!r}, {self.state.value})"


class Backoff:
    """Respawn delays per slot: 0.1 s, doubling with each death that came within a minute of
    the replica's start (or each failed start), at most 30 s.

    >>> b = Backoff()
    >>> [b.after_death(("g", 0), lived=1.0) for _ in range(3)]
    [0.1, 0.2, 0.4]
    >>> b.after_death(("g", 0), lived=120.0)
    0.1
    """

    __slots__ = ("_quick",)

    def __init__(self) -> None:
        #: (process group, slot) -> consecutive quick deaths (the exponent).
        self._quick: dict[tuple[str, int], int] = {}

    def after_death(self, slot: tuple[str, int], lived: float) -> float:
        """The delay before respawning a replica of ``slot`` that died after ``lived`` s."""
        if lived > RESPAWN_RESET:
            self._quick[slot] = 0
        n = self._quick.get(slot, 0)
        self._quick[slot] = n + 1
        return min(RESPAWN_CAP, RESPAWN_BASE * float(2**n))

    def after_failed_start(self, slot: tuple[str, int]) -> float:
        """The delay before trying again after a respawn of ``slot`` failed to start."""
        n = self._quick[slot] = self._quick.get(slot, 0) + 1
        return min(RESPAWN_CAP, RESPAWN_BASE * float(2**n))

    def restarts(self, slot: tuple[str, int]) -> int:
        """Consecutive quick deaths of ``slot`` so far."""
        return self._quick.get(slot, 0)
