"""``POST /v1/audio/transcriptions`` (audio in, text out) and ``POST /v1/images/generations``.

>>> client.audio.transcriptions.create(model="asr", file=open("a.wav", "rb"))  # doctest: +SKIP
>>> client.images.generate(model="t2i", prompt="a red square", size="64x64")  # doctest: +SKIP

Transcriptions: a multipart form (``file`` a WAV, ``model``; optional ``language``, ``prompt``,
``response_format`` ``json`` (default) or ``text``, and any field named after a Placeholder of
the graph). The graph (a Placeholder ``audio`` and an output ``text``, ``_endpoints``) gets the
file as an ``of.Audio`` (as sent: no resampling), ``language`` and ``prompt`` (None when
absent); the answer is ``{"text": the text frames joined}``. A file that is not a readable WAV
is a 400 naming ``file``.

Images: a JSON body (``prompt``; optional ``size`` ``"WxH"``, ``n``). The graph (a Placeholder
``prompt``) gets ``prompt``, ``size`` and ``n`` (None when absent); every frame whose value is an
``of.Image`` becomes one ``{"b64_json": PNG}`` of ``data``. ``response_format: "url"`` is a 400:
the server keeps no files to point to. Both answer 400 for the graph's ``InputError`` and 500
for its other failures, in OpenAI's error shape.
"""

from __future__ import annotations

import base64
import contextlib
import re
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from omniflow._exceptions import InputError
from omniflow._media import Image
from omniflow.serve._endpoints import Endpoint, graph_inputs
from omniflow.serve._media_in import BadMedia, decode_audio
from omniflow.serve._multipart import FormError, parse_form
from omniflow.serve._openai_common import (
    admitted,
    bad_request,
    chosen_model,
    read_json,
    request_session,
    send_failure,
    send_json,
)
from omniflow.serve._stream import CallResponse

if TYPE_CHECKING:
    from starlette.types import Send

    from omniflow.runtime import Call
    from omniflow.serve._state import ServeState

__all__ = ["ImagesResponse", "TranscriptionResponse", "routes"]

_SIZE = re.compile(r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$")
#: Fields of OpenAI's image request this server reads or accepts and leaves to the graph.
_IMAGE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "n",
        "size",
        "response_format",
        "session",
        "quality",
        "style",
        "user",
        "background",
        "moderation",
        "output_format",
        "output_compression",
    }
)
#: Fields of OpenAI's transcription request that never reach a graph.
_ASR_PROTOCOL = frozenset({"model", "file", "response_format", "session", "stream"})


# -- transcriptions --------------------------------------------------------------------------


async def transcriptions(request: Request) -> Response | CallResponse:
    return await admitted(request, _start_transcription)


async def _start_transcription(request: Request, state: ServeState) -> Response | CallResponse:
    rt = state.runtime
    try:
        form = parse_form(request.headers.get("content-type", ""), await request.body())
        fields = {name: part.text() for name, part in form.items() if part.filename is None}
    except FormError as exc:
        return bad_request(f"request body: {exc}", None)
    file = form.get("file")
    if file is None:
        return bad_request(
            "Missing required parameter: 'file' (the audio, a WAV)",
            "file",
            "missing_required_parameter",
        )
    model = chosen_model(
        fields.get("model"),
        rt.plans,
        Endpoint.TRANSCRIPTIONS,
        "transcription",
        "a Placeholder 'audio' and an output 'text'",
    )
    if not isinstance(model, str):
        return model
    fmt = fields.get("response_format", "json")
    if fmt not in ("json", "text"):
        return bad_request(
            f"Unsupported value: 'response_format' is {fmt!r}; this server answers 'json' "
            "(default) and 'text'",
            "response_format",
            "unsupported_value",
        )
    try:
        audio = decode_audio(file.data, "file")
    except BadMedia as exc:
        return bad_request(exc.message, exc.param)
    session, refused = request_session(request, fields.get("session"))
    if refused is not None:
        return refused
    given: dict[str, Any] = {**fields, "audio": audio}
    inputs = graph_inputs(rt.plans[model].inputs, given, skip=_ASR_PROTOCOL)
    try:
        call = rt.call(model, inputs, session=session)
    except InputError as exc:
        return bad_request(str(exc), exc.field)
    state.enter(call)
    return TranscriptionResponse(state, call, text=fmt == "text")


class TranscriptionResponse(CallResponse):
    """``{"text": ...}`` (or the text alone, ``text/plain``) of the call's ``text`` frames."""

    def __init__(self, state: ServeState, call: Call, *, text: bool) -> None:
        super().__init__(state, call)
        #: Answer ``text/plain``.
        self.plain = text

    async def respond(self, send: Send) -> None:
        parts: list[str] = []
        async with contextlib.aclosing(self.raw_frames()) as frames:
            async for frame in frames:
                if frame.field == "text":
                    v = frame.value
                    parts.append(v if isinstance(v, str) else str(v))
        if await send_failure(self, send):
            return
        text = "".join(parts)
        if not self.plain:
            await send_json(self, send, 200, {"text": text, "usage": None})
            return
        body = text.encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._finish(send, body)


# -- images ----------------------------------------------------------------------------------


async def images(request: Request) -> Response | CallResponse:
    return await admitted(request, _start_images)


async def _start_images(request: Request, state: ServeState) -> Response | CallResponse:
    rt = state.runtime
    body = await read_json(request)
    if not isinstance(body, dict):
        return body
    model = chosen_model(
        body.get("model"), rt.plans, Endpoint.IMAGES, "image", "a Placeholder 'prompt'"
    )
    if not isinstance(model, str):
        return model
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return bad_request("'prompt' must be a non-empty string", "prompt")
    fmt = body.get("response_format")
    if fmt not in (None, "b64_json"):
        return bad_request(
            f"Unsupported value: 'response_format' is {fmt!r}; this server answers "
            "'b64_json' only (it keeps no files to give URLs for)",
            "response_format",
            "unsupported_value",
        )
    size = body.get("size")
    if size is not None and size != "auto" and not (isinstance(size, str) and _SIZE.match(size)):
        return bad_request(
            f"'size' must be 'WIDTHxHEIGHT' (like '256x256') or 'auto', got {size!r}", "size"
        )
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10):
        return bad_request(f"'n' must be an integer from 1 to 10, got {n!r}", "n")
    inputs_of = rt.plans[model].inputs
    unknown = sorted(k for k in body if k not in _IMAGE_FIELDS and k not in inputs_of)
    if unknown:
        return bad_request(
            f"Unrecognized request argument supplied: {', '.join(unknown)} (graph '{model}' "
            f"takes {sorted(inputs_of)} besides OpenAI's fields)",
            None,
        )
    session, refused = request_session(request, body.get("session"))
    if refused is not None:
        return refused
    skip = _IMAGE_FIELDS - {"prompt", "n", "size"} - set(inputs_of)
    inputs = graph_inputs(inputs_of, body, skip=skip | {"model", "session", "response_format"})
    try:
        call = rt.call(model, inputs, session=session)
    except InputError as exc:
        return bad_request(str(exc), exc.field)
    state.enter(call)
    return ImagesResponse(state, call)


class ImagesResponse(CallResponse):
    """``{"created", "data": [{"b64_json": PNG}]}``: one entry per ``of.Image`` frame."""

    async def respond(self, send: Send) -> None:
        pictures: list[Image] = []
        async with contextlib.aclosing(self.raw_frames()) as frames:
            async for frame in frames:
                if isinstance(frame.value, Image):
                    pictures.append(frame.value)
        if await send_failure(self, send):
            return
        data = [{"b64_json": base64.b64encode(p.to_png()).decode()} for p in pictures]
        await send_json(self, send, 200, {"created": int(time.time()), "data": data})


routes = [
    Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
    Route("/v1/images/generations", images, methods=["POST"]),
]
