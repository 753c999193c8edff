"""Watching a server: the live page, its event stream, a call's story, the request's span.

    GET /ui                      the live page (one HTML file shipped in ``serve/_ui/``)
    GET /ui/graphs               each graph's plan laid out for drawing: nodes (plan order,
                                   x = layer, y = row) and edges (src, field, dst)
    GET /ui/events               text/event-stream: one ``data: {json}`` snapshot every
                                   ``interval`` seconds (``snapshot``)
    GET /v1/calls/{id}/story     the call's transition story while the runtime's bounded log
                                   still holds it: {"call_id", "story": [{"event", ...}]}

All of them sit behind the app's ``Guard`` like every other route (API key, Host and Origin
checks). ``traced_call`` wraps ``POST /v1/graphs/{name}/call`` in a server span while the
runtime traces (docs/contract.md §4), continuing the request's W3C ``traceparent``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from omniflow.plan import StaticPlan
    from omniflow.runtime import Runtime
    from omniflow.serve._state import ServeState

__all__ = ["layout", "routes", "snapshot", "traced_call"]

#: Seconds between two snapshots of ``GET /ui/events``.
INTERVAL = 0.5


def _state(request: Request) -> ServeState:
    state: ServeState = request.app.state.omniflow
    return state


# -- the plan, laid out ---------------------------------------------------------------------


def layout(plan: StaticPlan) -> dict[str, Any]:
    """``plan`` as boxes and arrows: ``<input>``, the nodes and ``<output>`` with a layer
    (``x``: the longest path from the input along edges that go forward in plan order, so
    a cycle's back edge does not push its head right) and a row within the layer (``y``)."""
    order = {"<input>": -1, **{n: i for i, n in enumerate(plan.nodes)}}
    order["<output>"] = len(plan.nodes)
    edges = sorted({(src, f, dst) for src, f, dst, _g in plan.edges})
    edges += [(src, f, "<output>") for f, srcs in sorted(plan.output_producers.items())
              for src in srcs]  # fmt: skip
    layer = dict.fromkeys(order, 0)
    for n in sorted(order, key=order.__getitem__):  # plan order: forward edges settle in one pass
        for src, _f, dst in edges:
            if src == n and order[dst] > order[src]:
                layer[dst] = max(layer[dst], layer[src] + 1)
    rows: dict[int, int] = {}
    nodes = []
    for n in sorted(order, key=order.__getitem__):
        x = layer[n]
        y = rows.get(x, 0)
        rows[x] = y + 1
        spec = plan.specs.get(n)
        nodes.append({"name": n, "x": x, "y": y, "role": spec.role if spec else ""})
    return {
        "name": plan.graph,
        "nodes": nodes,
        "edges": [{"src": s, "field": f, "dst": d} for s, f, d in edges],
    }


# -- live counters ---------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def snapshot(rt: Runtime, before: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per graph: calls in flight; per node: activations in flight, completed (total and per
    second since ``before``, the previous snapshot), errors, p50/p99 run time (ms) over the
    node's last ``RECENT`` activations. Empty counters while ``Runtime(metrics=False)``."""
    now = time.monotonic()
    m = rt.metrics
    calls = rt.calls_in_flight()
    prev_t = before["t"] if before else None
    graphs: dict[str, Any] = {}
    for g, plan in rt.plans.items():
        nodes: dict[str, Any] = {}
        for n in plan.nodes:
            nm = m.nodes.get((g, n)) if m is not None else None
            if nm is None:
                nodes[n] = {"inflight": 0, "completed": 0, "rate": 0.0, "errors": 0,
                            "p50_ms": None, "p99_ms": None}  # fmt: skip
                continue
            recent = list(nm.recent)
            rate = 0.0
            if before is not None and prev_t is not None and now > prev_t:
                done_before = before["graphs"][g]["nodes"][n]["completed"]
                rate = (nm.activations - done_before) / (now - prev_t)
            p50, p99 = _percentile(recent, 0.5), _percentile(recent, 0.99)
            nodes[n] = {
                "inflight": max(0, nm.started - nm.activations),
                "completed": nm.activations,
                "rate": round(rate, 2),
                "errors": nm.errors,
                "p50_ms": None if p50 is None else round(p50 * 1e3, 3),
                "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
            }
        graphs[g] = {"calls_inflight": calls.get(g, 0), "nodes": nodes}
    return {"t": now, "graphs": graphs}


# -- routes ---------------------------------------------------------------------------------


async def ui_page(request: Request) -> Response:
    page = resources.files("omniflow.serve").joinpath("_ui/index.html").read_bytes()
    return Response(
        page,
        media_type="text/html; charset=utf-8",
        # The page loads nothing from elsewhere: say so to the browser too.
        headers={
            "content-security-policy": "default-src 'self'; script-src 'unsafe-inline'; "
            "style-src 'unsafe-inline'; connect-src 'self'",
            "cache-control": "no-store",
        },
    )


async def ui_graphs(request: Request) -> Response:
    return JSONResponse([layout(p) for p in _state(request).runtime.plans.values()])


async def ui_events(request: Request) -> Response:
    state = _state(request)
    interval = INTERVAL

    async def events() -> AsyncIterator[bytes]:
        before: dict[str, Any] | None = None
        while not state.draining:
            snap = snapshot(state.runtime, before)
            before = snap
            yield b"data: " + json.dumps(snap).encode() + b"\n\n"
            await asyncio.sleep(interval)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"cache-control": "no-store", "x-accel-buffering": "no"},
    )


async def call_story(request: Request) -> Response:
    """``GET /v1/calls/{id}/story``: the call's story, oldest first (404 once the bounded
    log no longer reaches back to it, or for an id it never saw)."""
    call_id = request.path_params["call_id"]
    rt = _state(request).runtime
    story = rt.story(call_id)
    if not story:
        return JSONResponse(
            {
                "error": f"no story for call {call_id!r}: the id is unknown, or the call is "
                "older than the runtime's story log reaches (Runtime(story_size=...))"
            },
            status_code=404,
        )
    lines = [{"event": ev, **{k: _plain(v) for k, v in d.items()}} for ev, d in story]
    return JSONResponse({"call_id": call_id, "story": lines})


def _plain(value: Any) -> Any:
    """A story value as JSON: numbers, strings and lists of them as they are, else repr."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


routes = [
    Route("/ui", ui_page, methods=["GET"]),
    Route("/ui/graphs", ui_graphs, methods=["GET"]),
    Route("/ui/events", ui_events, methods=["GET"]),
    Route("/v1/calls/{call_id}/story", call_story, methods=["GET"]),
]


# -- the request's span ---------------------------------------------------------------------


async def traced_call(request: Request, name: str, inner: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``inner`` (the call route) inside a server span for the request, continuing its
    ``traceparent``: the call the route starts is its child (``rt.call`` reads the current
    span), and the span ends when the response has been written out."""
    from opentelemetry import context

    from omniflow.runtime._tracing import parse_traceparent
    from omniflow.serve._stream import CallResponse

    tracing = _state(request).runtime.tracing
    assert tracing is not None
    header = request.headers.get("traceparent")
    parent = parse_traceparent(header) if header else None
    span = tracing.tracer.start_span(
        f"POST /v1/graphs/{name}/call",
        context=parent,
        kind=tracing.SERVER,
        attributes={
            "http.request.method": "POST",
            "url.path": request.url.path,
            "omniflow.graph": name,
        },
    )
    token = context.attach(tracing.set_span_in_context(span))
    try:
        response = await inner()
    except BaseException:
        span.end()
        raise
    finally:
        context.detach(token)
    if isinstance(response, CallResponse):
        call = response.call

        def end() -> None:
            span.set_attribute("omniflow.call_id", call.call_id)
            span.set_attribute("omniflow.status", call.status)
            span.end()

        response.on_end = end
    else:
        span.set_attribute("http.response.status_code", getattr(response, "status_code", 0))
        span.end()
    return response
