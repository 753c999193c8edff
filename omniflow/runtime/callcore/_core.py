"""The call core: every scheduling decision of one graph call, as plain synchronous code.

The async shell (``_runtime``) feeds it one stimulus at a time and carries out the answer:

    core.handle(Start | Produced | Returned | Ended | Settle | Cancel | Crash) -> Instructions

``Instructions`` (``_stimuli``) is an immutable record: activations to run, frames for the
caller, data-plane refs to release, activations whose tasks to cancel, finished or not. The
core never sees a task and the shell never writes core state: the shell keeps its own
activation -> task map. Nothing here awaits, sleeps or touches a socket, so every rule is
tested by feeding stimuli.

``CallCore`` is a dispatcher: it routes frames and admits activations, and leaves each
concern to a part that owns its tables: ``_callstate`` (the call's life, counts, holds,
errors and story, shared by all), ``_latches`` (latched fields), ``_session`` (SeqId order
of session nodes and the caller), ``_gather`` (bucket lifecycle) and ``_settle`` (what ended
since the last settle, and the call's end).

Vocabulary (design/ARCHITECTURE.md, "Words we use", has the long form):

* entry  -- ``(node, stream id, index)``: one frame of a stamping node (a diamond root or a
  SeqId producer). Frames carry a *table*: the entries they descend from, oldest first.
* bucket -- gathers the inputs of one activation of a convergence node; keyed by the entry of
  its diamond root in the arriving frame's table (Rule C); join nodes use the call's entry.
* liveness -- every pending/running activation and gathering bucket is counted at its node
  under each entry of its table. A slot, a seq index or a caller field has *ended* when no live
  work under the relevant entry can still reach its producers. That is UNREACHABLE, derived.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

from omniflow._exceptions import NodeError
from omniflow.data._ref import DataRef
from omniflow.runtime.callcore._callstate import CallLife, CallState
from omniflow.runtime.callcore._compiled import Compiled, Fanout
from omniflow.runtime.callcore._gather import Buckets
from omniflow.runtime.callcore._latches import Latches
from omniflow.runtime.callcore._liveness import FRAME, INPUT_ENTRY, Entry, Table
from omniflow.runtime.callcore._orders import Orders
from omniflow.runtime.callcore._settle import Settler
from omniflow.runtime.callcore._stimuli import (
    NOTHING,
    REJECTED,
    Activation,
    ActState,
    Cancel,
    CancelKind,
    Crash,
    Emit,
    Ended,
    Instructions,
    Produced,
    Returned,
    Settle,
    Start,
    Stimulus,
)
from omniflow.runtime.callcore._validate import validate_call

__all__ = ["Activation", "CallCore", "Emit"]

PENDING, RUNNING, DONE = ActState.PENDING, ActState.RUNNING, ActState.DONE


class CallCore(CallState):
    """Scheduling state of one graph call."""

    __slots__ = (
        "_blocked",
        "_handlers",
        "_iterations",
        "_settle",
        "buckets",
        "gather",
        "latches",
        "orders",
        "settler",
    )

    def __init__(
        self,
        compiled: Compiled,
        call_id: str,
        *,
        story: deque[tuple[Any, ...]] | None = None,
        shuffle: random.Random | None = None,
    ) -> None:
        super().__init__(compiled, call_id, story, shuffle)
        #: Stimulus type -> handler (``_IGNORE_ALL`` once crashed).
        self._handlers = _HANDLERS
        #: Per throttled node: activations blocked by its max_concurrency.
        self._blocked: dict[str, deque[Activation]] = {}
        #: Per node on a cycle: activations admitted so far (max_iterations).
        self._iterations: dict[str, int] = {}
        #: The parts.
        self.latches = Latches(self)
        self.orders = Orders(self, self.latches)
        self.gather = Buckets(self, self.orders, self._admit)
        #: Gathering buckets by (node, group, key) (``gather``'s own table; the shell reads it).
        self.buckets = self.gather.gathering
        self.settler = Settler(self, self.gather, self.orders, self.latches)
        #: The settle (``Settler.settle``), bound once: the hot path calls it per activation.
        self._settle = self.settler.settle

    # ------------------------------------------------------------------ stimuli

    def handle(self, stimulus: Stimulus) -> Instructions:
        """Take one stimulus; answer what the shell must do (see ``_stimuli``)."""
        self.stimuli += 1
        if type(stimulus) is Returned and not self.crashed:
            # A coroutine method returned (the stimulus of nearly every activation, handled
            # inline): its frame (unless None) then its end, settled once.
            act, value, settle = stimulus
            story = self._story
            if story is not None:
                story.append((self.call_id, self.stimuli, "return", act.node, act.aid))
            if value is not None and not self.closing and act.state is RUNNING:
                self._frame(act, value)
            self._done(act, None, settle)
            accepted = True
        else:
            accepted = self._handlers[type(stimulus)](self, stimulus)
        run = self._out_run
        if not (self._out_release or self._out_cancel or self.finished):
            # The common answers: work to run and/or frames for the caller, or nothing.
            emit = self._out_emit
            if emit:
                self._out_emit = []
            elif not run:
                return NOTHING if accepted else REJECTED
            if run:
                self._out_run = []
                if self._shuffle is not None and len(run) > 1:
                    self._shuffle.shuffle(run)
            # ``tuple.__new__``: a NamedTuple's own constructor is Python code.
            return _new(Instructions, ((*run,), (*emit,), (), (), False, accepted))
        if run:
            self._out_run = []
            if self._shuffle is not None and len(run) > 1:
                self._shuffle.shuffle(run)
        emit = self._out_emit
        if emit:
            self._out_emit = []
        release = self._out_release
        if release:
            self._out_release = []
        cancel = self._out_cancel
        if cancel:
            self._out_cancel = []
            # Not one that ended within this very stimulus (the one whose frame broke a rule).
            cancel = [a for a in cancel if a.state is RUNNING]
        return _new(
            Instructions,
            (
                tuple(run) if run else (),
                tuple(emit) if emit else (),
                tuple(release) if release else (),
                tuple(cancel) if cancel else (),
                self.finished,
                accepted,
            ),
        )

    def _on_start(self, ev: Start) -> bool:
        """Deliver the Placeholders; the call's own entry roots everything after."""
        inputs = ev.inputs
        self._log("start", tuple(inputs))
        table: Table = (INPUT_ENTRY,)
        self.live.inc(table, "<input>")  # hold the call open while the inputs fan out
        fanout = self.c.fanout["<input>"]
        for f, v in inputs.items():
            fan = fanout.get(f)
            if fan is not None:
                self._dispatch(fan, "<input>", f, v, table, INPUT_ENTRY)
        self.live.dec(table, "<input>")
        self._settle()
        return True

    def _on_produced(self, ev: Produced) -> bool:
        """A method yielded a frame. False: stop the method (frame rejected, call closing)."""
        act = ev.act
        story = self._story
        if story is not None:  # ``_log``, inlined: once per yielded frame
            story.append((self.call_id, self.stimuli, "frame", act.node, act.aid))
        if self.closing or act.state is not RUNNING:
            return False
        if self._frame(act, ev.frame):
            if self._settle_due():
                self._settle()
            return True
        return False

    def _on_ended(self, ev: Ended) -> bool:
        act = ev.act
        exc = ev.exc
        self._log("end", act.node, act.aid, None if exc is None else type(exc).__name__)
        self._done(act, exc, ev.settle)
        return True

    def _on_settle(self, ev: Settle) -> bool:
        """Evaluate what ended since the last settle (the shell sends it after starting a
        batch of ready work; other stimuli settle on their own unless told not to)."""
        self._log("settle")
        self._settle()
        return True

    def _on_cancel(self, ev: Cancel) -> bool:
        self._log("cancel", ev.kind.value, ev.reason)
        if ev.error is not None and not self.closing:
            self.errors.append(ev.error)
        self._cancel(ev.kind)
        self._settle()  # what dropping the buckets and pending work ended
        return True

    def _on_crash(self, ev: Crash) -> bool:
        """An omniflow bug surfaced: end the call with an error naming it and cancel what
        runs. The state may be inconsistent, so nothing is settled; later stimuli are
        ignored."""
        exc = ev.exc
        self._log("crash", f"{type(exc).__name__}: {exc}")
        err = NodeError(
            "<runtime>",
            f"internal error {type(exc).__name__}: {exc}; this is an omniflow bug, please "
            f"report it with rt.story({self.call_id!r})",
            call_id=self.call_id,
            graph=self.graph,
            exc_type=type(exc).__name__,
        )
        err.__cause__ = exc
        self.errors.append(err)
        self._out_run.clear()
        self._out_cancel = [a for a in self.running if a.state is RUNNING]
        self._become(CallLife.CRASHED)
        self._handlers = _IGNORE_ALL
        return True

    def _ignore(self, ev: Stimulus) -> bool:
        """A crashed call takes no more stimuli (its state is whatever the bug left)."""
        return False

    def _frame(self, act: Activation, frame: Any) -> bool:
        node = act.node
        if type(frame) is not dict and not isinstance(frame, dict):
            self._node_error(
                act.node,
                f"produced {type(frame).__name__} {frame!r:.80}; return or yield "
                "a dict of output fields (or None for nothing)",
            )
            return False
        c = self.c
        outputs = c.outputs[node]
        if not outputs.issuperset(frame):
            f = next(f for f in frame if f not in outputs)
            self._node_error(
                act.node,
                f"produced field {f!r}, which is not among its declared "
                f"outputs {sorted(outputs)}; add it to outputs",
                field=str(f),
            )
            return False
        if node in c.stamping:
            idx = act.yidx  # only stamped frames need their yield index
            act.yidx = idx + 1
            if node in c.session_nodes:
                entry: Entry = (node, 0, self.orders.next_index(node))
            else:
                entry = (node, act.aid, idx)
            table = act.table
            if self._stamp_no is not None:  # on a graph with cycles
                for e in table:
                    if e[0] == node:  # a loop came back: keep one entry per stamping node
                        table = tuple(x for x in table if x[0] != node)
                        break
                self._stamp_no[entry] = len(self._stamp_no)
            table = (*table, entry)
            seq = entry if node in c.seq_nodes else act.seq
            # Hold: consumers of this frame are created one by one. Under the older entries
            # the producing activation holds its node (it is RUNNING until its end, which
            # comes after this frame); under its own entry the frame holds FRAME.
            own = (entry,)
            live = self.live
            live.inc(own, FRAME)
            fanout = c.fanout[node]
            for f, v in frame.items():
                fan = fanout.get(f)
                if fan is not None:  # else nobody consumes it
                    self._dispatch(fan, node, f, v, table, seq)
            live.dec(own, FRAME)
        else:
            table = act.table
            seq = act.seq
            fanout = c.fanout[node]
            for f, v in frame.items():
                fan = fanout.get(f)
                if fan is not None:  # else nobody consumes it
                    self._dispatch(fan, node, f, v, table, seq)
        return True

    def _done(self, act: Activation, exc: BaseException | None, settle: bool) -> None:
        """The method finished: returned, ended its stream, raised, or was cancelled."""
        if act.state is RUNNING:  # the one legal move to DONE from running, checked inline
            act.state = DONE
        else:
            self._move(act, DONE)  # raises TransitionError
        self.running.discard(act)
        node = act.node
        self.n_acts -= 1
        if self._counted:
            self.live.dec(act.table, node)
            if node in self.c.bucket_nodes:
                self._only_buckets(act.table, node)
        if act.refs:
            self._let_go(act.refs)
        if exc is not None:
            self._record_exc(act, exc)
        c = self.c
        if node not in c.unconstrained:
            if node in c.session_nodes:
                self.orders.idle(node)
            if node in c.throttled:
                self._running_per_node[node] -= 1
                blocked = self._blocked.get(node)
                if blocked and not self.closing:
                    self._run(blocked.popleft())
        # ``_settle_due()``, inlined (once per activation).
        if (
            self._touched
            or self.live.dirty
            or self._pump_later
            or self.n_parked
            or self._held
            or not self.n_acts
        ):
            if settle and not self._out_run:
                self._settle()
            else:
                # The shell is starting a batch of ready work (this one's, or what it still
                # had): it sends SETTLE once the batch is started, so one pass covers what a
                # whole batch of returns left behind.
                self.unsettled = True

    def _settle_due(self) -> bool:
        """Would a settle change anything now? (Otherwise none is run, nor asked for.)"""
        return bool(
            self._touched
            or self.live.dirty
            or self._pump_later
            or self.n_parked
            or self._held
            or not self.n_acts
        )

    def _cancel(self, kind: CancelKind) -> None:
        """Stop the call: drop pending work and buckets, ask the shell to cancel the rest."""
        if self.closing:
            return
        self._become(CallLife.CLOSING)
        self.stopped_by = kind
        self._held.clear()
        self.gather.drop_all()
        self.orders.drop_pending()
        for blocked in self._blocked.values():
            while blocked:
                self._drop_pending(blocked.popleft())
        self.latches.drop_parked()
        # Activations handed out by this very stimulus never reach the shell: retire them.
        for act in self._out_run:
            self._move(act, DONE)
            self.running.discard(act)
            if act.node in self.c.throttled:
                self._running_per_node[act.node] -= 1
            self.n_acts -= 1
            self._dec(act.table, act.node)
            self._let_go(act.refs)
        self._out_run.clear()
        self._out_cancel.extend(sorted(self.running, key=_aid_of))
        self.settler.maybe_finish()

    # ------------------------------------------------------------------ routing

    def _dispatch(
        self, fan: Fanout, src: str, f: str, value: Any, table: Table, seq: Entry
    ) -> None:
        """Send one frame of ``src``'s field ``f`` where ``fan`` (its fanout) says."""
        routes, latching, to_caller = fan
        if routes:
            is_ref = type(value) is DataRef
            for dst, g, bspec, direct in routes:
                if bspec is not None:
                    self.gather.arrive(bspec, src, f, value, table, seq)
                    continue
                if self.closing:
                    # A closing call starts nothing. (Holding the ref for an activation that
                    # is dropped at once would release it once per such route.)
                    continue
                if direct:  # no latch, loop bound, order or throttle
                    act = Activation(next(self._aids), dst, g, {f: value}, table, seq, RUNNING)
                    if is_ref:
                        act.refs = [value]
                        self._hold(value)
                    self.n_acts += 1
                    if self._counted:  # ``Liveness.inc``, inlined (once per hop)
                        # Every entry of the table is live already: the producer's activation
                        # (or the call's input hold) counts under the older ones, FRAME under
                        # a stamped frame's own.
                        counts = self.live.counts
                        for e in table:
                            d = counts[e]
                            d[dst] = d.get(dst, 0) + 1
                    self.running.add(act)
                    self._out_run.append(act)
                    continue
                act = Activation(next(self._aids), dst, g, {f: value}, table, seq)
                if is_ref:
                    act.refs = [value]
                    self._hold(value)
                self._admit(act)
        if latching:
            for dst in latching:
                for act in self.latches.value(dst, f, value):
                    self._admit(act)  # pairs, or parks again on another latch
                    self.n_acts -= 1  # its park ended
                    self._dec(act.table, act.node)
        if to_caller:
            self.orders.emit(src, f, value, seq)

    def _admit(self, act: Activation) -> None:
        node = act.node
        if self.closing:
            self._let_go(act.refs)
            return
        c = self.c
        if c.latch_of and (node, act.group) in c.latch_of and not self.latches.pair(act):
            return
        if node in c.unconstrained:  # no loop bound, no session order, no throttle: run it
            self.n_acts += 1
            self.live.inc(act.table, node)
            self._move(act, RUNNING)
            self.running.add(act)
            self._out_run.append(act)
            return
        if node in c.cycle_nodes:
            n = self._iterations.get(node, 0) + 1
            self._iterations[node] = n
            limit = self.c.plan.max_iterations
            if n > limit:
                self._node_error(
                    node,
                    f"exceeded max_iterations={limit} activations in one call (it lies on a "
                    "cycle); make the loop terminate sooner or raise Graph(max_iterations=...)",
                )
                self._let_go(act.refs)
                self._log("cancel", CancelKind.ERROR.value, f"{node} exceeded max_iterations")
                self._cancel(CancelKind.ERROR)
                return
        self.n_acts += 1
        self.live.inc(act.table, node)
        if node in c.session_nodes:
            self.orders.push(act)
            return
        cap = c.throttled.get(node)
        if cap is not None and self._running_per_node.get(node, 0) >= cap:
            self._blocked.setdefault(node, deque()).append(act)
            return
        self._run(act)

    # ------------------------------------------------------------------ invariants

    def validate(self) -> None:
        """Check every invariant of the call's state; raise AssertionError naming the breach.
        Call it between stimuli, after the shell settled (not from inside a step)."""
        validate_call(self, self._blocked, self.latches, self.orders, self.gather)


#: Stimulus type -> its handler (``Returned`` is handled inline by ``CallCore.handle``).
_HANDLERS: dict[type, Callable[[CallCore, Any], bool]] = {
    Produced: CallCore._on_produced,
    Ended: CallCore._on_ended,
    Settle: CallCore._on_settle,
    Start: CallCore._on_start,
    Cancel: CallCore._on_cancel,
    Crash: CallCore._on_crash,
}
_IGNORE_ALL: dict[type, Callable[[CallCore, Any], bool]] = dict.fromkeys(
    (Returned, *_HANDLERS), CallCore._ignore
)
_new = tuple.__new__


def _aid_of(act: Activation) -> int:
    return act.aid
