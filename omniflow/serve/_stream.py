"""ASGI responses that run one graph call: NDJSON stream, one JSON object, and their base.

>>> return NdjsonCallResponse(state, call)      # in a route, after rt.call(...)  # doctest: +SKIP

Every call response watches the client while it runs: a task waits on ``receive()`` for
``http.disconnect`` and cancels the call when the client goes away, even while no frame is being
written (a producer blocked on a slow model would otherwise run to its end for nobody). Writes
after a disconnect are skipped; ``OSError`` from ``send`` (what ASGI 2.4 servers raise on a
closed connection) counts as a disconnect too. Whatever happens, the call is over and released
from admission when the response returns.

NDJSON stream (``"stream": true``), one line per frame as soon as the runtime delivers it; the
frames already queued for the call when one is written go out with it in the same chunk (one
``send`` for all of them, never waiting for more). The response start goes through every
middleware (they count and check it); body chunks take the short way out: the server's
synchronous chunk writer when it offers one (``_conn.WRITE_BODY``: straight to the socket
while its buffer has room), else the ``send`` below the middleware wrappers
(``_guard.BODY_SEND``), so a token costs one write, not five nested ``send`` calls::

    {"field":"token","value":"txt0:6","node":"llm.generate","seq":0}
    ...
    {"done":true,"status":"ok","errors":[],"warnings":[]}

One JSON object (``"stream": false``), every declared output present (``[]`` when the call
produced none of it)::

    {"outputs":{"token":["txt0:6",...],"picture":[[0.6]]},"status":"ok","errors":[],
     "warnings":[]}

``warnings`` is ``call.warnings`` (docs/contract.md §3: ``{"node", "field", "message"}`` for each
DEAD bucket that had received frames). Errors carry the node's message, never its traceback: the
server logs that, with the call id, graph and node (``_logging.log_call_end``), and logs a
client's disconnect as one line.

A frame value with no JSON form (see ``_codec``) is left out and reported as an error entry
(``exc_type: "ValueEncodingError"``, naming node, field and seq); the call goes on and ends
with status ``"error"``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, cast

from omniflow.runtime import Call, Frame
from omniflow.serve._codec import ValueEncodingError, dumps
from omniflow.serve._conn import WRITE_BODY
from omniflow.serve._guard import BODY_SEND
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
    "frame_lines",
    "queued",
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
    return frame_lines([(frame, value)])


#: ``(field, node) -> b'{"field":...,"value":'`` and ``b',"node":...'`` split around the value;
#: a graph has few (field, node) pairs, so the two ``dumps`` per frame become one dict lookup.
_HEADS: dict[tuple[str, str], tuple[bytes, bytes]] = {}
_HEADS_MAX = 4096  # bound: field and node names come from graphs, but never grow without end


def _head_pair(field: str, node: str) -> tuple[bytes, bytes]:
    key = (field, node)
    pair = _HEADS.get(key)
    if pair is None:
        pair = (b'{"field":' + dumps(field) + b',"value":', b',"node":' + dumps(node))
        if len(_HEADS) < _HEADS_MAX:
            _HEADS[key] = pair
    return pair


def frame_lines(frames: list[tuple[Frame, bytes]]) -> bytes:
    """The NDJSON lines of ``frames`` (each ``(frame, JSON value)``), in order, as one chunk."""
    parts: list[bytes] = []
    add = parts.append
    for frame, value in frames:
        head, node = _head_pair(frame.field, frame.node)
        add(head)
        add(value)
        add(node)
        add(b',"seq":%d}\n' % frame.seq)
    return b"".join(parts)


def queued(call: Call) -> int:
    """Frames already delivered to ``call`` and not yet read: these can be taken at once,
    without waiting."""
    return call.buffered


def done_line(call: Call, extra: list[dict[str, Any]]) -> bytes:
    """The last NDJSON line: ``{"done": true, "status", "errors", "warnings", "call_id"}``
    (the id ``GET /v1/calls/{id}/story`` and ``omniflow story`` take)."""
    status, errors = call_status(call, extra)
    line = {
        "done": True,
        "status": status,
        "errors": errors,
        "warnings": call.warnings,
        "call_id": call.call_id,
    }
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
        #: The ``send`` for body chunks once the start went out (below the middleware).
        self.send_body: Send | None = None
        #: The server's synchronous chunk writer (``_conn.WRITE_BODY``), or None.
        self.write_body: Callable[[bytes], bool] | None = None
        self._complete = False
        #: Called once the response ended (the server span ends there), or None.
        self.on_end: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        self.send_body = scope.get(BODY_SEND, send)
        self.write_body = (scope.get("extensions") or {}).get(WRITE_BODY)
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
            if self.on_end is not None:
                self.on_end()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def respond(self, send: Send) -> None:
        raise NotImplementedError

    async def send_chunk(self, chunk: bytes) -> None:
        """One body chunk, more to follow (after the response start went through ``send``):
        see the module docstring for the way it takes."""
        write = self.write_body
        if write is None or not write(chunk):
            send = self.send_body
            assert send is not None  # set before respond runs
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def raw_frames(self) -> AsyncGenerator[Frame, None]:
        """The call's frames. Iterate under ``contextlib.aclosing`` so that leaving early
        cancels the call at once (not whenever the generator is collected)."""
        async with contextlib.aclosing(_frames_of(self.call)) as frames:
            async for frame in frames:
                yield frame

    async def frames(self) -> AsyncGenerator[tuple[Frame, bytes], None]:
        """The frames whose value has a JSON form, as ``(frame, encoded value)``; the others
        become entries of ``extra_errors``."""
        async with contextlib.aclosing(self.raw_frames()) as frames:
            async for frame in frames:
                encoded = self._encoded(frame)
                if encoded is not None:
                    yield frame, encoded

    def _encoded(self, frame: Frame) -> bytes | None:
        """``frame``'s value as JSON, or None after recording why it has no JSON form."""
        try:
            return dumps(frame.value)
        except ValueEncodingError as exc:
            self.state.http.encoding_errors += 1
            self.extra_errors.append(encoding_error(frame, exc))
            return None

    async def batches(self) -> AsyncGenerator[list[tuple[Frame, bytes]], None]:
        """Like ``frames``, in batches: each frame the runtime delivers together with the
        frames already queued behind it (up to ``BATCH_MAX``). It never waits for more, so no
        frame is held back; under load (the reader behind the producers) one write carries
        several frames instead of one each. Order is the call's order."""
        call = self.call
        async with contextlib.aclosing(_frames_of(call)) as frames:
            async for first in frames:
                batch = [first]
                while len(batch) < BATCH_MAX and queued(call):
                    batch.append(await anext(frames))  # there: returns without waiting
                encoded = [(frame, self._encoded(frame)) for frame in batch]
                out = [(frame, data) for frame, data in encoded if data is not None]
                if out:
                    yield out

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


#: The most frames one NDJSON write carries (the call's ``high_water`` bounds the queue too).
BATCH_MAX = 256

_NDJSON_HEADERS = [
    (b"content-type", b"application/x-ndjson"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-like proxies not to buffer the stream
]


class NdjsonCallResponse(CallResponse):
    """``application/x-ndjson``: one line per frame as produced, then the done line.

    While the client keeps up, a frame's line is written in the producer's turn
    (``Call.deliver``): the runtime hands the frames to ``_take``, which writes them with the
    server's chunk writer at once, and the response's task is not woken per frame. Whenever
    that is not possible (no chunk writer, a full socket buffer, the client gone, a value with
    no JSON form) ``_take`` refuses, the frames queue in the call, and the task writes them
    through ASGI as before; while it holds frames it has not finished writing, ``_take``
    refuses too, so no frame overtakes another.
    """

    def __init__(self, state: ServeState, call: Call) -> None:
        super().__init__(state, call)
        #: The task holds frames taken from the call and not yet written.
        self._holding = False
        #: Frames written, either way.
        self._n = 0
        #: Body bytes of the frame lines written, either way.
        self._nbytes = 0

    def _take(self, frames: list[Frame]) -> bool:
        """The call's sink: write ``frames`` now, or False (then they are queued)."""
        write = self.write_body
        if write is None or self._holding or self.disconnected:
            return False
        try:
            chunk = frame_lines([(frame, dumps(frame.value)) for frame in frames])
        except Exception:  # ValueEncodingError, or anything else: the task's way reports it
            return False
        if not write(chunk):
            return False
        self._n += len(frames)
        self._nbytes += len(chunk)
        return True

    async def respond(self, send: Send) -> None:
        http, graph, call = self.state.http, self.call.graph, self.call
        await send({"type": "http.response.start", "status": 200, "headers": _NDJSON_HEADERS})
        write, send_body = self.write_body, self.send_body
        assert send_body is not None  # set before respond runs
        if write is not None:
            call.deliver(self._take)
        try:
            async with contextlib.aclosing(self.batches()) as batches:
                async for batch in batches:
                    if self.disconnected:
                        continue
                    chunk = frame_lines(batch)
                    if not write or not write(chunk):  # (send_chunk, inlined)
                        self._holding = True
                        message = {"type": "http.response.body", "body": chunk, "more_body": True}
                        await send_body(message)
                        self._holding = False
                    self._n += len(batch)
                    self._nbytes += len(chunk)
        finally:
            call.deliver(None)
            http.frames_out[graph] = http.frames_out.get(graph, 0) + self._n
            http.bytes_out += self._nbytes
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
                b',"call_id":',
                dumps(self.call.call_id),
                b"}",
            )
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._finish(send, body)
