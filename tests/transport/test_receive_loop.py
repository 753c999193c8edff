from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from omniflow.transport import (
    Message,
    ReceiveLoop,
    bind,
    connect,
    encode,
    recv_message,
    send_message,
)
from omniflow.transport._codec import MAGIC, VERSION

GARBAGE = [
    [b"\x00garbage"],
    [MAGIC + bytes([VERSION + 1]) + b"\x90"],  # a newer omniflow
    [MAGIC + bytes([VERSION]) + b"\xc1"],  # broken msgpack
    encode({"x": np.arange(100_000)})[:1],  # its buffer frame lost
]


async def test_malformed_messages_are_counted_and_skipped(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[tuple[bytes | None, Message]] = []
    done = asyncio.Event()

    async def handler(peer: bytes | None, message: Message) -> None:
        received.append((peer, message))
        await send_message(worker, {"ok": message.body["n"]}, peer=peer)
        if message.body["n"] == 2:
            done.set()

    async with bind(url) as worker, connect(worker.url, identity=b"f") as front:
        loop = ReceiveLoop(worker, handler)
        with caplog.at_level(logging.WARNING, logger="omniflow.transport"):
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(loop.run())
                await send_message(front, {"n": 1}, kind="call")
                for frames in GARBAGE:
                    await front.send(frames)
                await send_message(front, {"n": 2}, kind="call")
                async with asyncio.timeout(5):
                    await done.wait()
                worker.close()
        assert task.done() and task.exception() is None  # run() returned on close
        assert [(p, m.kind, m.body) for p, m in received] == [
            (b"f", "call", {"n": 1}),
            (b"f", "call", {"n": 2}),
        ]
        assert loop.statistics() == {"received": 6, "handled": 2, "malformed": 4}
        assert [(await recv_message(front))[1].body for _ in range(2)] == [{"ok": 1}, {"ok": 2}]
    lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 4 and all("\n" not in line and "66" in line for line in lines)
    assert "wire version 2" in lines[1]


async def test_log_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(peer: bytes | None, message: Message) -> None:
        worker.close()

    async with bind("inproc://flood") as worker, connect("inproc://flood") as front:
        for _ in range(35):
            await front.send([b"junk"])
        await send_message(front, {"last": True})
        loop = ReceiveLoop(worker, handler)
        with caplog.at_level(logging.WARNING, logger="omniflow.transport"):
            await asyncio.wait_for(loop.run(), 5)
    assert loop.statistics()["malformed"] == 35
    assert len(caplog.records) == 10 + 2  # the first 10, then #20 and #30


async def test_handler_errors_end_the_loop() -> None:
    async def handler(peer: bytes | None, message: Message) -> None:
        raise ValueError("bug in the handler")

    async with bind("inproc://bug") as worker, connect("inproc://bug") as front:
        await send_message(front, {})
        with pytest.raises(ValueError, match="bug in the handler"):
            await asyncio.wait_for(ReceiveLoop(worker, handler).run(), 5)
