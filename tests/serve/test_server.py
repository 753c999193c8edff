"""A real ``omniflow serve`` subprocess on a real socket: streaming, disconnect, SIGTERM, memory,
and the OpenAI endpoint with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import httpx
import openai
import pytest

from .conftest import CHAT, TEST_GRAPHS, ServerProc, metric, run_server

TIMEOUT = httpx.Timeout(20.0)


async def wait_until(pred: Any) -> None:
    """Poll ``pred`` until it holds; a condition that never does is a hang, which the suite's
    pytest-timeout reports with every stack (no wall-clock bound of its own here)."""
    while not await pred():
        await asyncio.sleep(0.02)


async def lines_of(r: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in r.aiter_lines():
        if line:
            yield json.loads(line)


async def test_frames_stream_before_the_call_ends(
    shared_server: ServerProc, tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    async with httpx.AsyncClient(base_url=shared_server.url, timeout=TIMEOUT) as c:
        body = {"inputs": {"gate": str(gate)}}
        async with c.stream("POST", "/v1/graphs/gated/call", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/x-ndjson"
            lines = lines_of(r)
            first = await anext(lines)
            # The producer is still blocked on the gate: this frame was flushed mid-call.
            assert first == {"field": "step", "value": "started", "node": "gate.wait", "seq": 0}
            assert not gate.exists()
            gate.touch()
            rest = [line async for line in lines]
    assert rest == [
        {"field": "step", "value": "released", "node": "gate.wait", "seq": 1},
        {"done": True, "status": "ok", "errors": [], "warnings": [], "call_id": ANY},
    ]


async def test_client_disconnect_cancels_the_call(
    shared_server: ServerProc, tmp_path: Path
) -> None:
    gate = tmp_path / "never"
    marker = Path(str(gate) + ".cancelled")
    async with httpx.AsyncClient(base_url=shared_server.url, timeout=TIMEOUT) as c:
        before = (await c.get("/metrics")).text
        body = {"inputs": {"gate": str(gate)}}
        async with c.stream("POST", "/v1/graphs/gated/call", json=body) as r:
            first = await anext(lines_of(r))
            assert first["value"] == "started"
        # Leaving the block closed the connection mid-stream (the body was not read out).

        async def cancelled() -> bool:
            return marker.exists()

        await wait_until(cancelled)  # the producer got CancelledError

        async def idle() -> bool:
            text = (await c.get("/metrics")).text
            return (
                metric(text, "omniflow_active_calls") == 0
                and metric(text, "omniflow_http_calls_inflight") == 0
            )

        await wait_until(idle)
        after = (await c.get("/metrics")).text
    node = {"graph": "gated", "node": "gate.wait"}
    for name, labels in (
        ("omniflow_http_disconnects_total", {}),
        ("omniflow_node_cancelled_total", node),
        ("omniflow_calls_finished_total", {"status": "cancelled"}),
    ):
        assert metric(after, name, **labels) == metric(before, name, **labels) + 1, name
    assert metric(after, "omniflow_open_buckets") == 0
    assert metric(after, "omniflow_inflight_activations") == 0


async def test_client_leaving_a_non_stream_call_cancels_it(
    shared_server: ServerProc, tmp_path: Path
) -> None:
    gate = tmp_path / "never"
    body = {"inputs": {"gate": str(gate)}, "stream": False}
    async with httpx.AsyncClient(base_url=shared_server.url, timeout=TIMEOUT) as c:
        with pytest.raises(httpx.ReadTimeout):  # gives up and closes the connection
            await c.post("/v1/graphs/gated/call", json=body, timeout=httpx.Timeout(5, read=0.3))

        async def cancelled() -> bool:
            return Path(str(gate) + ".cancelled").exists()

        await wait_until(cancelled)

        async def idle() -> bool:
            text = (await c.get("/metrics")).text
            return metric(text, "omniflow_active_calls") == 0

        await wait_until(idle)


async def test_non_stream_and_errors_over_the_socket(shared_server: ServerProc) -> None:
    async with httpx.AsyncClient(base_url=shared_server.url, timeout=TIMEOUT) as c:
        r = await c.post("/v1/graphs/echo/call", json={"inputs": {"x": [1, "a"]}, "stream": False})
        assert r.json() == {
            "outputs": {"y": [[1, "a"]]},
            "status": "ok",
            "errors": [],
            "warnings": [],
            "call_id": ANY,
        }
        r = await c.post("/v1/graphs/nope/call", json={"inputs": {}})
        assert r.status_code == 404
        assert "unknown graph 'nope'" in r.json()["error"]
        r = await c.post("/v1/graphs/echo/call", content=b"{oops")
        assert r.status_code == 400
        r = await c.post("/v1/graphs/echo/call", json={"inputs": {}})
        assert r.status_code == 422
        assert "missing input 'x'" in r.json()["error"]
        # curl -d sends application/x-www-form-urlencoded: the body is still read as JSON.
        r = await c.post(
            "/v1/graphs/echo/call",
            content=b'{"inputs": {"x": 5}, "stream": false}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.json()["outputs"] == {"y": [5]}
        assert (await c.get("/healthz")).json() == {"status": "ok"}


async def test_openai_client_streaming_and_not(shared_server: ServerProc) -> None:
    async with openai.AsyncOpenAI(
        base_url=shared_server.url + "/v1", api_key="unused", max_retries=0
    ) as client:
        models = [m.id async for m in client.models.list()]
        assert models == ["chat"]
        messages: Any = [
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": "hello omniflow world"},
        ]
        done = await client.chat.completions.create(model="chat", messages=messages)
        assert done.object == "chat.completion"
        assert done.model == "chat"
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].message.content == "world omniflow hello"
        assert done.choices[0].finish_reason == "stop"
        assert done.usage is not None and done.usage.completion_tokens == 3

        stream = await client.chat.completions.create(
            model="chat",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
        deltas, finish, usage = [], None, None
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content)
                finish = chunk.choices[0].finish_reason or finish
        assert deltas == ["", "world", " omniflow", " hello", None]
        assert finish == "stop"
        assert usage is not None and usage.completion_tokens == 3

        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(model="gpt-4o", messages=messages)
        # the graph's InputError: a bad request, streaming or not (tests/serve/test_openai.py)
        with pytest.raises(openai.BadRequestError, match="no user message"):
            await client.chat.completions.create(model="chat", messages=messages[:1])
        with pytest.raises(openai.BadRequestError, match="no user message"):
            await client.chat.completions.create(model="chat", messages=messages[:1], stream=True)


async def _hammer(c: httpx.AsyncClient, n: int, concurrency: int) -> None:
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            body = {"inputs": {"x": i}, "stream": i % 2 == 0}
            r = await c.post("/v1/graphs/echo/call", json=body)
            assert r.status_code == 200
            assert r.text.endswith("}\n") if i % 2 == 0 else r.json()["status"] == "ok"

    await asyncio.gather(*(worker() for _ in range(concurrency)))


@pytest.mark.slow
async def test_nothing_of_2000_finished_calls_stays_in_the_server(
    shared_server: ServerProc,
) -> None:
    """Behaviour, not memory: every call's state is gone once it ended. (RSS around many calls
    is a benchmark's claim: benchmarks/bench_runtime.py memory shape, bench_http_limits.py.)"""
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=shared_server.url, timeout=TIMEOUT, limits=limits) as c:
        await _hammer(c, 2000, 16)
        text = (await c.get("/metrics")).text
    for gauge in ("omniflow_active_calls", "omniflow_open_buckets", "omniflow_inflight_activations",
                  "omniflow_http_calls_inflight", "omniflow_data_plane_held_bytes"):  # fmt: skip
        assert f"\n{gauge} " in text and metric(text, gauge) == 0, gauge


async def test_sigterm_drains_then_exits_0(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"OMNIFLOW_API_KEY": "k3y", "OMNIFLOW_TEST_MARKERS": str(markers)}
    with run_server(TEST_GRAPHS, "--max-inflight", "2", tmp=tmp_path, env=env) as server:
        auth = {"Authorization": "Bearer k3y"}
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as anon:
            r = await anon.get("/v1/graphs")
            assert r.status_code == 401
            assert (await anon.get("/healthz")).status_code == 200
        assert (markers / "setup").exists()
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, headers=auth) as c:
            body = {"inputs": {"gate": str(gate)}}
            async with (
                c.stream("POST", "/v1/graphs/gated/call", json=body) as r1,
                c.stream("POST", "/v1/graphs/gated/call", json=body) as r2,
            ):
                s1, s2 = lines_of(r1), lines_of(r2)
                assert (await anext(s1))["value"] == "started"
                assert (await anext(s2))["value"] == "started"
                r = await c.post("/v1/graphs/echo/call", json={"inputs": {"x": 1}})
                assert r.status_code == 429
                assert r.headers["retry-after"] == "1"

                server.proc.send_signal(15)  # SIGTERM

                async def draining() -> bool:
                    return (await c.get("/healthz")).status_code == 503

                await wait_until(draining)
                r = await c.post("/v1/graphs/echo/call", json={"inputs": {"x": 1}})
                assert r.status_code == 503
                assert "shutting down" in r.json()["error"]
                assert server.proc.poll() is None  # still serving the two calls
                gate.touch()
                rest1 = [line async for line in s1]
                rest2 = [line async for line in s2]
        for rest in (rest1, rest2):
            assert [ln.get("value") for ln in rest[:-1]] == ["released"]
            assert rest[-1] == {
                "done": True,
                "status": "ok",
                "errors": [],
                "warnings": [],
                "call_id": ANY,
            }
        assert server.proc.wait(15) == 0
        assert (markers / "teardown").exists()  # the runtime closed: role teardown ran
        assert "Traceback" not in server.stderr()


async def test_drain_timeout_cancels_calls_left(tmp_path: Path) -> None:
    gate = tmp_path / "never"
    with run_server(TEST_GRAPHS, "--drain-timeout", "0.3", tmp=tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            body = {"inputs": {"gate": str(gate)}}
            async with c.stream("POST", "/v1/graphs/gated/call", json=body) as r:
                lines = lines_of(r)
                assert (await anext(lines))["value"] == "started"
                server.proc.send_signal(15)
                rest = [line async for line in lines]
        assert rest[-1]["done"] is True
        assert rest[-1]["status"] == "cancelled"
        assert Path(str(gate) + ".cancelled").exists()
        assert server.proc.wait(15) == 0
        assert "Traceback" not in server.stderr()


async def test_serve_with_process_placement(tmp_path: Path) -> None:
    deploy = '{"reverser": {"replicas": 2, "process": "llm"}}'
    with run_server(CHAT, "--placement", deploy, tmp=tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            for words in ("a b c", "one two"):
                body = {"inputs": {"messages": [{"role": "user", "content": words}]}}
                r = await c.post("/v1/graphs/chat/call", json=body)
                lines = [json.loads(line) for line in r.text.splitlines()]
                assert "".join(ln["value"] for ln in lines[:-1]) == " ".join(words.split()[::-1])
                assert lines[-1]["status"] == "ok"
        assert server.terminate() == 0
        assert "Traceback" not in server.stderr()
