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
import binascii
import contextlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from omniflow._exceptions import InputError
from omniflow._media import Audio
from omniflow.serve._codec import dumps
from omniflow.serve._endpoints import Endpoint, graph_inputs, served
from omniflow.serve._openai import PcmStream, _Usage
from omniflow.serve._pcm import PCM16_RATE

if TYPE_CHECKING:
    from omniflow.runtime import Call
    from omniflow.serve._state import ServeState

__all__ = ["RealtimeError", "RealtimeSession", "routes"]

log = logging.getLogger("omniflow.serve")


class RealtimeError(Exception):
    """A client event the session refuses: sent back as an ``error`` event."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# -- the session: configuration, conversation, input buffer (no I/O) -------------------------


@dataclass(slots=True)
class RealtimeSession:
    """What one connection holds between events; each method checks one client event and
    changes the session (raising ``RealtimeError`` without changing it when refused)."""

    #: The graph serving the session.
    model: str
    #: The session's id (``sess_...``).
    id: str = field(default_factory=lambda: _new_id("sess"))
    #: ``["audio"]`` (audio + transcript) or ``["text"]``.
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    #: A system message put first, when not empty.
    instructions: str = ""
    #: The voice the graph's ``voice`` Placeholder receives.
    voice: str = "alloy"
    #: Sample rate of ``input_audio_buffer.append`` audio.
    input_rate: int = PCM16_RATE
    #: ``max_output_tokens`` as the graph's ``max_tokens`` (None: the graph's default).
    max_tokens: int | None = None
    #: Conversation items (``{"id", "type", "role", "content"}``), oldest first; user audio
    #: parts hold an ``of.Audio`` under ``"audio"``.
    items: list[dict[str, Any]] = field(default_factory=list)
    #: 16-bit PCM appended since the last commit or clear.
    buffer: bytearray = field(default_factory=bytearray)

    def config(self) -> dict[str, Any]:
        """The session object of ``session.created`` / ``session.updated``."""
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "max_output_tokens": self.max_tokens if self.max_tokens is not None else "inf",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": self.input_rate},
                    "turn_detection": None,
                },
                "output": {
                    "format": {"type": "audio/pcm", "rate": PCM16_RATE},
                    "voice": self.voice,
                },
            },
        }

    def update(self, session: Any) -> None:
        """``session.update``: GA fields, and the beta names of the same settings."""
        if not isinstance(session, dict):
            raise RealtimeError("invalid_value", "'session' must be an object", "session")
        new: dict[str, Any] = {}
        mods = session.get("output_modalities", session.get("modalities"))
        if mods is not None:
            if not isinstance(mods, list) or not mods or not set(mods) <= {"text", "audio"}:
                raise RealtimeError(
                    "invalid_value",
                    f"output_modalities must be ['audio'] or ['text'], got {mods!r}",
                    "session.output_modalities",
                )
            new["output_modalities"] = ["audio"] if "audio" in mods else ["text"]
        if session.get("instructions") is not None:
            if not isinstance(session["instructions"], str):
                raise RealtimeError(
                    "invalid_type", "instructions must be a string", "session.instructions"
                )
            new["instructions"] = session["instructions"]
        tokens = session.get("max_output_tokens", session.get("max_response_output_tokens"))
        if tokens is not None:
            if tokens == "inf":
                new["max_tokens"] = None
            elif isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1:
                new["max_tokens"] = tokens
            else:
                raise RealtimeError(
                    "invalid_value",
                    "max_output_tokens must be >= 1 or 'inf'",
                    "session.max_output_tokens",
                )
        audio = session.get("audio") or {}
        inp, out = audio.get("input") or {}, audio.get("output") or {}
        if session.get("turn_detection", inp.get("turn_detection")) is not None:
            raise RealtimeError(
                "unsupported_value",
                "server VAD is not offered: set turn_detection to null and commit each turn "
                "with input_audio_buffer.commit",
                "session.audio.input.turn_detection",
            )
        voice = out.get("voice", session.get("voice"))
        if voice is not None:
            if not isinstance(voice, str):
                raise RealtimeError(
                    "invalid_type", "voice must be a string", "session.audio.output.voice"
                )
            new["voice"] = voice
        fmt_in = inp.get("format", session.get("input_audio_format"))
        if fmt_in is not None:
            new["input_rate"] = _pcm_rate(fmt_in, "session.audio.input.format", any_rate=True)
        fmt_out = out.get("format", session.get("output_audio_format"))
        if fmt_out is not None:
            _pcm_rate(fmt_out, "session.audio.output.format", any_rate=False)
        for key, value in new.items():
            setattr(self, key, value)

    def append(self, audio: Any, limit: int) -> None:
        """``input_audio_buffer.append``: base64 16-bit PCM at the session's input rate."""
        if not isinstance(audio, str):
            raise RealtimeError("invalid_type", "audio must be a base64 string", "audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError(
                "invalid_value", f"audio is not valid base64 ({exc})", "audio"
            ) from None
        if len(self.buffer) + len(data) > limit:
            raise RealtimeError(
                "input_audio_buffer_too_large",
                f"the input audio buffer would hold over {limit} bytes (--max-body-mb); "
                "commit or clear it first",
                "audio",
            )
        self.buffer += data

    def commit(self) -> dict[str, Any]:
        """``input_audio_buffer.commit``: the buffer becomes a user item (returned)."""
        import numpy as np

        if not self.buffer:
            raise RealtimeError(
                "input_audio_buffer_commit_empty",
                "the input audio buffer is empty: append audio before committing",
            )
        if len(self.buffer) % 2:
            raise RealtimeError(
                "invalid_value",
                f"the input audio buffer holds {len(self.buffer)} bytes, not whole 16-bit samples",
            )
        samples = np.frombuffer(bytes(self.buffer), dtype="<i2").astype(np.int16)
        self.buffer.clear()
        clip = Audio(samples, sample_rate=self.input_rate)
        part = {"type": "input_audio", "audio": clip, "transcript": None}
        return self._add({"type": "message", "role": "user", "content": [part]})

    def create_item(self, item: Any) -> dict[str, Any]:
        """``conversation.item.create`` of a message (returned as stored)."""
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise RealtimeError(
                "unsupported_value", "only items of type 'message' are taken", "item.type"
            )
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise RealtimeError(
                "invalid_value",
                f"item.role must be user, assistant or system, got {role!r}",
                "item.role",
            )
        content = item.get("content")
        if not isinstance(content, list):
            raise RealtimeError("invalid_type", "item.content must be an array", "item.content")
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"item.content[{i}]"
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
                parts.append({"type": kind, "text": part["text"]})
            elif kind == "input_audio" and role == "user":
                import numpy as np

                try:
                    data = base64.b64decode(part.get("audio") or "", validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise RealtimeError(
                        "invalid_value",
                        f"{where}.audio is not valid base64 ({exc})",
                        f"{where}.audio",
                    ) from None
                if not data or len(data) % 2:
                    raise RealtimeError(
                        "invalid_value",
                        f"{where}.audio must be whole 16-bit PCM samples",
                        f"{where}.audio",
                    )
                clip = Audio(np.frombuffer(data, "<i2").astype(np.int16), self.input_rate)
                parts.append({"type": "input_audio", "audio": clip, "transcript": None})
            else:
                raise RealtimeError(
                    "invalid_value",
                    f"{where}: a part of type {kind!r} is not "
                    "taken (input_text, input_audio, text)",
                    where,
                )
        stored = {"type": "message", "role": role, "content": parts}
        if isinstance(item.get("id"), str):
            stored["id"] = item["id"]
        return self._add(stored)

    def add_answer(self, text: str) -> dict[str, Any]:
        """The assistant's answer joins the conversation."""
        part = {
            "type": "output_audio" if self.audio_out else "output_text",
            "transcript" if self.audio_out else "text": text,
        }
        return self._add({"type": "message", "role": "assistant", "content": [part]})

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        item.setdefault("id", _new_id("item"))
        item["object"] = "realtime.item"
        item["status"] = "completed"
        self.items.append(item)
        return item

    def previous_id(self, item: dict[str, Any]) -> str | None:
        """The id of the item before ``item`` (None for the first)."""
        i = self.items.index(item)
        return self.items[i - 1]["id"] if i else None

    @property
    def audio_out(self) -> bool:
        return "audio" in self.output_modalities

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat ``messages`` (audio parts carry an ``of.Audio``)."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        for item in self.items:
            texts, media = [], []
            for part in item["content"]:
                if "audio" in part and isinstance(part["audio"], Audio):
                    media.append({"type": "input_audio", "input_audio": part["audio"]})
                else:
                    texts.append(part.get("text") or part.get("transcript") or "")
            if not media:
                out.append({"role": item["role"], "content": "".join(texts)})
            else:
                parts = [{"type": "text", "text": t} for t in texts if t] + media
                out.append({"role": item["role"], "content": parts})
        return out


def _pcm_rate(fmt: Any, param: str, *, any_rate: bool) -> int:
    """The rate of an ``audio/pcm`` format (GA object, or beta ``"pcm16"``)."""
    if fmt == "pcm16":
        return PCM16_RATE
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    rate = fmt.get("rate", PCM16_RATE) if isinstance(fmt, dict) else None
    if kind != "audio/pcm":
        raise RealtimeError(
            "unsupported_value",
            f"{param}: only 'audio/pcm' (16-bit PCM) is offered, got {fmt!r}",
            param,
        )
    if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
        raise RealtimeError("invalid_value", f"{param}.rate must be a positive integer", param)
    if not any_rate and rate != PCM16_RATE:
        raise RealtimeError(
            "unsupported_value", f"{param}.rate: output audio is {PCM16_RATE} Hz", param
        )
    return rate


def _public(item: dict[str, Any]) -> dict[str, Any]:
    """An item as sent to the client (audio bytes left out, as OpenAI's echoes do)."""
    content = [
        {k: (None if isinstance(v, Audio) else v) for k, v in part.items()}
        for part in item["content"]
    ]
    return {**item, "content": content}


# -- the connection: events in, events out, one response at a time ---------------------------


@dataclass(slots=True)
class _Running:
    """The response in progress."""

    id: str
    call: Call
    task: asyncio.Task[None] | None = None
    item_id: str = field(default_factory=lambda: _new_id("item"))
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
                    "item": _public(item),
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
                    "item": _public(item),
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
        running = _Running(_new_id("resp"), call)
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
        usage = _Usage()
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
        extra["output"] = [_public(item)]
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
                    r, "cancelled", status_details=details, output=[_public(item)]
                ),
            }
        )


def _realtime_usage(usage: _Usage, frames: int) -> dict[str, Any]:
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
