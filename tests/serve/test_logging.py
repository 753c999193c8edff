"""Server-side logs over a real server: node errors with traceback, call id, graph and node;
``--log-format json``; one line per client disconnect; the client never sees a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from omniflow._exceptions import NodeError
from omniflow.serve._logging import JsonFormatter, TextFormatter

from .conftest import TEST_GRAPHS, run_server

TIMEOUT = httpx.Timeout(20.0)


async def _wait_for(pred: Any, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def test_node_errors_are_logged_as_json_with_traceback(tmp_path: Path) -> None:
    args = ["--log-format", "json", "--log-level", "info"]
    with run_server(TEST_GRAPHS, *args, tmp=tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            r = await c.post("/v1/graphs/values/call", json={"inputs": {"kind": "fail"}})
            done = json.loads(r.text.splitlines()[-1])
        assert done["status"] == "error"
        assert done["warnings"] == []
        [err] = done["errors"]
        assert err["node"] == "values.make"
        assert "boom on purpose" in err["message"]
        assert "Traceback" not in r.text  # the client gets the message only

        def logged() -> list[dict[str, Any]]:
            return [e for e in _json_lines(server.stderr()) if e["level"] == "error"]

        await _wait_for(lambda: logged())
        [entry] = logged()
        assert entry["logger"] == "omniflow.serve"
        assert entry["graph"] == "values" and entry["node"] == "values.make"
        assert entry["call_id"] and entry["call_id"] in entry["msg"]
        assert "boom on purpose" in entry["msg"]
        tb = entry["traceback"]
        assert tb.startswith("Traceback (most recent call last)")
        assert 'raise RuntimeError("boom on purpose")' in tb
        assert entry["ts"].endswith("Z")
        # every line the server wrote is one JSON object
        lines = [line for line in server.stderr().splitlines() if line.strip()]
        assert all(line.startswith("{") for line in lines), lines


async def test_a_client_disconnect_is_one_log_line(tmp_path: Path) -> None:
    gate = tmp_path / "never"
    marker = Path(str(gate) + ".cancelled")
    with run_server(TEST_GRAPHS, "--log-level", "debug", tmp=tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            body = {"inputs": {"gate": str(gate)}}
            async with c.stream("POST", "/v1/graphs/gated/call", json=body) as r:
                lines = r.aiter_lines()
                assert json.loads(await anext(lines))["value"] == "started"
                before = server.stderr()
        await _wait_for(marker.exists)
        await _wait_for(lambda: "client disconnected" in server.stderr())
        await asyncio.sleep(0.5)  # anything else it would log about it
        added = server.stderr()[len(before) :].splitlines()
        about = [line for line in added if "disconnect" in line.lower() or "Traceback" in line]
        assert len(about) == 1, added
        assert "graph=gated" in about[0]
        assert len(added) < 10, added


def _record(**extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("omniflow.serve", logging.ERROR, __file__, 1, "m %s", ("x",), None)
    for k, v in extra.items():
        setattr(record, k, v)
    return record


def test_formatters() -> None:
    rec = _record(call_id="c1", graph="g", node="n.run", traceback="Traceback ...\n  boom\n")
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"] == "m x" and out["level"] == "error" and out["logger"] == "omniflow.serve"
    assert (out["call_id"], out["graph"], out["node"]) == ("c1", "g", "n.run")
    assert out["traceback"] == "Traceback ...\n  boom"
    text = TextFormatter().format(rec)
    assert "ERROR omniflow.serve: m x [call_id=c1 graph=g node=n.run]\nTraceback ..." in text
    plain = json.loads(JsonFormatter().format(_record()))
    assert set(plain) == {"ts", "level", "logger", "msg"}


@pytest.mark.parametrize("placement", ["inproc"])
async def test_in_process_node_errors_carry_their_traceback(placement: str) -> None:
    import omniflow as of

    from . import _graphs

    async with of.Runtime(_graphs.values, placement=placement) as rt:
        call = rt.call("values", {"kind": "fail"})
        async for _ in call:
            pass
    [err] = call.errors
    assert isinstance(err, NodeError)
    assert err.traceback is not None
    assert "boom on purpose" in err.traceback and "_graphs.py" in err.traceback
