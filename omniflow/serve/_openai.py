"""OpenAI-compatible chat: ``POST /v1/chat/completions`` and ``GET /v1/models``.

>>> client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")  # doctest: +SKIP
>>> client.chat.completions.create(model="chat", messages=[...])               # doctest: +SKIP

A graph opts in by its shape: a Placeholder named ``messages`` (it receives the request's
OpenAI messages list, media parts decoded, see below) and an output field ``text`` (each frame's
value is a text delta). The request's ``model`` names the graph. Any other Placeholder of the
graph is filled from the request field of the same name (``temperature``, ``max_tokens``, or
anything passed with the client's ``extra_body``). A Placeholder named after one of OpenAI's
optional request fields (``OPTIONAL_FIELDS``: ``max_tokens``, ``temperature``, ``top_p``,
``seed``, ``stop``...) or one of ``_endpoints.KNOWN_INPUTS`` gets None when the request leaves
the field out, as OpenAI reads an absent field as null; ``max_completion_tokens`` fills
``max_tokens`` too.

Media (docs/contract.md §9). Message parts ``image_url`` (a ``data:`` URL) and ``input_audio``
(base64 WAV) reach the graph as ``of.Image`` / ``of.Audio`` in place of the part's payload
(``_media_in``); bad bytes or a remote URL are a 400 naming the part. With ``modalities:
["text", "audio"]`` and ``audio: {"voice", "format"}`` (Placeholders ``modalities``, ``voice``,
``audio_format`` receive them), every frame whose value is an ``of.Audio`` is audio out: without
streaming, ``choices[0].message.audio = {"id", "data", "expires_at", "transcript"}`` (``data``
the whole audio in the format: ``wav`` at the graph's rate, ``pcm16`` raw 16-bit 24 kHz mono;
``transcript`` the message text); streaming, each audio frame is one chunk whose
``delta.audio = {"id", "data", "transcript"}`` (``data`` that frame's audio as base64 16-bit
24 kHz PCM; with ``wav`` the first chunk's data starts with a streamed-WAV header, so the chunks
concatenated are one WAV; ``transcript`` the text deltas sent since the previous audio chunk),
in production order with the text chunks; the last audio chunk is ``{"id", "expires_at"}`` (as
OpenAI's), with a ``transcript`` when text followed the last audio frame. Resampling to
24 kHz is ``_pcm``'s linear interpolation, which gives the same samples streamed or not.
Formats: ``wav`` and ``pcm16``; any other is a 400 naming these.

``session`` in the body (``extra_body={"session": "s1"}``) or the ``X-Omniflow-Session`` header
runs the call in that session (turns of one conversation then reuse their cached prefix).

``"stream": true`` answers ``text/event-stream``: a first chunk with the assistant role, one
``chat.completion.chunk`` per text frame, a last chunk with the ``finish_reason``, then, as
OpenAI does, one chunk with empty ``choices`` and the ``usage`` only when
``stream_options.include_usage``, then ``data: [DONE]``. The stream starts with the first
text frame; a call that fails before it is answered as without streaming (below). A call that
fails after it sends ``data: {"error": {...}}`` instead of the last chunk. Without streaming the
answer is one ``chat.completion`` object.

Validation (``_chat_request``): every field of the request is checked as OpenAI checks it
(types, ranges, message roles and parts, ``stream_options`` only with ``stream``, fields nobody
takes) before the graph runs; a bad one is a 400 ``invalid_request_error`` naming it in
``param`` (``temperature: "hot"`` -> ``invalid_type``, param ``temperature``), and a ``model``
that names no chat graph a 404 ``model_not_found``, as OpenAI answers. A node that refuses its
input by raising ``of.InputError`` fails the call with a 400 too (``invalid_request_error``,
``param`` the error's ``field``); any other node failure is a 500 ``server_error``. Both carry
``x-should-retry: false``: the same request would fail the same way.

Usage: a graph that emits a ``usage`` frame (a dict with ``prompt_tokens``,
``completion_tokens``, optionally ``cached_tokens`` and ``finish_reason``; the last one wins)
has it reported as OpenAI's ``usage`` (``cached_tokens`` as
``usage.prompt_tokens_details.cached_tokens``) and its ``finish_reason`` ("stop" or "length")
as the choice's. Without one, usage counts text frames as completion tokens and reports 0
prompt tokens (the server does not know the graph's tokenizer) and the finish reason is "stop".

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so the client
raises its usual exceptions (NotFoundError, BadRequestError, RateLimitError...).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omniflow._exceptions import InputError
from omniflow._media import Audio
from omniflow.runtime import Call, Runtime
from omniflow.serve._chat_request import OPENAI_FIELDS, check_chat_request
from omniflow.serve._codec import dumps
from omniflow.serve._endpoints import Endpoint, endpoints_of, graph_inputs, served
from omniflow.serve._limits import bad_session
from omniflow.serve._media_in import BadMedia, decode_messages
from omniflow.serve._openai_common import (
    SESSION_HEADER,
    admitted,
    call_failure,
    error_message,
    openai_error,
    read_json,
    send_json,
    serve_state,
)
from omniflow.serve._pcm import PCM16_RATE, PcmStream, wav_header, whole_audio
from omniflow.serve._stream import CallResponse, call_status
from omniflow.serve._usage import Usage

if TYPE_CHECKING:
    from starlette.types import Send

    from omniflow.serve._state import ServeState

__all__ = ["AUDIO_FORMATS", "OPTIONAL_FIELDS", "AudioAnswer", "chat_graphs", "routes"]

#: Request fields that belong to the OpenAI protocol and are never graph inputs.
_PROTOCOL_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "session"})
#: OpenAI's optional chat request fields: a Placeholder named so is None when they are absent.
OPTIONAL_FIELDS = OPENAI_FIELDS - _PROTOCOL_FIELDS
#: Chat audio formats this server encodes.
AUDIO_FORMATS = ("wav", "pcm16")


def chat_graphs(rt: Runtime) -> list[str]:
    """Names of the graphs that opted in (a ``messages`` Placeholder and a ``text`` output)."""
    return served(rt.plans, Endpoint.CHAT)


async def list_models(request: Request) -> Response:
    """Every graph that serves at least one endpoint, with ``endpoints``: the ones it serves
    (``chat.completions``, ``audio.speech``, ``audio.transcriptions``, ``images.generations``,
    ``realtime``)."""
    created = int(time.time())
    data = []
    for name, plan in serve_state(request).runtime.plans.items():
        endpoints = endpoints_of(plan.inputs, plan.outputs)
        if endpoints:
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "omniflow",
                    "endpoints": endpoints,
                }
            )
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response | CallResponse:
    return await admitted(request, _start_chat)


@dataclass(frozen=True, slots=True)
class AudioAnswer:
    """Audio requested in a chat answer (``modalities`` has "audio")."""

    #: ``wav`` or ``pcm16``.
    format: str


def _audio_request(body: dict[str, Any]) -> AudioAnswer | JSONResponse | None:
    """The chat request's audio output, None when it asks for none, or its 400."""
    if "audio" not in (body.get("modalities") or ()):
        return None
    audio = body.get("audio")
    if audio is None:
        return openai_error(
            400,
            "Missing required parameter: 'audio'. It is required when 'modalities' includes "
            "'audio': send audio={'voice': 'alloy', 'format': 'wav'}.",
            param="audio",
            code="missing_required_parameter",
        )
    fmt = audio["format"]
    if fmt not in AUDIO_FORMATS:
        return openai_error(
            400,
            f"Unsupported value: 'audio.format' is '{fmt}'; this server encodes "
            f"{' and '.join(repr(f) for f in AUDIO_FORMATS)} (no encoder for '{fmt}' is "
            "installed).",
            param="audio.format",
            code="unsupported_value",
        )
    return AudioAnswer(fmt)


async def _start_chat(request: Request, state: ServeState) -> Response | CallResponse:
    rt = state.runtime
    body = await read_json(request, code=None)
    if not isinstance(body, dict):
        return body
    models = {name: rt.plans[name].inputs for name in chat_graphs(rt)}
    invalid = check_chat_request(body, models)
    if invalid is not None:
        return openai_error(invalid.status, invalid.message, param=invalid.param, code=invalid.code)
    model: str = body["model"]
    session = body.get("session", request.headers.get(SESSION_HEADER))
    problem = bad_session(session)
    if problem is not None:
        return openai_error(400, problem, param="session")
    audio = _audio_request(body)
    if isinstance(audio, JSONResponse):
        return audio
    try:
        messages = decode_messages(body["messages"])
    except BadMedia as exc:
        return openai_error(400, exc.message, param=exc.param, code="invalid_value")
    if body.get("max_tokens") is None and "max_completion_tokens" in body:
        body["max_tokens"] = body["max_completion_tokens"]
    # ``audio`` is OpenAI's output spec, never the graph's ``audio`` input (an of.Audio).
    given = {k: v for k, v in body.items() if k not in _PROTOCOL_FIELDS and k != "audio"}
    if isinstance(body.get("audio"), dict):
        given.setdefault("voice", body["audio"].get("voice"))
        given.setdefault("audio_format", body["audio"].get("format"))
    inputs = {"messages": messages, **graph_inputs(models[model], given, skip=_PROTOCOL_FIELDS)}
    try:
        call = rt.call(model, inputs, session=session)
    except InputError as exc:
        return openai_error(400, str(exc), param=exc.field)
    state.enter(call)
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    if body.get("stream"):
        return ChatStreamResponse(state, call, include_usage=include_usage, audio=audio)
    return ChatResponse(state, call, audio=audio)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=repr)


class ChatStreamResponse(CallResponse):
    """Server-sent events of ``chat.completion.chunk`` objects, then ``data: [DONE]``.

    The response starts with the call's first text frame: a call that fails before it has
    said anything is answered as without streaming (a 400 for the graph's ``InputError``,
    else a 500), so the client's ``create(stream=True)`` raises as OpenAI's does for a bad
    request, instead of a 200 whose stream holds an error."""

    def __init__(
        self, state: ServeState, call: Call, *, include_usage: bool, audio: AudioAnswer | None
    ) -> None:
        super().__init__(state, call)
        self.include_usage = include_usage
        self.audio = audio

    async def respond(self, send: Send) -> None:
        call, http = self.call, self.state.http
        head = {
            "id": f"chatcmpl-{call.call_id}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": call.graph,
        }

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + dumps({**head, "choices": choices, **extra}) + b"\n\n"

        def delta(d: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            return event([choice])

        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        n = 0
        tally = Usage()
        audio_id = f"audio_{call.call_id}"
        pcm = PcmStream(PCM16_RATE)
        wav_started = False
        unspoken: list[str] = []  # text sent since the last audio chunk

        def chunk_of(item: str | Audio) -> bytes:
            nonlocal wav_started
            if isinstance(item, str):
                unspoken.append(item)
                return delta({"content": item})
            data = pcm.feed(item)
            if self.audio is not None and self.audio.format == "wav" and not wav_started:
                wav_started = True
                data = wav_header(PCM16_RATE) + data
            said = "".join(unspoken)
            unspoken.clear()
            b64 = base64.b64encode(data).decode()
            return delta({"audio": {"id": audio_id, "data": b64, "transcript": said}})

        want_audio = self.audio is not None
        async with contextlib.aclosing(_chat_frames(self, tally, want_audio)) as items:
            first = await anext(items, None)
            if first is None:
                status, errors = call_status(call, self.extra_errors)
                if status != "ok":
                    if not self.disconnected:
                        await send_json(self, send, *call_failure(call, errors))
                    return
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            opening = delta({"role": "assistant", "content": ""})
            http.bytes_out += len(opening)
            await self.send_chunk(opening)
            if first is not None:
                chunk = chunk_of(first)
                await self.send_chunk(chunk)
                n += isinstance(first, str)
                http.bytes_out += len(chunk)
            async for item in items:
                if self.disconnected:
                    continue
                chunk = chunk_of(item)
                await self.send_chunk(chunk)
                n += isinstance(item, str)
                http.bytes_out += len(chunk)
        http.frames_out[call.graph] = http.frames_out.get(call.graph, 0) + n
        status, errors = call_status(call, self.extra_errors)
        if status == "ok":
            tail = b""
            if want_audio and pcm.rates:  # OpenAI's last audio update: its expiry
                last = {"id": audio_id, "expires_at": int(time.time()) + 3600}
                if unspoken:
                    last["transcript"] = "".join(unspoken)
                tail = delta({"audio": last})
            tail += delta({}, tally.finish_reason())
            if self.include_usage:
                tail += event([], usage=tally.usage(n))
        else:
            err = {"message": error_message(call, errors), "type": "server_error"}
            tail = b"data: " + dumps({"error": {**err, "param": None, "code": status}}) + b"\n\n"
        await self._finish(send, tail + b"data: [DONE]\n\n")


class ChatResponse(CallResponse):
    """One ``chat.completion`` object with the concatenated text (and audio, if asked)."""

    def __init__(self, state: ServeState, call: Call, *, audio: AudioAnswer | None) -> None:
        super().__init__(state, call)
        self.audio = audio

    async def respond(self, send: Send) -> None:
        call = self.call
        tally = Usage()
        parts: list[str] = []
        clips: list[Audio] = []
        async with contextlib.aclosing(_chat_frames(self, tally, self.audio is not None)) as it:
            async for item in it:
                if isinstance(item, str):
                    parts.append(item)
                else:
                    clips.append(item)
        if self.disconnected:
            return
        self.state.http.frames_out[call.graph] = self.state.http.frames_out.get(
            call.graph, 0
        ) + len(parts)
        status, errors = call_status(call, self.extra_errors)
        if status != "ok":
            await send_json(self, send, *call_failure(call, errors))
            return
        created = int(time.time())
        text = "".join(parts)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.audio is not None and clips:
            data = whole_audio(clips, self.audio.format)
            message["audio"] = {
                "id": f"audio_{call.call_id}",
                "data": base64.b64encode(data).decode(),
                "expires_at": created + 3600,
                "transcript": text,
            }
        obj: dict[str, Any] = {
            "id": f"chatcmpl-{call.call_id}",
            "object": "chat.completion",
            "created": created,
            "model": call.graph,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": tally.finish_reason(),
                }
            ],
            "usage": tally.usage(len(parts)),
        }
        await send_json(self, send, 200, obj)


async def _chat_frames(
    resp: CallResponse, tally: Usage, want_audio: bool
) -> AsyncGenerator[str | Audio, None]:
    """The call's text deltas (its ``text`` frames) and, when ``want_audio``, its audio
    (frames whose value is an ``of.Audio``), in order; ``usage`` frames go to ``tally``."""
    async with contextlib.aclosing(resp.raw_frames()) as frames:
        async for frame in frames:
            value = frame.value
            if isinstance(value, Audio):
                if want_audio:
                    yield value
            elif frame.field == "text":
                yield _text(value)
            elif frame.field == "usage":
                tally.see(value)


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
