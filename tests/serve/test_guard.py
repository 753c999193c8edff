"""Request checks in-process: Host, Origin, API key, body limits, NaN, timeout and session
fields, DELETE /v1/sessions, /readyz; the pure helpers of _limits; the connection tracker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow._exceptions import NodeError, OmniflowError
from omniflow.serve._conn import ConnectionTracker
from omniflow.serve._limits import Limits, bad_session, host_of, origin_host

from .conftest import FIG3, TEST_GRAPHS, InProcess

Factory = Callable[..., Any]

# -- pure helpers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "host"),
    [
        (b"localhost", "localhost"),
        (b"LOCALHOST:8000", "localhost"),
        (b"127.0.0.1:1", "127.0.0.1"),
        (b"[::1]:8000", "::1"),
        (b"[::1]", "::1"),
        (b"api.example.com", "api.example.com"),
        (b"evil.example:80", "evil.example"),
    ],
)
def test_host_of(header: bytes, host: str) -> None:
    assert host_of(header) == host


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        (b"http://localhost:3000", "localhost"),
        (b"https://api.example.com", "api.example.com"),
        (b"http://[::1]:8000", "::1"),
        (b"null", None),
        (b"localhost", None),
        (b"http://a.example/path", None),
    ],
)
def test_origin_host(origin: bytes, host: str | None) -> None:
    assert origin_host(origin) == host


def test_bad_session() -> None:
    assert bad_session(None) is None
    assert bad_session("s" * 1024) is None
    assert bad_session("é" * 512) is None  # 1024 bytes in UTF-8
    assert "1 to 1024 bytes" in str(bad_session("é" * 513))
    assert "1 to 1024 bytes" in str(bad_session(""))
    assert "must be a string" in str(bad_session(3))


def test_limits_validate() -> None:
    with pytest.raises(OmniflowError, match="header_timeout"):
        Limits(header_timeout=0)
    with pytest.raises(OmniflowError, match="idle_timeout"):
        Limits(idle_timeout=float("nan"))
    with pytest.raises(OmniflowError, match="max_connections"):
        Limits(max_connections=0)
    with pytest.raises(OmniflowError, match="max_body_bytes"):
        Limits(max_body_bytes=-1)


def test_node_error_traceback_survives_pickling() -> None:
    import pickle

    err = NodeError("a.run", "boom", call_id="c1", graph="g", traceback="Traceback ...\n")
    back = pickle.loads(pickle.dumps(err))
    assert back.traceback == "Traceback ...\n"
    assert NodeError("a.run", "boom").traceback is None
    assert "traceback" not in err.to_dict()  # clients get the message only


# -- the connection tracker: a state machine -------------------------------------------------


class _Conn:
    """What the tracker needs of a connection: ``close_quietly`` uncounts it."""

    def __init__(self, tracker: ConnectionTracker) -> None:
        self.tracker = tracker
        self.closed = False

    def close_quietly(self) -> None:
        self.closed = True
        self.tracker.open.discard(self)  # type: ignore[arg-type]
        self.tracker.waiting.pop(self, None)  # type: ignore[call-overload]


@settings(max_examples=200, deadline=None)
@given(
    cap=st.integers(1, 5),
    ops=st.lists(st.tuples(st.sampled_from("cbfx"), st.integers(0, 20)), max_size=60),
)
def test_tracker_keeps_the_cap_and_evicts_only_waiting_connections(
    cap: int, ops: list[tuple[str, int]]
) -> None:
    """c: connect; b: a connection starts a request; f: it finishes; x: it closes."""
    tracker = ConnectionTracker(Limits(max_connections=cap))
    busy: set[_Conn] = set()
    for op, i in ops:
        live = sorted(tracker.open, key=id)
        if op == "c":
            conn = _Conn(tracker)
            oldest_waiting = next(iter(tracker.waiting), None)
            full = len(tracker.open) >= cap
            admitted = tracker.admit(conn)  # type: ignore[arg-type]
            assert admitted == (not full or oldest_waiting is not None)
            if full and admitted:
                assert oldest_waiting is not None and oldest_waiting.closed
            if not admitted:
                assert busy == set(tracker.open)  # refused only when every one is busy
        elif live:
            conn = live[i % len(live)]
            if op == "b":
                tracker.waiting.pop(conn, None)
                busy.add(conn)
            elif op == "f" and conn in busy:
                busy.discard(conn)
                tracker.waiting[conn] = None
            elif op == "x":
                busy.discard(conn)
                conn.close_quietly()
        tracker.validate()
        assert not any(c.closed for c in busy)  # a running request is never evicted


# -- in-process requests ---------------------------------------------------------------------


async def test_foreign_host_gets_403_loopback_names_pass(inproc: Factory) -> None:
    s: InProcess = await inproc()
    for host in ("localhost", "127.0.0.1:8000", "[::1]:8000"):
        assert (await s.client.get("/v1/graphs", headers={"host": host})).status_code == 200
    r = await s.client.get("/v1/graphs", headers={"host": "evil.example"})
    assert r.status_code == 403
    assert "Host 'evil.example' is not served here" in r.json()["error"]
    r = await s.client.get("/v1/models", headers={"host": "evil.example"})
    assert r.status_code == 403
    assert "--allowed-host" in r.json()["error"]["message"]  # OpenAI's shape there
    for path in ("/healthz", "/readyz"):  # probes use whatever address they have
        assert (await s.client.get(path, headers={"host": "10.0.0.7"})).status_code == 200


async def test_allowed_hosts_and_star(inproc: Factory) -> None:
    s: InProcess = await inproc(TEST_GRAPHS, allowed_hosts=["api.example"])
    assert (await s.client.get("/v1/graphs", headers={"host": "api.example"})).status_code == 200
    assert (await s.client.get("/v1/graphs", headers={"host": "localhost"})).status_code == 403
    s = await inproc(TEST_GRAPHS, allowed_hosts=["*"])
    assert (await s.client.get("/v1/graphs", headers={"host": "any.example"})).status_code == 200


async def test_foreign_origin_gets_403_same_host_passes(inproc: Factory) -> None:
    s: InProcess = await inproc()
    body = {"inputs": {"x": 1}, "stream": False}
    for origin in ("http://evil.example", "null", "http://localhost.evil.example"):
        r = await s.client.post("/v1/graphs/echo/call", json=body, headers={"origin": origin})
        assert r.status_code == 403, origin
        assert "cross-origin" in r.json()["error"]
    for origin in ("http://localhost", "http://localhost:3000", "https://localhost"):
        r = await s.client.post("/v1/graphs/echo/call", json=body, headers={"origin": origin})
        assert r.status_code == 200, origin


async def test_api_key_spares_healthz_and_readyz(inproc: Factory) -> None:
    s: InProcess = await inproc(TEST_GRAPHS, api_key="k3y")
    assert (await s.client.get("/v1/graphs")).status_code == 401
    assert (await s.client.delete("/v1/sessions/s1")).status_code == 401
    assert (await s.client.get("/healthz")).status_code == 200
    assert (await s.client.get("/readyz")).json() == {"status": "ready"}
    r = await s.client.get("/v1/graphs", headers={"x-api-key": "k3y"})
    assert r.status_code == 200


async def test_content_length_over_the_limit_is_413_unread(inproc: Factory) -> None:
    s: InProcess = await inproc(TEST_GRAPHS, limits=Limits(max_body_bytes=100))
    r = await s.client.post("/v1/graphs/echo/call", content=b"x" * 101)
    assert r.status_code == 413
    assert r.headers["connection"] == "close"
    assert "101 bytes is over the server's limit of 100 bytes" in r.json()["error"]
    r = await s.client.post("/v1/graphs/echo/call", json={"inputs": {"x": "a" * 60}})
    assert r.status_code == 200
    assert s.state.http.rejected == {"body_too_large": 1}

    async def chunks() -> Any:  # no Content-Length: counted while read
        for _ in range(5):
            yield b"x" * 40

    r = await s.client.post("/v1/graphs/echo/call", content=chunks())
    assert r.status_code == 413
    r = await s.client.post("/v1/chat/completions", content=b"x" * 101)
    assert r.status_code == 413
    assert "error" in r.json() and "message" in r.json()["error"]
    assert s.state.reserved == 0


@pytest.mark.parametrize("text", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
async def test_nan_and_infinity_are_400(inproc: Factory, text: bytes) -> None:
    s: InProcess = await inproc()
    r = await s.client.post("/v1/graphs/echo/call", content=b'{"inputs": {"x": %s}}' % text)
    assert r.status_code == 400
    assert "finite" in r.json()["error"]
    assert s.state.reserved == 0


@pytest.mark.parametrize("timeout", [0, -1, "1", True, [1]])
async def test_bad_timeout_is_400(inproc: Factory, timeout: Any) -> None:
    s: InProcess = await inproc()
    r = await s.client.post("/v1/graphs/echo/call", json={"inputs": {"x": 1}, "timeout": timeout})
    assert r.status_code == 400
    assert "'timeout' must be a number of seconds > 0" in r.json()["error"]


async def test_delete_session_frees_it(inproc: Factory) -> None:
    s: InProcess = await inproc(FIG3)
    rt = s.state.runtime
    body = {"inputs": {"request": {"parts": [{"text": "a"}]}}, "stream": False}
    for sid in ("s1", "a/b c", "x" * 1024):
        r = await s.client.post("/v1/graphs/fig3/call", json={**body, "session": sid})
        assert r.json()["status"] == "ok"
    assert len(rt.sessions()) == 3
    for sid in ("s1", "a/b c", "x" * 1024, "never-was"):
        assert (await s.client.delete(f"/v1/sessions/{quote(sid)}")).status_code == 204
    assert rt.sessions() == []


async def test_readyz_names_roles_without_a_live_replica(inproc: Factory) -> None:
    s: InProcess = await inproc(TEST_GRAPHS)
    assert (await s.client.get("/readyz")).json() == {"status": "ready"}
    await s.state.drain(0)
    r = await s.client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["status"] == "draining"


@pytest.mark.timeout(120)
async def test_readyz_is_503_naming_a_role_whose_worker_died(tmp_path: Any) -> None:
    import os
    import signal

    from omniflow.serve import create_app

    app = create_app(TEST_GRAPHS, placement="process")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            assert (await c.get("/readyz")).json() == {"status": "ready"}
            remote = app.state.omniflow.runtime.remote
            rep = next(r for r in remote.fleet.replicas.values() if "echo" in r.roles)
            assert rep.process is not None
            os.kill(rep.process.pid, signal.SIGKILL)
            for _ in range(400):
                r = await c.get("/readyz")
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 503
            assert "echo" in r.json()["roles"]


# -- needs the call-lifecycle branch (Runtime(session_ttl=), rt.call(timeout=)) -------------


async def test_session_ttl_frees_idle_sessions(inproc: Factory) -> None:
    s: InProcess = await inproc(FIG3, session_ttl=0.2)
    rt = s.state.runtime
    body = {"inputs": {"request": {"parts": [{"text": "a"}]}}, "stream": False}
    for i in range(5):
        r = await s.client.post("/v1/graphs/fig3/call", json={**body, "session": f"s{i}"})
        assert r.json()["status"] == "ok"
    for _ in range(400):
        if not rt.sessions():
            break
        await asyncio.sleep(0.05)
    assert rt.sessions() == []


async def test_call_timeout_ends_the_call_with_a_timeout_error(
    inproc: Factory, tmp_path: Any
) -> None:
    s: InProcess = await inproc(TEST_GRAPHS)
    body = {"inputs": {"gate": str(tmp_path / "never")}, "timeout": 0.2, "stream": False}
    r = await s.client.post("/v1/graphs/gated/call", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["status"] == "error"
    # the timeout, then the cancel it caused at the node still running
    assert [e["kind"] for e in out["errors"]] == ["timeout", "cancel"]
    assert {e["node"] for e in out["errors"]} == {"gate.wait"}
