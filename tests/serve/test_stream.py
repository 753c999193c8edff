"""The NDJSON writer coalesces frames that are already queued into one chunk: nothing lost,
nothing reordered, nothing held back; frames written in the producer's turn (the server's
chunk writer, ``Call.deliver``) and frames queued for the response's task mix in order."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.runtime import Frame
from omniflow.serve import create_app
from omniflow.serve._conn import WRITE_BODY
from omniflow.serve._stream import BATCH_MAX, frame_line, frame_lines

BURST = str(Path(__file__).with_name("_burst.py"))

values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.just("SET"),
    st.lists(st.integers(), max_size=3),
)
plans = st.lists(st.tuples(st.sampled_from(["a", "b"]), values), min_size=1, max_size=300)


async def _post(plan: list[tuple[str, Any]], accept: list[bool] | None = None) -> list[bytes]:
    """The body chunks of one streamed call of ``burst``, through the whole ASGI app. With
    ``accept``, the scope offers a chunk writer (``WRITE_BODY``) that takes a chunk or
    refuses it (a full socket) in that cyclic pattern."""
    app = create_app([BURST])
    body = json.dumps({"inputs": {"plan": plan}, "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/graphs/burst/call", "raw_path": b"/v1/graphs/burst/call",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    request = [{"type": "http.request", "body": body, "more_body": False}]
    if accept is not None:
        turn = iter(accept * (len(plan) + 2))

        def write_body(chunk: bytes) -> bool:
            if not sent or not chunk or not next(turn, True):  # not started, or "full"
                return False
            sent.append({"type": "http.response.body", "body": chunk, "more_body": True})
            return True

        scope["extensions"] = {WRITE_BODY: write_body}

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await asyncio.Event().wait()  # the client stays until the response is over
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if accept is not None and message["type"] == "http.response.body":
            await asyncio.sleep(0)  # a socket draining: producers run meanwhile
        sent.append(message)

    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
        assert app.state.omniflow.runtime.stats()["active_calls"] == 0
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert all(m["type"] == "http.response.body" for m in sent[1:])
    assert [m["more_body"] for m in sent[1:]] == [True] * (len(sent) - 2) + [False]
    return [m["body"] for m in sent[1:]]


@settings(max_examples=40, deadline=None)
@given(plans)
def test_queued_frames_are_coalesced_all_delivered_in_order(plan: list[tuple[str, Any]]) -> None:
    chunks = asyncio.run(_post(plan))
    lines = [json.loads(x) for x in b"".join(chunks).splitlines()]
    done = lines.pop()
    good = [(f, v) for f, v in plan if v != "SET"]
    # every encodable frame, in the order produced, each with its own seq (its position)
    assert [(ln["field"], ln["value"]) for ln in lines] == good
    assert [ln["seq"] for ln in lines] == [i for i, (_, v) in enumerate(plan) if v != "SET"]
    assert {ln["node"] for ln in lines} <= {"burst.emit"}
    bad = [i for i, (_, v) in enumerate(plan) if v == "SET"]
    assert [e["exc_type"] for e in done["errors"]] == ["ValueEncodingError"] * len(bad)
    assert done["status"] == ("error" if bad else "ok")
    # every chunk but the done line is whole lines; the burst was queued before the first
    # write, so it went out in ceil(n / BATCH_MAX) chunks, not one per frame
    frame_chunks = chunks[:-1]
    assert all(c.endswith(b"\n") for c in chunks)
    if good:
        assert len(frame_chunks) <= -(-len(plan) // BATCH_MAX)
    assert chunks[-1].count(b"\n") == 1


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", 'q"\\\u00e9']), st.integers(), st.integers(0, 2**40)),
        max_size=20,
    )
)
def test_frame_lines_is_frame_line_joined(frames: list[tuple[str, int, int]]) -> None:
    fs = [(Frame(f, v, 'n.\u00e9"x', s), json.dumps(v).encode()) for f, v, s in frames]
    assert frame_lines(fs) == b"".join(frame_line(f, v) for f, v in fs)
    for (f, v, s), line in zip(
        frames, b"".join(frame_line(*x) for x in fs).splitlines(), strict=True
    ):
        assert json.loads(line) == {"field": f, "value": v, "node": 'n.\u00e9"x', "seq": s}


paused_plans = st.lists(
    st.tuples(st.sampled_from(["a", "b"]), st.one_of(st.integers(), st.just("PAUSE"))),
    min_size=1,
    max_size=200,
)


@settings(max_examples=40, deadline=None)
@given(paused_plans, st.lists(st.booleans(), min_size=1, max_size=20))
def test_frames_written_in_the_producers_turn_or_queued_arrive_all_in_order(
    plan: list[tuple[str, Any]], accept: list[bool]
) -> None:
    chunks = asyncio.run(_post(plan, accept))
    lines = [json.loads(x) for x in b"".join(chunks).splitlines()]
    done = lines.pop()
    frames = [(f, v) for f, v in plan if v != "PAUSE"]
    assert [(ln["field"], ln["value"]) for ln in lines] == frames
    assert [ln["seq"] for ln in lines] == list(range(len(frames)))
    assert done["status"] == "ok"
    assert all(c.endswith(b"\n") for c in chunks)
