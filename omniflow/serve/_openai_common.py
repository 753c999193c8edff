"""What every OpenAI endpoint shares: errors in OpenAI's shape, admission, the request's JSON
body and session, and the answer of a call that failed.

>>> openai_error(404, "no such graph", code="model_not_found").status_code
404

``admitted`` takes a slot before the body is read; ``read_json`` answers a body that is not a
JSON object with a 400; ``call_failure`` maps a failed call to a 400 (a node raised
``InputError``: the request is wrong) or a 500, and ``send_failure`` sends that answer unless
the call ended well (``_openai``, ``_speech``, ``_media_routes``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omniflow._exceptions import InputError, NodeError
from omniflow.serve._codec import ValueDecodingError, dumps, loads
from omniflow.serve._endpoints import Endpoint, served
from omniflow.serve._limits import bad_session
from omniflow.serve._stream import CallResponse, call_status

if TYPE_CHECKING:
    from starlette.types import Send

    from omniflow.runtime import Call
    from omniflow.serve._state import ServeState

__all__ = [
    "SESSION_HEADER",
    "admitted",
    "bad_request",
    "call_failure",
    "chosen_model",
    "error_message",
    "openai_error",
    "read_json",
    "request_session",
    "send_failure",
    "send_json",
    "serve_state",
    "unknown_model",
]

#: The header that names the session when the body does not.
SESSION_HEADER = "x-omniflow-session"


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


def bad_request(message: str, param: str | None, code: str | None = "invalid_value") -> Response:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return openai_error(400, message, param=param, code=code)


def unknown_model(model: str, models: list[str], what: str, shape: str) -> Response:
    """The 404 for a ``model`` that names no graph serving ``what`` (graphs of ``shape`` do)."""
    return openai_error(
        404,
        f"The model '{model}' does not exist: the {what} graphs served here are "
        f"{sorted(models)} (a graph serves {what} when it has {shape}).",
        param="model",
        code="model_not_found",
    )


def chosen_model(
    model: Any, plans: Mapping[str, Any], endpoint: Endpoint, what: str, shape: str
) -> str | Response:
    """The graph a request's ``model`` names among those of ``plans`` that serve ``endpoint``
    (``what``, graphs of ``shape``), or the 400 (none named) or 404 (``unknown_model``) that
    says why not: speech, transcriptions and images check the field alike."""
    models = served(plans, endpoint)
    if not isinstance(model, str) or not model:
        return bad_request(
            "you must provide a model parameter (a string)", "model", "missing_required_parameter"
        )
    if model not in models:
        return unknown_model(model, models, what, shape)
    return model


async def read_json(
    request: Request, code: str | None = "invalid_value"
) -> dict[str, Any] | Response:
    """The request's body as a JSON object, or the 400 (its ``code``) that says why it is not
    one."""
    try:
        body = loads(await request.body())
    except ValueDecodingError as exc:
        return bad_request(f"request body: {exc}", None, code)
    if not isinstance(body, dict):
        return bad_request("request body must be a JSON object", None, code)
    return body


def request_session(request: Request, given: Any) -> tuple[str | None, Response | None]:
    """The session the call runs in (``given`` from the body, else the header), and the 400
    when it is not a valid name."""
    session = given if given is not None else request.headers.get(SESSION_HEADER)
    problem = bad_session(session)
    return session, (bad_request(problem, "session") if problem is not None else None)


def serve_state(request: Request) -> ServeState:
    state: ServeState = request.app.state.omniflow
    return state


async def admitted(
    request: Request, start: Callable[[Request, ServeState], Awaitable[Response | CallResponse]]
) -> Response | CallResponse:
    """Run ``start`` under admission: a slot is taken before the body is read (a refused
    client costs no body bytes) and given back unless ``start`` returns a running call."""
    state = serve_state(request)
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
        response = await start(request, state)
    finally:
        if not isinstance(response, CallResponse):
            state.release()
    return response


def error_message(call: Call, errors: list[dict[str, Any]]) -> str:
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


def call_failure(call: Call, errors: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
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
        "message": error_message(call, errors),
        "type": "server_error",
        "param": None,
        "code": call.status if call.status != "ok" else "error",
    }
    return 500, {"error": error}


async def send_json(resp: CallResponse, send: Send, status: int, obj: dict[str, Any]) -> None:
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


async def send_failure(resp: CallResponse, send: Send) -> bool:
    """Answer a call that ended badly (``call_failure``), or nothing when the client has gone;
    False (nothing sent) when the call ended well and the answer is still to send."""
    if resp.disconnected:
        return True
    status, errors = call_status(resp.call, resp.extra_errors)
    if status == "ok":
        return False
    await send_json(resp, send, *call_failure(resp.call, errors))
    return True
