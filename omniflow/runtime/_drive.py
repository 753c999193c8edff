"""Driving role methods: one set of rules for the front (``_runtime``) and the worker
(``_worker``), which differ only in where a frame goes.

>>> out = first_step(method, kwargs)           # its error propagates  # doctest: +SKIP
>>> if type(out) is Running:                    # suspended: finished(*out) once out.task ends
...     out.task.add_done_callback(...)
>>> error = await drive(agen, push)                                      # doctest: +SKIP

A coroutine method runs its first step at once, in the caller's context (most methods finish
there, and need no task at all); the rest runs in a task that resumes that very coroutine. A
generator method is driven by :func:`drive`: each frame goes to ``push`` (which says whether
to go on), the consumer's congestion is awaited between frames, and the generator is always
closed, however it ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator
from typing import Any, NamedTuple

__all__ = ["Finished", "Running", "drive", "finished", "first_step", "generator_end"]


class Finished(NamedTuple):
    """How a method that ran as a task ended: the error it raised (None: it returned
    ``value``)."""

    error: BaseException | None
    value: Any = None


class Running(NamedTuple):
    """A coroutine method suspended in its first step, carried on by ``task``."""

    coro: Coroutine[Any, Any, Any]
    task: asyncio.Task[Any]


class _Continue:
    """Await an already-started coroutine that is suspended on ``fut`` (eager start's tail)."""

    __slots__ = ("coro", "fut")

    def __init__(self, coro: Any, fut: Any) -> None:
        self.coro = coro
        self.fut = fut

    def __await__(self) -> Generator[Any, None, Any]:
        coro, fut = self.coro, self.fut
        while True:
            try:
                yield fut
            except BaseException as exc:  # thrown in by our task: cancellation
                try:
                    fut = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                fut = coro.send(None)
            except StopIteration as stop:
                return stop.value


async def _await_continue(cont: _Continue) -> Any:
    return await cont


def first_step(method: Callable[..., Coroutine[Any, Any, Any]], kwargs: dict[str, Any]) -> Any:
    """Call a coroutine method and run it up to its first suspension, now: what it returned
    if it ended there (what it raised propagates), else :class:`Running` (a task made in the
    current context carries it on; :func:`finished` tells how that ended). Nothing is made
    for a method that ends at once, the common case on the hot path."""
    coro = method(**kwargs)
    try:
        fut = coro.send(None)
    except StopIteration as stop:
        return stop.value
    return Running(
        coro, asyncio.get_running_loop().create_task(_await_continue(_Continue(coro, fut)))
    )


def finished(coro: Coroutine[Any, Any, Any], task: asyncio.Task[Any]) -> Finished:
    """How the task of a :class:`Running` ended (a cancelled one closes its coroutine)."""
    if task.cancelled():
        coro.close()
        return Finished(asyncio.CancelledError())
    exc = task.exception()
    return Finished(exc) if exc is not None else Finished(None, task.result())


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
) -> BaseException | None:
    """Run a generator method to its end, handing each frame to ``push``.

    ``push(frame)`` returns False to stop the method early (its consumer is gone or refused
    the frame); an exception from it is the activation's error, like the method's own.
    ``space()`` returns something to await while the consumer is congested (None: go on).
    Returns the error the method ended with (None: it finished, or was stopped by ``push``);
    the generator is closed in every case.
    """
    exc: BaseException | None = None
    try:
        while True:
            try:
                frame = await agen.__anext__()
            except StopAsyncIteration:
                break
            if not push(frame):
                break
            if space is not None:
                wait = space()
                if wait is not None:
                    await wait
    except (Exception, asyncio.CancelledError) as e:
        exc = e
    finally:
        try:
            await agen.aclose()
        except BaseException as e:  # a generator that misbehaves on close
            exc = exc or e
    return exc
