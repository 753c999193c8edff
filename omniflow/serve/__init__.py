"""Serving graphs over HTTP: an ASGI app (Starlette) run by uvicorn, and its JSON value codec.

>>> from omniflow.serve import create_app, serve
>>> app = create_app("graphs/chat.py", max_inflight=64)     # doctest: +SKIP
>>> serve(app, host="127.0.0.1", port=8000)                 # doctest: +SKIP

    _codec    JSON values: {"$bytes": ...}, {"$tensor": ...}, both directions
    _state    admission (max in-flight, draining) and lifecycle of one app
    _stream   ASGI responses that run a call (NDJSON, JSON) and cancel it on disconnect
    _openai   /v1/chat/completions and /v1/models for graphs that opt in
    _metrics  /metrics in Prometheus text format
    _app      create_app: the routes, the API-key guard, the lifespan
    _server   uvicorn with drain-first SIGTERM handling
"""

from omniflow.serve._app import DEFAULT_DRAIN_TIMEOUT, create_app
from omniflow.serve._codec import ValueDecodingError, ValueEncodingError, dumps, loads
from omniflow.serve._server import serve
from omniflow.serve._state import ServeState, ServeStatus

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT",
    "ServeState",
    "ServeStatus",
    "ValueDecodingError",
    "ValueEncodingError",
    "create_app",
    "dumps",
    "loads",
    "serve",
]
