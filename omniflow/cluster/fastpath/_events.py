"""What goes into the fast-path machine and what comes out: events, instructions, run states.

The front's shell (``_remote``, ``_remote_replies``, ``_remote_fast``) turns everything that
happens to a forwarded run into one event for ``FastPathCore.handle`` and carries out the
instructions it returns, in order:

>>> out = fast.handle(Reported(rep, "c", 1, 0, [[0, "1.0.0"]], routes, 0))  # doctest: +SKIP
>>> out = fast.handle(Made("c", "m.run", 0, 0, {"x": 1}))                   # doctest: +SKIP
>>> out                                                                     # doctest: +SKIP
[Bind(wid='1.0.0', plan=..., via=rep)]

Replica handles are opaque to the machine but for two flags it reads at the event: ``alive``
(a lost replica is sent nothing and sends nothing more) and ``routable`` (a run is bound only
to a replica that still takes runs). Messages are opaque too: the shell says whether one is a
run's end (``done``) and releases the data-plane refs of one it is told to drop.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Protocol

__all__ = [
    "LEGAL",
    "WAIT",
    "AskClaims",
    "Bind",
    "CallEnded",
    "ClaimAnswer",
    "Deliver",
    "Drop",
    "Ended",
    "Event",
    "Fail",
    "FastPathTransitionError",
    "Handled",
    "Instruction",
    "Lost",
    "Made",
    "Malformed",
    "PlanLike",
    "ReplicaLike",
    "Reported",
    "RunState",
    "SendCancel",
    "SendClaim",
    "Started",
    "Unbound",
    "Wait",
]


class ReplicaLike(Protocol):
    """What the machine reads of a replica handle (``_fleet_replica.Replica``)."""

    @property
    def alive(self) -> bool: ...

    @property
    def routable(self) -> bool: ...


class HopLike(Protocol):
    """What the machine reads of a fast-path edge (``_forward.Hop``)."""

    @property
    def field(self) -> str: ...

    @property
    def node(self) -> str: ...

    @property
    def group(self) -> int: ...

    @property
    def qk(self) -> bool: ...


class PlanLike(Protocol):
    """What the machine reads of a route as the front sent it (``_remote_pending.Plan``)."""

    @property
    def hop(self) -> HopLike: ...

    @property
    def rep(self) -> Any: ...

    @property
    def sub(self) -> tuple[Any, ...]: ...


class RunState(enum.Enum):
    """Where a forwarded run stands at the front (a run the machine keeps nothing of is
    *gone*: never heard of, ended, or forgotten with its replica or its call)."""

    #: Messages came before anything reported it; they wait (``Waiting``) for its binding.
    EARLY = "early"
    #: The frame that reports it is in the core: the next activation of its node binds it.
    EXPECTED = "expected"
    #: Bound to the core's activation: the router's pending run on its replica.
    BOUND = "bound"
    #: The core did not make it (or it was claimed lost): cancelled, what it sends dropped.
    ORPHAN = "orphan"

    __hash__ = object.__hash__


#: Legal moves: state (None: gone) -> the states it may move to (None: gone).
LEGAL: dict[RunState | None, frozenset[RunState | None]] = {
    None: frozenset({RunState.EARLY, RunState.EXPECTED, RunState.ORPHAN}),
    RunState.EARLY: frozenset({RunState.EXPECTED, RunState.ORPHAN, None}),
    RunState.EXPECTED: frozenset({RunState.BOUND, RunState.ORPHAN, None}),
    RunState.BOUND: frozenset({RunState.ORPHAN, None}),
    RunState.ORPHAN: frozenset({None}),
}


class FastPathTransitionError(AssertionError):
    """A forwarded run was asked to make a move the table does not allow: an omniflow bug.
    The message names the call, the run, both states, the event and the run's story."""

    def __init__(
        self,
        call_id: str,
        wid: str,
        state: RunState | None,
        to: RunState | None,
        event: str,
        story: list[dict[str, Any]],
    ) -> None:
        self.call_id, self.wid, self.state, self.to = call_id, wid, state, to

        def name(s: RunState | None) -> str:
            return "gone" if s is None else s.value

        tail = "\n".join(f"  {d}" for d in story[-20:]) or "  (nothing)"
        super().__init__(
            f"call {call_id}: forwarded run {wid} cannot move {name(state)} -> {name(to)} on "
            f"{event} (allowed: {sorted(name(s) for s in LEGAL[state])}); its story:\n{tail}"
        )


# ---------------------------------------------------------------------------- events


class Reported(NamedTuple):
    """Frame ``k`` of activation ``a`` (running on ``rep`` with ``routes``; its own SeqId index
    ``seq``) reports the runs it forwarded (``x``: ``[route index, wire id]`` notes); the
    shell hands the frame to the core next, then sends ``Handled``."""

    rep: Any
    c: str
    a: int | str
    k: int
    x: list[Any]
    routes: tuple[Any, ...]
    seq: int


class Made(NamedTuple):
    """While a reported frame is in the core, it made an activation of ``node`` (OR group
    ``group``, SeqId index ``q``, arguments ``kwargs``): bind it if it is the forwarded one."""

    c: str
    node: str
    group: int
    q: int
    kwargs: dict[str, Any]


class Handled(NamedTuple):
    """The core handled the reported frame of call ``c``."""

    c: str


class Unbound(NamedTuple):
    """``msg`` from ``rep`` is about forwarded run ``wid`` of call ``c``, which ``rep`` does not
    hold (not bound, or an orphan's); ``done``: it is the run's end; ``may_wait``: the shell
    can hand it back to wait for the end of the loop turn."""

    rep: Any
    c: str
    wid: str
    msg: Any
    done: bool
    may_wait: bool


class Started(NamedTuple):
    """The router sent run ``a`` of call ``c`` with routes: runs it forwards name it as parent."""

    c: str
    a: int | str


class Ended(NamedTuple):
    """Run ``a`` of call ``c`` (with routes, or a bound forwarded one) ended on its replicas."""

    c: str
    a: int | str


class Lost(NamedTuple):
    """``rep`` was lost; ``cut``: the activations with routes it held (ending now: frames of
    theirs may never come)."""

    rep: Any
    cut: tuple[tuple[str, int | str], ...]


class AskClaims(NamedTuple):
    """``via`` was lost and what it held failed: claim the bound runs it forwarded."""

    via: Any


class ClaimAnswer(NamedTuple):
    """``rep`` answered claim ``r`` about call ``c``: it does not hold ``missing``."""

    rep: Any
    r: int
    c: str
    missing: list[Any]


class CallEnded(NamedTuple):
    """Call ``c`` ended: its runs still unaccounted for can never be bound."""

    c: str


Event = (
    Reported | Made | Handled | Unbound | Started | Ended | Lost | AskClaims | ClaimAnswer
    | CallEnded
)  # fmt: skip


# ---------------------------------------------------------------------------- instructions


class Wait(NamedTuple):
    """Hand the message back: it waits at the fleet for the end of the loop turn."""


#: The one ``Wait`` (it has no fields).
WAIT = Wait()


class Bind(NamedTuple):
    """Take the activation just made as forwarded run ``wid`` on ``plan.rep`` (from ``via``)."""

    wid: str
    plan: Any
    via: Any


class SendCancel(NamedTuple):
    """Send ``Cancel(c, wid)`` to ``rep``."""

    rep: Any
    c: str
    wid: str


class SendClaim(NamedTuple):
    """Send ``Claim(r, c, wids)`` to ``target``: which of these runs, forwarded by lost
    ``via``, it does not hold."""

    target: Any
    r: int
    c: str
    wids: list[str]
    via: Any


class Drop(NamedTuple):
    """Drop ``msg`` (an orphan's): release the data-plane refs among its outputs."""

    msg: Any


class Deliver(NamedTuple):
    """Hand ``msg`` from ``rep`` to the router as if it arrived now (a replay)."""

    rep: Any
    msg: Any


class Fail(NamedTuple):
    """End bound run ``wid`` of call ``c`` on ``rep`` as lost with its forwarder ``via``."""

    rep: Any
    c: str
    wid: str
    via: Any


class Malformed(NamedTuple):
    """Count and log a dropped message part from ``rep`` (``reason``: the wire's counter)."""

    rep: Any
    reason: str
    what: str


Instruction = Wait | Bind | SendCancel | SendClaim | Drop | Deliver | Fail | Malformed
