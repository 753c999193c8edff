"""The OpenAI layer (omniflow/serve/_openai.py) on a real ``omniflow serve``: request validation
and failed calls as the official ``openai`` client sees them, and their raw HTTP shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import CHAT, ServerProc, run_server

PICKY = str(Path(__file__).with_name("_chat_graphs.py"))
USER: Any = [{"role": "user", "content": "hi"}]
TIMEOUT = httpx.Timeout(20.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    with run_server(CHAT, PICKY, tmp=tmp_path_factory.mktemp("openai")) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as c:
        yield c


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    return body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"temperature": 2.5}, "temperature", "decimal_above_max_value"),
        ({"top_p": -1}, "top_p", "decimal_below_min_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens", "invalid_type"),
        ({"n": 3}, "n", "unsupported_value"),
        ({"stop": [1]}, "stop[0]", "invalid_type"),
        ({"seed": "7"}, "seed", "invalid_type"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
        ({"messages": []}, "messages", "empty_array"),
    ],
)
def test_bad_fields_are_bad_requests(
    client: openai.OpenAI, fields: dict[str, Any], param: str, code: str, stream: bool
) -> None:
    kw: dict[str, Any] = {"model": "picky", "messages": USER, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kw, stream=stream, extra_body={"mode": "echo"})
    assert info.value.status_code == 400
    err = _error(info.value)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert param.split("[")[0].split(".")[0] in err["message"]


def test_unknown_model_and_unknown_argument(client: openai.OpenAI) -> None:
    # OpenAI answers a model that does not exist with 404 model_not_found: so does omniflow
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    err = _error(info.value)
    assert (err["type"], err["code"]) == ("invalid_request_error", "model_not_found")
    assert "['chat', 'picky']" in err["message"]
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: mod"):
        client.chat.completions.create(model="picky", messages=USER, extra_body={"mod": "echo"})


def test_valid_fields_reach_the_graph(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model="picky", messages=USER, temperature=0.5, top_p=1, n=1, extra_body={"mode": "echo"}
    )
    assert done.choices[0].message.content == "hi at 0.5"
    done = client.chat.completions.create(model="picky", messages=USER, extra_body={"mode": "echo"})
    assert done.choices[0].message.content == "hi at None"  # absent: None, as OpenAI reads it
    # 'mode' is the graph's own required input: leaving it out names it
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="picky", messages=USER)
    assert _error(info.value)["param"] == "mode"


@pytest.mark.parametrize("stream", [False, True])
def test_a_graphs_input_error_is_a_bad_request(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="picky", messages=USER, stream=stream, extra_body={"mode": "refuse"}
        )
    err = _error(info.value)
    assert err["type"] == "invalid_request_error" and err["param"] == "mode"
    assert err["message"] == (
        "graph 'picky', node 'picky.answer': mode 'refuse' refuses every request; use 'echo'"
    )
    # graphs/chat.py refuses a conversation without a user message the same way
    system: Any = [{"role": "system", "content": "be terse"}]
    with pytest.raises(openai.BadRequestError, match="no user message") as info:
        client.chat.completions.create(model="chat", messages=system, stream=stream)
    assert _error(info.value)["param"] == "messages"


@pytest.mark.parametrize("stream", [False, True])
def test_a_node_failure_is_a_server_error(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.InternalServerError, match="picky crashed on purpose") as info:
        client.chat.completions.create(
            model="picky", messages=USER, stream=stream, extra_body={"mode": "crash"}
        )
    assert _error(info.value)["type"] == "server_error"
    assert info.value.response.headers["x-should-retry"] == "false"


def test_a_failure_after_the_stream_started_ends_it_with_an_error(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="picky", messages=USER, stream=True, extra_body={"mode": "late"}
    )
    said = []
    with pytest.raises(openai.APIError, match="refused after speaking"):
        for chunk in stream:
            said.append(chunk.choices[0].delta.content)
    assert said == ["", "partial"]
    # without streaming nothing was said yet: the whole answer is the 400
    with pytest.raises(openai.BadRequestError, match="refused after speaking"):
        client.chat.completions.create(model="picky", messages=USER, extra_body={"mode": "late"})


def test_raw_error_shapes(server: ServerProc) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/chat/completions", json={"model": "chat", "messages": USER, "stream": 1})
        assert r.status_code == 400
        assert r.headers["content-type"] == "application/json"
        assert r.json() == {
            "error": {
                "message": "Invalid type for 'stream': expected a boolean, but got an integer "
                "instead.",
                "type": "invalid_request_error",
                "param": "stream",
                "code": "invalid_type",
            }
        }
        body = {"model": "picky", "messages": USER, "mode": "refuse"}
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 400, r.text
            assert r.headers["content-type"] == "application/json"
            assert r.headers["x-should-retry"] == "false"
            assert json.loads(r.text) == {
                "error": {
                    "message": "graph 'picky', node 'picky.answer': mode 'refuse' refuses "
                    "every request; use 'echo'",
                    "type": "invalid_request_error",
                    "param": "mode",
                    "code": None,
                }
            }
        r = c.post("/v1/chat/completions", json={**body, "mode": "crash"})
        assert r.status_code == 500
        assert r.json()["error"] == {
            "message": "graph 'picky', node 'picky.answer': RuntimeError: picky crashed on purpose",
            "type": "server_error",
            "param": None,
            "code": "error",
        }
        r = c.post("/v1/chat/completions", json={**body, "mode": "echo", "stream": True})
        assert r.status_code == 200 and "x-should-retry" not in r.headers
        assert r.text.endswith("data: [DONE]\n\n")
        r = c.post("/v1/chat/completions", json={**body, "mode": "echo", "temperature": 1})
        assert r.status_code == 200 and "x-should-retry" not in r.headers
        assert r.json()["choices"][0]["message"]["content"] == "hi at 1"


@pytest.mark.slow
def test_a_graphs_input_error_is_a_bad_request_across_processes(tmp_path: Path) -> None:
    """In a worker process the node's InputError reaches the front by its type name only."""
    with (
        run_server(PICKY, "--placement", "process", tmp=tmp_path) as srv,
        openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError, match="refuses every request") as info:
            client.chat.completions.create(
                model="picky", messages=USER, extra_body={"mode": "refuse"}
            )
        assert _error(info.value)["type"] == "invalid_request_error"
        with pytest.raises(openai.InternalServerError, match="picky crashed on purpose"):
            client.chat.completions.create(
                model="picky", messages=USER, extra_body={"mode": "crash"}
            )
