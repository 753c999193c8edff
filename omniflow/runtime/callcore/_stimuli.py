"""What goes into the call core and what comes out: stimuli, instructions, states, the story.

The shell (``_runtime``) turns everything that happens to a call into one stimulus and hands
it to ``CallCore.handle``; the answer is an ``Instructions`` record it carries out:

>>> ins = core.handle(Start({"request": "hi"}))                 # doctest: +SKIP
>>> for act in ins.run: ...                                     # doctest: +SKIP
>>> ins = core.handle(Returned(act, {"reply": "hello"}))        # doctest: +SKIP
>>> ins.emit, ins.finished                                      # doctest: +SKIP
((('reply', 'hello', 'chat.run', 0),), True)

Every stimulus gets an id (its number within the call) and one story record; the transitions it
causes (bucket created, fired, DEAD, errors, warnings, the end) are recorded under that id.
Records are flat tuples ``(call id, stimulus id, event, *values)``, rendered into dicts only
when somebody reads the story.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from omniflow.runtime.callcore._liveness import Entry, Table

if TYPE_CHECKING:
    from omniflow.data._ref import DataRef

__all__ = [
    "NOTHING",
    "REJECTED",
    "SETTLE",
    "ActState",
    "Activation",
    "Cancel",
    "CancelKind",
    "Crash",
    "Emit",
    "Ended",
    "Instructions",
    "Produced",
    "Returned",
    "Settle",
    "Start",
    "Stimulus",
    "TransitionError",
    "render_story",
]

#: A frame for the caller: (field, value, node, seq index).
Emit = tuple[str, Any, str, int]


class ActState(enum.Enum):
    """Where an activation stands. PENDING -> RUNNING -> DONE, or PENDING -> DONE (dropped,
    or DEAD on a latch); nothing else (``CallState._move`` enforces it)."""

    #: Admitted; waits for its turn (session order, max_concurrency) or a latched value.
    PENDING = "pending"
    #: Handed to the shell to run (``Instructions.run``), until the shell reports its end.
    RUNNING = "running"
    #: Ended, or dropped before it ran.
    DONE = "done"

    # Members are singletons: hash them by identity, in C (``Enum.__hash__`` is Python code,
    # and the transition table is looked up twice per activation).
    __hash__ = object.__hash__


#: Legal moves: state -> the states it may move to.
LEGAL: dict[ActState, frozenset[ActState]] = {
    ActState.PENDING: frozenset({ActState.RUNNING, ActState.DONE}),
    ActState.RUNNING: frozenset({ActState.DONE}),
    ActState.DONE: frozenset(),
}


class Activation:
    """One run of one node's method with one set of inputs."""

    __slots__ = (
        "aid",
        "group",
        "kwargs",
        "node",
        "refs",
        "seq",
        "state",
        "table",
        "yidx",
    )

    def __init__(
        self,
        aid: int,
        node: str,
        group: int,
        kwargs: dict[str, Any],
        table: Table,
        seq: Entry,
        state: ActState = ActState.PENDING,
    ) -> None:
        #: Activation id, unique within the call.
        self.aid = aid
        #: Node name.
        self.node = node
        #: OR group that fired.
        self.group = group
        #: Keyword arguments for the method.
        self.kwargs = kwargs
        #: Entries the inputs descend from.
        self.table = table
        #: Nearest SeqId entry of the inputs (stream and index used for ordering).
        self.seq = seq
        #: PENDING, RUNNING or DONE (born PENDING, or RUNNING when admitted straight to
        #: running; moved by ``CallState._move`` only).
        self.state = state
        #: Frames produced so far (the next frame's yield index; counted for stamping nodes).
        self.yidx = 0
        #: Data-plane refs among its inputs (each held until the activation ends).
        self.refs: list[DataRef] | None = None

    def __repr__(self) -> str:
        return f"<Activation {self.node}#{self.aid} g{self.group} seq={self.seq}>"


class CancelKind(enum.Enum):
    """Why a call is being stopped."""

    #: The caller cancelled (the call ends "cancelled").
    CANCEL = "cancel"
    #: Its deadline passed (the call ends "error", with the shell's timeout NodeError).
    TIMEOUT = "timeout"
    #: A rule of the call broke (a loop past max_iterations): the call ends "error".
    ERROR = "error"


class TransitionError(AssertionError):
    """An activation was asked to make a move the state table does not allow: an omniflow bug.
    The message names the call, the node, both states and the call's story so far."""

    def __init__(
        self,
        call_id: str,
        node: str,
        aid: int,
        state: ActState,
        to: ActState,
        story: list[tuple[str, dict[str, Any]]],
    ) -> None:
        self.call_id = call_id
        self.node = node
        self.aid = aid
        self.state = state
        self.to = to
        self.story = story
        tail = "\n".join(f"  {ev} {d}" for ev, d in story[-20:]) or "  (story off)"
        super().__init__(
            f"call {call_id}: activation {node}#{aid} cannot move {state.value} -> {to.value} "
            f"(allowed from {state.value}: "
            f"{sorted(s.value for s in LEGAL[state]) or 'nothing'}); story:\n{tail}"
        )


# ------------------------------------------------------------------ stimuli


class Start(NamedTuple):
    """Deliver the call's inputs (the Placeholders)."""

    inputs: dict[str, Any]


class Produced(NamedTuple):
    """A running method yielded (or, remotely, sent) a frame; it keeps running."""

    act: Activation
    frame: Any


class Returned(NamedTuple):
    """A coroutine method returned ``value`` (None: no frame) and is done. ``settle=False``
    while the shell is still starting a batch of ready work: it sends ``SETTLE`` after it."""

    act: Activation
    value: Any
    settle: bool = True


class Ended(NamedTuple):
    """A method ended: its stream ended (``exc`` None), it raised, or it was cancelled
    (``asyncio.CancelledError``). ``settle`` as for ``Returned``."""

    act: Activation
    exc: BaseException | None = None
    settle: bool = True


class Settle(NamedTuple):
    """The shell started a batch of ready work: evaluate what the batch left behind."""


class Cancel(NamedTuple):
    """Stop the call: drop pending work and buckets, cancel what runs. ``error``: a NodeError
    of the shell's to record first (a timeout)."""

    kind: CancelKind = CancelKind.CANCEL
    reason: str = "the call was cancelled"
    error: Any = None


class Crash(NamedTuple):
    """An internal error surfaced while the shell drove the call: end it with an error naming
    the bug, and cancel everything that runs."""

    exc: BaseException


Stimulus = Start | Produced | Returned | Ended | Settle | Cancel | Crash

#: The one ``Settle`` stimulus.
SETTLE = Settle()


class Instructions(NamedTuple):
    """What the shell must do after a stimulus, in this order: release ``release`` (data-plane
    refs whose last holder let go), push ``emit`` to the caller, start ``run``, cancel the
    tasks of ``cancel``; then, if ``finished``, end the call. ``accepted`` answers
    ``Produced``: False means stop the method (its frame was rejected, or the call is
    closing)."""

    run: tuple[Activation, ...] = ()
    emit: tuple[Emit, ...] = ()
    release: tuple[DataRef, ...] = ()
    cancel: tuple[Activation, ...] = ()
    finished: bool = False
    accepted: bool = True


#: Nothing to do.
NOTHING = Instructions()
#: Nothing to do, and the frame was not taken.
REJECTED = Instructions(accepted=False)


# ------------------------------------------------------------------ the story

#: Story event -> the names of its values, in record order.
STORY_FIELDS: dict[str, tuple[str, ...]] = {
    # stimuli
    "start": ("inputs",),
    "frame": ("node", "aid"),
    "return": ("node", "aid"),
    "end": ("node", "aid", "exc"),
    "settle": (),
    "cancel": ("kind", "reason"),
    "crash": ("error",),
    # transitions they caused
    "bucket": ("node", "group", "key", "seq"),
    "fire": ("node", "group", "key", "aid"),
    "dead": ("node", "group", "key", "reason"),
    # a group-ordered session node released an activation: "order" (no earlier group's
    # bucket of its index gathers), "loop" (only the node's own queued work can complete
    # those that do), "stuck" (nothing else could run)
    "session": ("node", "group", "aid", "seq", "why"),
    "error": ("node", "aid", "error"),
    "cancelled": ("node", "aid"),
    "warning": ("node", "field", "message"),
    "finish": ("status",),
}


def render_story(
    records: Iterable[tuple[Any, ...]], call_id: str
) -> list[tuple[str, dict[str, Any]]]:
    """The story records of ``call_id`` as ``(event, {"stimulus": id, field: value, ...})``."""
    out: list[tuple[str, dict[str, Any]]] = []
    for cid, sid, event, *values in records:
        if cid != call_id:
            continue
        d: dict[str, Any] = {"stimulus": sid}
        d.update(zip(STORY_FIELDS[event], values, strict=True))
        out.append((event, d))
    return out
