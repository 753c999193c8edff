"""The ASGI app in-process (httpx ASGITransport): routes, shapes, errors, admission, auth."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import httpx
import numpy as np
import pytest

import omniflow as of
from omniflow.serve import create_app

from .conftest import CHAT, FIG3, TEST_GRAPHS, InProcess, metric

Factory = Callable[..., Any]


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


async def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_list_graphs(inproc: Factory) -> None:
    s: InProcess = await inproc()
    r = await s.client.get("/v1/graphs")
    assert r.status_code == 200
    graphs = {g["name"]: g for g in r.json()}
    assert graphs["echo"] == {"name": "echo", "inputs": ["x"], "outputs": ["y"]}
    assert graphs["chat"] == {"name": "chat", "inputs": ["messages"], "outputs": ["text"]}
    assert set(graphs) == {"echo", "gated", "values", "inspect", "chat"}


async def test_stream_is_ndjson_frames_then_done(inproc: Factory) -> None:
    s: InProcess = await inproc()
    messages = [{"role": "user", "content": "one two three"}]
    r = await s.client.post("/v1/graphs/chat/call", json={"inputs": {"messages": messages}})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-ndjson"
    assert r.text.endswith("\n")
    lines = ndjson(r.text)
    assert lines == [
        {"field": "text", "value": "three", "node": "reverser.generate", "seq": 0},
        {"field": "text", "value": " two", "node": "reverser.generate", "seq": 1},
        {"field": "text", "value": " one", "node": "reverser.generate", "seq": 2},
        {"done": True, "status": "ok", "errors": [], "warnings": [], "call_id": ANY},
    ]


async def test_non_stream_shape(inproc: Factory) -> None:
    s: InProcess = await inproc(FIG3)
    request = {"parts": [{"text": "ab"}, {"image": [1, 2]}]}
    r = await s.client.post(
        "/v1/graphs/fig3/call", json={"inputs": {"request": request}, "stream": False}
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"outputs", "status", "errors", "warnings", "call_id"}
    assert body["warnings"] == []
    assert (body["status"], body["errors"]) == ("ok", [])
    async with of.Runtime(*of.load_graphs(FIG3)) as rt:
        expected = await rt.run("fig3", {"request": request})
    assert body["outputs"] == expected


async def test_non_stream_lists_every_declared_output(inproc: Factory) -> None:
    s: InProcess = await inproc()
    r = await s.client.post(
        "/v1/graphs/values/call", json={"inputs": {"kind": "plain"}, "stream": False}
    )
    assert r.json() == {
        "outputs": {"value": ["before", "after"], "never": []},
        "status": "ok",
        "errors": [],
        "warnings": [],
        "call_id": ANY,
    }


async def test_session_runs_calls_in_that_session(inproc: Factory) -> None:
    s: InProcess = await inproc(FIG3)
    body = {"inputs": {"request": {"parts": [{"text": "a"}]}}, "session": "s1", "stream": False}
    for _ in range(2):
        r = await s.client.post("/v1/graphs/fig3/call", json=body)
        assert r.json()["status"] == "ok"
    assert s.state.runtime.sessions() == ["s1"]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/graphs/nope/call", {"inputs": {}}, 404, "unknown graph 'nope'"),
        ("/v1/graphs/echo/call", b"{not json", 400, "not valid JSON"),
        ("/v1/graphs/echo/call", b"", 400, "not valid JSON"),
        ("/v1/graphs/echo/call", [1, 2], 400, "must be a JSON object"),
        ("/v1/graphs/echo/call", {"x": 1}, 400, "unknown key(s) ['x']"),
        ("/v1/graphs/echo/call", {"inputs": [1]}, 400, "'inputs' must be an object"),
        ("/v1/graphs/echo/call", {"inputs": {"x": 1}, "stream": "yes"}, 400, "'stream'"),
        ("/v1/graphs/echo/call", {"inputs": {"x": 1}, "session": 3}, 400, "'session'"),
        ("/v1/graphs/echo/call", {"inputs": {"x": {"$bytes": "!!"}}}, 400, "base64"),
        ("/v1/graphs/echo/call", {"inputs": {}}, 422, "missing input 'x'"),
        ("/v1/graphs/echo/call", {"inputs": {"x": 1, "z": 2}}, 422, "unknown input 'z'"),
        ("/v1/nowhere", None, 404, "no route GET /v1/nowhere"),
    ],
)
async def test_error_statuses(
    inproc: Factory, path: str, body: Any, status: int, needle: str
) -> None:
    s: InProcess = await inproc()
    if body is None:
        r = await s.client.get(path)
    elif isinstance(body, bytes):
        r = await s.client.post(path, content=body)
    else:
        r = await s.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert set(r.json()) == {"error"}
    assert needle in r.json()["error"]


async def test_method_not_allowed_is_json(inproc: Factory) -> None:
    s: InProcess = await inproc()
    r = await s.client.get("/v1/graphs/echo/call")
    assert r.status_code == 405
    assert "GET is not allowed" in r.json()["error"]


async def test_max_inflight_answers_429_with_retry_after(inproc: Factory, tmp_path: Path) -> None:
    s: InProcess = await inproc(max_inflight=1)
    gate = tmp_path / "go"
    first = asyncio.create_task(
        s.client.post("/v1/graphs/gated/call", json={"inputs": {"gate": str(gate)}})
    )
    await wait_for(lambda: len(s.state.calls) == 1)
    r = await s.client.post("/v1/graphs/echo/call", json={"inputs": {"x": 1}})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert "max_inflight=1" in r.json()["error"]
    gate.touch()
    done = await first
    assert ndjson(done.text)[-1]["status"] == "ok"
    r = await s.client.post("/v1/graphs/echo/call", json={"inputs": {"x": 1}})
    assert r.status_code == 200
    text = (await s.client.get("/metrics")).text
    assert metric(text, "omniflow_http_calls_rejected_total", reason="max_inflight") == 1
    assert metric(text, "omniflow_http_requests_total", code="429") == 1


async def test_api_key(inproc: Factory) -> None:
    s: InProcess = await inproc(api_key="s3cret")
    c = s.client
    body = {"inputs": {"x": 1}, "stream": False}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Key": "nope"}):
        r = await c.post("/v1/graphs/echo/call", json=body, headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert "API key" in r.json()["error"]
    for path in ("/v1/graphs", "/metrics", "/v1/models"):
        assert (await c.get(path)).status_code == 401
    assert (await c.get("/healthz")).status_code == 200
    r = await c.post("/v1/graphs/echo/call", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.json()["outputs"] == {"y": [1]}
    r = await c.post("/v1/graphs/echo/call", json=body, headers={"X-API-Key": "s3cret"})
    assert r.json()["outputs"] == {"y": [1]}
    r = await c.post("/v1/chat/completions", json={})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's error shape there


async def test_bytes_and_tensors_both_directions(inproc: Factory) -> None:
    s: InProcess = await inproc()
    c = s.client
    r = await c.post("/v1/graphs/values/call", json={"inputs": {"kind": "bytes"}})
    assert ndjson(r.text)[1]["value"] == {"$bytes": base64.b64encode(b"\x00\xffomni").decode()}
    r = await c.post("/v1/graphs/values/call", json={"inputs": {"kind": "tensor"}})
    tensor = ndjson(r.text)[1]["value"]["$tensor"]
    assert (tensor["dtype"], tensor["shape"]) == ("float32", [2, 3])
    data = np.frombuffer(base64.b64decode(tensor["data"]), "<f4").reshape(2, 3)
    np.testing.assert_array_equal(data, np.arange(6, dtype=np.float32).reshape(2, 3))

    async def inspect(data: Any) -> dict[str, Any]:
        r = await c.post(
            "/v1/graphs/inspect/call", json={"inputs": {"data": data}, "stream": False}
        )
        assert r.status_code == 200, r.text
        report: dict[str, Any] = r.json()["outputs"]["report"][0]
        return report

    raw = base64.b64encode(b"\x01\x02").decode()
    assert await inspect({"$bytes": raw}) == {"type": "bytes", "hex": "0102"}
    arr = np.array([[1, 2], [3, 4]], dtype="<i8")
    spec = {"dtype": "int64", "shape": [2, 2], "data": base64.b64encode(arr.tobytes()).decode()}
    assert await inspect({"$tensor": spec}) == {
        "type": "ndarray",
        "dtype": "int64",
        "shape": [2, 2],
        "sum": 10.0,
        "writable": True,
    }
    assert (await inspect({"$bytes": raw, "other": 1}))["type"] == "dict"  # not a marker


MEDIA_GRAPHS = str(Path(__file__).with_name("_media_graphs.py"))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("stream", [True, False])
async def test_media_both_directions(inproc: Factory, stream: bool) -> None:
    """docs/api-media.md "Media values": ``$audio`` / ``$image`` in inputs and in frames sent
    back."""
    from ._media_graphs import word_audio

    s: InProcess = await inproc(MEDIA_GRAPHS)
    c = s.client

    async def values(graph: str, inputs: dict[str, Any], field: str) -> list[Any]:
        r = await c.post(f"/v1/graphs/{graph}/call", json={"inputs": inputs, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            lines = ndjson(r.text)
            assert lines[-1]["status"] == "ok", lines[-1]
            return [ln["value"] for ln in lines[:-1] if ln["field"] == field]
        body = r.json()
        assert body["status"] == "ok", body
        out: list[Any] = body["outputs"][field]
        return out

    # out: one tagged WAV per of.Audio frame, float samples written as 16-bit
    none = {"voice": None, "speed": None, "instructions": None}
    got = await values("speaker", {"input": "ab cde", **none}, "audio")
    assert [sorted(v) for v in got] == [["$audio"], ["$audio"]]
    assert [of.Audio.from_bytes(base64.b64decode(v["$audio"]["wav_b64"])) for v in got] == [
        word_audio("ab", 22050),
        word_audio("cde", 22050),
    ]
    got = await values("speaker", {"input": "ab", **none, "voice": "float"}, "audio")
    back = of.Audio.from_bytes(base64.b64decode(got[0]["$audio"]["wav_b64"]))
    assert back == of.Audio(word_audio("ab", 22050, "float32").pcm16(), sample_rate=22050)
    # ... and a tagged PNG per of.Image frame
    got = await values("painter", {"prompt": "red", "size": "5x3", "n": 2}, "image")
    pics = [of.Image.from_bytes(base64.b64decode(v["$image"]["png_b64"])) for v in got]
    assert [(p.width, p.height) for p in pics] == [(5, 3), (5, 3)]
    assert pics[0].pixels[0, 0].tolist() == [120, 128, 0]
    # in: media anywhere in the inputs reach the graph as of.Audio / of.Image
    pic = of.Image(np.zeros((2, 3, 3), dtype=np.uint8))
    pcm = np.array([1, -2, 3, 4], dtype="<i2").tobytes()
    audio = {"$audio": {"pcm16_b64": _b64(pcm), "sample_rate": 8000}}
    content = [
        {"type": "input_audio", "input_audio": audio},
        {"type": "image_url", "image_url": {"$image": {"png_b64": _b64(pic.to_png())}}},
    ]
    inputs = {"messages": [{"role": "user", "content": content}], "modalities": None,
              "voice": None, "audio_format": None}  # fmt: skip
    assert await values("talker", inputs, "text") == ["heard", " 4", " samples", " at",
                                                      " 8000", " Hz", " saw", " 3x2"]  # fmt: skip
    clip = word_audio("hello", 16000)
    inputs = {"audio": {"$audio": {"wav_b64": _b64(clip.to_wav())}}, "language": "en",
              "prompt": None}  # fmt: skip
    assert await values("asr", inputs, "text") == [f"{len(clip)} samples at 16000 Hz, en, None"]


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"$audio": {"wav_b64": "RIFF"}}, "inputs.audio.$audio.wav_b64"),  # truncated WAV
        ({"$audio": {"wav_b64": "not base64!"}}, "inputs.audio.$audio.wav_b64: not valid base64"),
        ({"$image": {"png_b64": _b64(b"GIF89a not a png")}}, "inputs.audio.$image.png_b64"),
        ({"$audio": {"mp3_b64": "AAAA"}}, "inputs.audio.$audio: expected an object with one of"),
    ],
)
async def test_bad_media_input_is_400_naming_the_path(
    inproc: Factory, value: dict[str, Any], path: str
) -> None:
    s: InProcess = await inproc(MEDIA_GRAPHS)
    inputs = {"audio": value, "language": None, "prompt": None}
    r = await s.client.post("/v1/graphs/asr/call", json={"inputs": inputs})
    assert r.status_code == 400, r.text
    assert path in r.json()["error"]


@pytest.mark.parametrize("stream", [True, False])
async def test_value_without_json_form_is_an_error_entry(inproc: Factory, stream: bool) -> None:
    s: InProcess = await inproc()
    for kind, needle in (("set", "builtins.set"), ("nan", "Out of range float")):
        r = await s.client.post(
            "/v1/graphs/values/call", json={"inputs": {"kind": kind}, "stream": stream}
        )
        assert r.status_code == 200
        if stream:
            lines = ndjson(r.text)
            assert [ln["value"] for ln in lines[:-1]] == ["before", "after"]
            done = lines[-1]
        else:
            done = r.json()
            assert done["outputs"]["value"] == ["before", "after"]
        assert done["status"] == "error"
        (err,) = done["errors"]
        assert err["node"] == "values.make"
        assert err["field"] == "value"
        assert err["exc_type"] == "ValueEncodingError"
        assert "output 'value' (seq 1) was not sent" in err["message"]
        assert needle in err["message"]
    text = (await s.client.get("/metrics")).text
    assert metric(text, "omniflow_http_encoding_errors_total") == 2


async def test_node_error_is_in_the_error_list(inproc: Factory) -> None:
    s: InProcess = await inproc()
    r = await s.client.post("/v1/graphs/values/call", json={"inputs": {"kind": "fail"}})
    lines = ndjson(r.text)
    assert lines[0]["value"] == "before"
    done = lines[-1]
    assert done["status"] == "error"
    (err,) = done["errors"]
    assert (err["node"], err["kind"]) == ("values.make", "error")
    assert "boom on purpose" in err["message"]


async def test_healthz_and_metrics(inproc: Factory) -> None:
    s: InProcess = await inproc()
    assert (await s.client.get("/healthz")).json() == {"status": "ok"}
    for x in range(3):
        await s.client.post("/v1/graphs/echo/call", json={"inputs": {"x": x}})
    await s.client.post("/v1/graphs/nope/call", json={"inputs": {}})
    r = await s.client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = r.text
    sample = r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]\w*="(\\.|[^"\\])*",?)*\})? \S+$'
    import re

    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or re.match(sample, line)
    node = {"graph": "echo", "node": "echo.run"}
    assert metric(text, "omniflow_node_activations_total", **node) == 3
    assert metric(text, "omniflow_node_latency_seconds_count", **node) == 3
    assert metric(text, "omniflow_node_latency_seconds_bucket", **node, le="+Inf") == 3
    assert metric(text, "omniflow_frames_total", graph="echo", field="y") == 3
    assert metric(text, "omniflow_http_frames_out_total", graph="echo") == 3
    assert metric(text, "omniflow_http_bytes_out_total") > 0
    assert metric(text, "omniflow_http_requests_total", code="200") == 4  # 3 calls + healthz
    assert metric(text, "omniflow_http_requests_total", code="404") == 1
    assert metric(text, "omniflow_calls_finished_total", status="ok") == 3
    assert metric(text, "omniflow_active_calls") == 0
    assert "# TYPE omniflow_node_latency_seconds histogram" in text


async def test_drain_lets_inflight_finish_and_refuses_new(inproc: Factory, tmp_path: Path) -> None:
    s: InProcess = await inproc()
    gate = tmp_path / "go"
    first = asyncio.create_task(
        s.client.post("/v1/graphs/gated/call", json={"inputs": {"gate": str(gate)}})
    )
    await wait_for(lambda: len(s.state.calls) == 1)
    drain = asyncio.create_task(s.state.drain(10.0))
    await wait_for(lambda: s.state.draining)
    r = await s.client.post("/v1/graphs/echo/call", json={"inputs": {"x": 1}})
    assert r.status_code == 503
    assert "shutting down" in r.json()["error"]
    assert (await s.client.get("/healthz")).status_code == 503
    assert (await s.client.get("/v1/graphs")).status_code == 200
    gate.touch()
    assert ndjson((await first).text)[-1] == {
        "done": True,
        "status": "ok",
        "errors": [],
        "warnings": [],
        "call_id": ANY,
    }
    assert await drain == 0


async def test_drain_timeout_cancels_the_rest(inproc: Factory, tmp_path: Path) -> None:
    s: InProcess = await inproc()
    gate = tmp_path / "never"
    first = asyncio.create_task(
        s.client.post("/v1/graphs/gated/call", json={"inputs": {"gate": str(gate)}})
    )
    await wait_for(lambda: len(s.state.calls) == 1)
    assert await s.state.drain(0.05) == 1
    lines = ndjson((await first).text)
    assert lines[0]["value"] == "started"
    assert lines[-1]["done"] is True
    assert lines[-1]["status"] == "cancelled"
    assert Path(str(gate) + ".cancelled").exists()  # the producer saw CancelledError


async def test_create_app_with_a_runtime_leaves_it_to_the_caller() -> None:
    async with of.Runtime(*of.load_graphs(TEST_GRAPHS)) as rt:
        app = create_app(rt)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                r = await c.post("/v1/graphs/echo/call", json={"inputs": {"x": 2}, "stream": False})
                assert r.json()["outputs"] == {"y": [2]}
                metrics = (await c.get("/metrics")).text
        assert "omniflow_node_activations_total" not in metrics  # metrics off in this runtime
        assert "omniflow_http_requests_total" in metrics
        assert rt.state.value == "running"  # not closed by the app
    with pytest.raises(of.OmniflowError, match="placement/registry"):
        create_app(rt, placement="process")


def test_create_app_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(of.GraphError, match="does not exist"):
        create_app(str(tmp_path / "missing.py"))
    with pytest.raises(of.OmniflowError, match="placement='gpu' is not understood"):
        create_app(CHAT, placement="gpu")
    with pytest.raises(of.OmniflowError, match="max_inflight"):
        create_app(CHAT, max_inflight=0)
    with pytest.raises(of.OmniflowError, match="at least one graph"):
        create_app([])


async def test_openai_routes_errors_in_openai_shape(inproc: Factory, tmp_path: Path) -> None:
    s: InProcess = await inproc(max_inflight=1)
    c = s.client
    models = (await c.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["chat"]
    user = [{"role": "user", "content": "x y"}]
    cases: list[tuple[Any, int, str | None]] = [
        (b"nope", 400, None),
        (b"[1]", 400, None),
        ({"model": "gpt", "messages": user}, 404, "model_not_found"),
        ({"model": "chat", "messages": "hi"}, 400, "invalid_type"),
        ({"model": "chat", "messages": user, "stream": 1}, 400, "invalid_type"),
        ({"model": "chat", "messages": user, "temperature": "hot"}, 400, "invalid_type"),
        ({"model": "chat", "messages": user, "session": 3}, 400, None),
    ]
    for body, status, code in cases:
        kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await c.post("/v1/chat/completions", **kw)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == code
    gate = tmp_path / "go"
    first = asyncio.create_task(
        c.post("/v1/graphs/gated/call", json={"inputs": {"gate": str(gate)}})
    )
    await wait_for(lambda: len(s.state.calls) == 1)
    r = await c.post("/v1/chat/completions", json={"model": "chat", "messages": user})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    gate.touch()
    await first
    r = await c.post(
        "/v1/chat/completions",
        json={"model": "chat", "messages": user, "stream": True, "stream_options": {}},
    )
    events = [ln for ln in r.text.split("\n\n") if ln]
    assert events[-1] == "data: [DONE]"
    assert r.headers["content-type"].startswith("text/event-stream")


_USAGE_CHAT = """
import omniflow as of

class Words(of.Role):
    @of.interface(inputs_or=[["messages", "max_tokens", "stop", "mood"]],
                  outputs=["text", "usage"])
    async def generate(self, messages, max_tokens, stop, mood):
        words = messages[-1]["content"].split()
        limit = len(words) if max_tokens is None else max_tokens
        said = words[:limit]
        for i, w in enumerate(said):
            yield {"text": w if i == 0 else " " + w}
        yield {"usage": {"prompt_tokens": 10, "completion_tokens": len(said),
                         "cached_tokens": 4 if of.context().session else 0,
                         "finish_reason": "length" if len(said) < len(words) else "stop",
                         "echo": [max_tokens, stop, mood]}}

graph = of.Graph("words", roles={"w": Words()},
                 inputs=[of.Placeholder(n) for n in ("messages", "max_tokens", "stop", "mood")],
                 outputs=["text", "usage"])
"""


async def test_openai_sampling_fields_and_graph_usage(inproc: Factory, tmp_path: Path) -> None:
    src = tmp_path / "words.py"
    src.write_text(_USAGE_CHAT)
    s: InProcess = await inproc(str(src))
    c = s.client
    user = [{"role": "user", "content": "a b c d"}]
    # 'mood' is not an OpenAI field: it stays a required input (400 naming it)
    r = await c.post("/v1/chat/completions", json={"model": "words", "messages": user})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mood"
    # absent OpenAI fields are None; the graph's usage frame is the usage
    body = {"model": "words", "messages": user, "mood": "ok"}
    r = await c.post("/v1/chat/completions", json=body)
    got = r.json()
    assert got["choices"][0]["message"]["content"] == "a b c d"
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # max_completion_tokens fills max_tokens; finish_reason length; session from the header
    r = await c.post(
        "/v1/chat/completions",
        json={**body, "max_completion_tokens": 2, "stop": ["x"]},
        headers={"x-omniflow-session": "s9"},
    )
    got = r.json()
    assert got["choices"][0]["message"]["content"] == "a b"
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 2
    assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    # streamed: usage only with include_usage, in a last chunk with no choices
    for include in (False, True):
        r = await c.post(
            "/v1/chat/completions",
            json={
                **body,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": include},
            },
        )
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
        assert r.text.endswith("data: [DONE]\n\n")
        finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finals[-1] == "length"
        usage = [e["usage"] for e in events if "usage" in e]
        if include:
            assert events[-1]["choices"] == []
            assert usage == [
                {
                    "prompt_tokens": 10,
                    "completion_tokens": 3,
                    "total_tokens": 13,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
            ]
        else:
            assert usage == []
    r = await c.post(
        "/v1/graphs/words/call",
        json={"inputs": {"messages": user, "max_tokens": 1, "stop": None, "mood": 1}},
    )
    assert json.loads(r.text.splitlines()[-2])["value"]["echo"] == [1, None, 1]
