"""The bounded server under abuse: big bodies, 1,000 idle connections, many sessions.

    .venv/bin/python benchmarks/bench_http_limits.py      # ~30 s on 2 cores

Against a real ``omniflow serve`` subprocess (default limits) serving the one-node graph below:

* **100 MB body**: a client announces ``Content-Length: 104857600`` and writes the body as fast
  as the server lets it; the server answers 413 from the header. Reported: bytes the client
  managed to write before the answer, and the server's peak RSS (``VmHWM``) over its idle RSS.
  Then the same with a chunked body (no length): 413 once 16 MiB were read.
* **1,000 idle connections**: ``/healthz`` latency (p50 / p99 / max over 200 requests on a
  keep-alive connection, and 50 on new connections, each of which evicts an idle one at the
  cap) with 1,000 connections open that never send a byte, next to the same with none open.
* **sessions**: RSS after 300 calls with 1 KiB session ids, then after ``DELETE`` of each;
  and 300 calls with 1 MiB session ids (refused with 400: an id is at most 1 KiB so that
  every session can be deleted by URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import omniflow as of


class Echo(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: Any) -> dict[str, Any]:
        return {"y": x}


echo = of.Graph("echo", roles={"echo": Echo()}, inputs=[of.Placeholder("x")], outputs=["y"])

HERE = Path(__file__).resolve()


def start_server(*args: str) -> tuple[subprocess.Popen[bytes], str, int]:
    cmd = [sys.executable, "-m", "omniflow", "serve", str(HERE), "--port", "0", *args]
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    m = re.search(rb"http://([\d.]+):(\d+)", proc.stdout.readline() if ready else b"")
    if m is None:
        proc.kill()
        raise SystemExit("server did not start")
    return proc, m.group(1).decode(), int(m.group(2))


def mem_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


async def request(host: str, port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"content-length: (\d+)", head.lower())
        return int(head.split()[1]), await reader.readexactly(int(m.group(1)) if m else 0)
    finally:
        writer.close()


async def big_body(host: str, port: int, chunked: bool) -> tuple[int, int]:
    """Write a 100 MB body as fast as the server reads it; (status, bytes written)."""
    reader, writer = await asyncio.open_connection(host, port)
    framing = b"transfer-encoding: chunked" if chunked else b"content-length: 104857600"
    writer.write(
        b"POST /v1/graphs/echo/call HTTP/1.1\r\nhost: 127.0.0.1\r\n" + framing + b"\r\n\r\n"
    )
    chunk = b"x" * 65536
    sent = 0

    async def pump() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):
            while sent < 100 * 2**20:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                await writer.drain()
                sent += len(chunk)

    task = asyncio.create_task(pump())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    writer.close()
    return int(head.split()[1]), sent


async def healthz_latency(host: str, port: int, n: int, fresh: bool) -> list[float]:
    out = []
    reader, writer = await asyncio.open_connection(host, port)
    req = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    for _ in range(n):
        t0 = time.perf_counter()
        if fresh:
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(re.search(rb"content-length: (\d+)", head).group(1)))  # type: ignore[union-attr]
        out.append((time.perf_counter() - t0) * 1000)
        assert head.startswith(b"HTTP/1.1 200"), head
    writer.close()
    return out


def stats_ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return f"p50 {statistics.median(xs):6.2f} ms  p99 {p99:6.2f} ms  max {xs[-1]:6.2f} ms"


async def call(host: str, port: int, session: str) -> int:
    body = b'{"inputs": {"x": 1}, "stream": false, "session": "%s"}' % session.encode()
    head = b"POST /v1/graphs/echo/call HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: %d\r\n\r\n"
    status, _ = await request(host, port, head % len(body) + body)
    return status


async def amain() -> None:
    proc, host, port = start_server("--idle-timeout", "120", "--header-timeout", "120")
    pid = proc.pid
    try:
        await healthz_latency(host, port, 20, fresh=False)  # warm up
        idle = mem_kib(pid, "VmRSS")
        print(f"idle server RSS: {idle / 1024:.1f} MiB")
        for chunked in (False, True):
            status, sent = await big_body(host, port, chunked)
            peak = mem_kib(pid, "VmHWM")
            kind = "chunked, no length " if chunked else "Content-Length 100MB"
            print(
                f"100 MB body ({kind}): {status}, client wrote {sent / 2**20:5.1f} MiB before "
                f"it, server peak RSS {peak / 1024:.1f} MiB (+{(peak - idle) / 1024:.1f} MiB "
                "over idle)"
            )
        lat = await healthz_latency(host, port, 200, False)
        print(f"/healthz, no idle connections:   {stats_ms(lat)}")
        conns = [await asyncio.open_connection(host, port) for _ in range(1000)]
        lat = await healthz_latency(host, port, 200, False)
        print(f"/healthz, 1000 idle connections: {stats_ms(lat)}")
        fresh = await healthz_latency(host, port, 50, True)
        print(f"  new connection each time:      {stats_ms(fresh)}")
        for _, w in conns:
            w.close()
        await asyncio.sleep(0.5)
        base = mem_kib(pid, "VmRSS")
        ids = [f"{i:04d}-" + "s" * 1019 for i in range(300)]
        for sid in ids:
            assert await call(host, port, sid) == 200
        held = mem_kib(pid, "VmRSS")
        for sid in ids:
            req = f"DELETE /v1/sessions/{sid} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode()
            assert (await request(host, port, req))[0] == 204
        after = mem_kib(pid, "VmRSS")
        refused = [await call(host, port, f"{i}-" + "s" * 2**20) for i in range(300)]
        big = mem_kib(pid, "VmRSS")
        print(
            f"sessions: RSS {base / 1024:.1f} MiB -> {held / 1024:.1f} after 300 calls with 1 KiB "
            f"ids -> {after / 1024:.1f} after DELETE; 300 calls with 1 MiB ids: "
            f"{sorted(set(refused))} -> RSS {big / 1024:.1f} MiB"
        )
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    asyncio.run(amain())
