"""The ASGI app: CONTRACT §4's routes on Starlette, plus the OpenAI-compatible chat routes.

>>> app = create_app("graphs/fig3.py", max_inflight=64)          # doctest: +SKIP
>>> uvicorn.run(app)                                             # or: omniflow serve

    GET  /v1/graphs                  [{"name", "inputs", "outputs"}]
    POST /v1/graphs/{name}/call      {"inputs": {...}, "session": "s1", "stream": true}
                                       stream true (default): application/x-ndjson, one line
                                       per frame, then {"done": true, "status", "errors"}
                                       stream false: {"outputs": {field: [values]}, "status",
                                       "errors"}
    GET  /healthz                    {"status": "ok"} (503 {"status": "draining"} at shutdown)
    GET  /metrics                    Prometheus text format 0.0.4
    GET  /v1/models                  OpenAI: the graphs that opted in to chat (see _openai)
    POST /v1/chat/completions        OpenAI: chat completion, streaming or not

Errors are JSON ``{"error": message}`` (OpenAI's shape on the two OpenAI routes): 400 a body
that is not a JSON object of ``inputs`` / ``session`` / ``stream``, 401 no or wrong API key,
404 an unknown graph or route, 422 a missing or unknown input, 429 more than ``max_inflight``
calls (with ``Retry-After``), 503 shutting down. Values in ``inputs`` and in frames use the
JSON encoding of ``_codec`` (``{"$bytes": ...}``, ``{"$tensor": ...}``).

The app's lifespan starts the Runtime (role setup) and, at shutdown, drains: no new calls
(503), in-flight calls get ``drain_timeout`` seconds, the rest are cancelled, then the Runtime
closes (role teardown). ``omniflow serve`` runs the drain on SIGTERM before uvicorn stops
listening, so that clients see 503s rather than refused connections (see ``_server``).
"""

from __future__ import annotations

import contextlib
import hmac
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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omniflow._exceptions import InputError, OmniflowError
from omniflow.dsl import Graph
from omniflow.plan import load_graphs
from omniflow.runtime import Runtime
from omniflow.serve import _openai
from omniflow.serve._codec import ValueDecodingError, loads
from omniflow.serve._metrics import CONTENT_TYPE, render
from omniflow.serve._state import ServeState
from omniflow.serve._stream import CallResponse, JsonCallResponse, NdjsonCallResponse

__all__ = ["DEFAULT_DRAIN_TIMEOUT", "GraphSource", "create_app"]

#: Seconds in-flight calls get to finish at shutdown before they are cancelled.
DEFAULT_DRAIN_TIMEOUT = 30.0

#: What ``create_app`` serves: a Runtime, Graphs, or graph files / module names.
GraphSource = Runtime | Graph | str | os.PathLike[str]

#: Keys a call body may hold.
_CALL_KEYS = ("inputs", "session", "stream")
#: Paths answered without an API key.
_OPEN_PATHS = frozenset({"/healthz"})
_OPENAI_PREFIXES = ("/v1/chat/", "/v1/models")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error shape of CONTRACT §4: ``{"error": message}``."""
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
    rt = state.runtime
    name = request.path_params["name"]
    plan = rt.plans.get(name)
    if plan is None:
        return error(404, f"unknown graph '{name}'; this server serves {sorted(rt.plans)}")
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
    session = body.get("session")
    if session is not None and not isinstance(session, str):
        return error(400, f"'session' must be a string or null, got {session!r}")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        return error(400, f"'stream' must be true or false, got {stream!r}")
    refused = state.admit()
    if refused is not None:
        status, _reason, message = refused
        return error(status, message, headers={"retry-after": "1"})
    try:
        call = rt.call(name, inputs, session=session)
    except InputError as exc:
        return error(422, str(exc))
    state.enter(call)
    if stream:
        return NdjsonCallResponse(state, call)
    return JsonCallResponse(state, call, plan.outputs)


async def healthz(request: Request) -> Response:
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": state.status.value}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = _state(request)
    text = render(state.runtime, state.http, inflight=len(state.calls), draining=state.draining)
    return Response(text, media_type=CONTENT_TYPE)


async def _not_found(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return error(405, f"{request.method} is not allowed on {request.url.path}")
    routes = "GET /v1/graphs, POST /v1/graphs/{name}/call, GET /healthz, GET /metrics"
    return error(404, f"no route {request.method} {request.url.path}; this server has {routes}")


# -- guard: API key and the requests-by-status counter -------------------------------------


class _Guard:
    """Pure ASGI middleware: checks the API key and counts responses by status."""

    def __init__(self, app: ASGIApp, state: ServeState) -> None:
        self.app = app
        self.state = state
        key = state.api_key
        self._key = key.encode() if key else None

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None or scope["path"] in _OPEN_PATHS:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self._key):
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counts = self.state.http.requests
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                code = message["status"]
                counts[code] = counts.get(code, 0) + 1
            await send(message)

        if not self._authorized(scope):
            msg = (
                "missing or wrong API key; send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"
            )
            body: Any = {"error": msg}
            if scope["path"].startswith(_OPENAI_PREFIXES):
                body = {"error": {"message": msg, "type": "invalid_request_error", "param": None}}
                body["error"]["code"] = "invalid_api_key"
            response = JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
            await response(scope, receive, counting_send)
            return
        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                counts[500] = counts.get(500, 0) + 1
            raise
        if not started:  # the client left before any response (nginx's 499)
            counts[499] = counts.get(499, 0) + 1


# -- the app -------------------------------------------------------------------------------


def _runtime(
    source: GraphSource | Sequence[GraphSource], placement: Any, registry: str | None
) -> tuple[Runtime, bool]:
    if isinstance(source, Runtime):
        if placement != "inproc" or registry is not None:
            raise OmniflowError(
                "placement/registry configure the Runtime that create_app builds; pass them to "
                "the Runtime you give it instead"
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
    return Runtime(*graphs, placement=placement, registry=registry, metrics=True), True


def create_app(
    runtime_or_graph_paths: GraphSource | Sequence[GraphSource],
    *,
    max_inflight: int | None = None,
    api_key: str | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    placement: Any = "inproc",
    registry: str | None = None,
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
    ``OMNIFLOW_API_KEY``).
    """
    rt, owns = _runtime(runtime_or_graph_paths, placement, registry)
    state = ServeState(
        rt,
        owns_runtime=owns,
        max_inflight=max_inflight,
        api_key=api_key or None,
        drain_timeout=drain_timeout,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    app = Starlette(
        routes=[
            Route("/v1/graphs", list_graphs, methods=["GET"]),
            Route("/v1/graphs/{name}/call", call_graph, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *_openai.routes,
        ],
        middleware=[Middleware(_Guard, state=state)],
        exception_handlers={404: _not_found, 405: _not_found},
        lifespan=lifespan,
    )
    app.state.omniflow = state
    return app
