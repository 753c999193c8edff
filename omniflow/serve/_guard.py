"""The app's outer ASGI middleware: Host, Origin, API key, body size and time, status counts.

>>> Starlette(routes, middleware=[Middleware(Guard, state=state)])     # doctest: +SKIP

Checks, in this order, before any route runs (and before any body byte is read):

1. ``Host`` not in ``state.allowed_hosts`` -> 403; an ``Origin`` whose host is not the request's
   own ``Host`` -> 403 (both skipped for ``/healthz`` and ``/readyz``, see ``_limits``);
2. no or wrong API key -> 401 (every route but ``/healthz`` and ``/readyz``);
3. ``Content-Length`` above ``max_body_bytes`` -> 413, unparsable -> 400.

A WebSocket upgrade (``/v1/realtime``) gets checks 1 and 2 (an ``Origin`` check matters most
there: browsers send WebSocket upgrades cross-site without asking); refused, it is answered
with the same HTTP error instead of the handshake (ASGI's WebSocket denial response; a server
without it gets close code 1008 before the handshake, which clients see as a 403).

Then the route runs with a ``receive`` that counts body bytes and watches the clock: a chunked
body passing ``max_body_bytes`` ends the request with 413 at once, a body not complete
``body_timeout`` seconds after the request arrived ends it with 408. Both answers carry
``Connection: close`` (the rest of the body is never read).

The guard (like Starlette's own wrappers inside it) only needs to see a response's
``http.response.start``; it puts the ``send`` it was given in the scope (``BODY_SEND``) so
that a streaming response can send its body chunks past the wrappers, after its start went
through them all (``_stream.CallResponse``): one wrapped call per response, not per token.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from omniflow.serve._limits import host_of, origin_host

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from omniflow.serve._state import ServeState

__all__ = ["BODY_SEND", "OPEN_PATHS", "Guard"]

#: Scope key of the ``send`` below the app's middleware wrappers (for body chunks only).
BODY_SEND = "omniflow.body_send"

#: Paths answered without an API key, whatever the Host or Origin.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_OPENAI_PREFIXES = ("/v1/chat/", "/v1/models", "/v1/audio/", "/v1/images/", "/v1/realtime")
_CLOSE = {"connection": "close"}


class _Refused(Exception):
    """The request breaks a limit while its body is read; answered by the Guard."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Guard:
    """Pure ASGI middleware: the checks above, and responses counted by status."""

    def __init__(self, app: ASGIApp, state: ServeState) -> None:
        self.app = app
        self.state = state
        key = state.api_key
        self._key = key.encode() if key else None
        hosts = state.allowed_hosts
        self._any_host = "*" in hosts
        self._hosts = frozenset(h.lower().strip("[]") for h in hosts)

    # ---------------------------------------------------------------- checks (pure)

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None or scope["path"] in OPEN_PATHS:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self._key):
                return True
        return False

    def _forbidden(self, scope: Scope) -> str | None:
        """Why the Host / Origin of the request is refused, or None."""
        if scope["path"] in OPEN_PATHS:
            return None
        host = origin = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = host_of(value)
            elif name == b"origin":
                origin = value
        if host is None:
            if self._any_host and origin is None:
                return None
            return "the request has no Host header; send one naming this server"
        if not self._any_host and host not in self._hosts:
            return (
                f"Host '{host[:100]}' is not served here; start the server with "
                f"--allowed-host {host[:100]} if clients reach it by that name"
            )
        if origin is not None and origin_host(origin) != host:
            return (
                f"cross-origin request from {origin[:100].decode('latin-1')!r} refused; "
                "call the API from the server's own origin or from outside a browser"
            )
        return None

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                return int(value) if value.isdigit() else -1
        return None

    # ---------------------------------------------------------------- ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
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

        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, counting_send)
            return
        scope[BODY_SEND] = send
        try:
            await self.app(scope, self._bounded(receive), counting_send)
        except _Refused as exc:
            if started:
                raise
            self._count("body_too_large" if exc.status == 413 else "body_timeout")
            response = self._error(scope, exc.status, exc.message, _CLOSE)
            await response(scope, receive, counting_send)
        except Exception:
            if not started:
                counts[500] = counts.get(500, 0) + 1
            raise
        if not started:  # the client left before any response (nginx's 499)
            counts[499] = counts.get(499, 0) + 1

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._access_refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        counts = self.state.http.requests
        counts[refusal.status_code] = counts.get(refusal.status_code, 0) + 1
        if "websocket.http.response" in (scope.get("extensions") or {}):
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": refusal.status_code,
                    "headers": refusal.raw_headers,
                }
            )
            await send({"type": "websocket.http.response.body", "body": refusal.body})
        else:
            await send({"type": "websocket.close", "code": 1008})

    def _access_refusal(self, scope: Scope) -> JSONResponse | None:
        """The 403 / 401 for a request whose Host, Origin or API key is refused, or None."""
        why = self._forbidden(scope)
        if why is not None:
            return self._error(scope, 403, why)
        if not self._authorized(scope):
            msg = (
                "missing or wrong API key; send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"
            )
            return self._error(scope, 401, msg, {"www-authenticate": "Bearer"}, "invalid_api_key")
        return None

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        refused = self._access_refusal(scope)
        if refused is not None:
            return refused
        length = self._content_length(scope)
        limit = self.state.limits.max_body_bytes
        if length is not None and length < 0:
            return self._error(scope, 400, "Content-Length is not a number", _CLOSE)
        if length is not None and length > limit:
            self._count("body_too_large")
            return self._error(scope, 413, self._too_large(length), _CLOSE)
        return None

    def _count(self, reason: str) -> None:
        rejected = self.state.http.rejected
        rejected[reason] = rejected.get(reason, 0) + 1

    def _too_large(self, size: int) -> str:
        limit = self.state.limits.max_body_bytes
        return (
            f"request body of {size} bytes is over the server's limit of {limit} bytes "
            f"(--max-body-mb {limit / 2**20:g}); send less, or raise the limit"
        )

    def _bounded(self, receive: Receive) -> Receive:
        limits = self.state.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout
        seen = 0
        complete = False

        async def bounded_receive() -> Message:
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _Refused(
                    408,
                    f"the request body did not arrive within {limits.body_timeout:g} s "
                    "(--body-timeout)",
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limits.max_body_bytes:
                    raise _Refused(413, self._too_large(seen))
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        return bounded_receive

    @staticmethod
    def _error(
        scope: Scope,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> JSONResponse:
        body: Any = {"error": message}
        if scope["path"].startswith(_OPENAI_PREFIXES):
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None}}
            body["error"]["code"] = code
        return JSONResponse(body, status_code=status, headers=headers)
