"""``recv_batch`` and ``try_send``: bursts handed over in one wake-up, in order, none lost."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from omniflow import RuntimeClosedError, TransportError
from omniflow.transport import bind, connect


async def _collect(endpoint: object, n: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < n:
        batch = await endpoint.recv_batch()  # type: ignore[attr-defined]
        assert batch, "recv_batch returns at least one message"
        got += [bytes(p.frames[0]) for p in batch]
    return got


async def test_recv_batch_returns_messages_in_order(url: str) -> None:
    async with bind(url) as worker, connect(worker.url, identity=b"f") as front:
        for i in range(10):
            await front.send([str(i).encode()])
        await asyncio.sleep(0.05)
        got = await _collect(worker, 10)
        assert got == [str(i).encode() for i in range(10)]
        assert worker.statistics()["received"] == 10
        # and back, to the connected side, mixed with plain recv
        for i in range(5):
            await worker.send([str(i).encode()], peer=b"f")
        assert bytes((await front.recv()).frames[0]) == b"0"
        assert await _collect(front, 4) == [b"1", b"2", b"3", b"4"]


async def test_a_burst_of_1000_is_fully_received(url: str) -> None:
    """No lost wake-up: the receiver waits while the burst arrives, sends in between."""
    n = 1000
    async with bind(url) as worker, connect(worker.url, identity=b"f") as front:
        await front.send([b"hello"])
        assert await _collect(worker, 1) == [b"hello"]

        async def burst() -> None:
            for i in range(n):
                if not front.try_send([i.to_bytes(4, "big")]):
                    await front.send([i.to_bytes(4, "big")])
                if i % 97 == 0:
                    await asyncio.sleep(0)

        async def echo() -> list[bytes]:
            got: list[bytes] = []
            while len(got) < n:
                for p in await worker.recv_batch():
                    got.append(bytes(p.frames[0]))
                    await worker.send([b"ack"], peer=p.peer)  # sends may eat the FD's edge
            return got

        sender = asyncio.create_task(burst())
        got = await asyncio.wait_for(echo(), 20)
        await sender
        assert got == [i.to_bytes(4, "big") for i in range(n)]
        assert await asyncio.wait_for(_collect(front, n), 20) == [b"ack"] * n


async def test_close_wakes_a_pending_recv_batch(url: str) -> None:
    worker = bind(url)
    pending = asyncio.create_task(worker.recv_batch())
    await asyncio.sleep(0.01)
    worker.close()
    with pytest.raises(RuntimeClosedError, match="endpoint is closed"):
        await pending
    with pytest.raises(RuntimeClosedError):
        await worker.recv_batch()
    with pytest.raises(RuntimeClosedError):
        worker.try_send([b"x"], peer=b"p")


async def test_try_send_checks_arguments_and_peers(url: str) -> None:
    async with bind(url) as worker, connect(worker.url, identity=b"f") as front:
        with pytest.raises(TransportError, match="at least one frame"):
            front.try_send([])
        with pytest.raises(TransportError, match="pass peer="):
            worker.try_send([b"x"])
        if not url.startswith("inproc"):
            with pytest.raises(TransportError, match="not connected"):
                worker.try_send([b"x"], peer=b"nobody")


async def test_try_send_never_overtakes_a_blocked_send() -> None:
    """At the high-water mark try_send refuses while a send waits, so order holds."""
    async with bind("tcp://127.0.0.1:0") as worker:
        worker._socket.setsockopt(zmq.RCVHWM, 2)  # type: ignore[attr-defined]
        front = connect(worker.url, identity=b"f")
        front._socket.setsockopt(zmq.SNDHWM, 2)  # type: ignore[attr-defined]
        try:
            await front.send([b"hello"])
            assert await _collect(worker, 1) == [b"hello"]
            sent = 0
            blocked: list[asyncio.Task[None]] = []
            for _ in range(10_000):  # the I/O thread may make room meanwhile: fill it again
                while front.try_send([sent.to_bytes(4, "big")]):
                    sent += 1
                    assert sent < 1_000_000, "the high-water mark never applied"
                blocked.append(asyncio.create_task(front.send([sent.to_bytes(4, "big")])))
                sent += 1
                await asyncio.sleep(0)
                if not blocked[-1].done():
                    break
            assert not blocked[-1].done(), "never saw a send wait at the high-water mark"
            assert not front.try_send([b"overtake"])
            got = await asyncio.wait_for(_collect(worker, sent), 20)
            await asyncio.gather(*blocked)
            assert got == [i.to_bytes(4, "big") for i in range(sent)]
        finally:
            front.close()
