"""OpenAI-compatible chat: ``POST /v1/chat/completions`` and ``GET /v1/models``.

>>> client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")  # doctest: +SKIP
>>> client.chat.completions.create(model="chat", messages=[...])               # doctest: +SKIP

A graph opts in by its shape: a Placeholder named ``messages`` (it receives the request's
OpenAI messages list as is) and an output field ``text`` (each frame's value is a text delta;
other output fields are not sent). The request's ``model`` names the graph. Any other
Placeholder of the graph is filled from the request field of the same name (``temperature``,
``max_tokens``, or anything passed with the client's ``extra_body``); ``session`` in the body
(``extra_body={"session": "s1"}``) runs the call in that session.

``"stream": true`` answers ``text/event-stream``: a first chunk with the assistant role, one
``chat.completion.chunk`` per text frame, a last chunk with ``finish_reason: "stop"`` (and one
with ``usage`` when ``stream_options.include_usage``), then ``data: [DONE]``. A call that ends
in error sends ``data: {"error": {...}}`` instead of the last chunk. Without streaming the answer
is one ``chat.completion`` object; a failed call is a 500 with ``x-should-retry: false`` (the
graph failed; retrying the same request would fail the same way). Usage counts text frames as
completion tokens and reports 0 prompt tokens: the server does not know the graph's tokenizer.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so the client
raises its usual exceptions (NotFoundError, BadRequestError, RateLimitError...).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omniflow._exceptions import InputError
from omniflow.runtime import Call, Runtime
from omniflow.serve._codec import ValueDecodingError, dumps, loads
from omniflow.serve._stream import CallResponse, call_status

if TYPE_CHECKING:
    from starlette.types import Send

    from omniflow.serve._state import ServeState

__all__ = ["chat_graphs", "openai_error", "routes"]

#: Request fields that belong to the OpenAI protocol and are never graph inputs.
_PROTOCOL_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "session"})


def chat_graphs(rt: Runtime) -> list[str]:
    """Names of the graphs that opted in (a ``messages`` Placeholder and a ``text`` output)."""
    return [n for n, p in rt.plans.items() if "messages" in p.inputs and "text" in p.outputs]


def openai_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _state(request: Request) -> ServeState:
    state: ServeState = request.app.state.omniflow
    return state


async def list_models(request: Request) -> Response:
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "omniflow"}
        for name in chat_graphs(_state(request).runtime)
    ]
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response | CallResponse:
    state = _state(request)
    rt = state.runtime
    try:
        body = loads(await request.body())
    except ValueDecodingError as exc:
        return openai_error(400, f"request body: {exc}")
    if not isinstance(body, dict):
        return openai_error(400, "request body must be a JSON object")
    model = body.get("model")
    models = chat_graphs(rt)
    if not isinstance(model, str) or model not in models:
        return openai_error(
            404,
            f"model {model!r} is not served here; the chat graphs are {models} (a graph serves "
            "chat when it has a Placeholder 'messages' and an output 'text')",
            param="model",
            code="model_not_found",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return openai_error(400, "'messages' must be a list of message objects", param="messages")
    stream = body.get("stream", False)
    session = body.get("session")
    if not isinstance(stream, bool) or (session is not None and not isinstance(session, str)):
        return openai_error(400, "'stream' must be a bool and 'session' a string")
    inputs: dict[str, Any] = {"messages": messages}
    for name in rt.plans[model].inputs:
        if name in body and name not in _PROTOCOL_FIELDS:
            inputs[name] = body[name]
    refused = state.admit()
    if refused is not None:
        status, reason, message = refused
        return openai_error(
            status,
            message,
            type_="rate_limit_error" if status == 429 else "server_error",
            code=reason,
            headers={"retry-after": "1"},
        )
    try:
        call = rt.call(model, inputs, session=session)
    except InputError as exc:
        return openai_error(400, str(exc), param=exc.field)
    state.enter(call)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    if stream:
        return ChatStreamResponse(state, call, include_usage=include_usage)
    return ChatResponse(state, call)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=repr)


def _error_message(call: Call, errors: list[dict[str, Any]]) -> str:
    if not errors:
        return f"the call ended with status '{call.status}'"
    e = errors[0]
    return f"graph '{call.graph}', node '{e['node']}': {e['message']}"


class ChatStreamResponse(CallResponse):
    """Server-sent events of ``chat.completion.chunk`` objects, then ``data: [DONE]``."""

    def __init__(self, state: ServeState, call: Call, *, include_usage: bool) -> None:
        super().__init__(state, call)
        self.include_usage = include_usage

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
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        first = delta({"role": "assistant", "content": ""})
        http.bytes_out += len(first)
        await send({"type": "http.response.body", "body": first, "more_body": True})
        n = 0
        async with contextlib.aclosing(_text_frames(self)) as texts:
            async for frame in texts:
                if self.disconnected:
                    continue
                chunk = delta({"content": frame})
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                n += 1
                http.bytes_out += len(chunk)
        http.frames_out[call.graph] = http.frames_out.get(call.graph, 0) + n
        status, errors = call_status(call, self.extra_errors)
        if status == "ok":
            tail = delta({}, "stop")
            if self.include_usage:
                usage = {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}
                tail += event([], usage=usage)
        else:
            err = {"message": _error_message(call, errors), "type": "server_error"}
            tail = b"data: " + dumps({"error": {**err, "param": None, "code": status}}) + b"\n\n"
        await self._finish(send, tail + b"data: [DONE]\n\n")


class ChatResponse(CallResponse):
    """One ``chat.completion`` object with the concatenated text."""

    async def respond(self, send: Send) -> None:
        call = self.call
        async with contextlib.aclosing(_text_frames(self)) as texts:
            parts = [t async for t in texts]
        if self.disconnected:
            return
        status, errors = call_status(call, self.extra_errors)
        if status == "ok":
            n = len(parts)
            code = 200
            obj: dict[str, Any] = {
                "id": f"chatcmpl-{call.call_id}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": call.graph,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(parts)},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n},
            }
        else:
            code = 500
            obj = {
                "error": {
                    "message": _error_message(call, errors),
                    "type": "server_error",
                    "param": None,
                    "code": status,
                }
            }
        body = dumps(obj)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-should-retry", b"false"),
        ]
        self.state.http.frames_out[call.graph] = self.state.http.frames_out.get(
            call.graph, 0
        ) + len(parts)
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await self._finish(send, body)


async def _text_frames(resp: CallResponse) -> AsyncGenerator[str, None]:
    """The text deltas of the call: the values of its ``text`` frames."""
    async with contextlib.aclosing(resp.raw_frames()) as frames:
        async for frame in frames:
            if frame.field == "text":
                yield _text(frame.value)


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
