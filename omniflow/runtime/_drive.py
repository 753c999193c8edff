"""Running role methods as tasks: one set of rules for the front (``_runtime``) and the
worker (``_worker_runs``), which differ only in where a frame goes.

>>> task = eager_task(walker(), contextvars.copy_context())      # doctest: +SKIP
>>> value = await Continue(coro, fut)                             # doctest: +SKIP
>>> error = await drive(agen, push)                               # doctest: +SKIP

Every role method runs inside one ``asyncio.Task`` from its first step to its end
(docs/concurrency.md, *Role methods run in tasks*). A task is costly next to a method that
returns at once (most methods on the hot path), so the shells share one: a *walker* is an
eagerly started task (:func:`eager_task`: its first step runs now, inside the task, as Python
3.12's ``eager_start`` does) that runs ready methods of one call one after another. A method
that returns within its first step has run inside the walker for its whole life; one that
suspends keeps the walker, which from then on only carries that method on
(:class:`Continue`) and leaves the rest of the ready work to a new walker. A generator method
is driven by :func:`drive` in a task of its own: each frame goes to ``push`` (which says
whether to go on), the consumer's congestion is awaited between frames, and the generator is
always closed, however it ended.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from asyncio import tasks as _tasks
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator
from typing import Any

__all__ = ["Continue", "drive", "eager_task", "generator_end"]

_Task = asyncio.Task


class _Grab:
    """Stands in for ``loop.call_soon`` while a Task is built (3.11 only): keeps its first
    step instead of scheduling it."""

    __slots__ = ("args", "context", "step")

    def __init__(self) -> None:
        self.step: Callable[..., Any] | None = None
        self.args: tuple[Any, ...] = ()
        self.context: contextvars.Context | None = None

    def __call__(self, step: Callable[..., Any], *args: Any, context: Any = None) -> None:
        self.step = step
        self.args = args
        self.context = context


#: Read out before the callback it grabbed runs, so nested uses may share it.
_GRAB = _Grab()
#: loop -> its instance dict (None: it has none, nothing is grabbed there).
_OWN: dict[Any, dict[str, Any] | None] = {}


def _own(loop: Any) -> dict[str, Any] | None:
    own = _OWN.get(loop, False)
    if own is False:
        if len(_OWN) > 64:  # (loops of finished asyncio.run calls)
            _OWN.clear()
        own = _OWN[loop] = getattr(loop, "__dict__", None)
    return own  # type: ignore[return-value]


def _run_as_task(loop: Any) -> None:
    """Run the grabbed task step now, as the loop would: in its context, with its task the
    current one (the task that was current, if any, swapped out and back, as 3.12 does)."""
    grab = _GRAB
    step, args, ctx = grab.step, grab.args, grab.context
    grab.step = grab.context = None
    assert step is not None and ctx is not None
    prev = _current_tasks.get(loop)
    if prev is not None:
        _leave_task(loop, prev)
    try:
        ctx.run(step, *args)
    finally:
        if prev is not None:
            _enter_task(loop, prev)


def _eager_311(coro: Coroutine[Any, Any, Any], context: contextvars.Context) -> asyncio.Task[Any]:
    """Python 3.12's ``Task(..., eager_start=True)`` on 3.11: build a real ``asyncio.Task``,
    take the first step it schedules (``call_soon(step, context=...)``, the only call its
    constructor makes on the loop) and run it now (``_run_as_task``). The step is the Task's
    own: it enters the task, steps the coroutine, and sets the result, or waits on what the
    coroutine awaits, exactly as if the loop had run it."""
    loop = asyncio.get_running_loop()
    own = _own(loop)
    if own is None:  # a loop without instance attributes: the first step runs next turn
        return loop.create_task(coro, context=context)
    own["call_soon"] = _GRAB
    try:
        task = _Task(coro, loop=loop, context=context)
    finally:
        del own["call_soon"]
    _run_as_task(loop)
    return task


def _eager_312(coro: Coroutine[Any, Any, Any], context: contextvars.Context) -> asyncio.Task[Any]:
    return _Task(coro, loop=asyncio.get_running_loop(), context=context, eager_start=True)  # type: ignore[call-arg]


if sys.version_info >= (3, 12):  # pragma: no cover - CI runs 3.11
    eager_task = _eager_312
else:
    _current_tasks: dict[Any, Any] = _tasks._current_tasks  # type: ignore[attr-defined]
    _enter_task = _tasks._enter_task
    _leave_task = _tasks._leave_task
    eager_task = _eager_311
eager_task.__doc__ = """A task running ``coro`` in ``context`` whose first step has already
run, inside the task, when this returns (it may be done by then)."""


class Continue:
    """Await a method's coroutine that suspended on ``fut`` in its first step, to its end
    (its value, or what it raised). Awaited by the task the first step ran in, so the method
    sees one task for its whole life; a cancel of that task is thrown into the method at its
    current ``await``."""

    __slots__ = ("coro", "fut")

    def __init__(self, coro: Coroutine[Any, Any, Any], fut: Any) -> None:
        self.coro = coro
        self.fut = fut

    def __await__(self) -> Generator[Any, None, Any]:
        coro, fut = self.coro, self.fut
        while True:
            try:
                yield fut
            except BaseException as exc:  # thrown in by the task: a cancel
                try:
                    fut = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                fut = coro.send(None)
            except StopIteration as stop:
                return stop.value


def generator_end(task: asyncio.Task[Any]) -> BaseException:
    """What to report for a :func:`drive` task that ended without reporting itself: one
    cancelled before its first step never ran its body (else its caller would wait for the
    activation forever)."""
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or asyncio.CancelledError()


async def drive(
    agen: AsyncGenerator[Any, None],
    push: Callable[[Any], bool],
    space: Callable[[], Awaitable[None] | None] | None = None,
    flush: Callable[[], None] | None = None,
    burst: int = 64,
) -> BaseException | None:
    """Run a generator method to its end, handing each frame to ``push``.

    ``push(frame)`` returns False to stop the method early (its consumer is gone or refused
    the frame); an exception from it is the activation's error, like the method's own.
    ``space()`` returns something to await while the consumer is congested (None: go on).
    With ``flush``, what the pushed frames make downstream is started by ``flush()``: before
    the generator suspends, after ``burst`` frames, and at its end; frames it yields without
    suspending are handed over together, inside this task's one step (docs/concurrency.md,
    *Role methods run in tasks*). Returns the error the method ended with (None: it finished,
    or was stopped by ``push``); the generator is closed in every case.
    """
    exc: BaseException | None = None
    held = 0  # frames pushed whose downstream waits for ``flush``
    try:
        while True:
            step = agen.__anext__()
            try:
                if flush is None:
                    frame = await step
                else:
                    try:
                        fut = step.send(None)
                    except StopIteration as stop:
                        frame = stop.value
                    else:  # it suspends: what its frames made starts first
                        if held:
                            held = 0
                            flush()
                        frame = await Continue(step, fut)
            except StopAsyncIteration:
                break
            if not push(frame):
                break
            if flush is not None:
                held += 1
                if held >= burst:
                    held = 0
                    flush()
            if space is not None:
                wait = space()
                if wait is not None:
                    if held and flush is not None:  # (about to suspend)
                        held = 0
                        flush()
                    await wait
    except (Exception, asyncio.CancelledError) as e:
        exc = e
    finally:
        if held:
            assert flush is not None
            flush()
        try:
            await agen.aclose()
        except BaseException as e:  # a generator that misbehaves on close
            exc = exc or e
    return exc
