"""HTTP serving overhead: a 3-node graph over ``omniflow serve`` vs the same graph in-process.

    .venv/bin/python benchmarks/bench_http.py             # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/bench_http.py --quick     # fewer requests (~30 s)

The graph (declared below, at module level, so ``omniflow serve benchmarks/bench_http.py``
serves it) is a chain of three trivial nodes, ``a.run -> b.run -> c.run``, each adding 1 to an
int: the framework overhead is all there is to measure.

* in-process: ``rt.run("chain3", {"x": i})`` on an ``of.Runtime`` in this process, by
  ``concurrency`` asyncio workers.
* HTTP: a real ``omniflow serve`` subprocess on a free port; ``concurrency`` workers, each
  POSTing ``/v1/graphs/chain3/call`` in a loop over its own keep-alive connection, with
  ``"stream": false`` (one JSON object) and ``"stream": true`` (NDJSON: one frame line and the
  done line, chunked). Two load generators, both async, in this one process:
  ``httpx.AsyncClient`` (pool of ``concurrency`` connections), what a Python client would use,
  and ``raw``: a minimal HTTP/1.1 client on asyncio streams (write the request, read the
  head, then the content-length body or the chunks), which costs the load generator far less,
  so its rows show what the server itself sustains.

Reported per row: requests/s, p50 and p99 latency, and the server process's CPU time per
request (from /proc/<pid>/stat): client and server share the machine's cores, and that column
separates the server's cost from the load generator's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import omniflow as of

# ====================================================================== the graph


class A(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"y": x + 1}


class B(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["z"])
    async def run(self, y: int) -> dict[str, Any]:
        return {"z": y + 1}


class C(of.Role):
    @of.interface(inputs_or=[["z"]], outputs=["out"])
    async def run(self, z: int) -> dict[str, Any]:
        return {"out": z + 1}


graph = of.Graph(
    "chain3", roles={"a": A(), "b": B(), "c": C()}, inputs=[of.Placeholder("x")], outputs=["out"]
)

# ====================================================================== measurement

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 16, 64)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(
    one: Callable[[int], Awaitable[None]], n: int, concurrency: int
) -> tuple[float, list[float]]:
    """Run ``one(i)`` for i < n with ``concurrency`` workers; (wall seconds, latencies)."""
    todo = iter(range(n))
    lat: list[float] = []

    async def worker() -> None:
        for i in todo:
            t0 = time.perf_counter()
            await one(i)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, lat


def _row(
    mode: str, c: int, wall: float, lat: list[float], cpu: float | None = None
) -> dict[str, Any]:
    lat = sorted(lat)
    return {
        "mode": mode,
        "c": c,
        "rps": len(lat) / wall,
        "p50": statistics.median(lat) * 1e3,
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "cpu_us": None if cpu is None else cpu / len(lat) * 1e6,
    }


async def bench_inprocess(n: int) -> list[dict[str, Any]]:
    rows = []
    async with of.Runtime(graph) as rt:

        async def one(i: int) -> None:
            out = await rt.run("chain3", {"x": i})
            assert out == {"out": [i + 3]}

        await _load(one, 2000, 16)  # warm-up
        for c in CONCURRENCY:
            cpu0 = time.process_time()
            wall, lat = await _load(one, n * 2, c)
            rows.append(_row("in-process rt.run", c, wall, lat, time.process_time() - cpu0))
    return rows


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "omniflow", "serve", __file__, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline().decode() if ready else ""
    m = re.search(r"http://\S+", line)
    if m is None:
        proc.kill()
        raise SystemExit(f"omniflow serve did not start: {line!r}")
    return proc, m.group(0)


def _check(status: int, body: bytes) -> None:
    if status != 200 or b'"status":"ok"' not in body:
        raise RuntimeError(f"bad response {status}: {body[:200]!r}")


async def _httpx_rows(url: str, pid: int, n: int, stream: bool, c: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:

        async def one(i: int) -> None:
            r = await client.post(
                "/v1/graphs/chain3/call", json={"inputs": {"x": i}, "stream": stream}
            )
            _check(r.status_code, r.content)

        await _load(one, max(200, c * 10), c)  # warm-up: open the connections
        cpu0 = _cpu_seconds(pid)
        wall, lat = await _load(one, n, c)
        cpu = _cpu_seconds(pid) - cpu0
    return _row(f"HTTP {'NDJSON stream' if stream else 'JSON'}, httpx", c, wall, lat, cpu)


class _RawConnection:
    """One keep-alive HTTP/1.1 connection; just enough protocol for this server's answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {len(body)}\r\n\r\n"
        self.writer.write(head.encode() + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw.split(b" ", 2)[1])
        m = re.search(rb"(?i)content-length: *(\d+)", raw)
        if m:
            return status, await self.reader.readexactly(int(m.group(1)))
        chunks = []
        while True:  # chunked
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunks.append((await self.reader.readexactly(size + 2))[:-2])
            if size == 0:
                return status, b"".join(chunks)


async def _raw_rows(url: str, pid: int, n: int, stream: bool, c: int) -> dict[str, Any]:
    m = re.match(r"http://([^:/]+):(\d+)", url)
    assert m is not None
    conns = [_RawConnection(*await asyncio.open_connection(m[1], int(m[2]))) for _ in range(c)]
    free = list(conns)
    flag = b"true" if stream else b"false"

    async def one(i: int) -> None:
        conn = free.pop()
        try:
            body = b'{"inputs":{"x":%d},"stream":%s}' % (i, flag)
            _check(*await conn.post("/v1/graphs/chain3/call", body))
        finally:
            free.append(conn)

    try:
        await _load(one, max(200, c * 10), c)
        cpu0 = _cpu_seconds(pid)
        wall, lat = await _load(one, n, c)
        cpu = _cpu_seconds(pid) - cpu0
    finally:
        for conn in conns:
            conn.writer.close()
            await conn.writer.wait_closed()
    return _row(f"HTTP {'NDJSON stream' if stream else 'JSON'}, raw client", c, wall, lat, cpu)


async def bench_http(url: str, pid: int, n: int) -> list[dict[str, Any]]:
    rows = []
    for gen in (_httpx_rows, _raw_rows):
        for stream in (False, True):
            for c in CONCURRENCY:
                rows.append(await gen(url, pid, n, stream, c))
    return rows


def table(rows: list[dict[str, Any]], base: dict[int, float]) -> str:
    out = [
        "| mode, load generator | concurrency | requests/s | p50 ms | p99 ms | "
        "server CPU µs/req | in-process rps / this |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cpu = "" if r["cpu_us"] is None else f"{r['cpu_us']:.0f}"
        ratio = base[r["c"]] / r["rps"]
        out.append(
            f"| {r['mode']} | {r['c']} | {r['rps']:,.0f} | {r['p50']:.3f} | {r['p99']:.3f} | "
            f"{cpu} | {ratio:.1f}x |"
        )
    return "\n".join(out)


async def amain(args: argparse.Namespace) -> None:
    import httpx
    import starlette
    import uvicorn

    n = 1000 if args.quick else args.requests
    inproc = await bench_inprocess(n)
    proc, url = start_server()
    try:
        http = await bench_http(url, proc.pid, n)
    finally:
        proc.terminate()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    base = {r["c"]: r["rps"] for r in inproc}
    print(f"## HTTP serving ({n} requests per HTTP row, {2 * n} per in-process row)\n")
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"uvicorn {uvicorn.__version__} (HTTP parser: "
        f"{'httptools' if _has('httptools') else 'h11'}, loop: "
        f"{'uvloop' if _has('uvloop') else 'asyncio'}), starlette {starlette.__version__}, "
        f"httpx {httpx.__version__}; the load generator runs in one process beside the server\n"
    )
    print(table(inproc + http, base))


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1000 requests per row")
    p.add_argument("--requests", type=int, default=5000, help="requests per HTTP row")
    asyncio.run(amain(p.parse_args()))


if __name__ == "__main__":
    main()
