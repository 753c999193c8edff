"""OpenAI-compatible chat: ``POST /v1/chat/completions`` and ``GET /v1/models``.

>>> client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")  # doctest: +SKIP
>>> client.chat.completions.create(model="chat", messages=[...])               # doctest: +SKIP

A graph opts in by its shape: a Placeholder named ``messages`` (it receives the request's
OpenAI messages list as is) and an output field ``text`` (each frame's value is a text delta;
other output fields are not sent). The request's ``model`` names the graph. Any other
Placeholder of the graph is filled from the request field of the same name (``temperature``,
``max_tokens``, or anything passed with the client's ``extra_body``). A Placeholder named after
one of OpenAI's optional request fields (``OPTIONAL_FIELDS``: ``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop``...) gets None when the request leaves the field out, as OpenAI
reads an absent field as null; ``max_completion_tokens`` fills ``max_tokens`` too. ``session``
in the body (``extra_body={"session": "s1"}``) or the ``X-Omniflow-Session`` header runs the
call in that session (turns of one conversation then reuse their cached prefix).

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

import contextlib
import json
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omniflow._exceptions import InputError, NodeError
from omniflow.runtime import Call, Runtime
from omniflow.serve._chat_request import OPENAI_FIELDS, check_chat_request
from omniflow.serve._codec import ValueDecodingError, dumps, loads
from omniflow.serve._limits import bad_session
from omniflow.serve._stream import CallResponse, call_status

if TYPE_CHECKING:
    from starlette.types import Send

    from omniflow.serve._state import ServeState

__all__ = ["OPTIONAL_FIELDS", "chat_graphs", "openai_error", "routes"]

#: Request fields that belong to the OpenAI protocol and are never graph inputs.
_PROTOCOL_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "session"})
#: OpenAI's optional chat request fields: a Placeholder named so is None when they are absent.
OPTIONAL_FIELDS = OPENAI_FIELDS - _PROTOCOL_FIELDS
#: The header that names the session when the body does not.
SESSION_HEADER = "x-omniflow-session"


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
    # Admission before the body is read: a refused client costs no body bytes.
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
    response: Response | CallResponse | None = None
    try:
        response = await _start_chat(request, state)
    finally:
        if not isinstance(response, CallResponse):
            state.release()
    return response


async def _start_chat(request: Request, state: ServeState) -> Response | CallResponse:
    rt = state.runtime
    try:
        body = loads(await request.body())
    except ValueDecodingError as exc:
        return openai_error(400, f"request body: {exc}")
    if not isinstance(body, dict):
        return openai_error(400, "request body must be a JSON object")
    models = {name: rt.plans[name].inputs for name in chat_graphs(rt)}
    invalid = check_chat_request(body, models)
    if invalid is not None:
        return openai_error(invalid.status, invalid.message, param=invalid.param, code=invalid.code)
    model: str = body["model"]
    session = body.get("session", request.headers.get(SESSION_HEADER))
    problem = bad_session(session)
    if problem is not None:
        return openai_error(400, problem, param="session")
    inputs: dict[str, Any] = {"messages": body["messages"]}
    if body.get("max_tokens") is None and "max_completion_tokens" in body:
        body["max_tokens"] = body["max_completion_tokens"]
    for name in models[model]:
        if name in _PROTOCOL_FIELDS:
            continue
        if name in body:
            inputs[name] = body[name]
        elif name in OPTIONAL_FIELDS:
            inputs[name] = None
    try:
        call = rt.call(model, inputs, session=session)
    except InputError as exc:
        return openai_error(400, str(exc), param=exc.field)
    state.enter(call)
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    if body.get("stream"):
        return ChatStreamResponse(state, call, include_usage=include_usage)
    return ChatResponse(state, call)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=repr)


def _error_message(call: Call, errors: list[dict[str, Any]]) -> str:
    if not errors:
        return f"the call ended with status '{call.status}'"
    e = errors[0]
    return f"graph '{call.graph}', node '{e['node']}': {e['message']}"


def _input_error(call: Call) -> NodeError | None:
    """The graph's own ``InputError`` that failed ``call`` (a node refused the request's
    input), in any placement (across processes only its type name survives)."""
    for err in call.errors:
        if err.kind == "error" and (
            err.exc_type == "InputError" or isinstance(err.__cause__, InputError)
        ):
            return err
    return None


def _failure(call: Call, errors: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """A failed call as an HTTP status and OpenAI error object: 400 when a node raised
    ``InputError`` (the request is wrong: retrying it cannot help), else 500."""
    refused = _input_error(call)
    if refused is not None:
        message = refused.message.removeprefix("InputError: ")
        field = getattr(refused.__cause__, "field", None) or refused.field
        error = {
            "message": f"graph '{call.graph}', node '{refused.node}': {message}",
            "type": "invalid_request_error",
            "param": field,
            "code": None,
        }
        return 400, {"error": error}
    error = {
        "message": _error_message(call, errors),
        "type": "server_error",
        "param": None,
        "code": call.status if call.status != "ok" else "error",
    }
    return 500, {"error": error}


async def _send_json(resp: CallResponse, send: Send, status: int, obj: dict[str, Any]) -> None:
    body = dumps(obj)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if status >= 400:
        # The call failed on what the request asked: the same request fails the same way.
        headers.append((b"x-should-retry", b"false"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await resp._finish(send, body)


class ChatStreamResponse(CallResponse):
    """Server-sent events of ``chat.completion.chunk`` objects, then ``data: [DONE]``.

    The response starts with the call's first text frame: a call that fails before it has
    said anything is answered as without streaming (a 400 for the graph's ``InputError``,
    else a 500), so the client's ``create(stream=True)`` raises as OpenAI's does for a bad
    request, instead of a 200 whose stream holds an error."""

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
        n = 0
        tally = _Usage()
        async with contextlib.aclosing(_text_frames(self, tally)) as texts:
            first = await anext(texts, None)
            if first is None:
                status, errors = call_status(call, self.extra_errors)
                if status != "ok":
                    if not self.disconnected:
                        await _send_json(self, send, *_failure(call, errors))
                    return
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            opening = delta({"role": "assistant", "content": ""})
            http.bytes_out += len(opening)
            await self.send_chunk(opening)
            if first is not None:
                chunk = delta({"content": first})
                await self.send_chunk(chunk)
                n += 1
                http.bytes_out += len(chunk)
            async for frame in texts:
                if self.disconnected:
                    continue
                chunk = delta({"content": frame})
                await self.send_chunk(chunk)
                n += 1
                http.bytes_out += len(chunk)
        http.frames_out[call.graph] = http.frames_out.get(call.graph, 0) + n
        status, errors = call_status(call, self.extra_errors)
        if status == "ok":
            tail = delta({}, tally.finish_reason())
            if self.include_usage:
                tail += event([], usage=tally.usage(n))
        else:
            err = {"message": _error_message(call, errors), "type": "server_error"}
            tail = b"data: " + dumps({"error": {**err, "param": None, "code": status}}) + b"\n\n"
        await self._finish(send, tail + b"data: [DONE]\n\n")


class ChatResponse(CallResponse):
    """One ``chat.completion`` object with the concatenated text."""

    async def respond(self, send: Send) -> None:
        call = self.call
        tally = _Usage()
        async with contextlib.aclosing(_text_frames(self, tally)) as texts:
            parts = [t async for t in texts]
        if self.disconnected:
            return
        self.state.http.frames_out[call.graph] = self.state.http.frames_out.get(
            call.graph, 0
        ) + len(parts)
        status, errors = call_status(call, self.extra_errors)
        if status != "ok":
            await _send_json(self, send, *_failure(call, errors))
            return
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
                    "finish_reason": tally.finish_reason(),
                }
            ],
            "usage": tally.usage(len(parts)),
        }
        await _send_json(self, send, 200, obj)


class _Usage:
    """The graph's own ``usage`` frame, if it emits one, in OpenAI's shape."""

    __slots__ = ("reported",)

    def __init__(self) -> None:
        self.reported: dict[str, Any] | None = None

    def see(self, value: Any) -> None:
        if isinstance(value, dict):
            self.reported = value

    def finish_reason(self) -> str:
        reason = (self.reported or {}).get("finish_reason")
        return "length" if reason == "length" else "stop"

    def usage(self, frames: int) -> dict[str, Any]:
        got = self.reported
        if got is None:
            return {"prompt_tokens": 0, "completion_tokens": frames, "total_tokens": frames}
        prompt, completion = _count(got, "prompt_tokens"), _count(got, "completion_tokens")
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if "cached_tokens" in got:
            out["prompt_tokens_details"] = {"cached_tokens": _count(got, "cached_tokens")}
        return out


def _count(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


async def _text_frames(resp: CallResponse, tally: _Usage) -> AsyncGenerator[str, None]:
    """The text deltas of the call (its ``text`` frames); ``usage`` frames go to ``tally``."""
    async with contextlib.aclosing(resp.raw_frames()) as frames:
        async for frame in frames:
            if frame.field == "text":
                yield _text(frame.value)
            elif frame.field == "usage":
                tally.see(frame.value)


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
