"""Serving graphs over HTTP: an ASGI app (Starlette) run by uvicorn, and its JSON value codec.

>>> from omniflow.serve import create_app, serve
>>> app = create_app("graphs/chat.py", max_inflight=64)     # doctest: +SKIP
>>> serve(app, host="127.0.0.1", port=8000)                 # doctest: +SKIP

    _codec    JSON values: {"$bytes": ...}, {"$tensor": ...}, both directions
    _state    admission (max in-flight, draining) and lifecycle of one app
    _stream   ASGI responses that run a call (NDJSON, JSON) and cancel it on disconnect
    _openai   /v1/chat/completions and /v1/models for graphs that opt in
    _openai_common  OpenAI errors, admission, the JSON body, a failed call's answer
    _usage    a chat answer's usage and finish reason
    _chat_request  an OpenAI chat request checked as OpenAI checks it (pure; 400/404 reasons)
    _metrics  /metrics through prometheus_client
    _limits   the server's limits, their defaults, the Host/Origin rules
    _guard    ASGI middleware: Host, Origin, API key, body size and time, status counts
    _conn     uvicorn's h11 protocol with idle/header timeouts and the connection cap
    _logging  text or JSON log lines; node errors of served calls with their tracebacks
    _app      create_app: the routes, the lifespan
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
