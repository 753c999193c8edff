"""Traces over OTLP/HTTP (docs/contract.md §4): a real receiver decoding the protobuf, a served
fig3 call in every placement, the caller's traceparent kept, no value in any attribute, and a
collector that refuses connections changing nothing for the calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import omniflow as of
from omniflow.runtime._tracing import otlp_provider
from omniflow.serve import create_app
from tests.runtime.conftest import ray_local  # noqa: F401  (the "ray" placement's Ray)
from tests.serve.conftest import FIG3

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
#: A value that must never show up in a span.
SECRET = "SECRET-cat-7781"
REQUEST = {"parts": [{"text": SECRET}, {"image": [1.25, 2.5]}]}
#: Activations of one fig3 call: node -> count.
ACTIVATIONS = {
    "parse.run": 1, "embedding.embed": 1, "vit.encode": 1, "vae.encode": 1,
    "llm.generate": 2, "diffusion.generate_image": 1, "vae.decode": 1,
}  # fmt: skip
#: node -> the nodes whose activation may be its span's parent (the graph's edges).
PARENTS = {
    "parse.run": {"omniflow.call"},
    "embedding.embed": {"parse.run"},
    "vit.encode": {"parse.run"},
    "vae.encode": {"parse.run"},
    "llm.generate": {"embedding.embed", "vit.encode", "vae.encode"},
    "diffusion.generate_image": {"llm.generate"},
    "vae.decode": {"diffusion.generate_image"},
}


class Receiver:
    """An OTLP/HTTP collector on a free port: decodes every export, keeps the spans."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                assert self.path == "/v1/traces"
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


def _attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


async def _served_calls(endpoint: str, placement: Any, n: int = 1) -> list[dict[str, Any]]:
    """``n`` calls of fig3 through the app (its lifespan flushes the exporter at the end)."""
    app = create_app(FIG3, placement=placement, otlp_endpoint=endpoint)
    bodies = []
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost"
        ) as client,
    ):
        for _ in range(n):
            r = await client.post(
                "/v1/graphs/fig3/call",
                json={"inputs": {"request": REQUEST}, "session": "s1", "stream": False},
                headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
            )
            assert r.status_code == 200
            bodies.append(r.json())
    return bodies


@pytest.mark.parametrize(
    "placement",
    ["inproc", pytest.param("process", marks=pytest.mark.slow),
     pytest.param("ray", marks=pytest.mark.slow)],
)  # fmt: skip
async def test_a_served_call_is_one_trace(receiver: Receiver, placement: Any) -> None:
    ray = None
    if placement == "ray":
        ray = pytest.importorskip("ray")
        if not ray.is_initialized():  # logical CPUs enough for a replica of every role
            ray.init(num_cpus=64, include_dashboard=False)
        else:
            ray = None
        from omniflow.cluster._ray_plan import Ray

        placement = Ray({})
    try:
        (body,) = await _served_calls(receiver.url, placement)
    finally:
        if ray is not None:
            ray.shutdown()
    assert body["status"] == "ok" and len(body["outputs"]["token"]) == len(SECRET) + 2
    spans = receiver.spans
    assert {s.trace_id.hex() for s in spans} == {CALLER_TRACE}
    by_id = {s.span_id: s for s in spans}
    (server,) = [s for s in spans if s.name == "POST /v1/graphs/fig3/call"]
    assert server.parent_span_id.hex() == CALLER_SPAN
    (call,) = [s for s in spans if s.name == "omniflow.call"]
    assert call.parent_span_id == server.span_id
    cattrs = _attrs(call)
    assert cattrs["omniflow.graph"] == "fig3" and cattrs["omniflow.status"] == "ok"
    assert cattrs["omniflow.call_id"] == body["call_id"] and cattrs["omniflow.session"] == "s1"
    acts = [s for s in spans if s.name in ACTIVATIONS]
    assert len(spans) == 2 + len(acts)
    assert {n: sum(s.name == n for s in acts) for n in ACTIVATIONS} == ACTIVATIONS
    for s in acts:
        a = _attrs(s)
        assert a["omniflow.node"] == s.name
        assert a["omniflow.role"] == s.name.split(".")[0]
        assert a["omniflow.frames"] >= 1
        if placement != "inproc":
            assert a["omniflow.replica"] != "front"
        parent = by_id[s.parent_span_id]
        assert parent.name in PARENTS[s.name], (s.name, parent.name)
        assert call.start_time_unix_nano <= s.start_time_unix_nano
        assert s.end_time_unix_nano <= call.end_time_unix_nano  # ends after every stream
    # The joins: the image merge links its other input, the token join its other stream.
    (img,) = [s for s in acts if s.name == "llm.generate" and _attrs(s)["omniflow.or_group"] == 1]
    inputs = {by_id[img.parent_span_id].name, *(by_id[lk.span_id].name for lk in img.links)}
    assert inputs == {"vit.encode", "vae.encode"}
    (join,) = [s for s in acts if s.name == "diffusion.generate_image"]
    feeders = {join.parent_span_id, *(lk.span_id for lk in join.links)}
    assert feeders == {s.span_id for s in acts if s.name == "llm.generate"}
    # No field's value anywhere.
    values = [SECRET, "1.25", "2.5", *body["outputs"]["token"]]
    for s in spans:
        for v in _attrs(s).values():
            assert not any(x in str(v) for x in values), (s.name, v)


def _refused_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again: nothing listens there


async def test_a_dead_collector_changes_nothing_for_calls(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    good = await _served_calls(receiver.url, "inproc", n=3)
    with caplog.at_level(logging.WARNING, logger="omniflow.tracing"):
        dead_url = f"http://127.0.0.1:{_refused_port()}"
        dead = await _served_calls(dead_url, "inproc", n=3)
    strip = [{k: v for k, v in b.items() if k != "call_id"} for b in good]
    assert [{k: v for k, v in b.items() if k != "call_id"} for b in dead] == strip
    # The lifespan's flush exports the batch, the collector refuses it: said exactly once,
    # naming the collector and what happens to the spans.
    said = [r.getMessage() for r in caplog.records if r.name == "omniflow.tracing"]
    assert len(said) == 1, said
    assert dead_url in said[0] and "dropping spans" in said[0], said


def test_a_full_span_queue_is_said_once() -> None:
    """The SDK warns for every span it drops from a full queue; omniflow lets one through."""
    import logging

    from omniflow.runtime import _tracing

    provider = _tracing.otlp_provider("http://127.0.0.1:9")  # nothing listens there
    try:
        queue = logging.getLogger(_tracing._QUEUE)
        records: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record)

        keep = Keep()
        queue.addHandler(keep)
        try:
            for i in range(5):
                queue.warning("Queue full, dropping %s.", f"span {i}")
        finally:
            queue.removeHandler(keep)
        said = [f for f in queue.filters if isinstance(f, _tracing._FirstOnly)]
        assert len(said) == 1 and len(records) == 1
        # (the SDK's own DuplicateFilter holds back repeats for a while; ours, for good)
        late = logging.LogRecord(_tracing._QUEUE, logging.WARNING, "", 0, "Queue full", (), None)
        assert not said[0].filter(late) and not said[0].filter(late)
    finally:
        provider.shutdown()


class Traced(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def work(self, x: int) -> dict[str, int]:
        from opentelemetry import trace

        with trace.get_tracer("tests.traced").start_as_current_span("user.work"):
            return {"y": x + 1}


traced = of.Graph(
    "traced", roles={"t": Traced()}, inputs=[of.Placeholder("x")], outputs=["y"]
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["process", "ray"])
async def test_a_worker_methods_own_span_nests_under_its_activation(
    receiver: Receiver, placement: str, request: pytest.FixtureRequest
) -> None:
    # The method runs in a worker process or a Ray actor: the front hands it its collector
    # (otlp_provider's endpoint), the run carries the activation's context.
    where: Any = placement
    if placement == "ray":
        request.getfixturevalue("ray_local")
        where = of.Ray()
    provider = otlp_provider(receiver.url)
    try:
        async with of.Runtime(traced, placement=where, tracer_provider=provider) as rt:
            assert await rt.run("traced", {"x": 1}) == {"y": [2]}
    finally:
        provider.shutdown()
    for _ in range(600):  # the worker flushes as it stops (a hang guard)
        if any(s.name == "user.work" for s in receiver.spans):
            break
        await asyncio.sleep(0.05)
    spans = receiver.spans
    (user,) = [s for s in spans if s.name == "user.work"]
    (act,) = [s for s in spans if s.name == "t.work"]
    (call,) = [s for s in spans if s.name == "omniflow.call"]
    assert _attrs(act)["omniflow.replica"] != "front"
    assert user.parent_span_id == act.span_id and act.parent_span_id == call.span_id
    assert user.trace_id == act.trace_id == call.trace_id
    assert act.start_time_unix_nano <= user.start_time_unix_nano


def test_only_providers_omniflow_built_name_their_collector() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from omniflow.runtime._tracing import otlp_endpoint

    ours = otlp_provider("http://127.0.0.1:9/")  # nothing listens there
    try:
        assert otlp_endpoint(ours) == "http://127.0.0.1:9/v1/traces"
        assert otlp_endpoint(TracerProvider()) is None  # its workers cannot rebuild it
        assert otlp_endpoint(object()) is None  # (not even weakly referenceable)
    finally:
        ours.shutdown()
