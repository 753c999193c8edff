"""How methods are driven (``runtime/_drive.py``), the one set of rules of front and worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omniflow.runtime._drive import Finished, Running, drive, finished, first_step, generator_end


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


async def test_first_step_finishes_eagerly_or_hands_over_a_task() -> None:
    async def quick(x: int) -> int:
        return x + 1

    async def failing() -> None:
        raise KeyError("k")

    async def slow(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    assert first_step(quick, {"x": 1}) == 2
    with pytest.raises(KeyError):
        first_step(failing, {})
    started = first_step(slow, {"x": 4})
    assert type(started) is Running
    coro, task = started
    await asyncio.wait([task])
    assert finished(coro, task) == Finished(None, 8)


async def test_a_cancelled_task_closes_its_coroutine() -> None:
    closed: list[bool] = []

    async def waits() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            closed.append(True)

    started: Any = first_step(waits, {})
    coro, task = started
    task.cancel()
    await asyncio.wait([task])
    end = finished(coro, task)
    assert isinstance(end.error, asyncio.CancelledError) and closed == [True]


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
