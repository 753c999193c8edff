"""Ping-pong round trips between two processes: raw pyzmq vs omniflow's ipc:// and uds:// endpoints.

    .venv/bin/python benchmarks/bench_zmq_raw.py [--scale 1.0] [--sizes 100,1000,65536,1048576]

Three ways, each with its own echo process:

* ``raw sync``: blocking pyzmq DEALER → ROUTER, the payload as one frame, ``copy=False``.
* ``raw asyncio``: the same with ``zmq.asyncio`` on both sides (what omniflow runs on).
* ``omniflow``: ``transport.connect``/``bind`` + codec over ``ipc://`` (pyzmq): the client
  sends ``{"op": "ping", "seq": i, "data": <payload bytes>}``, the echo process decodes it in a
  ``ReceiveLoop`` and answers ``{"op": "pong", "seq": i, "data": <the received payload>}``
  (payloads of 64 KiB and more travel out of band, zero-copy on both ends).
* ``omniflow uds``: the same over ``uds://`` (``transport/_uds.py``: plain Unix-domain sockets
  on the event loop, the same-node fast path that ``OMNIFLOW_FAST_PATH`` turns on).

Prints a Markdown table of p50/p99 round-trip times in µs and the omniflow/raw ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omniflow.transport import (
    Message,
    ReceiveLoop,
    bind,
    connect,
    recv_message,
    send_message,
)

SIZES = [100, 1_000, 65_536, 1_048_576]
STOP = b"STOP"


def _iterations(size: int, scale: float) -> int:
    base = 5000 if size <= 1_000 else 2000 if size <= 65_536 else 300
    return max(50, int(base * scale))


# ---------------------------------------------------------------------------------- echo side


def echo_raw(url: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(url)
    while True:
        parts = sock.recv_multipart(copy=False)
        if parts[1].bytes == STOP:
            break
        sock.send_multipart(parts, copy=False)
    sock.close(linger=0)
    ctx.term()


def echo_raw_asyncio(url: str) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(url)
        while True:
            parts = await sock.recv_multipart(copy=False)
            if parts[1].bytes == STOP:
                break
            await sock.send_multipart(parts, copy=False)
        sock.close(linger=0)
        ctx.term()

    asyncio.run(main())


def echo_omniflow(url: str) -> None:
    async def main() -> None:
        async with bind(url) as worker:

            async def handler(peer: bytes | None, message: Message) -> None:
                body = message.body
                if body["op"] == "stop":
                    worker.close()
                    return
                reply = {"op": "pong", "seq": body["seq"], "data": body["data"]}
                await send_message(worker, reply, peer=peer)

            await ReceiveLoop(worker, handler).run()

    asyncio.run(main())


# -------------------------------------------------------------------------------- client side


def client_raw(url: str, size: int, n: int) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(url)
    payload = os.urandom(size)
    samples = []
    for i in range(n + n // 10):  # the first tenth warms up
        start = time.perf_counter_ns()
        sock.send(payload, copy=False)
        reply = sock.recv(copy=False)
        elapsed = time.perf_counter_ns() - start
        assert len(reply) == size
        if i >= n // 10:
            samples.append(elapsed / 1000)
    sock.send(STOP)
    sock.close(linger=1000)
    ctx.term()
    return samples


def client_raw_asyncio(url: str, size: int, n: int) -> list[float]:
    async def main() -> list[float]:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(url)
        payload = os.urandom(size)
        samples = []
        for i in range(n + n // 10):
            start = time.perf_counter_ns()
            await sock.send(payload, copy=False)
            reply = await sock.recv(copy=False)
            elapsed = time.perf_counter_ns() - start
            assert len(reply) == size
            if i >= n // 10:
                samples.append(elapsed / 1000)
        await sock.send(STOP)
        sock.close(linger=1000)
        ctx.term()
        return samples

    return asyncio.run(main())


def client_omniflow(url: str, size: int, n: int) -> list[float]:
    async def main() -> list[float]:
        payload = os.urandom(size)
        samples = []
        async with connect(url) as front:
            for i in range(n + n // 10):
                start = time.perf_counter_ns()
                await send_message(front, {"op": "ping", "seq": i, "data": payload})
                _, reply = await recv_message(front)
                elapsed = time.perf_counter_ns() - start
                assert reply.body["seq"] == i and len(reply.body["data"]) == size
                if i >= n // 10:
                    samples.append(elapsed / 1000)
            await send_message(front, {"op": "stop"})
            await asyncio.sleep(0.05)  # let the stop leave before the socket closes
        return samples

    return asyncio.run(main())


MODES: dict[str, tuple[Callable[[str], None], Callable[[str, int, int], list[float]]]] = {
    "raw sync": (echo_raw, client_raw),
    "raw asyncio": (echo_raw_asyncio, client_raw_asyncio),
    "omniflow": (echo_omniflow, client_omniflow),
    "omniflow uds": (echo_omniflow, client_omniflow),
}


def measure(mode: str, size: int, n: int, tmp: str) -> tuple[float, float]:
    echo, client = MODES[mode]
    scheme = "uds" if mode.endswith("uds") else "ipc"
    url = f"{scheme}://{tmp}/{mode.replace(' ', '-')}-{size}.sock"
    proc = mp.get_context("spawn").Process(target=echo, args=(url,), daemon=True)
    proc.start()
    try:
        samples = client(url, size, n)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    cuts = statistics.quantiles(samples, n=100)
    return cuts[49], cuts[98]


def human(size: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= div and size % div == 0:
            return f"{size // div} {unit}"
    return f"{size} B"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="of-bench-", dir="/tmp") as tmp:
        for size in sizes:
            n = _iterations(size, args.scale)
            row: dict[str, Any] = {"size": size, "n": n}
            for mode in MODES:
                row[mode] = measure(mode, size, n, tmp)
            rows.append(row)
            print(f"# {human(size)} done", file=sys.stderr, flush=True)

    print(
        f"python {sys.version.split()[0]}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
        f"{os.cpu_count()} CPUs; round trip in µs, p50 / p99\n"
    )
    print(
        "| payload | n | raw sync | raw asyncio | omniflow ipc | omniflow uds | ipc p50 vs "
        "sync | ipc p50 vs asyncio | uds p50 vs ipc |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        sync, aio, of = row["raw sync"], row["raw asyncio"], row["omniflow"]
        uds = row["omniflow uds"]
        print(
            f"| {human(row['size'])} | {row['n']} | {sync[0]:.0f} / {sync[1]:.0f} | "
            f"{aio[0]:.0f} / {aio[1]:.0f} | {of[0]:.0f} / {of[1]:.0f} | "
            f"{uds[0]:.0f} / {uds[1]:.0f} | {of[0] / sync[0]:.2f}x | {of[0] / aio[0]:.2f}x | "
            f"{uds[0] / of[0]:.2f}x |"
        )


if __name__ == "__main__":
    main()
