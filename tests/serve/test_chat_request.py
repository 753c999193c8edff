"""The OpenAI chat request checks (omniflow/serve/_chat_request.py): no server, no event loop."""

from __future__ import annotations

from typing import Any

import pytest

from omniflow.serve._chat_request import OPENAI_FIELDS, Invalid, check_chat_request

USER = [{"role": "user", "content": "hi"}]
MODELS = {"chat": ["messages", "temperature", "mood"], "other": ["messages"]}


def check(**body: Any) -> Invalid | None:
    return check_chat_request({"model": "chat", "messages": USER, **body}, MODELS)


def refused(body: dict[str, Any]) -> tuple[int, str | None, str | None]:
    got = check_chat_request(body, MODELS)
    assert got is not None, f"{body} was accepted"
    return got.status, got.param, got.code


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 0, "top_p": 1, "max_tokens": 1, "max_completion_tokens": 5, "n": 1},
        {"temperature": 2.0, "top_p": 0.0, "seed": -(2**63), "stop": "x", "stream": False},
        {"temperature": None, "top_p": None, "seed": None, "stop": None, "stream": None},
        {"stop": ["a", "b", "c", "d"], "stream": True, "stream_options": {"include_usage": True}},
        {"presence_penalty": -2, "frequency_penalty": 2, "logprobs": False, "top_logprobs": 0},
        {"user": "u", "logit_bias": {"50256": -100}, "session": "s1", "mood": {"any": "thing"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}},
        {"metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True},
    ],
)
def test_valid_requests_pass(fields: dict[str, Any]) -> None:
    assert check(**fields) is None


def test_every_message_shape_openai_takes_passes() -> None:
    messages = [
        {"role": "system", "content": "be terse"},
        {"role": "developer", "content": [{"type": "text", "text": "really"}], "name": "d"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}},
                {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
                {"type": "file", "file": {"file_id": "f1"}},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "function", "name": "f", "content": None},
        {"role": "user", "content": "and now?"},
    ]
    assert check_chat_request({"model": "chat", "messages": messages}, MODELS) is None


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"temperature": True}, "temperature", "invalid_type"),
        ({"temperature": 2.5}, "temperature", "decimal_above_max_value"),
        ({"temperature": -0.1}, "temperature", "decimal_below_min_value"),
        ({"top_p": 1.01}, "top_p", "decimal_above_max_value"),
        ({"top_p": [0.5]}, "top_p", "invalid_type"),
        ({"presence_penalty": 3}, "presence_penalty", "decimal_above_max_value"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "decimal_below_min_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 5.0}, "max_tokens", "invalid_type"),
        ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
        ({"max_completion_tokens": -1}, "max_completion_tokens", "integer_below_min_value"),
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"n": 2}, "n", "unsupported_value"),
        ({"n": 1.5}, "n", "invalid_type"),
        ({"seed": 1.5}, "seed", "invalid_type"),
        ({"seed": 2**63}, "seed", "integer_above_max_value"),
        ({"stop": 3}, "stop", "invalid_type"),
        ({"stop": ["a", 1]}, "stop[1]", "invalid_type"),
        ({"stop": list("abcde")}, "stop", "array_above_max_length"),
        ({"stream": 1}, "stream", "invalid_type"),
        ({"stream": "true"}, "stream", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stream": True, "stream_options": [1]}, "stream_options", "invalid_type"),
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "invalid_type",
        ),
        ({"logprobs": True}, "logprobs", "unsupported_value"),
        ({"logprobs": "no"}, "logprobs", "invalid_type"),
        ({"top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
        ({"logit_bias": {"1": 101}}, "logit_bias.1", "decimal_above_max_value"),
        ({"user": 7}, "user", "invalid_type"),
        ({"tools": {"type": "function"}}, "tools", "invalid_type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
        ({"tools": [{"type": "web"}]}, "tools[0].type", "invalid_value"),
        ({"tool_choice": "always"}, "tool_choice", "invalid_value"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "missing_required_parameter",
        ),
        ({"modalities": ["video"]}, "modalities[0]", "invalid_value"),
        ({"audio": {"voice": "alloy"}}, "audio.format", "missing_required_parameter"),
        ({"audio": {"voice": "alloy", "format": "ogg"}}, "audio.format", "invalid_value"),
        ({"metadata": "m"}, "metadata", "invalid_type"),
        ({"temprature": 0.5}, None, None),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    fields: dict[str, Any], param: str | None, code: str | None
) -> None:
    got = check(**fields)
    assert got is not None
    assert (got.status, got.param, got.code) == (400, param, code), got.message
    name = param.split(".")[0].split("[")[0] if param else next(iter(fields))
    assert name in got.message


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        (None, "messages", "missing_required_parameter"),
        ("hi", "messages", "invalid_type"),
        ([], "messages", "empty_array"),
        (["hi"], "messages[0]", "invalid_type"),
        ([{"content": "hi"}], "messages[0].role", "missing_required_parameter"),
        ([{"role": "robot", "content": "hi"}], "messages[0].role", "invalid_value"),
        ([{"role": 1, "content": "hi"}], "messages[0].role", "invalid_type"),
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
        ([{"role": "user", "content": "a", "name": 3}], "messages[0].name", "invalid_type"),
        (
            [*USER, {"role": "user", "content": [{"type": "video"}]}],
            "messages[1].content[0].type",
            "invalid_value",
        ),
        (
            [{"role": "user", "content": [{"text": "no type"}]}],
            "messages[0].content[0].type",
            "missing_required_parameter",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text",
            "invalid_type",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]}],
            "messages[0].content[0].image_url",
            "invalid_type",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].image_url.url",
            "missing_required_parameter",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}],
                }
            ],
            "messages[0].content[0].image_url.detail",
            "invalid_value",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "AA=="}}],
                }
            ],
            "messages[0].content[0].input_audio.format",
            "missing_required_parameter",
        ),
        (
            [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
            "invalid_value",
        ),
        ([{"role": "assistant"}], "messages[0].content", "missing_required_parameter"),
        (
            [{"role": "assistant", "content": None, "tool_calls": "c"}],
            "messages[0].tool_calls",
            "invalid_type",
        ),
        (
            [{"role": "tool", "content": "4"}],
            "messages[0].tool_call_id",
            "missing_required_parameter",
        ),
        ([{"role": "function", "content": "4"}], "messages[0].name", "missing_required_parameter"),
    ],
)
def test_bad_messages_are_400_naming_the_path(messages: Any, param: str, code: str) -> None:
    got = check_chat_request({"model": "chat", "messages": messages}, MODELS)
    assert got is not None
    assert (got.status, got.param, got.code) == (400, param, code), got.message


def test_the_model_missing_wrong_or_unknown() -> None:
    assert refused({"messages": USER}) == (400, "model", "missing_required_parameter")
    assert refused({"model": 4, "messages": USER}) == (400, "model", "invalid_type")
    unknown = check_chat_request({"model": "gpt-4o", "messages": USER}, MODELS)
    # OpenAI answers a model that does not exist with 404 model_not_found; so do we
    assert unknown is not None and (unknown.status, unknown.code) == (404, "model_not_found")
    assert "['chat', 'other']" in unknown.message


def test_graph_inputs_are_not_unrecognized_only_for_that_graph() -> None:
    assert check_chat_request({"model": "chat", "messages": USER, "mood": 1}, MODELS) is None
    got = check_chat_request({"model": "other", "messages": USER, "mood": 1}, MODELS)
    assert got is not None and got.param is None
    assert got.message.startswith("Unrecognized request argument supplied: mood")
    assert "graph 'other' takes ['messages']" in got.message


def test_type_messages_read_as_openai_writes_them() -> None:
    got = check(temperature="hot")
    assert got == Invalid(
        400,
        "Invalid type for 'temperature': expected a decimal, but got a string instead.",
        "temperature",
        "invalid_type",
    )
    got = check(temperature=3)
    assert got is not None and got.message == (
        "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, "
        "but got 3 instead."
    )
    got = check(stop=7)
    assert got is not None
    assert got.message == (
        "Invalid type for 'stop': expected one of a string or an array, but got an integer instead."
    )


def test_openai_fields_are_the_protocol_and_the_checked_ones() -> None:
    assert {"model", "messages", "temperature", "max_completion_tokens", "stream"} <= OPENAI_FIELDS
    assert "session" not in OPENAI_FIELDS  # ours, not OpenAI's
