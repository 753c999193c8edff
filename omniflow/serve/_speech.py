"""``POST /v1/audio/speech``: text in, audio streamed out as the graph produces it.

>>> client.audio.speech.create(model="voice_chat", voice="alloy", input="hello")  # doctest: +SKIP

A graph serves it with a Placeholder ``input`` (``_endpoints``); ``voice``, ``speed`` and
``instructions`` fill the Placeholders of those names (None when absent), other Placeholders
come from same-named body fields. Every frame whose value is an ``of.Audio`` is audio out, in
order; the answer starts with the first one (a call that fails before it is a 400 for the
graph's ``InputError``, else a 500, in OpenAI's error shape) and each later frame leaves as
soon as it is produced:

* ``response_format: "wav"`` (default): ``audio/wav``, a 16-bit mono WAV header written for a
  stream of unknown length (sizes 0xFFFFFFFF), then the samples at the first frame's rate;
* ``"pcm"``: ``audio/pcm``, raw 16-bit little-endian mono samples, the rate in the
  ``X-Sample-Rate`` header (the first frame's; later frames at another rate are resampled to
  it, ``_pcm``);
* ``stream_format: "sse"``: ``text/event-stream`` events ``{"type": "speech.audio.delta",
  "audio": base64}`` carrying those same bytes, then ``{"type": "speech.audio.done", "usage":
  {...}}`` (or ``{"type": "error", "error": {...}}`` when the call fails midway).

A raw body whose call fails midway just ends (the error is logged with the call id); use SSE
to be told. Other formats (mp3, opus...) are a 400 naming the supported ones.
"""

from __future__ import annotations

import base64
import contextlib
import math
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from omniflow._exceptions import InputError
from omniflow._media import Audio
from omniflow.serve._codec import dumps
from omniflow.serve._endpoints import Endpoint, graph_inputs
from omniflow.serve._limits import bad_session
from omniflow.serve._openai_common import (
    SESSION_HEADER,
    admitted,
    bad_request,
    call_failure,
    chosen_model,
    read_json,
    send_json,
)
from omniflow.serve._pcm import PcmStream, wav_header
from omniflow.serve._stream import CallResponse, call_status

if TYPE_CHECKING:
    from starlette.types import Send

    from omniflow.serve._state import ServeState

__all__ = ["SPEECH_FORMATS", "SpeechResponse", "routes"]

#: ``response_format`` values this server writes.
SPEECH_FORMATS = ("wav", "pcm")
#: Body fields that are the protocol's, never graph inputs.
_PROTOCOL = frozenset({"model", "response_format", "stream_format", "session"})


async def speech(request: Request) -> Response | CallResponse:
    return await admitted(request, _start_speech)


async def _start_speech(request: Request, state: ServeState) -> Response | CallResponse:
    rt = state.runtime
    body = await read_json(request)
    if not isinstance(body, dict):
        return body
    model = chosen_model(
        body.get("model"), rt.plans, Endpoint.SPEECH, "speech", "a Placeholder 'input'"
    )
    if not isinstance(model, str):
        return model
    text = body.get("input")
    if not isinstance(text, str) or not text:
        return bad_request("'input' must be a non-empty string: the text to speak", "input")
    fmt = body.get("response_format", "wav")
    if fmt not in SPEECH_FORMATS:
        return bad_request(
            f"Unsupported value: 'response_format' is {fmt!r}; this server writes 'wav' "
            "(default) and 'pcm' (16-bit little-endian mono, rate in X-Sample-Rate)",
            "response_format",
            "unsupported_value",
        )
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        return bad_request(
            f"Invalid value for 'stream_format': {stream_format!r}; use 'audio' or 'sse'",
            "stream_format",
        )
    speed = body.get("speed")
    if speed is not None and (
        isinstance(speed, bool)
        or not isinstance(speed, int | float)
        or not math.isfinite(speed)
        or not 0.25 <= speed <= 4.0
    ):
        return bad_request(f"'speed' must be a number from 0.25 to 4.0, got {speed!r}", "speed")
    for name in ("voice", "instructions"):
        if body.get(name) is not None and not isinstance(body[name], str | dict):
            return bad_request(f"'{name}' must be a string", name)
    session = body.get("session", request.headers.get(SESSION_HEADER))
    problem = bad_session(session)
    if problem is not None:
        return bad_request(problem, "session")
    inputs = graph_inputs(rt.plans[model].inputs, body, skip=_PROTOCOL)
    try:
        call = rt.call(model, inputs, session=session)
    except InputError as exc:
        return bad_request(str(exc), exc.field)
    state.enter(call)
    return SpeechResponse(state, call, fmt=fmt, sse=stream_format == "sse")


class SpeechResponse(CallResponse):
    """The call's audio frames as one audio body or SSE events (module docstring)."""

    def __init__(self, state: ServeState, call: Any, *, fmt: str, sse: bool) -> None:
        super().__init__(state, call)
        #: ``wav`` or ``pcm``.
        self.fmt = fmt
        #: Server-sent events instead of a raw body.
        self.sse = sse

    async def _clips(self) -> AsyncGenerator[Audio, None]:
        async with contextlib.aclosing(self.raw_frames()) as frames:
            async for frame in frames:
                if isinstance(frame.value, Audio):
                    yield frame.value

    async def respond(self, send: Send) -> None:
        call, http = self.call, self.state.http
        async with contextlib.aclosing(self._clips()) as clips:
            first = await anext(clips, None)
            status, errors = call_status(call, self.extra_errors)
            if first is None and status != "ok":
                if not self.disconnected:
                    await send_json(self, send, *call_failure(call, errors))
                return
            rate = first.sample_rate if first is not None else 24000
            pcm = PcmStream(rate)
            if self.sse:
                ctype = b"text/event-stream; charset=utf-8"
            else:
                ctype = b"audio/wav" if self.fmt == "wav" else b"audio/pcm"
            headers = [
                (b"content-type", ctype),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
                (b"x-sample-rate", str(rate).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            head = wav_header(rate) if self.fmt == "wav" else b""

            def wrap(data: bytes) -> bytes:
                if not self.sse:
                    return data
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
                return b"data: " + dumps(event) + b"\n\n"

            if head or first is not None:
                data = head + (pcm.feed(first) if first is not None else b"")
                chunk = wrap(data)
                http.bytes_out += len(chunk)
                await self.send_chunk(chunk)
            async for clip in clips:
                if self.disconnected:
                    continue
                data = pcm.feed(clip)
                if not data:
                    continue
                chunk = wrap(data)
                http.bytes_out += len(chunk)
                await self.send_chunk(chunk)
        tail = b""
        if self.sse:
            status, errors = call_status(call, self.extra_errors)
            if status == "ok":
                # The server does not know the graph's tokens (samples are not tokens).
                usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
                done = {"type": "speech.audio.done", "usage": usage}
            else:
                _code, obj = call_failure(call, errors)
                done = {"type": "error", **obj}
            tail = b"data: " + dumps(done) + b"\n\n"
        await self._finish(send, tail)


routes = [Route("/v1/audio/speech", speech, methods=["POST"])]
