"""The processes of bench_engine.py's HTTP measure: the engine behind ``omniflow serve``, and
the same engine called directly in a process of its own, with and without an HTTP stream.

    OMNIFLOW_BENCH_MODEL=<dir> omniflow serve benchmarks/engine_role.py     # graph "llm"
    OMNIFLOW_BENCH_MODEL=<dir> python benchmarks/engine_role.py --direct    # stdin-driven worker
    OMNIFLOW_BENCH_MODEL=<dir> python benchmarks/engine_role.py --direct-http   # bare HTTP

Each holds one ``TorchEngine`` (max_batch 16) on ``OMNIFLOW_BENCH_THREADS`` torch threads. The
graph's one node streams a ``token`` frame per generated token; the worker reads lines
``<concurrency> <new tokens> <prompt length>`` on stdin, runs that many concurrent requests
straight on its engine and answers the aggregate tokens/s on stdout (the engine alone: no
token leaves the process). ``--direct-http`` is the least an HTTP server calling the engine
directly must do for the same client: the same request, the same NDJSON lines in HTTP/1.1
chunks, one socket write per token as it is produced (``serve_direct``), with none of
omniflow (no runtime, no ASGI, no middleware); it prints its URL, then serves until stdin
closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

import omniflow as of


def prompts(k: int, plen: int) -> list[list[int]]:
    """The prompts every contender of the concurrent measures uses."""
    return [[5 + (i * 7 + j) % 300 for j in range(plen)] for i in range(k)]


class StepClock:
    """A stand-in for the engine with no model (``OMNIFLOW_BENCH_FAKE_STEP=<seconds>``): every
    step, one token for each running request, all delivered in one loop turn as TorchEngine
    delivers a step's tokens. With no forward pass and no engine thread, the event-loop
    thread's CPU per token is the serving path's own cost and nothing else."""

    def __init__(self, step: float) -> None:
        self.step = step
        self._running: set[asyncio.Queue[_Token]] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def generate(self, req: of.GenerateRequest) -> AsyncIterator[_Token]:
        queue: asyncio.Queue[_Token] = asyncio.Queue()
        self._running.add(queue)
        try:
            for _ in range(req.sampling.max_new_tokens):
                yield await queue.get()
        finally:
            self._running.discard(queue)

    async def _run(self) -> None:
        token = 0
        while True:
            await asyncio.sleep(self.step)
            token = (token + 1) % 300
            for queue in self._running:
                queue.put_nowait(_Token(token))


class _Token:
    __slots__ = ("token_id",)

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id


def make_engine() -> Any:
    """The process's engine: a TorchEngine on ``$OMNIFLOW_BENCH_MODEL``, or a ``StepClock``."""
    if "OMNIFLOW_BENCH_FAKE_STEP" in os.environ:
        return StepClock(float(os.environ["OMNIFLOW_BENCH_FAKE_STEP"]))
    torch.set_num_threads(int(os.environ.get("OMNIFLOW_BENCH_THREADS", "2")))
    return of.TorchEngine(
        os.environ["OMNIFLOW_BENCH_MODEL"],
        max_batch=16,
        max_step_tokens=2112,
        pool_pages=2048,
        executor=os.environ.get("OMNIFLOW_BENCH_EXECUTOR", "thread"),
    )


def request(ids: list[int], n: int) -> of.GenerateRequest:
    greedy = of.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return of.GenerateRequest(input_ids=ids, sampling=greedy)


class Llm(of.Role):
    """The engine as a role: one ``token`` frame per generated token."""

    def __init__(self, engine: of.TorchEngine | None = None) -> None:
        self.engine = engine  #: a caller's engine (not stopped here), or made at setup
        self._own = engine is None

    async def setup(self) -> None:
        if self._own and "OMNIFLOW_BENCH_MODEL" in os.environ:
            self.engine = make_engine()
            await self.engine.start()

    async def teardown(self) -> None:
        if self._own and self.engine is not None:
            await self.engine.stop()

    @of.interface(inputs_or=[["ids", "n"]], outputs=["token"])
    async def generate(self, ids: list[int], n: int) -> AsyncIterator[dict[str, Any]]:
        if self.engine is None:
            raise RuntimeError("set OMNIFLOW_BENCH_MODEL to a model directory")
        async for out in self.engine.generate(request(ids, n)):
            yield {"token": out.token_id}


graph = of.Graph(
    "llm",
    roles={"llm": Llm()},
    inputs=[of.Placeholder("ids"), of.Placeholder("n")],
    outputs=["token"],
)


async def direct(engine: of.TorchEngine, k: int, n: int, plen: int) -> float:
    """Aggregate tokens/s of ``k`` concurrent requests on ``engine``."""

    async def one(ids: list[int]) -> int:
        return sum([1 async for _ in engine.generate(request(ids, n))])

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts(k, plen)))
    dt = time.perf_counter() - t
    assert sum(counts) == k * n, counts
    return sum(counts) / dt


_DONE = b'{"done":true,"status":"ok","errors":[],"warnings":[]}\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve_direct(
    engine: of.TorchEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One ``POST /v1/graphs/llm/call`` answered straight from ``engine``: the bytes
    ``omniflow serve`` writes for it, a chunk per token, then the done line."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        inputs = json.loads(await reader.readexactly(length))["inputs"]
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        seq = 0
        async for out in engine.generate(request(inputs["ids"], inputs["n"])):
            line = b'{"field":"token","value":%d,"node":"llm.generate","seq":%d}\n' % (
                out.token_id,
                seq,
            )
            writer.write(_chunk(line))
            await writer.drain()  # backpressure, as serve's transport has
            seq += 1
        writer.write(_chunk(_DONE) + b"0\r\n\r\n")
        await writer.drain()
    finally:
        writer.close()


async def _http_worker() -> None:
    engine = make_engine()
    await engine.start()
    server = await asyncio.start_server(lambda r, w: serve_direct(engine, r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"http://127.0.0.1:{port}", flush=True)
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):
        pass
    server.close()
    await engine.stop()


async def _worker() -> None:
    engine = make_engine()
    await engine.start()
    await direct(engine, 2, 4, 8)  # warm-up
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        k, n, plen = (int(x) for x in line.split())
        print(f"{await direct(engine, k, n, plen):.3f}", flush=True)
    await engine.stop()


if __name__ == "__main__" and "--direct" in sys.argv:
    asyncio.run(_worker())
elif __name__ == "__main__" and "--direct-http" in sys.argv:
    asyncio.run(_http_worker())
