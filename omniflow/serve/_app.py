"""The ASGI app: docs/contract.md §4's routes on Starlette, plus the OpenAI-compatible chat routes.

>>> app = create_app("graphs/fig3.py", max_inflight=64)          # doctest: +SKIP
>>> uvicorn.run(app)                                             # or: omniflow serve

    GET  /v1/graphs                  [{"name", "inputs", "outputs"}]
    POST /v1/graphs/{name}/call      {"inputs": {...}, "session": "s1", "stream": true}
                                       stream true (default): application/x-ndjson, one line
                                       per frame, then {"done": true, "status", "errors"}
                                       stream false: {"outputs": {field: [values]}, "status",
                                       "errors"}
    GET  /healthz                    {"status": "ok"} (503 {"status": "draining"} at shutdown)
    GET  /readyz                     {"status": "ready"}, or 503 {"status": "unready",
                                       "roles": [roles without a live replica]}
    DELETE /v1/sessions/{id}         close a session (its GlobalParameters): 204
    GET  /metrics                    Prometheus text format 0.0.4
    GET  /ui, /ui/graphs, /ui/events the live page and what it draws (see _live)
    GET  /v1/calls/{id}/story        a recent call's transition story (see _live)
    GET  /v1/models                  OpenAI: each graph with the endpoints its shape serves
    POST /v1/chat/completions        OpenAI: chat completion, streaming or not, text and audio
    POST /v1/audio/speech            OpenAI: text to speech, streamed (_speech)
    POST /v1/audio/transcriptions    OpenAI: speech to text, multipart (_media_routes)
    POST /v1/images/generations      OpenAI: prompt to PNGs (_media_routes)
    WS   /v1/realtime?model=NAME     OpenAI Realtime events, one session per connection
                                       (_realtime)

Errors are JSON ``{"error": message}`` (OpenAI's shape on the OpenAI routes): 400 a body
that is not a JSON object of ``inputs`` / ``session`` / ``stream`` / ``timeout`` (or holds NaN or
an infinity), 401 no or wrong API key, 403 a Host or Origin not served (``_guard``), 404 an
unknown graph or route, 408 a body slower than ``body_timeout``, 413 a body over
``max_body_bytes``, 422 a missing or unknown input, 429 more than ``max_inflight`` calls (with
``Retry-After``; admission happens before the body is read), 503 shutting down. Values in
``inputs`` and in frames use the JSON encoding of ``_codec`` (``{"$bytes": ...}``,
``{"$tensor": ...}``) and ``_media_json`` (``{"$audio": ...}``, ``{"$image": ...}``; a malformed
one is a 400 naming its input path).

The app's lifespan starts the Runtime (role setup) and, at shutdown, drains: no new calls
(503), in-flight calls get ``drain_timeout`` seconds, the rest are cancelled, then the Runtime
closes (role teardown). ``omniflow serve`` runs the drain on SIGTERM before uvicorn stops
listening, so that clients see 503s rather than refused connections (see ``_server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omniflow._exceptions import InputError, MediaError, OmniflowError
from omniflow._loader import load_graphs
from omniflow.dsl import Graph
from omniflow.runtime import Runtime
from omniflow.serve import _live, _media_routes, _openai, _realtime, _speech
from omniflow.serve._codec import ValueDecodingError, loads
from omniflow.serve._guard import Guard
from omniflow.serve._limits import LOOPBACK_HOSTS, Limits, bad_session
from omniflow.serve._media_json import decode_tree
from omniflow.serve._metrics import CONTENT_TYPE, render
from omniflow.serve._state import ServeState
from omniflow.serve._stream import CallResponse, JsonCallResponse, NdjsonCallResponse

__all__ = ["DEFAULT_DRAIN_TIMEOUT", "GraphSource", "create_app"]

#: Seconds in-flight calls get to finish at shutdown before they are cancelled.
DEFAULT_DRAIN_TIMEOUT = 30.0

#: What ``create_app`` serves: a Runtime, Graphs, or graph files / module names.
GraphSource = Runtime | Graph | str | os.PathLike[str]

#: Keys a call body may hold.
_CALL_KEYS = ("inputs", "session", "stream", "timeout")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error shape of docs/contract.md §4: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _state(request: Request) -> ServeState:
    state: ServeState = request.app.state.omniflow
    return state


# -- routes --------------------------------------------------------------------------------


async def list_graphs(request: Request) -> Response:
    plans = _state(request).runtime.plans
    return JSONResponse(
        [
            {"name": n, "inputs": list(p.inputs), "outputs": list(p.outputs)}
            for n, p in plans.items()
        ]
    )


async def call_graph(request: Request) -> Response | CallResponse:
    state = _state(request)
    name = request.path_params["name"]
    if name not in state.runtime.plans:
        plans = sorted(state.runtime.plans)
        return error(404, f"unknown graph '{name}'; this server serves {plans}")
    # Admission before the body is read: a refused client costs no body bytes.
    refused = state.admit()
    if refused is not None:
        status, _reason, message = refused
        return error(status, message, headers={"retry-after": "1"})
    response: Response | CallResponse | None = None
    try:
        if state.runtime.tracing is None:
            response = await _start_call(request, state, name)
        else:  # a server span around it (docs/contract.md §4)
            response = await _live.traced_call(
                request, name, lambda: _start_call(request, state, name)
            )
    finally:
        if not isinstance(response, CallResponse):
            state.release()
    return response


async def _start_call(request: Request, state: ServeState, name: str) -> Response | CallResponse:
    rt = state.runtime
    plan = rt.plans[name]
    example = '{"inputs": {' + ", ".join(f'"{i}": ...' for i in plan.inputs) + "}}"
    try:
        body = loads(await request.body())
    except ValueDecodingError as exc:
        return error(400, f"request body: {exc}; send {example}")
    if not isinstance(body, dict):
        return error(400, f"request body must be a JSON object like {example}")
    unknown = sorted(set(body) - set(_CALL_KEYS))
    if unknown:
        return error(400, f"unknown key(s) {unknown} in the request body; it takes {_CALL_KEYS}")
    inputs = body.get("inputs")
    if not isinstance(inputs, dict):
        return error(400, f"'inputs' must be an object of Placeholder name -> value: {example}")
    try:
        inputs = decode_tree(inputs)
    except MediaError as exc:  # names the input path: inputs.clip.$audio.wav_b64
        return error(400, str(exc))
    session = body.get("session")
    problem = bad_session(session)
    if problem is not None:
        return error(400, problem)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        return error(400, f"'stream' must be true or false, got {stream!r}")
    timeout = body.get("timeout")
    options: dict[str, Any] = {}
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            return error(400, f"'timeout' must be a number of seconds > 0, got {timeout!r}")
        assert math.isfinite(timeout)  # loads rejects NaN and infinities
        options["timeout"] = float(timeout)
    try:
        call = rt.call(name, inputs, session=session, **options)
    except InputError as exc:
        return error(422, str(exc))
    state.enter(call)
    if stream:
        return NdjsonCallResponse(state, call)
    return JsonCallResponse(state, call, plan.outputs)


async def close_session(request: Request) -> Response:
    """``DELETE /v1/sessions/{id}``: wait for the session's queued calls, free what it holds."""
    await _state(request).runtime.close_session(request.path_params["session"])
    return Response(status_code=204)


async def healthz(request: Request) -> Response:
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": state.status.value}, status_code=503)
    return JSONResponse({"status": "ok"})


def unready_roles(rt: Runtime) -> list[str]:
    """Roles with no live replica (none for roles that run in this process)."""
    return rt.readiness()


async def readyz(request: Request) -> Response:
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": state.status.value, "roles": []}, status_code=503)
    roles = unready_roles(state.runtime)
    if roles:
        return JSONResponse({"status": "unready", "roles": roles}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    state = _state(request)
    text = render(state.runtime, state.http, inflight=len(state.calls), draining=state.draining)
    return Response(text, media_type=CONTENT_TYPE)


async def _not_found(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return error(405, f"{request.method} is not allowed on {request.url.path}")
    routes = (
        "GET /v1/graphs, POST /v1/graphs/{name}/call, DELETE /v1/sessions/{id}, GET /healthz, "
        "GET /readyz, GET /metrics, GET /ui, GET /v1/calls/{id}/story"
    )
    return error(404, f"no route {request.method} {request.url.path}; this server has {routes}")


# -- the app -------------------------------------------------------------------------------


def _runtime(
    source: GraphSource | Sequence[GraphSource],
    placement: Any,
    registry: str | None,
    session_ttl: float | None,
    tracer_provider: Any = None,
) -> tuple[Runtime, bool]:
    if isinstance(source, Runtime):
        if (
            placement != "inproc"
            or registry is not None
            or session_ttl is not None
            or tracer_provider is not None
        ):
            raise OmniflowError(
                "placement/registry/session_ttl/tracing configure the Runtime that create_app "
                "builds; pass them to the Runtime you give it instead"
            )
        return source, False
    items = [source] if isinstance(source, Graph | str | os.PathLike) else list(source)
    if not items:
        raise OmniflowError("create_app needs a Runtime, a Graph, or at least one graph file")
    graphs: list[Graph] = []
    for item in items:
        if isinstance(item, Runtime):
            raise OmniflowError("create_app takes one Runtime, or graphs / graph files, not both")
        if isinstance(item, Graph):
            graphs.append(item)
        else:
            graphs.extend(load_graphs(item if isinstance(item, str) else Path(item)))
    options: dict[str, Any] = {}
    if session_ttl is not None:
        options["session_ttl"] = session_ttl
    if tracer_provider is not None:
        options["tracer_provider"] = tracer_provider
    rt = Runtime(*graphs, placement=placement, registry=registry, metrics=True, **options)
    return rt, True


def create_app(
    runtime_or_graph_paths: GraphSource | Sequence[GraphSource],
    *,
    max_inflight: int | None = None,
    api_key: str | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    placement: Any = "inproc",
    registry: str | None = None,
    session_ttl: float | None = None,
    limits: Limits | None = None,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    otlp_endpoint: str | None = None,
) -> Starlette:
    """The ASGI app serving a Runtime, or every Graph of the given graphs / graph files.

    >>> app = create_app(["graphs/fig3.py", "graphs/chat.py"], api_key="s3cret")  # doctest: +SKIP

    Given graphs or files, it builds ``Runtime(*graphs, placement=..., registry=...,
    metrics=True)`` now (so declaration and placement errors raise here) and owns it: the
    app's lifespan starts and closes it. A Runtime given already started stays the caller's to
    close; one given unstarted is started and closed by the app. ``app.state.omniflow`` is the
    ServeState (admission, counters, ``drain``). Under httpx's ASGITransport, which sends no
    lifespan events, wrap the client in ``async with app.router.lifespan_context(app):``.
    ``api_key`` is not read from the environment here (``omniflow serve`` reads
    ``OMNIFLOW_API_KEY``). ``session_ttl`` goes to ``Runtime(session_ttl=)`` (None: the
    Runtime's default). ``limits`` bound request bodies here and connections under ``serve``
    (``_limits``); ``allowed_hosts`` are the ``Host`` names answered (default: loopback names;
    ``"*"``: any). ``otlp_endpoint``: export traces there over OTLP/HTTP (the app builds the
    tracer provider, and flushes it at shutdown; docs/contract.md §4).
    """
    provider = None
    if otlp_endpoint:
        from omniflow.runtime._tracing import otlp_provider

        provider = otlp_provider(otlp_endpoint)
    rt, owns = _runtime(runtime_or_graph_paths, placement, registry, session_ttl, provider)
    state = ServeState(
        rt,
        owns_runtime=owns,
        max_inflight=max_inflight,
        api_key=api_key or None,
        drain_timeout=drain_timeout,
        limits=limits,
        allowed_hosts=allowed_hosts,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            try:
                await state.close()
            finally:
                if provider is not None:  # (what is batched leaves, off the event loop)
                    await asyncio.to_thread(provider.shutdown)

    app = Starlette(
        routes=[
            Route("/v1/graphs", list_graphs, methods=["GET"]),
            Route("/v1/graphs/{name}/call", call_graph, methods=["POST"]),
            Route("/v1/sessions/{session:path}", close_session, methods=["DELETE"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *_live.routes,
            *_openai.routes,
            *_speech.routes,
            *_media_routes.routes,
            *_realtime.routes,
        ],
        middleware=[Middleware(Guard, state=state)],
        exception_handlers={404: _not_found, 405: _not_found},
        lifespan=lifespan,
    )
    app.state.omniflow = state
    return app
