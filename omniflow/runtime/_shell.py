"""The local shell: hands a call core its stimuli, carries out its answers, runs the methods.

One event loop, no locks: every decision is one synchronous call into a ``CallCore``. Every
method runs inside one asyncio.Task from its first step to its end: a call's ready methods run
one after another in an eagerly started *walker* task, and a method that suspends keeps its
walker to its end while the rest go on in another (``Shell._walk``; docs/concurrency.md, "Role
methods run in tasks"). The ``Runtime`` owns the shell and the calls' lifecycle and sessions.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from omniflow._exceptions import OmniflowError
from omniflow.data._plane import DataPlane, DataRef
from omniflow.dsl._context import ActivationContext, _current
from omniflow.runtime._batcher import BatchEntry, Batcher
from omniflow.runtime._call import Call
from omniflow.runtime._drive import Continue, drive, eager_task, generator_end
from omniflow.runtime._executor import Remote
from omniflow.runtime._metrics import RuntimeMetrics, count_reads
from omniflow.runtime._params import SessionParams
from omniflow.runtime.callcore._core import RUNNING, Activation, CallCore
from omniflow.runtime.callcore._stimuli import (
    NOTHING,
    SETTLE,
    Crash,
    Ended,
    Instructions,
    Produced,
    Returned,
    Stimulus,
)

__all__ = ["Shell"]

logger = logging.getLogger("omniflow.runtime")

_new = tuple.__new__
#: A caller frame's value (``Emit`` is (field, value, node, seq index)).
_value = operator.itemgetter(1)


def _context_of(call: Call, act: Activation) -> ActivationContext:
    """Build the context of a local activation (only when its method calls of.context())."""
    params = call._params
    if params is None:  # a call without a session: its parameters live as long as it does
        params = call._params = SessionParams(call._rt._factories)
    return ActivationContext(
        graph=call.graph,
        session=call.session,
        call_id=call.call_id,
        node=act.node,
        or_group=act.group,
        params=params,
        seq=act.seq[2],
        aid=act.aid,
        pools=call._rt._pool_view,
    )


class Shell:
    """Runs the calls of one ``Runtime``: stimuli in, the core's answers carried out. Built
    first (remote roles and batchers report to it); ``remote``, ``remote_nodes``, ``batchers``
    and ``finish`` (``Calls.finish``: the end of a call) are filled in after."""

    #: The end of a call (``Calls.finish``), called when the core says the call finished.
    finish: Callable[[Call, CallCore | None], None]

    def __init__(
        self,
        *,
        plane: DataPlane | None,
        metrics: RuntimeMetrics | None,
        validate: bool,
    ) -> None:
        #: This process's data plane (None when every role runs here: objects pass as is).
        self.plane = plane
        #: Counters for /metrics (None while metrics are off).
        self.metrics = metrics
        #: Check every call core's invariants after each step (tests switch this on).
        self.validate = validate
        #: Worker processes and their replicas (None for in-process placement).
        self.remote: Remote | None = None
        #: Nodes whose role runs in a worker process (``remote.submit`` starts them).
        self.remote_nodes: frozenset[str] = frozenset()
        #: node -> its batcher, for the batched nodes this process runs (``batch=``).
        self.batchers: dict[str, Batcher] = {}
        #: Every task the shell started and that has not ended (``close`` finds none left).
        self.tasks: set[asyncio.Task[Any]] = set()
        #: The walker task now between two methods (``_walk``: ready coroutine methods run
        #: inline in it), else None.
        self._walker: asyncio.Task[Any] | None = None
        #: The method that just suspended in the walker (activation, coroutine, what it
        #: awaits): the walker carries it on.
        self._parked: tuple[Activation, Any, Any] | None = None
        #: Set by ``_spawn`` while a walker's first step may run; the walker clears it.
        self._spawning = False

    # The shell's whole contract with the core: hand it a stimulus, carry out the answer.
    # What runs where (tasks, remote handles, start times) is the shell's own business and
    # lives on the Call (``_ready``, ``_tasks``, ``_t0``); the core's state is only read.

    def step(self, call: Call, core: CallCore, stimulus: Stimulus) -> bool:
        """One stimulus from outside the pump: handle it, carry out the answer, then start
        the ready work it made. Returns ``Instructions.accepted``."""
        ins = core.handle(stimulus)
        if ins is not NOTHING:
            run, emit, release, cancel, finished, accepted = ins
            if emit or release or cancel or finished:
                self._apply(call, core, ins)
            else:  # ``_apply``'s common case, inlined: work to start
                call._ready.extend(run)
                self._pump(call, core)
                return accepted
        self._pump(call, core)
        return ins.accepted

    def _apply(self, call: Call, core: CallCore, ins: Instructions) -> None:
        """Carry out one answer of the core (``Instructions`` says in which order)."""
        if ins is NOTHING:
            return
        run, emit, release, cancel, finished, _accepted = ins
        if release:
            self._release(release)
        if emit:
            if self.plane is not None and DataRef in map(type, map(_value, emit)):
                if self.metrics is not None:  # (the caller's copies: read across processes)
                    count_reads(self.metrics.edge_bytes, call.graph, "<output>", emit)
                emit = tuple(map(self._materialize, emit))
            call._push(emit)
            if self.metrics is not None:
                out = self.metrics.frames_out
                for f, *_ in emit:
                    out[(call.graph, f)] = out.get((call.graph, f), 0) + 1
        if run:
            call._ready.extend(run)
        if cancel:
            current = asyncio.current_task()
            tasks = call._tasks
            for act in cancel:
                task = tasks.get(act)
                if task is not None and task is not current:
                    task.cancel()
        if finished:
            call._ready.clear()
            self.finish(call, core)

    def _pump(self, call: Call, core: CallCore) -> None:
        """Start the ready work, batch by batch; after each batch let the core settle what
        the batch's returns left behind (once, not after every return).

        Local coroutine methods run inside a walker task (``_walk``): here, inline, when this
        is a walker between methods; else a new walker is started eagerly and runs the ready
        work itself until it empties or a method suspends in it (then this loop goes on with
        what is left). A method that suspends in this walker makes it that method's task:
        the pump stops here and the walker's caller goes on with the rest."""
        ready = call._ready
        while True:
            while ready:
                if self._walker is None and ready[0].node in call._coros:
                    if not self._spawn(call, core):
                        return  # (it starts next turn and pumps everything itself)
                    continue
                self._launch(call, core, ready.popleft())
                if self._parked is not None:
                    return
            if not core.unsettled or call.done:
                break
            self._apply(call, core, core.handle(SETTLE))
        if self.validate:
            core.validate()

    def _spawn(self, call: Call, core: CallCore) -> bool:
        """Start a walker for the call's ready work; True when its first step ran now."""
        self._spawning = True
        eager_task(self._walk(call, core), call._ctx.copy())
        ran = not self._spawning  # the walker took the flag: its first step ran
        self._spawning = False
        return ran

    async def _walk(self, call: Call, core: CallCore) -> None:
        """A walker: the task that the call's ready coroutine methods run in, one after
        another, until one suspends; that one keeps this task to its end (``Continue``),
        then this walker reports it and runs what became ready, as before. The rest of the
        ready work, when a method suspends, goes on in the caller of this walker's first step
        (the pump that started it) or, on later steps, in new walkers started here. A walker
        serves one call, in its task's own copy of the caller's context: what a method sets
        in a contextvar no other call's method sees."""
        me = asyncio.current_task()
        # Started by ``_spawn`` (eagerly): the pump that started it goes on after it.
        eager, self._spawning = self._spawning, False
        while True:
            outer = self._walker
            self._walker = me
            try:
                self._pump(call, core)
            except Exception as exc:
                self.crash(call, exc)
            finally:
                self._walker = outer
            parked = self._parked
            if parked is None:
                return
            self._parked = None
            act, coro, fut = parked
            call._tasks[act] = me
            if me not in self.tasks:
                self.track(me)  # type: ignore[arg-type]
            if not eager and call._ready:
                self._pump(call, core)  # (walker off: the rest in walkers of their own)
            eager = False
            try:
                value = await Continue(coro, fut)
            except (Exception, asyncio.CancelledError) as exc:
                error: BaseException | None = exc
            else:
                error = None
            if call.done:
                return
            try:
                if error is not None:
                    self._done(call, core, act, error)
                else:
                    del call._tasks[act]
                    if self.metrics is not None:
                        self._observe(call, act, None)
                    self._apply(call, core, core.handle(_new(Returned, (act, value, True))))
                if error is not None or me.cancelling():  # type: ignore[union-attr]
                    # A cancelled task runs no other method: the rest in new walkers.
                    self._pump(call, core)
                    return
            except Exception as exc:
                self.crash(call, exc)
                return

    def _launch(self, call: Call, core: CallCore, act: Activation) -> None:
        # (A worker's ``Activations._run`` runs by the same rules, runtime/_drive; its ends
        # go to the front as messages, these step the call core at once.)
        metrics = self.metrics
        while True:  # one turn per activation of a chain of inline returns
            if metrics is not None:
                call._t0[act] = time.perf_counter()
            method = call._coros.get(act.node)
            kwargs = act.kwargs
            if method is None or act.refs:
                got = self._launch_other(call, core, act)
                if got is None:
                    return
                method, kwargs = got
            # In the walker's context (its task's own copy of the caller's at ``rt.call``):
            # of.context() reads this activation.
            _current.set((_context_of, call, act))
            walker, self._walker = self._walker, None  # (a nested call starts its own)
            try:
                coro = method(**kwargs)
                fut = coro.send(None)
            except StopIteration as stop:
                out = stop.value
            except (Exception, asyncio.CancelledError) as exc:
                self._done(call, core, act, exc, not call._ready)
                return
            else:  # suspended: this walker is the method's task from now on
                self._parked = (act, coro, fut)
                return
            finally:
                self._walker = walker
            # Returned within its first step; more of the batch waiting: settle later.
            if metrics is not None:
                self._observe(call, act, None)
            # (``tuple.__new__``: the NamedTuple's own constructor is Python code.)
            ins = core.handle(_new(Returned, (act, out, not call._ready)))
            if ins is NOTHING:
                return
            run, emit, release, cancel, done, _ = ins
            if emit or release or cancel or done:
                self._apply(call, core, ins)
                return
            if len(run) == 1 and not call._ready:
                # The pump would start it next: start it now (a chain's next hop).
                act = run[0]
                continue
            call._ready.extend(run)  # ``_apply``'s common case, inlined
            return

    def _launch_other(
        self, call: Call, core: CallCore, act: Activation
    ) -> tuple[Any, dict[str, Any]] | None:
        """``_launch`` for a remote node, a generator, or inputs on the data plane: start it
        here, or return the coroutine method and its inputs to start the common way (None:
        started, or already failed)."""
        node = act.node
        if node in self.remote_nodes:
            assert self.remote is not None
            self.remote.submit(call, core, act)
            return None
        kwargs = self._resolve_inputs(call, core, act) if act.refs else act.kwargs
        if kwargs is None:
            return None
        batcher = self.batchers.get(node)
        if batcher is not None:  # (the batch ends it: ``on_done`` / ``on_fail``)
            entry = BatchEntry(
                batcher,
                kwargs,
                (_context_of, call, act),
                call,
                lambda frame: self.remote_return(call, core, act, frame),
                lambda exc: self.ended(call, core, act, exc),
            )
            call._tasks[act] = entry
            batcher.add(entry)
            return None
        method = core.c.methods[node]
        if node not in core.c.generators:
            return method, kwargs
        ctx = call._ctx.copy()
        ctx.run(_current.set, (_context_of, call, act))
        try:
            agen = method(**kwargs)
        except Exception as exc:
            self._done(call, core, act, exc, not call._ready)
            return None
        # The generator's own task, in its own context, from its first step to its end.
        task = asyncio.get_running_loop().create_task(
            self._drive(call, core, act, agen), context=ctx
        )
        call._tasks[act] = task
        self.track(task)
        task.add_done_callback(lambda t: self._drive_ended(call, core, act, t))
        return None

    def _drive_ended(
        self, call: Call, core: CallCore, act: Activation, task: asyncio.Task[Any]
    ) -> None:
        """A generator task ended. ``_drive`` reports the end itself; a task cancelled before
        its first step never ran its body, so its end is reported here (else the call would
        wait for it forever)."""
        if call._tasks.get(act) is task and act.state is RUNNING and not call.done:
            self.ended(call, core, act, generator_end(task))

    async def _drive(self, call: Call, core: CallCore, act: Activation, agen: Any) -> None:
        """Run a generator method here (``_drive.drive``): its frames go to the call core at
        once; the work they make starts in a walker at each ``flush`` (a frame the generator
        yields without suspending is handed over with the others of its burst)."""

        def push(frame: Any) -> bool:
            if call.done:
                return False
            try:
                # (``tuple.__new__``: the NamedTuple's own constructor is Python code.)
                ins = core.handle(_new(Produced, (act, frame)))
                self._apply(call, core, ins)
                return ins.accepted
            except Exception as internal:
                self.crash(call, internal)
                return False

        def flush() -> None:
            if call.done:
                return
            try:
                self._pump(call, core)
            except Exception as internal:
                self.crash(call, internal)

        def space() -> Any:
            return call._wait_space() if call._congested() else None

        self.ended(call, core, act, await drive(agen, push, space, flush))

    def _observe(self, call: Call, act: Activation, exc: BaseException | None) -> None:
        """Per-node metrics of an ended activation (only while metrics are on)."""
        assert self.metrics is not None
        nm = self.metrics.node(call.graph, act.node)
        nm.activations += 1
        if exc is not None:
            if isinstance(exc, asyncio.CancelledError):
                nm.cancelled += 1
            else:
                nm.errors += 1
        t0 = call._t0.pop(act, None)
        if t0 is not None:
            nm.observe(time.perf_counter() - t0)

    def _done(
        self,
        call: Call,
        core: CallCore,
        act: Activation,
        exc: BaseException | None,
        settle: bool = True,
    ) -> None:
        """The method ended with no frame of its own left to deliver (its stream ended, it
        raised, it was cancelled, it never started): tell the core."""
        call._tasks.pop(act, None)
        if self.metrics is not None:
            self._observe(call, act, exc)
        self._apply(call, core, core.handle(Ended(act, exc, settle)))

    def remote_frame(self, call: Call, core: CallCore, act: Activation, frame: Any) -> None:
        if call.done:
            return
        try:
            ins = core.handle(_new(Produced, (act, frame)))
            self._apply(call, core, ins)
            if not ins.accepted and not core.closing:
                handle = call._tasks.get(act)
                if handle is not None:
                    handle.cancel()  # the core rejected the frame: stop the remote method
            self._pump(call, core)
        except Exception as exc:
            self.crash(call, exc)

    def remote_return(self, call: Call, core: CallCore, act: Activation, frame: Any) -> None:
        """A remote coroutine returned ``frame``: the frame and the end in one stimulus, as
        for a local one (``_launch``)."""
        if call.done:
            return
        try:
            call._tasks.pop(act, None)
            if self.metrics is not None:
                self._observe(call, act, None)
            self.step(call, core, _new(Returned, (act, frame, True)))
        except Exception as exc:
            self.crash(call, exc)

    def ended(self, call: Call, core: CallCore, act: Activation, exc: BaseException | None) -> None:
        """A method ended outside the pump (a generator task, a worker's ``done``): record it
        and carry on; an internal error ends only this call."""
        if call.done:
            return
        try:
            self._done(call, core, act, exc)
            self._pump(call, core)
        except Exception as internal:
            self.crash(call, internal)

    def crash(self, call: Call, exc: BaseException) -> None:
        """A bug in omniflow surfaced while running ``call``: the core ends it with an error
        and names what runs, which is cancelled; the runtime keeps serving (the call's story
        tells what led here)."""
        logger.error("internal error in call %s", call.call_id, exc_info=exc)
        core = call.core
        if core is None or call.done:
            return
        call._ready.clear()
        self._apply(call, core, core.handle(Crash(exc)))

    def _release(self, refs: Sequence[DataRef]) -> None:
        mine = [r for r in refs if r.source == "" and r.pid == os.getpid()]
        if self.plane is not None:
            for ref in mine:
                self.plane.release(ref)
        if self.remote is not None and len(mine) < len(refs):
            self.remote.release([r for r in refs if r.source != ""])

    def _materialize(self, frame: tuple[str, Any, str, int]) -> tuple[str, Any, str, int]:
        """A frame for the caller must outlive the call: copy a data-plane value out."""
        value = frame[1]
        if type(value) is DataRef and self.plane is not None:
            try:
                value = self.plane.read_now(value, copy=True)
            except OmniflowError as exc:
                value = f"<data-plane value lost: {exc}>"
            return (frame[0], value, frame[2], frame[3])
        return frame

    def _resolve_inputs(self, call: Call, core: CallCore, act: Activation) -> dict[str, Any] | None:
        """A local activation's inputs with data-plane refs swapped for their values
        (zero-copy views where the producer is on this host). None: the activation already
        failed."""
        plane = self.plane
        if plane is None:
            return act.kwargs
        try:
            kwargs = {f: plane.resolve_now(v) for f, v in act.kwargs.items()}
        except OmniflowError as exc:
            self._done(call, core, act, exc, not call._ready)
            return None
        if self.metrics is not None:  # (what was read from another process's pool)
            count_reads(self.metrics.edge_bytes, call.graph, act.node, act.kwargs.items())
        return kwargs

    def track(self, task: asyncio.Task[Any]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
