"""The shell of batching: a timer and one task per batch around a ``BatchQueue``.

>>> batcher = Batcher("vit.encode", role.encode, Batch(16, 5))      # doctest: +SKIP
>>> entry = BatchEntry(batcher, {"image": im}, ctx, "call-1", on_done, on_fail)  # doctest: +SKIP
>>> batcher.add(entry)                                              # doctest: +SKIP

One ``Batcher`` per batched node and replica (the front's Runtime for in-process roles, each
worker for its own), shared by every call and session that reaches it. The call core never
sees a batch: each activation started (``add``) and each ends once, through ``on_done(frame)``
(a dict or None, as a coroutine's return) or ``on_fail(exc)`` (an exception, a cancel), exactly
as a method of its own would. The decisions (which activations, when) are the pure
``BatchQueue``'s; here they are carried out: a timer for the queue's deadline, and one task per
batch in which the method runs from its first step to its end, in a copy of the replica's
context with ``of.context()`` the batch's first activation and ``of.batch_contexts()`` all.

Cancel: an activation that waits leaves the queue; one whose batch runs ends at once as
cancelled and its entry of the result is dropped (a batch left with no activation is
cancelled). Either way its end is reported on the next loop turn, never inside the caller's
own cancel (the shells cancel while carrying out the core's answer).
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from omniflow._exceptions import OmniflowError
from omniflow.dsl._context import _batch, _current
from omniflow.dsl._role import Batch
from omniflow.runtime._batching import BatchQueue
from omniflow.runtime._drive import eager_task

__all__ = ["BatchEntry", "Batcher", "EntryState"]

logger = logging.getLogger("omniflow.runtime")

#: The event loop's timer resolution: epoll waits whole milliseconds, rounded up, so a timer
#: fires up to 1 ms late. The timer is armed this much early and takes what is due by then:
#: a batch runs at most ``max_wait_ms`` after its first activation, never a millisecond past.
SLACK = 0.001


class EntryState(enum.Enum):
    #: In the queue, waiting for its batch.
    QUEUED = "queued"
    #: Its batch runs.
    RUNNING = "running"
    #: Its end was reported (result, failure or cancel): nothing more happens to it.
    OVER = "over"


class BatchEntry:
    """One activation handed to a batcher; ``cancel()`` is what the shells call on the
    activation's handle (it stands where a task would)."""

    __slots__ = ("batch", "batcher", "ctx", "group", "kwargs", "on_done", "on_fail", "state")

    def __init__(
        self,
        batcher: Batcher,
        kwargs: dict[str, Any],
        ctx: Any,
        group: Any,
        on_done: Callable[[Any], None],
        on_fail: Callable[[BaseException], None],
    ) -> None:
        self.batcher = batcher
        #: The activation's inputs, by field.
        self.kwargs = kwargs
        #: What ``of.context()`` reads for this activation (``_context._current``'s value).
        self.ctx = ctx
        #: The call it belongs to (fairness is across calls).
        self.group = group
        #: Called once with the activation's frame (a dict, or None: a zero-yield).
        self.on_done = on_done
        #: Called once with what the activation failed with (a CancelledError when cancelled).
        self.on_fail = on_fail
        #: Where it stands.
        self.state = EntryState.QUEUED
        #: Its batch (the entries and their task) once it runs.
        self.batch: _Running | None = None

    def cancel(self) -> None:
        self.batcher.cancel(self)


class _Running:
    __slots__ = ("entries", "task")

    def __init__(self, entries: list[BatchEntry]) -> None:
        self.entries = entries
        self.task: asyncio.Task[None] | None = None


class Batcher:
    """The batches of one node in one replica."""

    def __init__(
        self,
        node: str,
        method: Callable[..., Any],
        spec: Batch,
        *,
        clock: Callable[[], float] = time.monotonic,
        track: Callable[[asyncio.Task[Any]], None] | None = None,
    ) -> None:
        #: Node name.
        self.node = node
        #: The bound method (a coroutine function), called once per batch.
        self.method = method
        #: Which activations run together, and when.
        self.queue = BatchQueue(node, spec.max_size, spec.max_wait_ms / 1000.0)
        #: Seconds, monotonic (tests pass a fake clock and call ``poll``).
        self.clock = clock
        #: Called with each batch's task (the Runtime keeps its tasks).
        self.track = track
        #: The context each batch runs in a copy of (the replica's, set when it starts).
        self.base = contextvars.Context()
        #: The timer armed for the queue's deadline, and that deadline.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        #: Batches whose method runs now.
        self.running: set[_Running] = set()

    def add(self, entry: BatchEntry) -> None:
        """``entry`` is ready: queue it, run what is due, arm the timer for the rest."""
        self.queue.add(entry, entry.group, self.clock())
        self.poll()

    def poll(self, slack: float = 0.0, eager: bool = False) -> None:
        """Start every batch that is due now (or within ``slack``), then arm the timer for
        the next deadline. ``eager``: start each batch's task now (not from inside a pump)."""
        now = self.clock()
        while (keys := self.queue.take(now + slack)) is not None:
            self._start(keys, eager)
        self._arm(now)

    def _arm(self, now: float) -> None:
        at = self.queue.deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            delay = max(0.0, at - now - SLACK)
            self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = None
        # A timer callback runs in no task and no pump: the batch's first step may run here.
        self.poll(SLACK, eager=True)

    def _start(self, entries: list[BatchEntry], eager: bool = False) -> None:
        run = _Running(entries)
        for e in entries:
            e.state = EntryState.RUNNING
            e.batch = run
        ctx = self.base.copy()
        ctx.run(_current.set, entries[0].ctx)
        ctx.run(_batch.set, tuple(e.ctx for e in entries))
        self.running.add(run)  # (before its first step, which may end it)
        # The batch's own task: started eagerly from the timer, else one loop turn later (it
        # never runs inside the pump that queued its last activation, another call's walker).
        coro = self._run(run)
        if eager:
            task = eager_task(coro, ctx)
        else:
            task = asyncio.get_running_loop().create_task(coro, context=ctx)
        run.task = task
        if self.track is not None:
            self.track(task)
        # A batch cancelled (runtime or worker closing, every activation gone), even before
        # its first step: what is still running ends as cancelled.
        task.add_done_callback(lambda t: self._end(run, None) if t.cancelled() else None)

    async def _run(self, run: _Running) -> None:
        entries = run.entries
        n = len(entries)
        names: dict[str, None] = {}
        for e in entries:
            names.update(dict.fromkeys(e.kwargs))
        lists = {f: [e.kwargs.get(f) for e in entries] for f in names}
        results: list[Any]
        try:
            out = await self.method(**lists)
        except Exception as exc:  # the method raised: every activation of the batch fails
            results = [exc] * n
        else:
            if isinstance(out, list | tuple) and len(out) == n:
                results = list(out)
            else:
                kind = type(out).__name__
                got = f"a {kind} of {len(out)}" if isinstance(out, list | tuple) else kind
                results = [
                    OmniflowError(
                        f"node '{self.node}': a batched method returns a list with one entry "
                        f"per activation ({n} in this batch: a dict, None or an exception "
                        f"each); it returned {got}"
                    )
                ] * n
        self._end(run, results)

    def _end(self, run: _Running, results: list[Any] | None) -> None:
        """Report each activation of the batch still running (None: cancelled)."""
        if run not in self.running:
            return
        self.running.discard(run)
        if results is None:
            results = [asyncio.CancelledError() for _ in run.entries]
        for e, r in zip(run.entries, results, strict=True):
            if e.state is not EntryState.RUNNING:
                continue  # cancelled while the batch ran: its result is dropped
            e.state = EntryState.OVER
            try:
                if isinstance(r, BaseException):
                    e.on_fail(r)
                else:
                    e.on_done(r)
            except Exception:  # (the shells report their own errors; one never stops the rest)
                logger.exception("node '%s': reporting a batched activation failed", self.node)

    def cancel(self, entry: BatchEntry) -> None:
        """The activation's call was cancelled: out of the queue, or out of its running
        batch (whose task is cancelled once none of its activations is left)."""
        state = entry.state
        if state is EntryState.OVER:
            return
        entry.state = EntryState.OVER
        loop = asyncio.get_running_loop()
        if state is EntryState.QUEUED:
            self.queue.remove(entry)
            self._arm(self.clock())
        else:
            run = entry.batch
            assert run is not None
            # (No task yet: cancelled from within its own eager first step, which ends it.)
            if run.task is not None and all(e.state is not EntryState.RUNNING for e in run.entries):
                run.task.cancel()
        loop.call_soon(entry.on_fail, asyncio.CancelledError())

    def close(self) -> None:
        """Stop the timer (the shells cancel their activations first)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None

    def statistics(self) -> dict[str, Any]:
        """The queue's counters (``BatchQueue.statistics``) and ``"running"``: batches whose
        method runs now."""
        stats = self.queue.statistics()
        stats["running"] = len(self.running)
        return stats

    def validate(self) -> None:
        self.queue.validate()
        for run in self.running:
            assert all(e.batch is run for e in run.entries), f"node '{self.node}': stray entry"
        for key in self.queue._where:
            assert isinstance(key, BatchEntry) and key.state is EntryState.QUEUED, (
                f"node '{self.node}': a queued activation is {getattr(key, 'state', key)!r}"
            )
