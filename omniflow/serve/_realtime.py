"""``WS /v1/realtime?model=NAME``: OpenAI's Realtime event protocol over a chat graph.

>>> with client.realtime.connect(model="voice_chat") as rt:              # doctest: +SKIP
...     rt.input_audio_buffer.append(audio=base64_pcm16_24khz)
...     rt.input_audio_buffer.commit()
...     rt.response.create()
...     for event in rt: ...                       # deltas, then response.done

One connection is one session (its calls run in the Runtime session ``rt-<id>``, closed with
the connection), over a graph that serves chat (``_endpoints``). Client events:
``session.update``, ``input_audio_buffer.append`` / ``.commit`` / ``.clear``,
``conversation.item.create``, ``response.create``, ``response.cancel``. Server events:
``session.created``, ``session.updated``, ``input_audio_buffer.committed`` / ``.cleared``,
``conversation.item.created``, ``response.created``, ``response.output_text.delta`` /
``response.output_audio.delta`` / ``response.output_audio_transcript.delta`` and their
``.done``, ``response.done``, ``error`` (GA names, as the ``openai`` client reads them).

* The session (``RealtimeSession``): ``output_modalities`` (default ``["audio"]``: audio deltas
  and the text as transcript deltas; ``["text"]``: text deltas), ``instructions`` (a system
  message first), ``audio.input.format`` / ``audio.output.format`` (``audio/pcm``; input at any
  ``rate``, 24 kHz by default; output at 24 kHz), ``audio.output.voice``. Server VAD is not
  offered: ``turn_detection`` must be null (the client commits its turns).
* ``response.create`` runs one graph call with the conversation so far as ``messages``
  (committed audio as ``{"type": "input_audio", "input_audio": of.Audio}`` parts, as chat
  gives them), ``modalities`` ``["text", "audio"]`` or ``["text"]``, ``voice``,
  ``audio_format`` ``"pcm16"``; audio frames become ``response.output_audio.delta`` as they
  are produced (16-bit 24 kHz PCM, ``_pcm``'s resampler), each sent before the next frame is
  read (the socket's backpressure reaches the producers through the call's queue). The
  assistant's text joins the conversation when the response ends (cancelled ones too).
* ``response.cancel``, and a user turn committed while a response runs (barge-in), cancel the
  running call at once: no delta of it is sent after, its ``response.done`` has ``status
  "cancelled"`` (``status_details.reason`` ``client_cancelled`` / ``turn_detected``).
* Protections: the Guard's Host / Origin / API key checks run on the upgrade request (refused:
  an HTTP 403 / 401 instead of the handshake); a message over ``--max-body-mb`` closes that
  connection (1009) and no other; an open session counts against ``--max-connections`` as a
  running request; a session with no client event for ``--ws-idle-timeout`` seconds while no
  response runs is closed (1000); the input audio buffer is bounded by ``--max-body-mb``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from omniflow._exceptions import InputError
from omniflow._media import Audio
from omniflow.serve._codec import dumps
from omniflow.serve._endpoints import Endpoint, graph_inputs, served
from omniflow.serve._pcm import PCM16_RATE, PcmStream
from omniflow.serve._realtime_session import RealtimeError, RealtimeSession, new_id, public_item
from omniflow.serve._usage import Usage

if TYPE_CHECKING:
    from omniflow.runtime import Call
    from omniflow.serve._state import ServeState

__all__ = ["RealtimeError", "RealtimeSession", "routes"]

log = logging.getLogger("omniflow.serve")


# -- the connection: events in, events out, one response at a time ---------------------------


@dataclass(slots=True)
class _Running:
    """The response in progress."""

    id: str
    call: Call
    task: asyncio.Task[None] | None = None
    item_id: str = field(default_factory=lambda: new_id("item"))
    text: list[str] = field(default_factory=list)


class _Connection:
    def __init__(self, ws: WebSocket, state: ServeState, model: str) -> None:
        self.ws = ws
        self.state = state
        self.session = RealtimeSession(model)
        self.rt_session = f"rt-{self.session.id}"
        self.running: _Running | None = None
        self._send_lock = asyncio.Lock()
        self._ids = itertools.count()
        self.closed = False

    async def send(self, event: dict[str, Any]) -> None:
        event = {"event_id": f"event_{next(self._ids)}", **event}
        async with self._send_lock:
            if self.closed:
                return
            try:
                await self.ws.send_text(dumps(event).decode())
            except (WebSocketDisconnect, OSError, RuntimeError):
                self.closed = True

    async def error(self, exc: RealtimeError, event_id: str | None) -> None:
        err = {
            "type": "invalid_request_error",
            "code": exc.code,
            "message": exc.message,
            "param": exc.param,
            "event_id": event_id,
        }
        await self.send({"type": "error", "error": err})

    async def run(self) -> None:
        idle = self.state.limits.ws_idle_timeout
        await self.send({"type": "session.created", "session": self.session.config()})
        try:
            while not self.closed:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), idle)
                except TimeoutError:
                    if self.running is not None:
                        continue
                    await self.ws.close(1000, f"idle for {idle:g} s (--ws-idle-timeout)")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    text = (message.get("bytes") or b"").decode("utf-8", "replace")
                await self.handle(text)
        finally:
            self.closed = True
            await self.cancel_response(None)
            await self.state.runtime.close_session(self.rt_session)

    async def handle(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError as exc:
            await self.error(RealtimeError("invalid_json", f"not a JSON event ({exc})"), None)
            return
        if not isinstance(event, dict):
            await self.error(RealtimeError("invalid_json", "an event is a JSON object"), None)
            return
        event_id = event.get("event_id")
        try:
            await self.dispatch(event)
        except RealtimeError as exc:
            await self.error(exc, event_id if isinstance(event_id, str) else None)

    async def dispatch(self, event: dict[str, Any]) -> None:
        session, kind = self.session, event.get("type")
        if kind == "session.update":
            session.update(event.get("session"))
            await self.send({"type": "session.updated", "session": session.config()})
        elif kind == "input_audio_buffer.append":
            session.append(event.get("audio"), self.state.limits.max_body_bytes)
        elif kind == "input_audio_buffer.clear":
            session.buffer.clear()
            await self.send({"type": "input_audio_buffer.cleared"})
        elif kind == "input_audio_buffer.commit":
            item = session.commit()
            await self.cancel_response("turn_detected")  # barge-in
            previous = session.previous_id(item)
            await self.send(
                {
                    "type": "input_audio_buffer.committed",
                    "item_id": item["id"],
                    "previous_item_id": previous,
                }
            )
            await self.send(
                {
                    "type": "conversation.item.created",
                    "previous_item_id": previous,
                    "item": public_item(item),
                }
            )
        elif kind == "conversation.item.create":
            item = session.create_item(event.get("item"))
            if item["role"] == "user":
                await self.cancel_response("turn_detected")  # barge-in
            await self.send(
                {
                    "type": "conversation.item.created",
                    "previous_item_id": session.previous_id(item),
                    "item": public_item(item),
                }
            )
        elif kind == "response.create":
            await self.start_response(event.get("response") or {})
        elif kind == "response.cancel":
            if self.running is None:
                raise RealtimeError("response_cancel_not_active", "no response is running")
            await self.cancel_response("client_cancelled")
        else:
            raise RealtimeError(
                "unknown_event",
                f"event type {kind!r} is not handled here; this server takes session.update, "
                "input_audio_buffer.append/commit/clear, conversation.item.create, "
                "response.create and response.cancel",
                "type",
            )

    async def start_response(self, options: dict[str, Any]) -> None:
        if self.running is not None:
            raise RealtimeError(
                "conversation_already_has_active_response",
                f"response {self.running.id} is still running: cancel it or wait for its "
                "response.done",
            )
        state, session = self.state, self.session
        refused = state.admit()
        if refused is not None:
            raise RealtimeError(refused[1], refused[2])
        rt = state.runtime
        audio = session.audio_out
        given = {
            "messages": session.messages(),
            "modalities": ["text", "audio"] if audio else ["text"],
            "voice": session.voice,
            "audio_format": "pcm16" if audio else None,
            "max_tokens": session.max_tokens,
        }
        inputs = graph_inputs(rt.plans[session.model].inputs, given)
        try:
            call = rt.call(session.model, inputs, session=self.rt_session)
        except InputError as exc:
            state.release()
            raise RealtimeError("invalid_value", str(exc), exc.field) from None
        state.enter(call)
        running = _Running(new_id("resp"), call)
        self.running = running
        await self.send(
            {"type": "response.created", "response": self._response(running, "in_progress")}
        )
        running.task = asyncio.get_running_loop().create_task(self._stream(running))
        _ = options  # per-response overrides are not taken; the session's settings apply

    def _response(self, r: _Running, status: str, **extra: Any) -> dict[str, Any]:
        modalities = list(self.session.output_modalities)
        return {
            "object": "realtime.response",
            "id": r.id,
            "status": status,
            "output_modalities": modalities,
            "conversation_id": self.session.id,
            "output": [],
            **extra,
        }

    async def _stream(self, r: _Running) -> None:
        """Send the call's deltas as produced, then its done events (not when cancelled)."""
        call, session = r.call, self.session
        audio = session.audio_out
        pcm = PcmStream(PCM16_RATE)
        usage = Usage()
        where = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        text_kind = "response.output_audio_transcript" if audio else "response.output_text"
        try:
            async with contextlib.aclosing(aiter(call)) as frames:
                async for frame in frames:
                    value = frame.value
                    if isinstance(value, Audio):
                        if audio:
                            data = pcm.feed(value)
                            b64 = base64.b64encode(data).decode()
                            await self.send(
                                {"type": "response.output_audio.delta", **where, "delta": b64}
                            )
                    elif frame.field == "text":
                        delta = value if isinstance(value, str) else str(value)
                        r.text.append(delta)
                        await self.send({"type": f"{text_kind}.delta", **where, "delta": delta})
                    elif frame.field == "usage":
                        usage.see(value)
        finally:
            if not call.done:
                await call.cancel()
            self.state.leave(call)
        # Not cancelled: the call ended on its own.
        self.running = None
        text = "".join(r.text)
        if audio:
            await self.send({"type": "response.output_audio.done", **where})
        key = "transcript" if audio else "text"
        await self.send({"type": f"{text_kind}.done", **where, key: text})
        item = session.add_answer(text)
        r.item_id = item["id"]
        ok = call.status == "ok"
        extra: dict[str, Any] = {"usage": _realtime_usage(usage, len(r.text))}
        if not ok:
            errors = call.errors
            msg = errors[0].message if errors else f"the call ended with status {call.status}"
            extra["status_details"] = {
                "type": "failed",
                "error": {"type": "server_error", "code": call.status, "message": msg},
            }
        extra["output"] = [public_item(item)]
        await self.send(
            {
                "type": "response.done",
                "response": self._response(r, "completed" if ok else "failed", **extra),
            }
        )

    async def cancel_response(self, reason: str | None) -> None:
        """Cancel the running response now (its call too); ``reason`` None: the connection
        is closing (nothing is sent)."""
        r = self.running
        if r is None:
            return
        self.running = None
        task = r.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        elif task is None:  # (start_response had not made it yet)
            await r.call.cancel()
            self.state.leave(r.call)
        if reason is None:
            return
        item = self.session.add_answer("".join(r.text))
        details = {"type": "cancelled", "reason": reason}
        await self.send(
            {
                "type": "response.done",
                "response": self._response(
                    r, "cancelled", status_details=details, output=[public_item(item)]
                ),
            }
        )


def _realtime_usage(usage: Usage, frames: int) -> dict[str, Any]:
    got = usage.usage(frames)
    cached = (got.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "total_tokens": got["total_tokens"],
        "input_tokens": got["prompt_tokens"],
        "output_tokens": got["completion_tokens"],
        "input_token_details": {
            "cached_tokens": cached,
            "text_tokens": got["prompt_tokens"],
            "audio_tokens": 0,
        },
        "output_token_details": {"text_tokens": got["completion_tokens"], "audio_tokens": 0},
    }


async def realtime(ws: WebSocket) -> None:
    state: ServeState = ws.app.state.omniflow
    model = ws.query_params.get("model") or ""
    models = served(state.runtime.plans, Endpoint.REALTIME)
    if model not in models:
        await _deny(
            ws,
            404,
            f"The model '{model}' does not exist: the realtime graphs served "
            f"here are {sorted(models)}; connect to /v1/realtime?model=NAME",
            "model_not_found",
        )
        return
    if state.draining:
        await _deny(ws, 503, "the server is shutting down", "draining")
        return
    await ws.accept()
    started = time.monotonic()
    conn = _Connection(ws, state, model)
    try:
        await conn.run()
    finally:
        log.info(
            "realtime session %s on '%s' closed after %.1f s",
            conn.session.id,
            model,
            time.monotonic() - started,
        )


async def _deny(ws: WebSocket, status: int, message: str, code: str) -> None:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(body, status_code=status))
    else:
        await ws.close(1008, message[:120])


routes = [WebSocketRoute("/v1/realtime", realtime)]
