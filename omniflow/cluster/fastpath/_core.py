"""The fast path's machine: every decision the front takes about forwarded runs, pure.

>>> fast = FastPathCore()
>>> fast.handle(Started("c", 1))
[]
>>> fast.handle(Unbound("r2", "c", "1.0.0", "its done", done=True, may_wait=False))
[]
>>> fast.state("c", "1.0.0")
<RunState.EARLY: 'early'>

A worker starts a direct-fire run on another worker itself (docs/fast-path.md); the front's
call core still makes the activation it always makes. This machine binds the two, keeps what
a forwarded run sends before its binding and replays it after, orphans (cancels, drops what
they send) the runs the core did not make, cuts the runs below an activation whose replica was
lost, and claims the bound runs a lost forwarder may never have delivered. It takes events
(``_events``) and returns instructions; it does no I/O, reads no clock and awaits nothing.
The router (``_remote``, ``_remote_replies``) and ``_remote_fast.FastPath`` carry them out.

Each forwarded run is in one ``RunState`` (or gone); ``LEGAL`` is the table of moves, checked
at every move (``FastPathTransitionError``), each recorded in a bounded story
(``story(call_id)``); ``validate()`` checks every invariant (tests call it after each event).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from omniflow.cluster.fastpath._events import (
    LEGAL,
    WAIT,
    AskClaims,
    Bind,
    CallEnded,
    ClaimAnswer,
    Deliver,
    Drop,
    Ended,
    Event,
    Fail,
    FastPathTransitionError,
    Handled,
    Instruction,
    Lost,
    Made,
    Malformed,
    Reported,
    RunState,
    SendCancel,
    SendClaim,
    Started,
    Unbound,
)
from omniflow.cluster.fastpath._validate import validate_fastpath
from omniflow.cluster.fastpath._waiting import Waiting, parent_of

__all__ = ["FastPathCore"]

_EARLY, _EXPECTED, _BOUND, _ORPHAN = (
    RunState.EARLY, RunState.EXPECTED, RunState.BOUND, RunState.ORPHAN,
)  # fmt: skip

#: (call id, wire id): how the front knows a run.
Key = tuple[str, int | str]
#: What a reported frame says of one forwarded run: (wire id, route, SeqId index, forwarder).
Expected = tuple[str, Any, int, Any]


class FastPathCore:
    """Forwarded runs from the frame that reports them (or their first message) to their end."""

    __slots__ = (
        "_bound", "_claim_ids", "_handlers", "_rejected", "_story", "bound", "claims", "cut",
        "early", "events", "expect", "forwarded", "orphaned", "orphans", "running", "runs",
    )  # fmt: skip

    def __init__(self, story: int = 4096) -> None:
        #: (call id, wire id) -> state of each forwarded run the front keeps anything of.
        self.runs: dict[tuple[str, str], RunState] = {}
        #: While a reported frame is in the core: node -> what it forwarded to that node.
        self.expect: dict[str, Expected] | None = None
        #: Expected runs whose activation differed from what was forwarded (orphaned at
        #: ``Handled``, with the ones the core did not make).
        self._rejected: list[Expected] = []
        #: Runs bound while the reported frame is in the core (their early messages replay).
        self._bound: list[tuple[str, str]] = []
        #: call id -> what its unbound forwarded runs sent (each message with its ``done``).
        self.early: dict[str, Waiting] = {}
        #: call id -> wire id -> replica of each orphan not ended yet (what it sends is dropped).
        self.orphans: dict[str, dict[str, Any]] = {}
        #: call id -> activations with routes that ended with their replica lost: frames of
        #: theirs may never come, so a run they forwarded that turns up later is an orphan.
        self.cut: dict[str, set[int | str]] = {}
        #: Runs with routes on their replicas: the parents that may still report forwards.
        self.running: set[Key] = set()
        #: Bound forwarded runs -> (the replica that runs it, its forwarder).
        self.bound: dict[tuple[str, str], tuple[Any, Any]] = {}
        #: Claims asked: request id -> (the replica asked, call id, wire ids, lost forwarder).
        self.claims: dict[int, tuple[Any, str, list[str], Any]] = {}
        self._claim_ids = itertools.count(1)
        #: Runs bound, and runs orphaned (observability).
        self.forwarded = 0
        self.orphaned = 0
        #: Events handled (each story record names the event it came from).
        self.events = 0
        #: The last moves: (event number, event, call id, wire id, from, to); None: off.
        self._story: deque[tuple[Any, ...]] | None = deque(maxlen=story) if story else None
        self._handlers: dict[type, Callable[[Any], list[Instruction]]] = {
            Reported: self._reported,
            Made: self._made,
            Handled: self._handled,
            Unbound: self._unbound,
            Started: self._started,
            Ended: self._ended,
            Lost: self._lost,
            AskClaims: self._ask_claims,
            ClaimAnswer: self._claim_answer,
            CallEnded: self._call_ended,
        }

    def handle(self, event: Event) -> list[Instruction]:
        """Take one event; what the shell must do, in order."""
        self.events += 1
        return self._handlers[type(event)](event)

    # ---------------------------------------------------------------- observability

    def state(self, c: str, wid: str) -> RunState | None:
        """Where forwarded run ``wid`` of call ``c`` stands (None: gone)."""
        return self.runs.get((c, wid))

    def waiting(self) -> int:
        """Runs kept for calls: early, cut, orphans (0 once every call ended)."""
        return (
            sum(len(e) for e in self.early.values())
            + sum(len(c) for c in self.cut.values())
            + sum(len(o) for o in self.orphans.values())
        )

    def story(self, c: str, wid: str | None = None) -> list[dict[str, Any]]:
        """The recorded moves of call ``c``'s forwarded runs (of ``wid`` only, if given)."""
        return [
            {"event": n, "on": ev, "wid": w, "from": _name(old), "to": _name(new)}
            for n, ev, cid, w, old, new in self._story or ()
            if cid == c and (wid is None or w == wid)
        ]

    # ---------------------------------------------------------------- moves

    def _move(self, c: str, wid: str, to: RunState | None, on: str) -> None:
        key = (c, wid)
        runs = self.runs
        old = runs.get(key)
        if to not in LEGAL[old]:
            raise FastPathTransitionError(c, wid, old, to, on, self.story(c, wid))
        if to is None:
            del runs[key]
        else:
            runs[key] = to
        story = self._story
        if story is not None:
            story.append((self.events, on, c, wid, old, to))

    def _gone(self, c: str, wid: str, on: str) -> None:
        if (c, wid) in self.runs:
            self._move(c, wid, None, on)

    def _orphan(
        self, out: list[Instruction], rep: Any, c: str, wid: str, done: bool, on: str
    ) -> None:
        """A forwarded run the core did not make: cancel it (unless it is ``done``) and drop
        what it sends until its done."""
        self.orphaned += 1
        if done or not rep.alive:  # (a lost replica sends nothing more)
            self._gone(c, wid, on)
            return
        self.orphans.setdefault(c, {})[wid] = rep
        self._move(c, wid, _ORPHAN, on)
        out.append(SendCancel(rep, c, wid))

    def _drop(
        self, out: list[Instruction], c: str, wid: str, msg: Any, done: bool, on: str
    ) -> None:
        """Drop ``msg`` of orphan ``wid``; its done ends the orphan."""
        if done:
            orphans = self.orphans.get(c)
            if orphans is not None and orphans.pop(wid, None) is not None:
                self._move(c, wid, None, on)
                if not orphans:
                    del self.orphans[c]
        out.append(Drop(msg))

    def _drop_early(
        self, out: list[Instruction], rep: Any, c: str, wid: str, msgs: list[Any], on: str
    ) -> None:
        """Unbound run ``wid`` can no longer be bound: an orphan; drop what it sent."""
        self._orphan(out, rep, c, wid, any(done for _m, done in msgs), on)
        for m, done in msgs:
            self._drop(out, c, wid, m, done, on)

    def _is_orphan(self, c: str, wid: int | str) -> bool:
        """Whether nothing can bind ``wid`` any more: its nearest ancestor the front knows of
        is an orphan, or is not running (an activation that ended had every frame handled,
        so each run it forwarded is bound or orphaned). An ancestor still waiting for its own
        binding decides nothing: look further up."""
        orphans = self.orphans.get(c, ())
        cut = self.cut.get(c, ())
        running = self.running
        while type(wid) is str:
            if wid in orphans:
                return True
            wid = parent_of(wid)
            if (c, wid) in running:
                return False
            if wid in cut:
                return True
        return True

    # ---------------------------------------------------------------- a reported frame

    def _reported(self, ev: Reported) -> list[Instruction]:
        if self.expect is not None:
            raise AssertionError(f"call {ev.c}: a frame of {ev.a} reported inside another's")
        rep, c, a, k, routes = ev.rep, ev.c, ev.a, ev.k, ev.routes
        runs = self.runs
        expect: dict[str, Expected] = {}
        out: list[Instruction] = []
        for item in ev.x:
            if type(item) is list and len(item) == 2:
                r, wid = item
                # (``wire_id(a, k, r)``, inline: once per forwarded run)
                if type(r) is int and 0 <= r < len(routes) and wid == f"{a}.{k}.{r}":
                    plan = routes[r]
                    hop = plan.hop
                    state = runs.get((c, wid))
                    if (state is None or state is _EARLY) and hop.node not in expect:
                        expect[hop.node] = (wid, plan, k if hop.qk else ev.seq, rep)
                        self._move(c, wid, _EXPECTED, "reported")
                        continue
            out.append(Malformed(rep, "malformed", f"a forward note {item!r:.60}"))
        self.expect = expect
        return out

    def _made(self, ev: Made) -> list[Instruction]:
        expect = self.expect
        if expect is None:
            return []
        hit = expect.pop(ev.node, None)
        if hit is None:
            return []
        wid, plan, q, via = hit
        hop = plan.hop
        kwargs = ev.kwargs
        if (
            not plan.rep.routable
            or ev.group != hop.group
            or ev.q != q
            or len(kwargs) != 1
            or hop.field not in kwargs
        ):
            self._rejected.append(hit)  # (an orphan at ``Handled``; the core's goes the slow way)
            return []
        c = ev.c
        key = (c, wid)
        self._move(c, wid, _BOUND, "made")
        self.bound[key] = (plan.rep, via)
        if plan.sub:
            self.running.add(key)
        self.forwarded += 1
        self._bound.append(key)
        return [Bind(wid, plan, via)]

    def _handled(self, ev: Handled) -> list[Instruction]:
        """The runs the frame reported that the core did not make are orphans, with what
        they sent and their unbound descendants; the bound ones' early messages replay."""
        c = ev.c
        expect = self.expect
        if expect is None:
            raise AssertionError(f"call {c}: a frame handled that was never reported")
        self.expect = None
        out: list[Instruction] = []
        left = [*self._rejected, *expect.values()]
        self._rejected.clear()
        for wid, plan, _q, _via in left:
            waiting = self.early.get(c)
            entry = waiting.take(wid) if waiting is not None else None
            if entry is None:
                self._orphan(out, plan.rep, c, wid, False, "handled")
            else:
                self._drop_early(out, plan.rep, c, wid, entry[1], "handled")
            if waiting is not None:
                for sub, rep, msgs in waiting.orphans_of(wid):  # (it will bind none of them)
                    self._drop_early(out, rep, c, sub, msgs, "handled")
                if not waiting.early:
                    del self.early[c]
        bound = self._bound
        while bound:
            c2, wid = bound.pop()
            waiting = self.early.get(c2)
            if waiting is None:
                continue
            entry = waiting.take(wid)
            if entry is None:
                continue
            if not waiting.early:
                del self.early[c2]
            rep, msgs = entry
            out.extend(Deliver(rep, m) for m, _done in msgs)
        return out

    # ---------------------------------------------------------------- messages before binding

    def _unbound(self, ev: Unbound) -> list[Instruction]:
        rep, c, wid = ev.rep, ev.c, ev.wid
        state = self.runs.get((c, wid))
        if state is _BOUND or state is _EXPECTED:  # (bound on another replica: not its to say)
            return [Malformed(rep, "foreign", f"a message of ({c!r:.40}, {wid}), not its run")]
        if self._is_orphan(c, wid):
            out: list[Instruction] = []
            if state is _EARLY:  # (its parent's end found none of it: all of it goes now)
                kept = self.early[c]
                entry = kept.take(wid)
                assert entry is not None
                if not kept.early:
                    del self.early[c]
                entry[1].append((ev.msg, ev.done))
                self._drop_early(out, entry[0], c, wid, entry[1], "unbound")
                return out
            if state is None and not ev.done:
                self._orphan(out, rep, c, wid, False, "unbound")  # (not known as one yet)
            self._drop(out, c, wid, ev.msg, ev.done, "unbound")
            return out
        if ev.may_wait:
            return [WAIT]
        waiting = self.early.get(c)
        if waiting is None:
            waiting = self.early[c] = Waiting()
        waiting.add(rep, wid, (ev.msg, ev.done))
        if state is None:
            self._move(c, wid, _EARLY, "unbound")
        return []

    # ---------------------------------------------------------------- runs with routes

    def _started(self, ev: Started) -> list[Instruction]:
        self.running.add((ev.c, ev.a))
        return []

    def _ended(self, ev: Ended) -> list[Instruction]:
        """A run ended: a bound one is gone; the unbound runs below one with routes never
        will be bound (every frame of it was handled): orphans."""
        c, a = ev.c, ev.a
        key = (c, a)
        if type(a) is str and self.bound.pop((c, a), None) is not None:
            self._move(c, a, None, "ended")
        if key not in self.running:
            return []
        self.running.remove(key)
        waiting = self.early.get(c)  # (never empty: emptied ones are deleted)
        if waiting is None or a not in waiting.kids:
            return []
        out: list[Instruction] = []
        for wid, rep, msgs in waiting.orphans_of(a):
            self._drop_early(out, rep, c, wid, msgs, "ended")
        if not waiting.early:
            del self.early[c]
        return out

    # ---------------------------------------------------------------- lost replicas, claims

    def _lost(self, ev: Lost) -> list[Instruction]:
        """What ``rep`` sent before binding goes with it, and its orphans; claims asked of it
        are forgotten (what it held fails); the activations with routes it held are cut."""
        rep = ev.rep
        for c in list(self.early):
            waiting = self.early[c]
            for wid in [w for w, (r, _) in waiting.early.items() if r is rep]:
                self._move(c, wid, None, "lost")
            waiting.drop_replica(rep)
            if not waiting:
                del self.early[c]
        for c in list(self.orphans):
            orphans = self.orphans[c]
            for wid in [w for w, r in orphans.items() if r is rep]:
                del orphans[wid]
                self._move(c, wid, None, "lost")
            if not orphans:
                del self.orphans[c]
        for r in [r for r, claim in self.claims.items() if claim[0] is rep]:
            del self.claims[r]
        for c, a in ev.cut:
            self.cut.setdefault(c, set()).add(a)
        return []

    def _ask_claims(self, ev: AskClaims) -> list[Instruction]:
        """``via`` was lost: runs it forwarded that the front bound may never have reached
        their replica (the frame that reported a forward may reach the front before the
        forward leaves the worker's queues). Ask each live replica which of them it does not
        hold, one claim per call."""
        via = ev.via
        asked: dict[tuple[Any, str], list[str]] = {}
        for (c, wid), (target, v) in self.bound.items():
            if v is via and target.alive:
                asked.setdefault((target, c), []).append(wid)
        out: list[Instruction] = []
        for (target, c), wids in asked.items():
            r = next(self._claim_ids)
            self.claims[r] = (target, c, wids, via)
            out.append(SendClaim(target, r, c, wids, via))
        return out

    def _claim_answer(self, ev: ClaimAnswer) -> list[Instruction]:
        """The runs ``rep`` does not hold never will run: they fail as lost with their
        forwarder, and what they might still send is dropped (orphans). One that ended
        meanwhile (its done came first on the same connection) is left alone."""
        rep, r, c = ev.rep, ev.r, ev.c
        claim = self.claims.get(r)
        if claim is None or claim[0] is not rep or claim[1] != c:
            return [Malformed(rep, "foreign", f"an answer to claim {r}, not its")]
        del self.claims[r]
        asked, via = set(claim[2]), claim[3]
        out: list[Instruction] = []
        for wid in ev.missing:
            if type(wid) is not str or wid not in asked:
                out.append(Malformed(rep, "malformed", f"a claimed {wid!r:.40}"))
                continue
            key = (c, wid)
            held = self.bound.get(key)
            if held is None or held[0] is not rep:
                continue
            del self.bound[key]
            self.orphans.setdefault(c, {})[wid] = rep
            self._move(c, wid, _ORPHAN, "claimed")
            self.orphaned += 1
            out.append(Fail(rep, c, wid, via))
        return out

    # ---------------------------------------------------------------- the call's end

    def _call_ended(self, ev: CallEnded) -> list[Instruction]:
        """Call ``c`` ended: its runs still unaccounted for can never be bound."""
        c = ev.c
        out: list[Instruction] = []
        waiting = self.early.pop(c, None)
        if waiting is not None:
            for wid, (rep, msgs) in waiting.early.items():
                self._drop_early(out, rep, c, wid, msgs, "call ended")
        orphans = self.orphans.pop(c, None)  # (what they send later is dropped all the same)
        for wid in orphans or ():
            self._move(c, wid, None, "call ended")
        self.cut.pop(c, None)
        return out

    # ---------------------------------------------------------------- invariants

    def validate(self) -> None:
        """Raise AssertionError naming the first breach of an invariant (``_validate``)."""
        validate_fastpath(
            self.runs, self.expect, self._rejected, self._bound, self.early, self.orphans,
            self.bound, self.cut, self.claims,
        )  # fmt: skip
        assert self.forwarded >= 0 and self.orphaned >= 0


def _name(state: RunState | None) -> str:
    return "gone" if state is None else state.value
