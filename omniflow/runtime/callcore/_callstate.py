"""What every part of the call core shares: the call's life, its counts, its answer being
gathered, its data-plane holds, its errors, warnings and story.

``CallCore`` (``_core``) is a ``CallState`` and hands itself to its parts (``_latches``,
``_session``, ``_gather``, ``_settle``); the parts own their own tables and reach the shared
state and these small operations only through it. The call's life is one ``CallLife`` value,
moved by ``CallState._become`` along ``LIFE`` and nowhere else.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import random
import traceback
from collections import deque
from typing import Any

from omniflow._exceptions import NodeError
from omniflow.data._ref import DataRef
from omniflow.runtime.callcore._buckets import Bucket
from omniflow.runtime.callcore._compiled import Compiled
from omniflow.runtime.callcore._liveness import Entry, Liveness, Table, Uncounted
from omniflow.runtime.callcore._stimuli import (
    LEGAL,
    Activation,
    ActState,
    CancelKind,
    Emit,
    TransitionError,
    render_story,
)

__all__ = ["LIFE", "CallLife", "CallState", "LifeError"]

RUNNING = ActState.RUNNING


class CallLife(enum.Enum):
    """Where a call stands. OPEN -> FINISHED, or OPEN -> CLOSING -> CLOSED (a Cancel: the
    caller's, a timeout, a broken rule); a Crash moves any state but CRASHED to CRASHED."""

    #: Taking stimuli, starting work.
    OPEN = "open"
    #: Stopping: starts nothing, waits for the cancelled work to end.
    CLOSING = "closing"
    #: Ended without being stopped.
    FINISHED = "finished"
    #: Ended after being stopped.
    CLOSED = "closed"
    #: An omniflow bug ended it (``Crash``); later stimuli are ignored.
    CRASHED = "crashed"

    __hash__ = object.__hash__  # singletons: hash by identity, in C (as ``ActState``)


#: Legal moves of a call's life: state -> the states it may move to.
LIFE: dict[CallLife, frozenset[CallLife]] = {
    CallLife.OPEN: frozenset({CallLife.CLOSING, CallLife.FINISHED, CallLife.CRASHED}),
    CallLife.CLOSING: frozenset({CallLife.CLOSED, CallLife.CRASHED}),
    CallLife.FINISHED: frozenset({CallLife.CRASHED}),
    CallLife.CLOSED: frozenset({CallLife.CRASHED}),
    CallLife.CRASHED: frozenset(),
}
_CLOSING = frozenset({CallLife.CLOSING, CallLife.CLOSED, CallLife.CRASHED})
_OPEN = CallLife.OPEN
_FINISHED = frozenset({CallLife.FINISHED, CallLife.CLOSED, CallLife.CRASHED})


class LifeError(AssertionError):
    """A call was asked to make a move ``LIFE`` does not allow: an omniflow bug."""


class CallState:
    """The state all parts of one call's core share (``CallCore`` is one)."""

    __slots__ = (
        "_aids",
        "_counted",
        "_held",
        "_out_cancel",
        "_out_emit",
        "_out_release",
        "_out_run",
        "_pump_later",
        "_running_per_node",
        "_shuffle",
        "_stamp_no",
        "_story",
        "_touched",
        "_waiters",
        "blive",
        "c",
        "call_id",
        "closing",
        "errors",
        "finished",
        "graph",
        "life",
        "live",
        "n_acts",
        "n_parked",
        "refcounts",
        "running",
        "stimuli",
        "stopped_by",
        "unsettled",
        "warnings",
    )

    def __init__(
        self,
        compiled: Compiled,
        call_id: str,
        story: deque[tuple[Any, ...]] | None,
        shuffle: random.Random | None,
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
        #: The answer to the stimulus being handled, gathered while it is (``handle`` turns
        #: them into an ``Instructions`` record and starts afresh): activations to run,
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
        self._story = story
        #: The call's life (moved by ``_become`` only).
        self.life = _OPEN
        #: ``life`` is CLOSING, CLOSED or CRASHED: start nothing (read on the hot path, and
        #: by the shell; written by ``_become`` only).
        self.closing = False
        #: ``life`` is FINISHED, CLOSED or CRASHED (written by ``_become`` only).
        self.finished = False
        #: The Cancel that closed the call, if one did.
        self.stopped_by: CancelKind | None = None
        #: A stimulus left settling for later: the shell must send ``SETTLE`` once it has
        #: started the ready work it holds (read-only for the shell).
        self.unsettled = False
        #: Consumer edges (activations, buckets, latches) holding each data-plane ref.
        self.refcounts: dict[DataRef, int] = {}
        #: Errors of the call (kind "error" or "cancel").
        self.errors: list[NodeError] = []
        #: DEAD activations that had received frames: {"node", "field", "message"} each.
        self.warnings: list[dict[str, str]] = []
        #: Running activations (for cancellation).
        self.running: set[Activation] = set()
        #: Activations admitted and not done (pending, parked or running).
        self.n_acts = 0
        #: Of those, activations parked on a latched field (``_latches``).
        self.n_parked = 0
        #: Per throttled node: its running activations (max_concurrency).
        self._running_per_node: dict[str, int] = {}
        #: Buckets and ordering queues waiting on an entry's liveness.
        self._waiters: dict[Entry, set[Any]] = {}
        #: What the next settle must look at: buckets that may fire now, session nodes to
        #: pump (several OR groups got an activation in this step, or a held node's bucket
        #: changed), and group-ordered session nodes whose next activation waits for an
        #: earlier group's bucket.
        self._touched: list[Bucket] = []
        self._pump_later: set[str] = set()
        self._held: set[str] = set()
        #: On graphs with cycles: the order in which entries were stamped. A loop that comes
        #: back replaces a node's older entry, so there the entries of a table no longer say
        #: which frame came first by themselves; their stamp numbers do (production order of
        #: collected and counted frames).
        self._stamp_no: dict[Entry, int] | None = {} if compiled.cycle_nodes else None

    # ------------------------------------------------------------------ life

    def _become(self, to: CallLife) -> None:
        """The one place the call's life changes (``LIFE``)."""
        if to not in LIFE[self.life]:
            raise LifeError(
                f"call {self.call_id}: cannot move from {self.life.name} to {to.name}; "
                f"story: {self.story()}"
            )
        self.life = to
        self.closing = to in _CLOSING
        self.finished = to in _FINISHED

    @property
    def cancelled(self) -> bool:
        """The caller cancelled the call."""
        return self.stopped_by is CancelKind.CANCEL

    @property
    def crashed(self) -> bool:
        """A Crash ended the call: later stimuli are ignored."""
        return self.life is CallLife.CRASHED

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

    def story(self) -> list[tuple[str, dict[str, Any]]]:
        """The call's story so far (empty when no story is kept)."""
        return [] if self._story is None else render_story(self._story, self.call_id)

    def _log(self, event: str, *values: Any) -> None:
        """One story record under the current stimulus (``_stimuli.STORY_FIELDS`` names the
        values): a tuple, rendered only when somebody reads the story."""
        if self._story is not None:
            self._story.append((self.call_id, self.stimuli, event, *values))

    # ------------------------------------------------------------------ errors, warnings

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

    def _node_error(self, node: str, message: str, field: str | None = None) -> None:
        self.errors.append(
            NodeError(
                node, message, kind="error", field=field, call_id=self.call_id, graph=self.graph
            )
        )
        self._log("error", node, None, message)

    # ------------------------------------------------------------------ activations

    def _move(self, act: Activation, to: ActState) -> None:
        """The one place an activation changes state (``_stimuli.LEGAL``)."""
        if to not in LEGAL[act.state]:
            raise TransitionError(self.call_id, act.node, act.aid, act.state, to, self.story())
        act.state = to

    def _run(self, act: Activation) -> None:
        self._move(act, RUNNING)
        node = act.node
        if node in self.c.throttled:
            self._running_per_node[node] = self._running_per_node.get(node, 0) + 1
        self.running.add(act)
        self._out_run.append(act)

    def _drop_pending(self, act: Activation) -> None:
        self._move(act, ActState.DONE)
        self.n_acts -= 1
        self._dec(act.table, act.node)
        self._let_go(act.refs)

    # ------------------------------------------------------------------ liveness

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

    def _watch(self, e: Entry, waiter: Any) -> None:
        ws = self._waiters.get(e)
        if ws is None:
            ws = self._waiters[e] = set()
        ws.add(waiter)
        self.live.watch(e)

    # ------------------------------------------------------------------ data-plane refs

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


_NONE: dict[str, int] = {}
