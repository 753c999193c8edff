"""The bounded server over real sockets: body size and time, slow headers, idle connections,
the connection cap, Host/Origin, sessions. Timings are generous waits, never tight asserts
(the numbers live in benchmarks/bench_http.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import TEST_GRAPHS, ServerProc, metric, run_server

TIMEOUT = httpx.Timeout(20.0)


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """Short timeouts, a 1 MiB body limit, a small connection cap."""
    tmp = tmp_path_factory.mktemp("strict_server")
    args = ["--header-timeout", "1", "--idle-timeout", "1", "--body-timeout", "1"]
    args += ["--max-body-mb", "1", "--max-connections", "3", "--allowed-host", "api.example"]
    with run_server(TEST_GRAPHS, *args, tmp=tmp) as server:
        yield server


def _addr(server: ServerProc) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


@contextlib.asynccontextmanager
async def raw(server: ServerProc) -> AsyncIterator[tuple[asyncio.StreamReader, Any]]:
    reader, writer = await asyncio.open_connection(*_addr(server))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 20)
    return status, headers, body


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """True when the server closes the connection (EOF or reset) within ``seconds``."""
    while True:  # (a response may come first, then EOF)
        try:
            data = await asyncio.wait_for(reader.read(65536), seconds)
        except TimeoutError:
            return False
        except ConnectionError:
            return True
        if not data:
            return True


def _post_head(
    length: int | None, host: str = "127.0.0.1", path: str = "/v1/graphs/echo/call"
) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"{framing}\r\n\r\n"
    ).encode()


# -- body size and time ------------------------------------------------------------------------


async def test_413_for_100mb_content_length_without_reading_the_body(
    shared_server: ServerProc,
) -> None:
    async with raw(shared_server) as (reader, writer):
        writer.write(_post_head(100 * 2**20) + b'{"inputs": {"x": "')  # 18 of 100 MiB bytes
        await writer.drain()
        status, headers, body = await read_response(reader)
        assert status == 413
        assert headers["connection"] == "close"
        assert "over the server's limit of 16777216 bytes" in json.loads(body)["error"]
        assert await closed_within(reader, 20)  # the rest of the body is never read


async def test_413_for_a_chunked_body_past_the_limit(strict_server: ServerProc) -> None:
    """2 MiB of chunks against a 1 MiB limit and no terminating chunk: a server that waited
    for the whole body would answer 408 (body timeout), so a 413 proves it stopped reading
    at the limit. Nothing here depends on how fast either side runs."""
    async with raw(strict_server) as (reader, writer):
        writer.write(_post_head(None))
        chunk = b"x" * (256 * 1024)
        with contextlib.suppress(ConnectionError):
            for _ in range(8):
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        status, headers, body = await read_response(reader)
        assert status == 413
        assert headers["connection"] == "close"
        assert "(--max-body-mb 1)" in json.loads(body)["error"]
        assert await closed_within(reader, 20)


async def test_a_body_slower_than_body_timeout_gets_408(strict_server: ServerProc) -> None:
    async with raw(strict_server) as (reader, writer):
        writer.write(_post_head(100) + b'{"inputs":')
        await writer.drain()
        status, _headers, body = await read_response(reader)
        assert status == 408
        assert "within 1 s" in json.loads(body)["error"]


async def test_admission_refuses_before_the_body_is_read(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    with run_server(TEST_GRAPHS, "--max-inflight", "1", tmp=tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            body = {"inputs": {"gate": str(gate)}}
            async with c.stream("POST", "/v1/graphs/gated/call", json=body) as r:
                lines = r.aiter_lines()
                assert json.loads(await anext(lines))["value"] == "started"  # the slot is taken
                async with raw(server) as (reader, writer):
                    writer.write(_post_head(1000))  # headers only: no body byte is ever sent
                    await writer.drain()
                    status, headers, _ = await read_response(reader)
                    assert status == 429
                    assert headers["retry-after"] == "1"
                gate.touch()


# -- connection timeouts and the cap -----------------------------------------------------------


async def test_a_slow_header_connection_is_closed(strict_server: ServerProc) -> None:
    async with raw(strict_server) as (reader, writer):
        writer.write(b"GET /v1/graphs HTTP/1.1\r\nhost: 127.0.0.1\r\n")

        async def trickle() -> None:  # slowloris: one header line every 0.2 s, for a minute
            with contextlib.suppress(ConnectionError):
                for i in range(300):
                    writer.write(f"x-slow-{i}: y\r\n".encode())
                    await writer.drain()
                    await asyncio.sleep(0.2)

        sender = asyncio.create_task(trickle())
        try:
            assert await closed_within(reader, 30), "the slow-header connection stayed open"
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        assert not sender.done() or sender.cancelled()  # closed long before the trickle ended


@pytest.mark.slow
async def test_idle_connections_are_closed(strict_server: ServerProc) -> None:
    async with raw(strict_server) as (reader, _writer):  # never sends a byte
        assert await closed_within(reader, 30)
    async with raw(strict_server) as (reader, writer):  # idle after one keep-alive request
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        status, _, _ = await read_response(reader)
        assert status == 200
        assert await closed_within(reader, 30)
    async with httpx.AsyncClient(base_url=strict_server.url, timeout=TIMEOUT) as c:
        text = (await c.get("/metrics")).text
    assert metric(text, "omniflow_http_connections_closed_total", reason="timeout") >= 1


async def test_the_cap_evicts_idle_connections_then_refuses_when_all_are_busy(
    strict_server: ServerProc, tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    idle = [await asyncio.open_connection(*_addr(strict_server)) for _ in range(3)]
    try:
        async with httpx.AsyncClient(base_url=strict_server.url, timeout=TIMEOUT) as c:
            # 3 idle connections fill the cap: this one evicts the oldest and is served.
            assert (await c.get("/healthz")).status_code == 200
            assert await closed_within(idle[0][0], 20)
        streams: list[Any] = []
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(3):  # three connections, each running a call
                cl = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=strict_server.url, timeout=TIMEOUT)
                )
                body = {"inputs": {"gate": str(gate)}}
                r = await stack.enter_async_context(
                    cl.stream("POST", "/v1/graphs/gated/call", json=body)
                )
                lines = r.aiter_lines()
                assert json.loads(await anext(lines))["value"] == "started"
                streams.append(lines)
            async with raw(strict_server) as (reader, _writer):
                status, _headers, body = await read_response(reader)
                assert status == 503
                assert "--max-connections" in json.loads(body)["error"]
            gate.touch()
            for lines in streams:
                assert json.loads([line async for line in lines if line][-1])["done"] is True
    finally:
        for _, w in idle:
            w.close()


@pytest.mark.timeout(120)
async def test_healthz_answers_with_1000_idle_connections_open(tmp_path: Path) -> None:
    args = ["--idle-timeout", "60", "--header-timeout", "60", "--max-connections", "1000"]
    with run_server(TEST_GRAPHS, *args, tmp=tmp_path) as server:
        conns = []
        try:
            for _ in range(1000):
                conns.append(await asyncio.open_connection(*_addr(server)))
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
                for _ in range(3):
                    assert (await c.get("/healthz")).json() == {"status": "ok"}
                text = (await c.get("/metrics")).text
            assert metric(text, "omniflow_http_connections_open") == 1000
        finally:
            for _, w in conns:
                w.close()


# -- Host, Origin, sessions --------------------------------------------------------------------


async def test_foreign_host_and_origin_get_403_over_the_socket(strict_server: ServerProc) -> None:
    async with httpx.AsyncClient(base_url=strict_server.url, timeout=TIMEOUT) as c:
        assert (await c.get("/v1/graphs")).status_code == 200
        r = await c.get("/v1/graphs", headers={"host": "evil.example"})
        assert r.status_code == 403
        assert "--allowed-host evil.example" in r.json()["error"]
        assert (await c.get("/v1/graphs", headers={"host": "api.example:80"})).status_code == 200
        r = await c.post(
            "/v1/graphs/echo/call",
            json={"inputs": {"x": 1}},
            headers={"origin": "http://evil.example"},
        )
        assert r.status_code == 403
        same = {"origin": strict_server.url}
        assert (await c.get("/v1/graphs", headers=same)).status_code == 200
        assert (await c.get("/healthz", headers={"host": "evil.example"})).status_code == 200


async def test_delete_frees_sessions(shared_server: ServerProc) -> None:
    async with httpx.AsyncClient(base_url=shared_server.url, timeout=TIMEOUT) as c:
        before = metric((await c.get("/metrics")).text, "omniflow_sessions")
        ids = [f"{i:04d}-" + "s" * 1019 for i in range(20)]  # the longest ids: 1024 bytes
        for sid in ids:
            body = {"inputs": {"x": 1}, "session": sid, "stream": False}
            assert (await c.post("/v1/graphs/echo/call", json=body)).json()["status"] == "ok"
        text = (await c.get("/metrics")).text
        assert metric(text, "omniflow_sessions") == before + 20
        for sid in ids:
            assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 204
        text = (await c.get("/metrics")).text
        assert metric(text, "omniflow_sessions") == before
        # A 1 MiB id could not be deleted by URL (h11 caps a request head at 16 KiB): refused.
        body = {"inputs": {"x": 1}, "session": "s" * 2**20}
        r = await c.post("/v1/graphs/echo/call", json=body)
        assert r.status_code == 400
        assert "1 to 1024 bytes" in r.json()["error"]
        assert metric((await c.get("/metrics")).text, "omniflow_sessions") == before


async def test_nan_and_infinity_are_400_over_the_socket(shared_server: ServerProc) -> None:
    async with httpx.AsyncClient(base_url=shared_server.url, timeout=TIMEOUT) as c:
        for text in ("NaN", "Infinity", "-Infinity", "1e400"):
            r = await c.post(
                "/v1/graphs/echo/call",
                content=b'{"inputs": {"x": %s}}' % text.encode(),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400, text
            assert "finite" in r.json()["error"]
