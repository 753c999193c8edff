"""ASGI responses that run one graph call: NDJSON stream, one JSON object, and their base.

>>> return NdjsonCallResponse(state, call)      # in a route, after rt.call(...)  # doctest: +SKIP

Every call response watches the client while it runs: a task waits on ``receive()`` for
``http.disconnect`` and cancels the call when the client goes away, even while no frame is being
written (a producer blocked on a slow model would otherwise run to its end for nobody). Writes
after a disconnect are skipped; ``OSError`` from ``send`` (what ASGI 2.4 servers raise on a
closed connection) counts as a disconnect too. Whatever happens, the call is over and released
from admission when the response returns.

NDJSON stream (``"stream": true``), one line per frame as soon as the runtime delivers it::

    {"field":"token","value":"txt0:6","node":"llm.generate","seq":0}
    ...
    {"done":true,"status":"ok","errors":[],"warnings":[]}

One JSON object (``"stream": false``), every declared output present (``[]`` when the call
produced none of it)::

    {"outputs":{"token":["txt0:6",...],"picture":[[0.6]]},"status":"ok","errors":[],
     "warnings":[]}

``warnings`` is ``call.warnings`` (CONTRACT §3: ``{"node", "field", "message"}`` for each DEAD
bucket that had received frames). Errors carry the node's message, never its traceback: the
server logs that, with the call id, graph and node (``_logging.log_call_end``), and logs a
client's disconnect as one line.

A frame value with no JSON form (see ``_codec``) is left out and reported as an error entry
(``exc_type: "ValueEncodingError"``, naming node, field and seq); the call goes on and ends
with status ``"error"``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

from omniflow.runtime import Call, Frame
from omniflow.serve._codec import ValueEncodingError, dumps
from omniflow.serve._logging import log_call_end

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from omniflow.serve._state import ServeState

__all__ = [
    "CallResponse",
    "JsonCallResponse",
    "NdjsonCallResponse",
    "call_status",
    "done_line",
    "encoding_error",
    "frame_line",
]


def encoding_error(frame: Frame, exc: ValueEncodingError) -> dict[str, Any]:
    """The error-list entry for a frame whose value cannot be written as JSON."""
    return {
        "node": frame.node,
        "kind": "error",
        "message": f"output '{frame.field}' (seq {frame.seq}) was not sent: {exc}",
        "field": frame.field,
        "exc_type": "ValueEncodingError",
    }


def call_status(call: Call, extra: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The status and JSON error list of a finished call, with the server's own errors added."""
    errors = [e.to_dict() for e in call.errors] + extra
    status = call.status
    if extra and status == "ok":
        status = "error"
    return status, errors


def _frames_of(call: Call) -> AsyncGenerator[Frame, None]:
    # Call.__aiter__ is an async generator; its annotation only says AsyncIterator.
    return cast("AsyncGenerator[Frame, None]", aiter(call))


def frame_line(frame: Frame, value: bytes) -> bytes:
    """One NDJSON line ``{"field","value","node","seq"}``; ``value`` is already JSON."""
    return b"".join(
        (
            b'{"field":',
            dumps(frame.field),
            b',"value":',
            value,
            b',"node":',
            dumps(frame.node),
            b',"seq":',
            str(frame.seq).encode(),
            b"}\n",
        )
    )


def done_line(call: Call, extra: list[dict[str, Any]]) -> bytes:
    """The last NDJSON line: ``{"done": true, "status", "errors", "warnings"}``."""
    status, errors = call_status(call, extra)
    line = {"done": True, "status": status, "errors": errors, "warnings": call.warnings}
    return dumps(line) + b"\n"


class CallResponse:
    """Base: run ``respond`` while watching for the client's disconnect; release the call."""

    def __init__(self, state: ServeState, call: Call) -> None:
        #: The server's state (admission, counters).
        self.state = state
        #: The running call this response writes out.
        self.call = call
        #: The client went away; nothing more is written.
        self.disconnected = False
        #: Frame values that had no JSON form, as error-list entries.
        self.extra_errors: list[dict[str, Any]] = []
        self._complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        try:
            await self.respond(send)
        except OSError:  # ASGI spec 2.4 servers raise it for writes to a closed connection
            self._gone()
        finally:
            watcher.cancel()
            if not call.done:
                await call.cancel()
            self.state.leave(call)
            log_call_end(call, disconnected=self.disconnected)
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def respond(self, send: Send) -> None:
        raise NotImplementedError

    async def raw_frames(self) -> AsyncGenerator[Frame, None]:
        """The call's frames. Iterate under ``contextlib.aclosing`` so that leaving early
        cancels the call at once (not whenever the generator is collected)."""
        async with contextlib.aclosing(_frames_of(self.call)) as frames:
            async for frame in frames:
                yield frame

    async def frames(self) -> AsyncGenerator[tuple[Frame, bytes], None]:
        """The frames whose value has a JSON form, as ``(frame, encoded value)``; the others
        become entries of ``extra_errors``."""
        http = self.state.http
        async with contextlib.aclosing(self.raw_frames()) as frames:
            async for frame in frames:
                try:
                    encoded = dumps(frame.value)
                except ValueEncodingError as exc:
                    http.encoding_errors += 1
                    self.extra_errors.append(encoding_error(frame, exc))
                    continue
                yield frame, encoded

    def _gone(self) -> None:
        if not self.disconnected and not self._complete:
            self.disconnected = True
            self.state.http.disconnects += 1

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server that cannot tell us; the writes will
            return
        if self._complete:
            return
        self._gone()
        await self.call.cancel()

    async def _finish(self, send: Send, body: bytes) -> None:
        self._complete = True
        if not self.disconnected:
            self.state.http.bytes_out += len(body)
            await send({"type": "http.response.body", "body": body, "more_body": False})


_NDJSON_HEADERS = [
    (b"content-type", b"application/x-ndjson"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-like proxies not to buffer the stream
]


class NdjsonCallResponse(CallResponse):
    """``application/x-ndjson``: one line per frame as produced, then the done line."""

    async def respond(self, send: Send) -> None:
        http, graph = self.state.http, self.call.graph
        await send({"type": "http.response.start", "status": 200, "headers": _NDJSON_HEADERS})
        n = nbytes = 0
        try:
            async with contextlib.aclosing(self.frames()) as frames:
                async for frame, value in frames:
                    if self.disconnected:
                        continue
                    line = frame_line(frame, value)
                    await send({"type": "http.response.body", "body": line, "more_body": True})
                    n += 1
                    nbytes += len(line)
        finally:
            http.frames_out[graph] = http.frames_out.get(graph, 0) + n
            http.bytes_out += nbytes
        await self._finish(send, done_line(self.call, self.extra_errors))


class JsonCallResponse(CallResponse):
    """``application/json``: ``{"outputs": {field: [values]}, "status", "errors"}``."""

    def __init__(self, state: ServeState, call: Call, outputs: tuple[str, ...]) -> None:
        super().__init__(state, call)
        self.outputs = outputs

    async def respond(self, send: Send) -> None:
        by_field: dict[str, list[bytes]] = {f: [] for f in self.outputs}
        n = 0
        async with contextlib.aclosing(self.frames()) as frames:
            async for frame, value in frames:
                by_field.setdefault(frame.field, []).append(value)
                n += 1
        if self.disconnected:
            return
        graph, http = self.call.graph, self.state.http
        http.frames_out[graph] = http.frames_out.get(graph, 0) + n
        status, errors = call_status(self.call, self.extra_errors)
        body = b"".join(
            (
                b'{"outputs":{',
                b",".join(dumps(f) + b":[" + b",".join(vs) + b"]" for f, vs in by_field.items()),
                b'},"status":',
                dumps(status),
                b',"errors":',
                dumps(errors),
                b',"warnings":',
                dumps(self.call.warnings),
                b"}",
            )
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._finish(send, body)
