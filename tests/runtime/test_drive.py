"""How methods are driven (``runtime/_drive.py``), the one set of rules of front and worker."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from omniflow.runtime._drive import Continue, drive, eager_task, generator_end


class Gen:
    """A generator method that records how it was closed."""

    def __init__(self, n: int, fail_at: int | None = None, bad_close: bool = False) -> None:
        self.n, self.fail_at, self.bad_close = n, fail_at, bad_close
        self.closed = False

    async def __call__(self) -> AsyncIterator[int]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise ValueError(f"boom at {i}")
                yield i
        finally:
            self.closed = True
            if self.bad_close:
                raise RuntimeError("close failed")


async def test_every_frame_is_pushed_and_the_generator_closed() -> None:
    got: list[int] = []
    gen = Gen(3)
    assert await drive(gen(), lambda f: got.append(f) is None) is None
    assert got == [0, 1, 2] and gen.closed


async def test_push_false_stops_the_method_early() -> None:
    got: list[int] = []
    gen = Gen(10)
    assert await drive(gen(), lambda f: got.append(f) is None and f < 2) is None
    assert got == [0, 1, 2] and gen.closed


async def test_the_method_error_and_a_push_error_are_the_activation_error() -> None:
    err = await drive(Gen(3, fail_at=1)(), lambda f: True)
    assert isinstance(err, ValueError) and str(err) == "boom at 1"

    def refuse(frame: int) -> bool:
        raise TypeError("cannot carry it")

    gen = Gen(3)
    err = await drive(gen(), refuse)
    assert isinstance(err, TypeError) and gen.closed


async def test_a_failing_close_is_reported_unless_something_failed_first() -> None:
    err = await drive(Gen(1, bad_close=True)(), lambda f: True)
    assert isinstance(err, RuntimeError) and str(err) == "close failed"

    def refuse(frame: int) -> bool:
        raise TypeError("cannot carry it")

    err = await drive(Gen(3, bad_close=True)(), refuse)  # closed after the push failed
    assert isinstance(err, TypeError)


async def test_congestion_is_awaited_between_frames() -> None:
    space = asyncio.Event()
    got: list[int] = []
    task = asyncio.get_running_loop().create_task(
        drive(
            Gen(3)(),
            lambda f: got.append(f) is None,
            lambda: None if space.is_set() else space.wait(),
        )
    )
    for _ in range(5):
        await asyncio.sleep(0)
    assert got == [0]  # waits for space after the first frame
    space.set()
    assert await task is None and got == [0, 1, 2]


async def test_cancelling_the_driver_ends_the_method_with_cancelled() -> None:
    gen = Gen(10**6)
    started = asyncio.Event()

    async def slow(f: int) -> None:
        await asyncio.sleep(3600)

    task = asyncio.get_running_loop().create_task(
        drive(gen(), lambda f: started.set() is None, lambda: slow(0))
    )
    await started.wait()
    task.cancel()
    assert isinstance(await task, asyncio.CancelledError) and gen.closed


async def test_eager_task_runs_its_first_step_inside_the_task_now() -> None:
    seen: list[Any] = []
    var: contextvars.ContextVar[int] = contextvars.ContextVar("var", default=0)

    async def quick(x: int) -> int:
        seen.append(asyncio.current_task())
        var.set(x)
        return x + 1

    outer = asyncio.current_task()
    ctx = contextvars.copy_context()
    task = eager_task(quick(1), ctx)
    assert task.done() and task.result() == 2  # ran now, no loop turn
    assert seen == [task]  # inside its own task, not the caller's
    assert asyncio.current_task() is outer  # the caller's task is current again
    assert ctx[var] == 1 and var.get() == 0  # in the given context only


async def test_an_eager_task_that_suspends_stays_one_task_to_its_end() -> None:
    seen: list[Any] = []

    async def slow() -> int:
        seen.append(asyncio.current_task())
        async with asyncio.timeout(5):  # needs a task, the same one on exit
            await asyncio.sleep(0)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(asyncio.sleep(0))
        with anyio.fail_after(5):  # anyio's cancel scope: entered and left in one task
            await asyncio.sleep(0)
        seen.append(asyncio.current_task())
        return 8

    task = eager_task(slow(), contextvars.copy_context())
    assert not task.done() and seen == [task]
    assert await task == 8 and seen == [task, task]


async def test_eager_tasks_nest_and_fail_like_tasks() -> None:
    async def failing() -> None:
        raise KeyError("k")

    async def outer() -> Any:
        inner = eager_task(failing(), contextvars.copy_context())  # started inside a task
        assert asyncio.current_task() is me[0]
        return inner

    me: list[Any] = []

    async def host() -> Any:
        me.append(asyncio.current_task())
        return await outer()

    inner = await asyncio.get_running_loop().create_task(host())
    assert inner.done() and isinstance(inner.exception(), KeyError)


async def test_continue_carries_a_suspended_coroutine_to_its_end_in_one_task() -> None:
    closed: list[bool] = []
    seen: list[Any] = []

    async def method() -> str:
        try:
            await asyncio.sleep(3600)
        finally:
            closed.append(True)
        return "never"

    async def steady() -> str:
        seen.append(asyncio.current_task())
        async with asyncio.timeout(5):
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        seen.append(asyncio.current_task())
        return "done"

    async def carry(coro: Any) -> Any:
        fut = coro.send(None)  # its first step, in this task
        return await Continue(coro, fut)

    task = asyncio.get_running_loop().create_task(carry(steady()))
    assert await task == "done" and seen == [task, task]
    task = asyncio.get_running_loop().create_task(carry(method()))
    await asyncio.sleep(0)
    task.cancel()  # thrown into the method at its await, its finally runs
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]


@pytest.mark.parametrize("how", ["cancelled", "failed", "returned"])
async def test_generator_end_reports_a_task_that_never_reported(how: str) -> None:
    async def body() -> None:
        if how == "failed":
            raise OSError("x")

    task = asyncio.get_running_loop().create_task(body())
    if how == "cancelled":
        task.cancel()
    await asyncio.wait([task])
    end = generator_end(task)
    expected = OSError if how == "failed" else asyncio.CancelledError
    assert isinstance(end, expected)


async def test_drive_hands_a_burst_over_before_the_generator_suspends() -> None:
    """With ``flush``: frames yielded without suspending are flushed together; the flush
    comes before the generator suspends, after ``burst`` frames, when congested, at the end."""
    log: list[str] = []
    congested = [False]

    async def gen() -> AsyncIterator[int]:
        for i in range(3):
            log.append(f"make {i}")
            yield i
        await asyncio.sleep(0)  # suspends: 0..2's work starts before
        log.append("resumed")
        for i in range(3, 8):
            yield i
        congested[0] = True
        yield 8
        congested[0] = False
        yield 9

    async def relieved() -> None:
        log.append("wait")

    def push(frame: int) -> bool:
        log.append(f"push {frame}")
        return True

    def space() -> Any:
        return relieved() if congested[0] else None

    exc = await drive(gen(), push, space, lambda: log.append("flush"), burst=4)
    assert exc is None
    flushes = [i for i, e in enumerate(log) if e == "flush"]
    assert log[: flushes[0] + 1] == [
        "make 0", "push 0", "make 1", "push 1", "make 2", "push 2", "flush"
    ]  # fmt: skip
    assert log.index("resumed") > flushes[0]
    assert log[log.index("push 6") + 1] == "flush"  # 3..6: a burst of 4
    assert log[log.index("push 8") + 1 : log.index("push 8") + 3] == ["flush", "wait"]
    assert log[-1] == "flush" and log[-2] == "push 9"  # the end


async def test_drive_without_flush_is_frame_by_frame() -> None:
    pushed: list[int] = []
    assert await drive(Gen(3)(), lambda f: pushed.append(f) is None) is None
    assert pushed == [0, 1, 2]
