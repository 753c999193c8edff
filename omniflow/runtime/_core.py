"""The call core: every scheduling decision of one graph call, as plain synchronous code.

The async shell (``_runtime``) feeds it one stimulus at a time and carries out the answer:

    core.handle(Start | Produced | Returned | Ended | Settle | Cancel | Crash) -> Instructions

``Instructions`` (``_stimuli``) is an immutable record: activations to run, frames for the
caller, data-plane refs to release, activations whose tasks to cancel, finished or not. The
core never sees a task and the shell never writes core state: the shell keeps its own
activation -> task map. Nothing here awaits, sleeps or touches a socket, so every rule is
tested by feeding stimuli.

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

import asyncio
import itertools
import random
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from omniflow._exceptions import NodeError
from omniflow.data._ref import DataRef
from omniflow.runtime._buckets import (
    Bucket,
    BucketSpec,
    Dead,
    Fire,
    quiescent_pick,
    rule_error,
)
from omniflow.runtime._compiled import Compiled, Fanout
from omniflow.runtime._liveness import FRAME, INPUT_ENTRY, Entry, Liveness, Table, Uncounted
from omniflow.runtime._ordering import StreamOrder
from omniflow.runtime._stimuli import (
    LEGAL,
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
    TransitionError,
    render_story,
)

__all__ = ["Activation", "CallCore", "Emit"]

PENDING, RUNNING, DONE = ActState.PENDING, ActState.RUNNING, ActState.DONE


class _SessionQueue:
    """Algorithm 1 state of one lb="session" node within one call."""

    __slots__ = ("busy", "streams")

    def __init__(self) -> None:
        self.busy = False
        self.streams: dict[tuple[str, int], StreamOrder] = {}


class _Latch:
    """One latched field of one node within one call (``latch=``): its value once the first
    frame came, and the activations that wait for it."""

    __slots__ = ("ended", "feeders", "field", "has", "node", "parked", "value")

    def __init__(self, node: str, fld: str, feeders: frozenset[str]) -> None:
        self.node = node
        self.field = fld
        #: Nodes from which a producer of the field can still be reached.
        self.feeders = feeders
        self.has = False
        self.value: Any = None
        #: Ended with no frame: activations that need it are DEAD.
        self.ended = False
        self.parked: list[Activation] = []


class CallCore:
    """Scheduling state of one graph call."""

    def __init__(
        self,
        compiled: Compiled,
        call_id: str,
        *,
        story: deque[tuple[Any, ...]] | None = None,
        shuffle: random.Random | None = None,
    ) -> None:
        self.c = compiled
        self.graph = compiled.plan.graph
        self.call_id = call_id
        #: Live work per entry and node (``Uncounted`` when the plan never asks).
        self.live = Liveness() if compiled.counted else Uncounted()
        self._counted = compiled.counted
        #: Liveness of gathering buckets alone (a session node asks whether one of its own
        #: buckets may still fire with a given SeqId).
        self.blive = Liveness()
        self._aids = itertools.count(1)
        #: The answer to the stimulus being handled, gathered while it is (``_instructions``
        #: turns them into an ``Instructions`` record and starts afresh): activations to run,
        #: frames for the caller in release order, data-plane refs whose last holder let go,
        #: activations whose tasks to cancel.
        self._out_run: list[Activation] = []
        self._out_emit: list[Emit] = []
        self._out_release: list[DataRef] = []
        self._out_cancel: list[Activation] = []
        #: Stimuli handled so far (the id of the current one).
        self.stimuli = 0
        #: Seeded shuffling of each batch of ready work (``Runtime(validate=True)``), so that
        #: order bugs surface in tests; None: plan order.
        self._shuffle = shuffle
        #: A Crash ended the call: later stimuli are ignored.
        self.crashed = False
        #: A stimulus left settling for later: the shell must send ``SETTLE`` once it has
        #: started the ready work it holds (read-only for the shell).
        self.unsettled = False
        #: Stimulus type -> handler (``_IGNORE_ALL`` once crashed).
        self._handlers = _HANDLERS
        #: Consumer edges (activations, buckets) holding each data-plane ref.
        self.refcounts: dict[DataRef, int] = {}
        #: Errors of the call (kind "error" or "cancel").
        self.errors: list[NodeError] = []
        #: DEAD activations that had received frames: {"node", "field", "message"} each.
        self.warnings: list[dict[str, str]] = []
        self.finished = False
        self.cancelled = False
        self.closing = False
        #: Running activations (for cancellation).
        self.running: set[Activation] = set()
        #: Activations admitted and not done (pending or running).
        self.n_acts = 0
        #: Per node: running activations (max_concurrency) and activations blocked by it.
        self._running_per_node: dict[str, int] = {}
        self._blocked: dict[str, deque[Activation]] = {}
        #: Gathering buckets by (node, group, key), and keys that already fired or died.
        self.buckets: dict[tuple[str, int, Entry], Bucket] = {}
        self._spent: dict[tuple[str, int, Entry], str] = {}
        #: DEAD buckets whose input rules can still be broken by a straggler: frames seen per
        #: plain or counted field (a second frame is an error even after the bucket died).
        self._dead_seen: dict[tuple[str, int, Entry], dict[str, int]] = {}
        #: Buckets and ordering queues waiting on an entry's liveness.
        self._waiters: dict[Entry, set[Any]] = {}
        self._touched: list[Bucket] = []
        self._session: dict[str, _SessionQueue] = {}
        self._session_seq: dict[str, int] = {}
        self._caller: dict[tuple[str, str, int], StreamOrder] = {}
        self._iterations: dict[str, int] = {}
        self._story = story
        #: Latched fields by (node, field), created on first use; activations parked on them.
        #: Session nodes with several OR groups that got an activation in this step.
        self._pump_later: set[str] = set()
        self._latches: dict[tuple[str, str], _Latch] = {}
        self._n_parked = 0
        #: Gathering buckets of group-ordered session nodes by (node, SeqId entry): an
        #: earlier group's bucket of an index holds back later groups' activations of it.
        self._seq_buckets: dict[tuple[str, Entry | None], list[Bucket]] = {}
        #: Group-ordered session nodes whose next activation waits for such a bucket.
        self._held: set[str] = set()
        #: On graphs with cycles: the order in which entries were stamped. A loop that comes
        #: back replaces a node's older entry, so there the entries of a table no longer say
        #: which frame came first by themselves; their stamp numbers do (production order of
        #: collected and counted frames).
        self._stamp_no: dict[Entry, int] | None = {} if compiled.cycle_nodes else None

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
        self.closing = True
        self._out_run.clear()
        self._out_cancel = [a for a in self.running if a.state is RUNNING]
        self.finished = True
        self.crashed = True
        self._handlers = _IGNORE_ALL
        return True

    def _ignore(self, ev: Stimulus) -> bool:
        """A crashed call takes no more stimuli (its state is whatever the bug left)."""
        return False

    def _frame(self, act: Activation, frame: Any) -> bool:
        node = act.node
        if type(frame) is not dict and not isinstance(frame, dict):
            self._reject(
                act,
                f"produced {type(frame).__name__} {frame!r:.80}; return or yield "
                "a dict of output fields (or None for nothing)",
            )
            return False
        c = self.c
        outputs = c.outputs[node]
        if not outputs.issuperset(frame):
            f = next(f for f in frame if f not in outputs)
            self._reject(
                act,
                f"produced field {f!r}, which is not among its declared "
                f"outputs {sorted(outputs)}; add it to outputs",
                field=str(f),
            )
            return False
        if node in c.stamping:
            idx = act.yidx  # only stamped frames need their yield index
            act.yidx = idx + 1
            if node in c.session_nodes:
                n = self._session_seq.get(node, 0)
                self._session_seq[node] = n + 1
                entry: Entry = (node, 0, n)
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
                self._session[node].busy = False
                self._pump_session(node)
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
            or self._n_parked
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
            or self._n_parked
            or self._held
            or not self.n_acts
        )

    def _move(self, act: Activation, to: ActState) -> None:
        """The one place an activation changes state (``_stimuli.LEGAL``)."""
        if to not in LEGAL[act.state]:
            raise TransitionError(
                self.call_id,
                act.node,
                act.aid,
                act.state,
                to,
                [] if self._story is None else render_story(self._story, self.call_id),
            )
        act.state = to

    def _cancel(self, kind: CancelKind) -> None:
        """Stop the call: drop pending work and buckets, ask the shell to cancel the rest."""
        if self.closing:
            return
        self.closing = True
        if kind is CancelKind.CANCEL:
            self.cancelled = True
        self._held.clear()
        for key, b in list(self.buckets.items()):
            self._drop_bucket(key, b)
        for sq_node, sq in self._session.items():
            for so in sq.streams.values():
                for items in so.pending.values():
                    for act in items:
                        self._drop_pending(act)
                so.pending.clear()
            del sq_node
        for blocked in self._blocked.values():
            while blocked:
                self._drop_pending(blocked.popleft())
        for lt in self._latches.values():
            for act in lt.parked:
                self._n_parked -= 1
                self._drop_pending(act)
            lt.parked = []
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
        self._maybe_finish()

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
                    self._arrive(bspec, src, f, value, table, seq)
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
                self._latch_value(dst, f, value)
        if to_caller:
            self._emit(src, f, value, seq)

    def _arrive(
        self, bspec: BucketSpec, src: str, f: str, value: Any, table: Table, seq: Entry
    ) -> None:
        if bspec.by_call:
            pos = 0
        else:
            root = bspec.root
            pos = len(table) - 1
            while pos > 0 and table[pos][0] != root:
                pos -= 1
        key = table[pos]
        bid = (bspec.node, bspec.group, key)
        b = self.buckets.get(bid)
        if b is None:
            spent = self._spent.get(bid)
            if spent is not None:
                if spent == "fired":
                    self._node_error(bspec.node, self._late_frame_message(bspec, f), field=f)
                    return
                # A DEAD bucket's outputs are already ended, but its input rules still hold:
                # whether a call errs must not depend on when the bucket was found DEAD.
                seen = self._dead_seen.get(bid)
                if seen is not None:
                    n = seen.get(f, 0)
                    err = rule_error(bspec.by_field[f], n)
                    if err is not None:
                        del self._dead_seen[bid]
                        self._node_error(bspec.node, err, field=f)
                    else:
                        seen[f] = n + 1
                return
            # The bucket keeps every entry its frames share (so far: all of this frame's), not
            # only those up to its key: a frame that descends from one frame of another root
            # still carries that root's entry when it leaves, and meets its siblings there.
            b = Bucket(bspec, key, table)
            b.seq = _seq_in(table[: pos + 1], self.c)
            self.buckets[bid] = b
            if bspec.node in self.c.group_ordered:
                self._seq_buckets.setdefault((bspec.node, b.seq), []).append(b)
            self.live.inc(table, bspec.node)
            self.blive.inc(table, bspec.node)
            self._watch(key, b)
            if self._story is not None:
                self._log("bucket", bspec.node, bspec.group, key, b.seq)
            # Slots may have ended before the bucket existed (no drop will announce them):
            # learn them now, while this frame's producer still holds its own slots open.
            fresh = True
        else:
            fresh = False
            if table is not b.table and len(b.table) > pos + 1:
                self._share(b, table, pos)
        fs = bspec.by_field[f]
        # Frames of a plain field are never sorted: skip building their sort key.
        if fs.mode == "plain":
            sort_key: Any = None
        elif self._stamp_no is None:
            sort_key = (table[pos + 1 :], b.arrivals)
        else:
            stamped = self._stamp_no
            sort_key = (tuple(stamped.get(e, -1) for e in table[pos + 1 :]), b.arrivals)
        err = b.add(f, value, sort_key)
        if type(value) is DataRef and err is None:
            b.refs.append(value)
            self._hold(value)
        if err is not None:
            self._node_error(bspec.node, err, field=f)
            self._kill_bucket(bid, b, "input rule broken")
            return
        # Otherwise the bucket is re-evaluated when liveness under its key drops: its own
        # producer's activation (or dispatch hold) always ends after this arrival.
        if fresh:
            self._evaluate(b, None)
        elif b.could_fire_now(fs):
            self._touched.append(b)
        elif bspec.node in self._held:
            self._pump_later.add(bspec.node)  # fewer open fields: perhaps only a loop's left

    def _share(self, b: Bucket, table: Table, pos: int) -> None:
        """Keep in ``b.table`` only the entries ``table`` (a new frame's) shares with it; the
        bucket stops being live under the others."""
        gone = tuple(e for e in b.table[pos + 1 :] if e not in table)
        if gone:
            b.table = tuple(e for e in b.table if e not in gone)
            node = b.spec.node
            self.live.dec(gone, node)
            self.blive.dec(gone, node)
            self._only_buckets(gone, node)

    @staticmethod
    def _late_frame_message(bspec: BucketSpec, f: str) -> str:
        fs = bspec.by_field[f]
        if fs.mode == "count" and fs.threshold is not None:
            return (
                f"field '{f}' received more than activate_by_count={fs.threshold} frames in one "
                "call; use omniflow.ALL to take every frame, or a larger count"
            )
        if fs.ends_only:
            how = "activate_by_count=ALL" if fs.mode == "count" else "collect"
            return (
                f"field '{f}' ({how}) received a frame after its bucket already fired: every "
                f"stream of '{f}' had ended for it, and then a stream was re-entered (a loop "
                "came back through a producer of it). Keep the loop's own frames out of the "
                f"collected field (give them another name), or move the {how} node after "
                "the loop"
            )
        return (
            f"field '{f}' received a frame after its activation already fired; two streams "
            f"meet here frame by frame. Declare collect=['{f}'] to receive all frames as a list, "
            "or make the streams share a fork source"
        )

    def _admit(self, act: Activation) -> None:
        node = act.node
        if self.closing:
            self._let_go(act.refs)
            return
        c = self.c
        if c.latch_of and (node, act.group) in c.latch_of and not self._pair(act):
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
            sq = self._session.get(node)
            if sq is None:
                sq = self._session[node] = _SessionQueue()
            skey = (act.seq[0], act.seq[1])
            so = sq.streams.get(skey)
            if so is None:
                so = sq.streams[skey] = StreamOrder(act.seq[0], act.seq[1])
            so.push(act.seq[2], act)
            if len(c.specs[node].groups) > 1:
                # Activations of one SeqId index run in OR-group declaration order: wait for
                # the rest of this step's arrivals before picking (settle pumps it).
                self._pump_later.add(node)
            else:
                self._pump_session(node)
            return
        cap = c.throttled.get(node)
        if cap is not None and self._running_per_node.get(node, 0) >= cap:
            self._blocked.setdefault(node, deque()).append(act)
            return
        self._run(act)

    def _run(self, act: Activation) -> None:
        self._move(act, RUNNING)
        node = act.node
        if node in self.c.throttled:
            self._running_per_node[node] = self._running_per_node.get(node, 0) + 1
        self.running.add(act)
        self._out_run.append(act)

    # ------------------------------------------------------------------ latches

    def _latch(self, node: str, fld: str) -> _Latch:
        lt = self._latches.get((node, fld))
        if lt is None:
            feeders = self.c.latch_feeders[(node, fld)]
            lt = self._latches[(node, fld)] = _Latch(node, fld, feeders)
        return lt

    def _latch_value(self, node: str, fld: str, value: Any) -> None:
        """A frame of a latched field: the first one of the call is the value, for good."""
        lt = self._latch(node, fld)
        if lt.has or lt.ended or self.closing:
            return
        lt.has = True
        lt.value = value
        if type(value) is DataRef:
            self._hold(value)  # the latch's own hold, until the call ends
        parked, lt.parked = lt.parked, []
        for act in parked:
            self._n_parked -= 1
            self._admit(act)  # pairs, or parks again on another latch
            self.n_acts -= 1
            self._dec(act.table, act.node)

    def _pair(self, act: Activation) -> bool:
        """Give ``act`` its latched values; False when it waits for one (parked, live) or is
        DEAD because one ended with no frame (reported in ``warnings``)."""
        for fld in self.c.latch_of[(act.node, act.group)]:
            lt = self._latch(act.node, fld)
            if lt.has:
                if fld not in act.kwargs:
                    act.kwargs[fld] = lt.value
                    if type(lt.value) is DataRef:
                        if act.refs is None:
                            act.refs = []
                        act.refs.append(lt.value)
                        self._hold(lt.value)
                continue
            if lt.ended:
                self._latch_dead(act, lt)
                return False
            lt.parked.append(act)
            self._n_parked += 1
            self.n_acts += 1
            self.live.inc(act.table, act.node)
            return False
        return True

    def _parked_under(self, e: Entry, node: str) -> bool:
        """An activation of ``node`` waits for a latched value under ``e`` (its SeqId index
        has not settled: the activation still comes)."""
        return any(
            act.node == node and e in act.table
            for lt in self._latches.values()
            for act in lt.parked
        )

    def _latch_dead(self, act: Activation, lt: _Latch) -> None:
        self._let_go(act.refs)
        self._warn(
            act.node,
            lt.field,
            f"OR group {act.group} activation never ran: latched input '{lt.field}' ended "
            f"with no frame for this call; {', '.join(sorted(act.kwargs))} dropped",
        )

    def _check_latches(self) -> None:
        """Latches with parked activations whose field can no longer arrive end: every
        activation parked on them is DEAD."""
        parked_at: dict[str, int] = {}
        for lt in self._latches.values():
            if lt.parked:
                parked_at[lt.node] = parked_at.get(lt.node, 0) + len(lt.parked)
        for lt in self._latches.values():
            if not lt.parked or self.live.reaches(INPUT_ENTRY, lt.feeders, parked_at):
                continue
            lt.ended = True
            parked, lt.parked = lt.parked, []
            for act in parked:
                self._n_parked -= 1
                self.n_acts -= 1
                self._move(act, DONE)
                self._dec(act.table, act.node)
                self._latch_dead(act, lt)

    # ------------------------------------------------------------------ ordering

    def _pump_session(self, node: str, settled: bool = False, force: bool = False) -> None:
        """Release the next activation of a session node in SeqId order (Algorithm 1); within
        one index, in OR-group order (docs/contract.md §1). ``settled``: called by ``_settle`` with
        every bucket decided that can be, so a bucket still gathering is waiting on work that
        is live now; ``force``: the call is stuck, release the first held-back activation."""
        sq = self._session[node]
        if sq.busy or self.closing:
            return
        feeders = self.c.seq_feeders[node]
        own = frozenset((node,))
        ordered = node in self.c.group_ordered
        if ordered:
            self._held.discard(node)
        for so in sq.streams.values():
            while so.pending:
                act = so.peek_current(_group_of)
                if act is not None:
                    why = "order"
                    if ordered and act.group:
                        why = self._group_wait(node, act, settled)
                        if why == "wait" and force:
                            why, force = "stuck", False
                        if why == "wait":
                            # An earlier group's bucket of this index may still fire: its
                            # activation goes first (retiring it, or settling, pumps again).
                            self._held.add(node)
                            self._unwatch_order(so)
                            if not settled:
                                self._pump_later.add(node)
                            break
                    so.pop_current(_group_of)
                    sq.busy = True
                    self._unwatch_order(so)
                    if self._story is not None and ordered:
                        self._log("session", node, act.group, act.aid, act.seq, why)
                    self._run(act)
                    return
                e = so.entry()
                if (
                    self.live.reaches(e, feeders)
                    or self.blive.reaches(e, own)
                    or (self._n_parked and self._parked_under(e, node))
                ):
                    self._watch_order(so, None, node)
                    break
                so.advance()

    def _group_wait(self, node: str, act: Activation, settled: bool) -> str:
        """Must ``act`` (a later OR group's) wait for an earlier group's bucket of its index?
        "wait" while such a bucket can still fire without the node's own queued work, "loop"
        when the node's queued work alone can still complete every such bucket (waiting would
        deadlock the call: the later activation runs first), "order" when there is none."""
        group = act.group
        earlier = [b for b in self._seq_buckets.get((node, act.seq), ()) if b.spec.group < group]
        if not earlier:
            return "order"
        counts = self.live.counts
        if settled and all(b.fed_only_at(counts.get(b.key), node) for b in earlier):
            return "loop"
        return "wait"

    def _emit(self, node: str, f: str, value: Any, seq: Entry) -> None:
        key = (f, seq[0], seq[1])
        so = self._caller.get(key)
        if so is None:
            so = self._caller[key] = StreamOrder(seq[0], seq[1])
        idx = seq[2]
        if idx != so.exp and not so.pending:
            # The common streaming case: earlier indices have settled; skip over them.
            feeders = self.c.seq_out_feeders[f]
            reaches = self.live.reaches
            while so.exp < idx and not reaches((so.node, so.sid, so.exp), feeders):
                so.exp += 1
        if idx == so.exp:
            self._out_emit.append((f, value, node, idx))
            return
        so.push(idx, (f, value, node, idx))
        self._release_caller(f, so)

    def _release_caller(self, f: str, so: StreamOrder) -> None:
        feeders = self.c.seq_out_feeders[f]
        while so.pending:
            items = so.take_current()
            if items:
                self._out_emit.extend(items)
                if not so.pending:
                    break
            if self.live.reaches(so.entry(), feeders):
                self._watch_order(so, f, "")
                return
            so.advance()
        self._unwatch_order(so)

    def _watch_order(self, so: StreamOrder, f: str | None, node: str) -> None:
        """Wake ``so`` when its expected index may have settled (f: caller field, or None for
        the session node ``node``)."""
        if so.watching == so.exp:
            return
        self._unwatch_order(so)
        e = so.entry()
        so.watching = so.exp
        self._watch(e, (so, f, node))

    def _unwatch_order(self, so: StreamOrder) -> None:
        if so.watching < 0:
            return
        e = (so.node, so.sid, so.watching)
        so.watching = -1
        ws = self._waiters[e]  # registered by _watch_order until now (validate checks it)
        for w in list(ws):
            if isinstance(w, tuple) and w[0] is so:
                ws.discard(w)
                self.live.unwatch(e)
        if not ws:
            del self._waiters[e]

    # ------------------------------------------------------------------ settling

    def _watch(self, e: Entry, waiter: Any) -> None:
        ws = self._waiters.get(e)
        if ws is None:
            ws = self._waiters[e] = set()
        ws.add(waiter)
        self.live.watch(e)

    def _settle(self) -> None:
        """Evaluate touched buckets and waiters of entries whose liveness dropped, to a fixpoint;
        then finish the call if nothing of it is left."""
        self.unsettled = False
        self._settle_pass()
        while True:
            while self._pump_later:
                for node in sorted(self._pump_later):
                    self._pump_later.discard(node)
                    self._pump_session(node, settled=True)
                self._settle_pass()
            if not self._held or self.running or self.closing:
                return
            # Nothing runs and only held-back session work is left: the buckets it waits for
            # can complete only through it, whatever the path (docs/contract.md §1: the wait never
            # deadlocks a call). The earliest node in plan order goes first.
            order = self.c.order
            self._pump_session(min(self._held, key=order.__getitem__), settled=True, force=True)
            self._settle_pass()

    def _settle_pass(self) -> None:
        if self._n_parked:
            self._check_latches()
        live = self.live
        if not (self._touched or live.dirty):
            if not self.n_acts:
                self._maybe_finish()
            return
        while self._touched or live.dirty:
            while self._touched:
                b = self._touched.pop()
                self._evaluate(b)
            if live.dirty:
                dirty = live.dirty
                live.dirty = {}
                for e, dropped in dirty.items():
                    ws = self._waiters.get(e)
                    if not ws:
                        continue
                    for w in sorted(ws, key=_waiter_order) if len(ws) > 1 else list(ws):
                        if isinstance(w, Bucket):
                            # Only a node that feeds a still-open slot can have ended one.
                            if w.wakes_on(dropped):
                                self._evaluate(w, dropped)
                            continue
                        so, f, node = w
                        if so.watching != e[2]:
                            continue
                        feeders = (
                            self.c.seq_feeders[node] if f is None else self.c.seq_out_feeders[f]
                        )
                        if not any(n in feeders for n in dropped) and not (
                            f is None and any(n == node for n in dropped)
                        ):
                            continue
                        if f is None:
                            self._unwatch_order(so)
                            self._pump_session(node)
                        else:
                            self._release_caller(f, so)
            if self._n_parked:
                self._check_latches()
        if not self.n_acts:
            self._maybe_finish()

    def _evaluate(self, b: Bucket, dropped: Sequence[str] | None = ()) -> None:
        """Decide a bucket. ``dropped``: nodes whose live work under its key just ended (only
        fields they feed can have ended); None: check every open field; (): arrivals only."""
        if b.retired:
            return
        reason = b.refresh(self.live.counts.get(b.key), dropped)
        if reason is None:
            if b.open:
                if b.spec.node in self._held:
                    # Still gathering, but what can feed it shrank: perhaps to the held-back
                    # activations alone (a loop), which then run first.
                    self._pump_later.add(b.spec.node)
                return  # still waiting for a field
            verdict = b.decide()  # nothing open: Fire or Dead, never Wait
        else:
            verdict = Dead(reason)
        spec = b.spec
        bid = (spec.node, spec.group, b.key)
        if type(verdict) is Fire:
            self._fire(bid, b, verdict.kwargs)
        else:
            assert type(verdict) is Dead
            self._kill_bucket(bid, b, verdict.reason)
            self._keep_rules(bid, b)

    def _fire(self, bid: tuple[str, int, Entry], b: Bucket, kwargs: dict[str, Any]) -> None:
        """The bucket is complete: its activation takes over its inputs and their holds."""
        node, group, key = bid
        self._retire_bucket(bid, b, "fired")
        seq = b.seq if b.seq is not None else INPUT_ENTRY
        act = Activation(next(self._aids), node, group, kwargs, b.table, seq)
        if self._story is not None:
            self._log("fire", node, group, key, act.aid)
        act.refs = b.refs or None  # the bucket's holds pass to its activation
        self._admit(act)
        self.live.dec(b.table, node)
        self.blive.dec(b.table, node)
        self._only_buckets(b.table, node)

    def _kill_bucket(self, bid: tuple[str, int, Entry], b: Bucket, reason: str) -> None:
        self._retire_bucket(bid, b, "dead")
        self._log("dead", bid[0], bid[1], bid[2], reason)
        if b.arrivals and b.dead_field is not None and not self.closing:
            # Frames arrived and are lost with the bucket: say so (docs/contract.md §3, warnings).
            got = sorted(b.frames)
            self._warn(
                bid[0],
                b.dead_field,
                f"OR group {bid[1]} never fired: {reason}, after {', '.join(got)} arrived; "
                f"those frames are dropped (list '{b.dead_field}' in optional=... to run "
                "without it)",
            )
        self.live.dec(b.table, bid[0])
        self.blive.dec(b.table, bid[0])
        self._only_buckets(b.table, bid[0])
        self._let_go(b.refs)

    def _keep_rules(self, bid: tuple[str, int, Entry], b: Bucket) -> None:
        """Remember what a DEAD bucket saw, for the fields a straggler could still break."""
        seen = {
            fs.name: len(b.frames.get(fs.name, ()))
            for fs in b.spec.fields
            if fs.mode == "plain" or (fs.mode == "count" and fs.threshold is not None)
        }
        if seen:
            self._dead_seen[bid] = seen

    def _retire_bucket(self, bid: tuple[str, int, Entry], b: Bucket, how: str) -> None:
        b.retired = True
        del self.buckets[bid]
        self._spent[bid] = how
        node = bid[0]
        if node in self.c.group_ordered:
            sk = (node, b.seq)
            lst = self._seq_buckets[sk]
            lst.remove(b)
            if not lst:
                del self._seq_buckets[sk]
            if node in self._held:
                self._pump_later.add(node)  # what it held back may run now
        # A gathering bucket is always watched under its key (``validate`` checks it).
        ws = self._waiters[b.key]
        ws.remove(b)
        self.live.unwatch(b.key)
        if not ws:
            del self._waiters[b.key]

    def _drop_bucket(self, bid: tuple[str, int, Entry], b: Bucket) -> None:
        self._retire_bucket(bid, b, "dead")
        self.live.dec(b.table, bid[0])
        self.blive.dec(b.table, bid[0])
        self._only_buckets(b.table, bid[0])
        self._let_go(b.refs)

    def _dec(self, table: Table, node: str) -> None:
        """Live work at ``node`` ended (an activation, a dispatch hold)."""
        self.live.dec(table, node)
        if node in self.c.bucket_nodes:
            self._only_buckets(table, node)

    def _only_buckets(self, table: Table, node: str) -> None:
        """Wake the waiters of ``table``'s entries under which ``node`` now holds nothing but
        gathering buckets. A count that reaches zero announces itself (``Liveness.dec``); this
        is the other drop a bucket must hear about: a bucket discounts itself at its own node,
        and a pending bucket counts as a possible producer of its node's outputs only until
        the rest of the node's work is gone (docs/contract.md §1, "a stream has ended")."""
        live = self.live
        watched = live.watched
        bcounts = self.blive.counts
        for e in table:
            if e not in watched:
                continue
            d = live.counts.get(e)
            n = d.get(node, 0) if d else 0
            if n and n <= bcounts.get(e, _NONE).get(node, 0):
                nodes = live.dirty.get(e)
                if nodes is None:
                    live.dirty[e] = [node]
                elif node not in nodes:
                    nodes.append(node)

    def _hold(self, ref: DataRef) -> None:
        self.refcounts[ref] = self.refcounts.get(ref, 0) + 1

    def _let_go(self, refs: list[DataRef] | None) -> None:
        """Consumer edges finished with ``refs``; the last one out releases the block."""
        if not refs:
            return
        counts = self.refcounts
        for ref in refs:
            n = counts[ref] - 1
            if n:
                counts[ref] = n
            else:
                del counts[ref]
                self._out_release.append(ref)

    def _drop_pending(self, act: Activation) -> None:
        self._move(act, DONE)
        self.n_acts -= 1
        self._dec(act.table, act.node)
        self._let_go(act.refs)

    def _maybe_finish(self) -> None:
        if self.finished:
            return
        while self.n_acts == 0 and self.buckets and not self.closing:
            # Quiescent but buckets still gather: only buckets wait on buckets (a cycle of
            # convergence nodes). Settle the earliest in plan order as if its open slots had
            # ended; that either fires it (new work) or kills it.
            bid, b = self._settle_first()
            verdict = b.evaluate(None)  # as if every open slot had ended
            if type(verdict) is Fire:
                self._fire(bid, b, verdict.kwargs)
                self._settle()
                return
            self._kill_bucket(bid, b, verdict.reason if type(verdict) is Dead else "quiescent")
            # Settled as if its open slots had ended, but a straggler may still come (a frame
            # of a field the cycle was holding back): the input rules hold for it exactly as
            # for a bucket found DEAD by liveness (docs/contract.md §1, "never silently dropped").
            self._keep_rules(bid, b)
        if self.n_acts == 0 and not self.buckets and not self.running:
            for lt in self._latches.values():
                if lt.has and type(lt.value) is DataRef:
                    lt.has = False
                    self._let_go([lt.value])
            for so_key, so in self._caller.items():
                while so.pending:
                    self._out_emit.extend(so.take_current())
                    so.advance()
                del so_key
            self.finished = True
            self._log("finish", self.status)

    def _settle_first(self) -> tuple[tuple[str, int, Entry], Bucket]:
        """The bucket a quiescent call settles next (``quiescent_pick``)."""
        order = self.c.order
        items = sorted(self.buckets.items(), key=lambda kv: (order[kv[0][0]], kv[0]))
        return items[quiescent_pick([b for _bid, b in items])]

    # ------------------------------------------------------------------ errors

    def _warn(self, node: str, fld: str, message: str) -> None:
        self.warnings.append({"node": node, "field": fld, "message": message})
        self._log("warning", node, fld, message)

    def _record_exc(self, act: Activation, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self.errors.append(
                NodeError(
                    act.node, "cancelled", kind="cancel", call_id=self.call_id, graph=self.graph
                )
            )
            self._log("cancelled", act.node, act.aid)
            return
        if isinstance(exc, NodeError) and exc.node == act.node:
            err = exc
        else:
            err = NodeError(
                act.node,
                f"{type(exc).__name__}: {exc}",
                kind="error",
                call_id=self.call_id,
                graph=self.graph,
                exc_type=type(exc).__name__,
                traceback="".join(traceback.format_exception(exc)),
            )
            err.__cause__ = exc
        self.errors.append(err)
        self._log("error", act.node, act.aid, str(exc))

    def _reject(self, act: Activation, message: str, field: str | None = None) -> None:
        self._node_error(act.node, message, field=field)

    def _node_error(self, node: str, message: str, field: str | None = None) -> None:
        self.errors.append(
            NodeError(
                node, message, kind="error", field=field, call_id=self.call_id, graph=self.graph
            )
        )
        self._log("error", node, None, message)

    @property
    def status(self) -> str:
        """ "cancelled" when the caller cancelled, "error" when a node failed, "cancelled" when
        a node was cancelled by something else (a worker shutting down): its outputs are
        missing, so the call did not end "ok"."""
        if self.cancelled:
            return "cancelled"
        if any(e.kind == "error" for e in self.errors):
            return "error"
        if self.errors:
            return "cancelled"
        return "ok"

    def _log(self, event: str, *values: Any) -> None:
        """One story record under the current stimulus (``_stimuli.STORY_FIELDS`` names the
        values): a tuple, rendered only when somebody reads the story."""
        if self._story is not None:
            self._story.append((self.call_id, self.stimuli, event, *values))

    # ------------------------------------------------------------------ invariants

    def validate(self) -> None:
        """Check every invariant of the call's state; raise AssertionError naming the breach.
        Call it between stimuli, after the shell settled (not from inside a step)."""
        if self.crashed:
            return  # a crashed call's state is whatever the bug left
        if not self.finished and (
            self._touched or self.live.dirty or self._pump_later or self.unsettled
        ):
            # (A finished call has nothing left to settle: what it still notes about drops
            # or touched buckets wakes nobody; the checks below hold it to "nothing left".)
            raise AssertionError(
                f"call {self.call_id}: left unsettled (touched {len(self._touched)} buckets, "
                f"liveness drops under {sorted(self.live.dirty)}); the shell must send SETTLE "
                "after starting a batch of ready work"
            )
        self._validate_group_order()
        work: list[tuple[Table, str]] = []
        acts = set(self.running)
        for sq in self._session.values():
            for so in sq.streams.values():
                so.validate()
                for items in so.pending.values():
                    acts.update(items)
        for blocked in self._blocked.values():
            acts.update(blocked)
        parked = [a for lt in self._latches.values() for a in lt.parked]
        if len(parked) != self._n_parked:
            raise AssertionError(
                f"{len(parked)} activations parked on latches, {self._n_parked} counted"
            )
        acts.update(parked)
        for a in acts:
            work.append((a.table, a.node))
        for (node, _g, _k), b in self.buckets.items():
            work.append((b.table, node))
            if b not in self._waiters.get(b.key, ()):
                raise AssertionError(f"bucket {node}/{b.key} gathers but nobody wakes it")
        orders = [*self._caller.values()]
        orders.extend(so for sq in self._session.values() for so in sq.streams.values())
        for so in orders:
            e = (so.node, so.sid, so.watching)
            if so.watching >= 0 and not any(
                type(w) is tuple and w[0] is so for w in self._waiters.get(e, ())
            ):
                raise AssertionError(f"stream order watches {e} but nobody wakes it")
        if self._counted:
            self.live.validate(work)
        elif self.live.counts or self.live.dirty:
            raise AssertionError(f"an uncounted call counted liveness: {self.live.counts}")
        self.blive.validate((b.table, node) for (node, _g, _k), b in self.buckets.items())
        held: dict[DataRef, int] = {}
        holders: list[list[DataRef] | None] = [a.refs for a in acts]
        holders.extend(b.refs for b in self.buckets.values())
        holders.extend(
            [lt.value] for lt in self._latches.values() if lt.has and type(lt.value) is DataRef
        )
        for refs in holders:
            for ref in refs or ():
                held[ref] = held.get(ref, 0) + 1
        if held != self.refcounts:
            raise AssertionError(f"data-plane refcounts drifted: {self.refcounts} vs {held}")
        if len(acts) != self.n_acts:
            raise AssertionError(f"n_acts={self.n_acts} but {len(acts)} activations are known")
        for bid in self.buckets:
            if bid in self._spent:
                raise AssertionError(f"bucket {bid} is both gathering and spent")
        for so in self._caller.values():
            so.validate()
        if self.finished and (self.n_acts or self.buckets or self.live.counts):
            raise AssertionError(f"call {self.call_id} finished with work left: {self.live.counts}")

    def _validate_group_order(self) -> None:
        """Every gathering bucket of a group-ordered session node is indexed by its SeqId, and
        an idle session node with an activation at its expected index is held back by an
        earlier group's bucket that can still fire without it (never stuck: something runs)."""
        indexed = [b for bs in self._seq_buckets.values() for b in bs]
        gathering = [b for b in self.buckets.values() if b.spec.node in self.c.group_ordered]
        if len(indexed) != len(gathering) or any(
            b not in self._seq_buckets.get((b.spec.node, b.seq), ()) for b in gathering
        ):
            raise AssertionError(
                f"session buckets by SeqId drifted: {len(indexed)} indexed, "
                f"{len(gathering)} gathering"
            )
        if self.closing or self.crashed:
            return
        for node, sq in self._session.items():
            if sq.busy:
                continue
            for so in sq.streams.values():
                act = so.peek_current(_group_of)
                if act is None:
                    continue
                if node not in self._held or self._group_wait(node, act, True) != "wait":
                    raise AssertionError(
                        f"session node {node}: {act} waits at index {so.exp} for nothing"
                    )
                if not self.running:
                    raise AssertionError(
                        f"session node {node}: {act} waits for a bucket of an earlier group "
                        "while nothing runs (the call is stuck)"
                    )


_NONE: dict[str, int] = {}

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


def _seq_in(table: Table, c: Compiled) -> Entry:
    """The nearest SeqId entry of ``table``. Every table starts with the call's own entry
    (``INPUT_ENTRY``; "<input>" counts among ``seq_nodes``), so the search stops there."""
    i = len(table) - 1
    while table[i][0] not in c.seq_nodes:
        i -= 1
    return table[i]


def _group_of(act: Activation) -> int:
    return act.group


def _aid_of(act: Activation) -> int:
    return act.aid


def _waiter_order(w: Any) -> tuple[int, Any]:
    if isinstance(w, Bucket):
        return (0, (w.spec.node, w.spec.group))
    return (1, (w[0].node, w[0].sid, w[1] or "", w[2]))
