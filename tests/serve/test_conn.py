"""``_conn.WRITE_BODY``: the synchronous chunk writer a streaming response gets from the server.

Under a real uvicorn server in this process (the serve protocol class), a tiny ASGI app calls
the writer at each point of a response and records what it answered; the client reads the raw
bytes and parses them with h11, so a frame written the short way is the same HTTP as one sent
through ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h11
import pytest
import uvicorn

from omniflow.serve._conn import WRITE_BODY, protocol_class
from omniflow.serve._limits import Limits

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@contextlib.asynccontextmanager
async def running(app: App) -> AsyncIterator[int]:
    """``app`` under uvicorn with the serve protocol on a free loopback port."""
    protocol, _tracker = protocol_class(Limits())
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_config=None, ws="none")
    server = uvicorn.Server(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):  # hang guard
            while not server.started:
                await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


async def exchange(port: int, request: bytes) -> tuple[h11.Response, bytes]:
    """Send ``request`` raw; the response parsed by h11 (status line, headers, whole body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    writer.write(request)
    # h11 as a client must see the request go out to expect a response.
    headers = [("host", "x"), ("content-length", "0")]
    conn.send(h11.Request(method="POST", target="/", headers=headers))
    conn.send(h11.EndOfMessage())
    head: h11.Response | None = None
    body = b""
    try:
        async with asyncio.timeout(30):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
    finally:
        writer.close()
    assert head is not None
    return head, body


HTTP11 = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
HTTP10 = b"POST / HTTP/1.0\r\nhost: x\r\ncontent-length: 0\r\n\r\n"


def streaming_app(seen: list[tuple[str, bool]], headers: list[tuple[bytes, bytes]]) -> App:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = scope["extensions"][WRITE_BODY]
        seen.append(("before start", write(b"x")))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        seen.append(("empty", write(b"")))
        for i in range(3):
            line = b'{"seq":%d}\n' % i
            if not write(line):
                seen.append(("asgi", False))
                await send({"type": "http.response.body", "body": line, "more_body": True})
            else:
                seen.append(("line", True))
        await send({"type": "http.response.body", "body": b"end\n", "more_body": False})
        seen.append(("after end", write(b"x")))

    return app


async def test_chunks_written_the_short_way_are_the_http_h11_would_write() -> None:
    seen: list[tuple[str, bool]] = []
    async with running(streaming_app(seen, [(b"content-type", b"text/plain")])) as port:
        head, body = await exchange(port, HTTP11)
    assert head.status_code == 200
    assert (b"transfer-encoding", b"chunked") in head.headers
    assert body == b'{"seq":0}\n{"seq":1}\n{"seq":2}\nend\n'
    assert seen == [
        ("before start", False),
        ("empty", False),
        ("line", True),
        ("line", True),
        ("line", True),
        ("after end", False),
    ]


@pytest.mark.parametrize(
    ("request_bytes", "headers"),
    [
        (HTTP10, [(b"content-type", b"text/plain")]),  # HTTP/1.0: no chunks, close-delimited
        (HTTP11, [(b"content-length", b"34")]),  # a declared length: no chunks
    ],
    ids=["http10", "content-length"],
)
async def test_a_body_that_is_not_chunked_goes_through_asgi(
    request_bytes: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    seen: list[tuple[str, bool]] = []
    async with running(streaming_app(seen, headers)) as port:
        _head, body = await exchange(port, request_bytes)
    assert body == b'{"seq":0}\n{"seq":1}\n{"seq":2}\nend\n'
    assert [s for s in seen if s[0] in ("line", "asgi")] == [("asgi", False)] * 3


async def test_a_full_socket_refuses_the_short_way_and_send_waits_for_the_reader() -> None:
    """Backpressure is unchanged: once the transport's buffer is over its high-water mark
    the writer says no, and the ASGI send waits until the client reads."""
    chunk = b"y" * 65536
    state: dict[str, Any] = {"short": 0}
    refused, sent = asyncio.Event(), asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = scope["extensions"][WRITE_BODY]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(100_000):  # bound: kernel buffers hold a few MiB at most
            if not write(chunk):
                break
            state["short"] += 1
        refused.set()
        await send({"type": "http.response.body", "body": b"last", "more_body": True})
        sent.set()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with running(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HTTP11)
        async with asyncio.timeout(30):
            await refused.wait()
        assert state["short"] >= 1
        for _ in range(20):  # the app stays blocked while nobody reads (loop turns, no clock)
            await asyncio.sleep(0)
        assert not sent.is_set()
        total = b""
        async with asyncio.timeout(30):
            while not total.endswith(b"0\r\n\r\n"):
                total += await reader.read(1 << 20)
        assert sent.is_set()
        assert total.count(b"10000\r\n") == state["short"]  # every short-way chunk arrived
        writer.close()
