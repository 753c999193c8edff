"""The fast-path machine under random event orders (hypothesis): frames reporting forwards
(each run made as forwarded, made unlike it, or not made), forwarded runs' messages before and
after their binding (held back by the fleet or not), runs ending, replicas lost, claims asked
and answered, calls ending. ``validate()`` after every event, and what the machine promises:

- every message it keeps is delivered once (after its run's binding) or dropped once, or is
  still kept, or went with its lost replica; a message it does not keep is handed back, or
  dropped at once;
- a run is bound at most once, and only to the activation of the frame that reported it;
- nothing is sent to a replica that is gone; a cancel is sent once per run while its call
  lives;
- a claim names only bound runs of the lost forwarder, and only those claimed fail;
- after a call's end nothing of it waits (early, orphans, cuts).
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import event as hypothesis_event
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omniflow.cluster.fastpath import FastPathCore, RunState
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
    Handled,
    Instruction,
    Lost,
    Made,
    Malformed,
    Reported,
    SendCancel,
    SendClaim,
    Started,
    Unbound,
)
from tests.runtime.fastpath_world import Plan, Rep, route

CALLS = ("c", "d")
NODES = ("m.run", "n.run")
#: How the core treats a reported run: made as forwarded, made unlike it, not made.
HOW = st.sampled_from(["made", "unlike", "not"])


class FastPathMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = FastPathCore(story=64)
        self.reps = [Rep(f"r{i}") for i in range(4)]
        self.ids = itertools.count()
        #: Activations that run with routes: (call, wire id) -> (replica, routes, frames sent).
        self.live: dict[tuple[str, int | str], list[Any]] = {}
        #: Every forwarded run reported: (call, wid) -> its route (for its replica).
        self.known: dict[tuple[str, str], Plan] = {}
        self.bound: dict[tuple[str, str], Any] = {}  # -> the replica that forwarded it
        self.kept: set[int] = set()  # message ids the machine keeps
        self.delivered: set[int] = set()
        self.dropped: set[int] = set()
        self.forgotten: set[int] = set()
        self.cancelled: set[tuple[str, str]] = set()
        self.failed: set[tuple[str, str]] = set()
        self.claims: dict[int, tuple[Any, str, list[str]]] = {}
        self.ended: set[str] = set()
        self.done: set[tuple[str, str]] = set()  # runs whose done the machine took
        self.front = itertools.count(1)

    # ------------------------------------------------------------------ the shell's side

    def handle(self, event: Any) -> list[Instruction]:
        out = self.core.handle(event)
        self.core.validate()
        for ins in out:
            hypothesis_event(type(ins).__name__)  # (--hypothesis-show-statistics: what ran)
            if type(ins) is Deliver:
                _c, wid, mid = ins.msg
                assert mid in self.kept and mid not in self.delivered | self.dropped
                assert (_c, wid) in self.bound, f"{wid} delivered before its binding"
                self.delivered.add(mid)
            elif type(ins) is Drop:
                _c, _wid, mid = ins.msg
                assert mid not in self.delivered | self.dropped
                self.dropped.add(mid)
            elif type(ins) is SendCancel:
                assert ins.rep.alive
                # (after its call's end the machine forgets its orphans: a run's later
                # message is cancelled again)
                assert ins.c in self.ended or (ins.c, ins.wid) not in self.cancelled
                self.cancelled.add((ins.c, ins.wid))
            elif type(ins) is SendClaim:
                assert ins.target.alive and not ins.via.alive
                for wid in ins.wids:
                    assert self.bound.get((ins.c, wid)) is ins.via
                self.claims[ins.r] = (ins.target, ins.c, ins.wids)
            elif type(ins) is Fail:
                assert (ins.c, ins.wid) in self.bound
                self.failed.add((ins.c, ins.wid))
                self._end(ins.c, ins.wid)  # (the shell ends it as lost)
            else:
                assert type(ins) in (Malformed, Bind) or ins is WAIT, ins
        return out

    def _end(self, c: str, a: int | str) -> None:
        if (c, a) in self.live:
            del self.live[(c, a)]
        self.handle(Ended(c, a))

    def _alive(self) -> list[Rep]:
        return [r for r in self.reps if r.alive]

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < 6)
    @rule(c=st.sampled_from(CALLS), rep=st.integers(0, 3), depth=st.integers(0, 2))
    def start(self, c: str, rep: int, depth: int) -> None:
        """The router sends a run with routes (each a chain ``depth`` hops deeper)."""
        alive = [i for i, r in enumerate(self.reps) if r.alive]
        if c in self.ended or not alive:
            return
        rep = alive[rep % len(alive)]
        a = next(self.front)

        def routes(d: int) -> tuple[Plan, ...]:
            return tuple(
                route(n, self.reps[(rep + 1 + i + d) % 4], sub=routes(d - 1) if d else ())
                for i, n in enumerate(NODES)
            )

        self.live[(c, a)] = [self.reps[rep], routes(depth), 0]
        self.handle(Started(c, a))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        """A frame of a live activation reports a forward per route; the core makes each
        as forwarded, unlike it, or not at all; then the frame is handled."""
        (c, a) = data.draw(st.sampled_from(sorted(self.live, key=str)))
        rep, routes, k = self.live[(c, a)]
        self.live[(c, a)][2] = k + 1
        x = [[r, f"{a}.{k}.{r}"] for r in range(len(routes))]
        self.handle(Reported(rep, c, a, k, x, routes, 0))
        for r, plan in enumerate(routes):
            wid = f"{a}.{k}.{r}"
            self.known[(c, wid)] = plan
            how = data.draw(HOW)
            if how == "not":
                continue
            out = self.handle(Made(c, plan.hop.node, 0, 0 if how == "made" else 1, {"x": 1}))
            if out:
                assert out == [Bind(wid, plan, rep)] and how == "made" and plan.rep.routable
                assert (c, wid) not in self.bound
                self.bound[(c, wid)] = rep
                if plan.sub:
                    self.live[(c, wid)] = [plan.rep, plan.sub, 0]
        self.handle(Handled(c))

    def _soon(self) -> dict[tuple[str, str], Plan]:
        """Runs the next two frames of each live activation will report (forwarded already:
        their messages may come first)."""
        return {
            (c, f"{a}.{k + d}.{r}"): plan
            for (c, a), (_rep, routes, k) in self.live.items()
            for d in (0, 1)
            for r, plan in enumerate(routes)
        }

    @precondition(lambda self: self.known or self.live)
    @rule(data=st.data(), done=st.booleans(), may_wait=st.booleans())
    def message(self, data: st.DataObject, done: bool, may_wait: bool) -> None:
        """A message of a forwarded run its replica does not hold: not reported yet, unbound,
        or an orphan's (a bound run's own messages go to the router, not here)."""
        runs = {**self._soon(), **self.known}
        (c, wid) = data.draw(st.sampled_from(sorted(runs)))
        rep = runs[(c, wid)].rep
        if not rep.alive or self.core.state(c, wid) is RunState.BOUND or (c, wid) in self.done:
            return  # (a worker sends nothing after a run's done)
        mid = next(self.ids)
        out = self.handle(Unbound(rep, c, wid, (c, wid, mid), done, may_wait))
        if out == [WAIT]:
            assert may_wait
            return
        if done:
            self.done.add((c, wid))
        if not out:
            self.kept.add(mid)
        else:
            assert mid in self.dropped, out

    @precondition(lambda self: self.live or self.bound)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        """A live activation, or a bound run, ends."""
        keys = sorted({*self.live, *(k for k in self.bound if k in self.core.bound)}, key=str)
        if keys:
            c, a = data.draw(st.sampled_from(keys))
            if type(a) is str:
                self.done.add((c, a))
            self._end(c, a)

    @precondition(lambda self: sum(r.alive for r in self.reps) > 2)
    @rule(i=st.integers(0, 3))
    def lose(self, i: int) -> None:
        """A replica is lost: its activations with routes are cut and end, then claims."""
        rep = self.reps[i]
        if not rep.alive:
            return
        rep.lose()
        cut = tuple(k for k, (r, _routes, _k) in self.live.items() if r is rep)
        self.forgotten |= {  # (what it sent early goes with it: nothing more will come)
            m[2]
            for waiting in self.core.early.values()
            for r, msgs in waiting.early.values()
            if r is rep
            for m, _done in msgs
        }
        self.handle(Lost(rep, cut))
        for c, a in cut:
            self._end(c, a)
        for key, (target, _via) in list(self.core.bound.items()):
            if target is rep:
                self._end(*key)
        for r in [r for r, (target, _c, _w) in self.claims.items() if target is rep]:
            del self.claims[r]
        self.handle(AskClaims(rep))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(sorted(self.claims)))
        target, c, wids = self.claims.pop(r)
        missing = data.draw(st.lists(st.sampled_from(wids), unique=True))
        before = set(self.failed)
        self.handle(ClaimAnswer(target, r, c, missing))
        for wid in set(missing):
            if (c, wid) in self.core.bound:
                raise AssertionError(f"{wid} claimed missing but still bound")
        assert self.failed - before <= {(c, w) for w in missing}

    @precondition(lambda self: len(self.ended) < len(CALLS) and len(self.known) > 4)
    @rule(c=st.sampled_from(CALLS))
    def call_ends(self, c: str) -> None:
        if c in self.ended:
            return
        for key in [k for k in self.live if k[0] == c]:
            self._end(*key)
        self.ended.add(c)
        self.handle(CallEnded(c))
        assert c not in self.core.early and c not in self.core.orphans
        assert c not in self.core.cut

    # ------------------------------------------------------------------ invariants

    @invariant()
    def every_kept_message_is_accounted_for_once(self) -> None:
        still = {
            m[2]
            for waiting in self.core.early.values()
            for _rep, msgs in waiting.early.values()
            for m, _done in msgs
        }
        gone = [self.delivered, self.dropped, self.forgotten]
        assert sum(map(len, gone)) == len(set().union(*gone)), "a message accounted twice"
        assert self.kept == (self.kept & set().union(*gone)) | still
        assert not (still & set().union(*gone))

    @invariant()
    def only_running_activations_are_parents(self) -> None:
        assert self.core.running == set(self.live)


FastPathMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
test_fast_path_machine = FastPathMachine.TestCase
