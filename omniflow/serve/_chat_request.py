"""An OpenAI chat request, checked the way OpenAI checks it, before any graph runs.

>>> user = [{"role": "user", "content": "hi"}]
>>> check_chat_request({"model": "chat", "messages": user, "temperature": "hot"}, {"chat": []})
Invalid(status=400, message="Invalid type for 'temperature': expected a decimal, but got a \
string instead.", param='temperature', code='invalid_type')

Pure code (no I/O, no Starlette): ``_openai`` calls it on the decoded body and answers the
``Invalid`` it returns as a 400 (404 for an unknown model) in OpenAI's error shape, so a client
gets ``BadRequestError`` naming the field instead of a graph failing on a value it was never
meant to see. Messages, codes and ``param`` paths follow OpenAI's own (``invalid_type``,
``decimal_above_max_value``, ``missing_required_parameter``, ``messages[0].content``...).

What is checked:

* ``model``: a string naming a served chat graph. A missing one is a 400; one that names no
  chat graph is a **404** ``model_not_found``, as OpenAI answers for a model that does not exist.
* ``messages``: a non-empty array of objects, each with a ``role`` among OpenAI's and the
  ``content`` that role takes (text parts for system/developer/tool, also image/audio/file
  parts for user, text/refusal parts or tool calls for assistant), ``tool_call_id`` for tool.
* Every other OpenAI field, when present and not null: its JSON type and range (``temperature``
  0..2, ``top_p`` 0..1, penalties -2..2, ``max_tokens`` / ``max_completion_tokens`` / ``n``
  integers >= 1, ``seed`` a 64-bit integer, ``stop`` a string or at most 4 strings, ``stream``
  a boolean, ``stream_options`` only with ``stream``...).
* Fields this server cannot honour whatever the graph: ``n`` > 1 (one choice per answer) and
  ``logprobs: true`` are a 400 ``unsupported_value`` rather than an answer that ignores them.
* A field that is neither OpenAI's, nor ``session``, nor a Placeholder of the graph is a 400
  ("Unrecognized request argument supplied"), as OpenAI answers: a misspelt ``temprature``
  is named instead of silently ignored.

OpenAI fields that the graph does not take as a Placeholder are still checked, then not passed
on (a graph without a ``temperature`` input decides its own sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OPENAI_FIELDS", "Invalid", "check_chat_request"]


@dataclass(frozen=True, slots=True)
class Invalid:
    """Why a request is refused, in the terms of OpenAI's error object."""

    #: HTTP status: 400, or 404 for a model that is not served.
    status: int
    #: ``error.message``: what is wrong and what was expected.
    message: str
    #: ``error.param``: the offending field as OpenAI writes it (``messages[0].role``).
    param: str | None
    #: ``error.code``: OpenAI's code (``invalid_type``, ``model_not_found``...).
    code: str | None


class _Refused(Exception):
    """Raised inside the checks, carrying the ``Invalid``; never leaves this module."""

    def __init__(self, invalid: Invalid) -> None:
        super().__init__(invalid.message)
        self.invalid = invalid


def _refuse(message: str, param: str | None, code: str | None, status: int = 400) -> _Refused:
    return _Refused(Invalid(status, message, param, code))


# -- JSON types, named as OpenAI names them -------------------------------------------------

_STRING, _INTEGER, _NUMBER, _BOOLEAN, _OBJECT, _ARRAY = (
    "a string",
    "an integer",
    "a decimal",
    "a boolean",
    "an object",
    "an array",
)


def _kind(value: Any) -> str:
    """The JSON type of a decoded value, in OpenAI's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return _BOOLEAN
    if isinstance(value, int):
        return _INTEGER
    if isinstance(value, float):
        return _NUMBER
    if isinstance(value, str):
        return _STRING
    if isinstance(value, list):
        return _ARRAY
    return _OBJECT  # a dict, or a {"$bytes"} / {"$tensor"} object the codec decoded


def _is(value: Any, kind: str) -> bool:
    k = _kind(value)
    # An integer is a decimal too (temperature 1); a decimal is never an integer (n 1.0).
    return k == kind or (kind == _NUMBER and k == _INTEGER)


def _expect(value: Any, param: str, *kinds: str) -> None:
    if any(_is(value, kind) for kind in kinds):
        return
    wanted = kinds[0] if len(kinds) == 1 else "one of " + " or ".join(kinds)
    raise _refuse(
        f"Invalid type for '{param}': expected {wanted}, but got {_kind(value)} instead.",
        param,
        "invalid_type",
    )


def _bounded(value: Any, param: str, kind: str, low: float | None, high: float | None) -> None:
    _expect(value, param, kind)
    word = "integer" if kind == _INTEGER else "decimal"
    if low is not None and value < low:
        raise _refuse(
            f"Invalid '{param}': {word} below minimum value. Expected a value >= {low:g}, "
            f"but got {value!r} instead.",
            param,
            f"{word}_below_min_value",
        )
    if high is not None and value > high:
        raise _refuse(
            f"Invalid '{param}': {word} above maximum value. Expected a value <= {high:g}, "
            f"but got {value!r} instead.",
            param,
            f"{word}_above_max_value",
        )


def _one_of(value: Any, param: str, allowed: tuple[str, ...]) -> None:
    _expect(value, param, _STRING)
    if value not in allowed:
        quoted = [f"'{a}'" for a in allowed]
        names = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]
        raise _refuse(
            f"Invalid value for '{param}': '{value}'. Supported values are: {names}.",
            param,
            "invalid_value",
        )


def _required(obj: Mapping[str, Any], key: str, path: str) -> Any:
    if obj.get(key) is None:
        raise _refuse(
            f"Missing required parameter: '{path}.{key}'.",
            f"{path}.{key}",
            "missing_required_parameter",
        )
    return obj[key]


# -- messages --------------------------------------------------------------------------------

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: The content part types each role may send (a plain string is always allowed).
_PART_TYPES: dict[str, tuple[str, ...]] = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
}


def _part(part: Any, path: str, types: tuple[str, ...]) -> None:
    _expect(part, path, _OBJECT)
    kind = _required(part, "type", path)
    _one_of(kind, f"{path}.type", types)
    if kind in ("text", "refusal"):
        _expect(_required(part, kind, path), f"{path}.{kind}", _STRING)
    elif kind == "image_url":
        image = _required(part, "image_url", path)
        _expect(image, f"{path}.image_url", _OBJECT)
        _expect(_required(image, "url", f"{path}.image_url"), f"{path}.image_url.url", _STRING)
        if image.get("detail") is not None:
            _one_of(image["detail"], f"{path}.image_url.detail", ("auto", "low", "high"))
    elif kind == "input_audio":
        audio = _required(part, "input_audio", path)
        where = f"{path}.input_audio"
        _expect(audio, where, _OBJECT)
        _expect(_required(audio, "data", where), f"{where}.data", _STRING)
        _one_of(_required(audio, "format", where), f"{where}.format", ("wav", "mp3"))
    else:  # file
        _expect(_required(part, "file", path), f"{path}.file", _OBJECT)


def _content(content: Any, path: str, role: str) -> None:
    _expect(content, path, _STRING, _ARRAY)
    if isinstance(content, list):
        for i, part in enumerate(content):
            _part(part, f"{path}[{i}]", _PART_TYPES[role])


def _message(msg: Any, path: str) -> None:
    _expect(msg, path, _OBJECT)
    role = _required(msg, "role", path)
    _one_of(role, f"{path}.role", _ROLES)
    if msg.get("name") is not None:
        _expect(msg["name"], f"{path}.name", _STRING)
    if role == "function":
        _expect(_required(msg, "name", path), f"{path}.name", _STRING)
        if msg.get("content") is not None:
            _expect(msg["content"], f"{path}.content", _STRING)
        return
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None:
            _expect(calls, f"{path}.tool_calls", _ARRAY)
            for i, call in enumerate(calls):
                _expect(call, f"{path}.tool_calls[{i}]", _OBJECT)
        if msg.get("content") is None and calls is None and msg.get("function_call") is None:
            _required(msg, "content", path)  # an assistant turn says something or calls a tool
        if msg.get("content") is not None:
            _content(msg["content"], f"{path}.content", role)
        return
    _content(_required(msg, "content", path), f"{path}.content", role)
    if role == "tool":
        _expect(_required(msg, "tool_call_id", path), f"{path}.tool_call_id", _STRING)


def _messages(messages: Any) -> None:
    if messages is None:
        raise _refuse(
            "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
        )
    _expect(messages, "messages", _ARRAY)
    if not messages:
        raise _refuse(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got "
            "an empty array instead.",
            "messages",
            "empty_array",
        )
    for i, msg in enumerate(messages):
        _message(msg, f"messages[{i}]")


# -- the other fields ------------------------------------------------------------------------

_INT64 = 2**63


def _stop(value: Any) -> None:
    _expect(value, "stop", _STRING, _ARRAY)
    if isinstance(value, list):
        if len(value) > 4:
            raise _refuse(
                "Invalid 'stop': array too long. Expected an array with maximum length 4, but "
                f"got an array with length {len(value)} instead.",
                "stop",
                "array_above_max_length",
            )
        for i, s in enumerate(value):
            _expect(s, f"stop[{i}]", _STRING)


def _n(value: Any) -> None:
    _bounded(value, "n", _INTEGER, 1, 128)
    if value != 1:
        raise _refuse(
            f"Unsupported value: 'n' is {value}; this server answers one choice per request, "
            "so 'n' must be 1 (send the request n times instead).",
            "n",
            "unsupported_value",
        )


def _logprobs(value: Any) -> None:
    _expect(value, "logprobs", _BOOLEAN)
    if value:
        raise _refuse(
            "Unsupported value: 'logprobs' must be false or null; this server does not "
            "return log probabilities.",
            "logprobs",
            "unsupported_value",
        )


def _logit_bias(value: Any) -> None:
    _expect(value, "logit_bias", _OBJECT)
    for token, bias in value.items():
        _bounded(bias, f"logit_bias.{token}", _NUMBER, -100, 100)


def _tools(value: Any) -> None:
    _expect(value, "tools", _ARRAY)
    for i, tool in enumerate(value):
        path = f"tools[{i}]"
        _expect(tool, path, _OBJECT)
        kind = _required(tool, "type", path)
        _one_of(kind, f"{path}.type", ("function", "custom"))
        spec = _required(tool, kind, path)
        _expect(spec, f"{path}.{kind}", _OBJECT)
        _expect(_required(spec, "name", f"{path}.{kind}"), f"{path}.{kind}.name", _STRING)


def _tool_choice(value: Any) -> None:
    _expect(value, "tool_choice", _STRING, _OBJECT)
    if isinstance(value, str):
        _one_of(value, "tool_choice", ("none", "auto", "required"))


def _response_format(value: Any) -> None:
    _expect(value, "response_format", _OBJECT)
    kind = _required(value, "type", "response_format")
    _one_of(kind, "response_format.type", ("text", "json_object", "json_schema"))
    if kind == "json_schema":
        schema = _required(value, "json_schema", "response_format")
        _expect(schema, "response_format.json_schema", _OBJECT)
        name = _required(schema, "name", "response_format.json_schema")
        _expect(name, "response_format.json_schema.name", _STRING)


def _modalities(value: Any) -> None:
    _expect(value, "modalities", _ARRAY)
    for i, m in enumerate(value):
        _one_of(m, f"modalities[{i}]", ("text", "audio"))


def _audio(value: Any) -> None:
    _expect(value, "audio", _OBJECT)
    _expect(_required(value, "voice", "audio"), "audio.voice", _STRING, _OBJECT)
    _one_of(
        _required(value, "format", "audio"),
        "audio.format",
        ("wav", "aac", "mp3", "flac", "opus", "pcm16"),
    )


def _typed(*kinds: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        _expect(value, name, *kinds)

    return check


def _ranged(kind: str, low: float | None, high: float | None) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        _bounded(value, name, kind, low, high)

    return check


def _alone(check: Callable[[Any], None]) -> Callable[[str, Any], None]:
    return lambda _name, value: check(value)


#: Every optional field of OpenAI's chat request and how its non-null value is checked.
_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "temperature": _ranged(_NUMBER, 0, 2),
    "top_p": _ranged(_NUMBER, 0, 1),
    "frequency_penalty": _ranged(_NUMBER, -2, 2),
    "presence_penalty": _ranged(_NUMBER, -2, 2),
    "max_tokens": _ranged(_INTEGER, 1, None),
    "max_completion_tokens": _ranged(_INTEGER, 1, None),
    "n": _alone(_n),
    "seed": _ranged(_INTEGER, -_INT64, _INT64 - 1),
    "stop": _alone(_stop),
    "stream": _typed(_BOOLEAN),
    "stream_options": _typed(_OBJECT),
    "logprobs": _alone(_logprobs),
    "top_logprobs": _ranged(_INTEGER, 0, 20),
    "logit_bias": _alone(_logit_bias),
    "user": _typed(_STRING),
    "tools": _alone(_tools),
    "tool_choice": _alone(_tool_choice),
    "parallel_tool_calls": _typed(_BOOLEAN),
    "functions": _typed(_ARRAY),
    "function_call": _typed(_STRING, _OBJECT),
    "response_format": _alone(_response_format),
    "modalities": _alone(_modalities),
    "audio": _alone(_audio),
    "metadata": _typed(_OBJECT),
    "store": _typed(_BOOLEAN),
    "service_tier": _typed(_STRING),
    "reasoning_effort": _typed(_STRING),
    "verbosity": _typed(_STRING),
    "prediction": _typed(_OBJECT),
    "web_search_options": _typed(_OBJECT),
    "prompt_cache_key": _typed(_STRING),
    "safety_identifier": _typed(_STRING),
}

#: The fields of OpenAI's chat request (never an "unrecognized argument").
OPENAI_FIELDS = frozenset({"model", "messages", *_CHECKS})


def _check(body: Mapping[str, Any], models: Mapping[str, Collection[str]]) -> None:
    model = body.get("model")
    if model is None:
        raise _refuse("you must provide a model parameter", "model", "missing_required_parameter")
    _expect(model, "model", _STRING)
    if model not in models:
        raise _refuse(
            f"The model '{model}' does not exist: the chat graphs served here are "
            f"{sorted(models)} (a graph serves chat when it has a Placeholder 'messages' and an "
            "output 'text').",
            "model",
            "model_not_found",
            status=404,
        )
    _messages(body.get("messages"))
    for name, check in _CHECKS.items():
        value = body.get(name)
        if value is not None:
            check(name, value)
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise _refuse(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
                "invalid_value",
            )
        if options.get("include_usage") is not None:
            _expect(options["include_usage"], "stream_options.include_usage", _BOOLEAN)
    inputs = models[model]
    for name in body:
        if name not in OPENAI_FIELDS and name != "session" and name not in inputs:
            raise _refuse(
                f"Unrecognized request argument supplied: {name} (graph '{model}' takes "
                f"{sorted(inputs)} besides OpenAI's fields)",
                None,
                None,
            )


def check_chat_request(
    body: Mapping[str, Any], models: Mapping[str, Collection[str]]
) -> Invalid | None:
    """Why ``body`` (a decoded JSON object) is not a chat request for one of ``models``
    (graph name -> its Placeholder names), or None when it is one."""
    try:
        _check(body, models)
    except _Refused as refused:
        return refused.invalid
    return None
