"""Workers forked by a fork server (``cluster/_forkserver.py``, the launcher's default with the
fast path on): a forked worker sees what a spawned one sees; the front supervises it as its own
(exit codes, kill by pidfd); a fork server that cannot start or is lost costs no work; the
front's side of the control connection keeps replies, exits and losses apart in any order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omniflow as of
from omniflow.cluster import _forkserver
from omniflow.cluster._forkserver import ForkServer, ForkServerError
from omniflow.cluster._launch import ForkedHandle, SubprocessHandle, SubprocessLauncher

from . import fork_graphs as fg
from .test_multiprocess import alive

GRAPH_FILE = str(Path(fg.__file__).resolve())
KEY = "test-cluster-key-0123456789abcdef"

pytestmark = pytest.mark.skipif(
    not _forkserver.forking_supported(), reason="fork servers need Linux pidfds"
)


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIFLOW_CLUSTER_KEY", KEY)
    monkeypatch.delenv("OMNIFLOW_FAST_PATH", raising=False)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 30) -> None:
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > within:
            pytest.fail(f"not within {within:.0f}s: {what}")
        await asyncio.sleep(0.02)


def launcher_of(rt: of.Runtime) -> SubprocessLauncher:
    assert rt.remote is not None
    launcher = rt.remote.fleet.launcher
    assert isinstance(launcher, SubprocessLauncher)
    return launcher


async def facts(rt: of.Runtime) -> dict[str, Any]:
    out = await rt.run("fork_where", {"x": 1})
    assert out["y"] == [2]
    facts: dict[str, Any] = out["facts"][0]
    return facts


# ---------------------------------------------------------------- a forked worker, end to end


@pytest.mark.slow
async def test_a_forked_worker_sees_what_a_spawned_one_sees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same command line, environment (set after the front started), directory, path and a
    session of its own; only its parent differs (the fork server, not the front)."""
    monkeypatch.setenv(fg.PROBE_ENV, "forked")
    async with of.Runtime(fg.where, placement="process") as rt:
        forked = await facts(rt)
        [server] = launcher_of(rt)._servers
        assert server.process is not None
        handle = next(iter(rt.remote.fleet.replicas.values())).process  # type: ignore[union-attr]
        assert isinstance(handle, ForkedHandle) and handle.pid == forked["pid"]
    assert forked["ppid"] == server.process.pid != os.getpid()
    assert server.process.returncode == 0  # closed with the runtime
    monkeypatch.setenv(fg.PROBE_ENV, "spawned")
    monkeypatch.setenv("OMNIFLOW_FAST_PATH", "0")
    async with of.Runtime(fg.where, placement="process") as rt:
        spawned = await facts(rt)
        assert launcher_of(rt)._servers == []
        handle = next(iter(rt.remote.fleet.replicas.values())).process  # type: ignore[union-attr]
        assert isinstance(handle, SubprocessHandle)
    assert spawned["ppid"] == os.getpid()
    for f in (forked, spawned):
        assert f["sid"] == f["pid"]  # a session of its own: Ctrl-C is the front's
        assert f["cwd"] == f["path0"] == os.getcwd()
        assert f["argv0"].endswith(os.path.join("omniflow", "__main__.py"))
        assert f["argv"] == ["worker", GRAPH_FILE]
        assert f["start_error_file"].endswith(".err")
    assert (forked["probe"], spawned["probe"]) == ("forked", "spawned")


@pytest.mark.slow
async def test_a_fork_server_that_cannot_start_leaves_the_worker_spawned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_forkserver, "ENTRY", "import sys; sys.exit(3)")
    with caplog.at_level(logging.WARNING, logger="omniflow.runtime"):
        async with of.Runtime(fg.where, placement="process") as rt:
            f = await facts(rt)
            [server] = launcher_of(rt)._servers
            assert server.lost == "it exited"
    assert f["ppid"] == os.getpid()
    assert any("is spawned, not forked" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
async def test_a_lost_fork_server_takes_its_workers_and_the_fleet_forks_new_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="omniflow.runtime"):
        async with of.Runtime(fg.where, placement="process") as rt:
            first = await facts(rt)
            os.kill(first["ppid"], signal.SIGKILL)

            async def replaced() -> bool:
                with contextlib.suppress(Exception):
                    return bool((await facts(rt))["pid"] != first["pid"])
                return False

            await eventually(replaced, "a new worker answers")
            second = await facts(rt)
            assert not alive(first["pid"])
            assert second["ppid"] not in (first["ppid"], os.getpid())  # a new fork server
            servers = launcher_of(rt)._servers
            assert [s.lost for s in servers] == ["it exited", None]
    assert any("killing its 1 workers" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the fork server itself


async def server_here(tmp_path: Path) -> ForkServer:
    server = ForkServer(os.getcwd(), dict(os.environ), vary=("OMNIFLOW_START_ERROR_FILE",))
    await server.start()
    return server


@pytest.mark.slow
async def test_exit_codes_come_from_the_fork_server_and_kill_goes_by_pidfd(
    tmp_path: Path,
) -> None:
    server = await server_here(tmp_path)
    try:
        env = dict(os.environ)
        version = await server.fork(["--version"], env)
        assert await version.wait() == 0 and version.returncode == 0
        no_bind = await server.fork(["worker", GRAPH_FILE, "--role", "w"], env)
        assert await no_bind.wait() == 1  # "needs --registry or --bind"
        bind = f"uds://{tmp_path}/w.sock"
        worker = await server.fork(["worker", GRAPH_FILE, "--role", "w", "--bind", bind], env)
        await eventually(lambda: asyncio.sleep(0, (tmp_path / "w.sock").exists()), "bound")
        assert worker.returncode is None and alive(worker.pid)
        worker.kill()
        assert await worker.wait() == -signal.SIGKILL
        worker.kill()  # (ended: nothing to kill, no error)
    finally:
        await server.close()
    assert server.process is not None and server.process.returncode == 0
    with pytest.raises(ForkServerError, match="gone: closed"):
        await server.fork(["--version"], dict(os.environ))


@pytest.mark.slow
async def test_a_bad_request_is_answered_and_the_server_forks_on(tmp_path: Path) -> None:
    server = await server_here(tmp_path)
    try:
        assert server._sock is not None and server._loop is not None
        for raw in (b"not json", json.dumps({"argv": "--version", "env": {}}).encode()):
            reply = server._loop.create_future()
            server._replies.append(reply)
            server._sock.send(raw)
            with pytest.raises(ForkServerError, match="refused: a request"):
                await reply
        ok = await server.fork(["--version"], dict(os.environ))
        assert await ok.wait() == 0
    finally:
        await server.close()


def test_a_fork_server_serves_its_own_directory_and_environment_only() -> None:
    env = {"PATH": "/bin", "OMNIFLOW_START_ERROR_FILE": "/tmp/a.err"}
    server = ForkServer("/srv", env, vary=("OMNIFLOW_START_ERROR_FILE",))
    assert server.serves("/srv", {**env, "OMNIFLOW_START_ERROR_FILE": "/tmp/b.err"})
    assert server.serves("/srv", {"PATH": "/bin"})
    assert not server.serves("/elsewhere", env)
    assert not server.serves("/srv", {**env, "PYTHONPATH": "/x"})
    assert not server.serves("/srv", {"OMNIFLOW_START_ERROR_FILE": "/tmp/a.err"})
    server.lost = "it exited"
    assert not server.serves("/srv", env)


def test_bad_requests_are_named() -> None:
    parse = _forkserver._parse_request
    assert parse(b'{"argv": ["a"], "env": {"K": "v"}}') == {"argv": ["a"], "env": {"K": "v"}}
    assert "not JSON" in str(parse(b"\xff"))
    bad: Any
    for bad in ([], {"argv": ["a"]}, {"argv": [1], "env": {}}, {"argv": [], "env": {"K": 1}}):
        assert "must be" in str(parse(json.dumps(bad).encode()))


def test_a_child_whose_fork_was_given_up_on_is_killed_and_still_reaped() -> None:
    """A fork cancelled before its answer came (its caller gave up): the child the server
    forked anyway is killed through its pidfd, not left running unowned, and its exit report
    is still taken."""
    orphan = subprocess.Popen(["sleep", "600"])
    try:
        asyncio.run(_given_up(orphan.pid))
        assert orphan.wait(30) == -signal.SIGKILL
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


async def _given_up(target: int) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = ForkServer(os.getcwd(), {})
    server.attach(ours)
    loop = asyncio.get_running_loop()
    theirs.setblocking(False)
    task = loop.create_task(server.fork(["--version"], {}))
    await loop.sock_recv(theirs, 1 << 16)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pidfd = os.pidfd_open(target)
    socket.send_fds(theirs, [json.dumps({"pid": target}).encode()], [pidfd])
    os.close(pidfd)
    await eventually(lambda: asyncio.sleep(0, target in server._children), "the answer read")
    theirs.send(json.dumps({"exit": target, "code": -signal.SIGKILL}).encode())
    await eventually(lambda: asyncio.sleep(0, not server._children), "the exit taken")
    assert server.lost is None  # (the answer to a cancelled fork breaks nothing)
    theirs.close()
    await server.close()


# ---------------------------------------------------------------- the front's side, any order

#: One step of a scripted fork server: answer the next request (0: with a pid; 1: with an
#: error; 2: with a pid and, in the same breath, that child's exit, both read before the fork
#: resumes), or report child ``i``'s exit (``i`` modulo the children so far; a repeat is
#: ignored).
Step = tuple[str, int]
steps = st.lists(
    st.one_of(
        st.tuples(st.just("fork"), st.integers(0, 2)),
        st.tuples(st.just("exit"), st.integers(0, 7)),
    ),
    max_size=14,
)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=steps, close_at_end=st.booleans())
def test_the_front_matches_replies_exits_and_loss_in_any_order(
    script: list[Step], close_at_end: bool
) -> None:
    """Against a scripted server: each fork gets the pid answered to it (in order) or its
    error, each exit report ends the right child with its code (once), and a lost server ends
    every child still running as killed and fails the forks still waiting; no fd is left."""
    sleeper = subprocess.Popen(["sleep", "600"])  # the children's pidfds point at it
    before = open_fds()
    try:
        asyncio.run(_scripted(script, close_at_end, sleeper.pid))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert open_fds() == before


async def _scripted(script: list[Step], close_at_end: bool, target: int) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = ForkServer(os.getcwd(), {})
    server.attach(ours)
    loop = asyncio.get_running_loop()
    theirs.setblocking(False)
    forked: list[tuple[int, Any]] = []  # (pid answered, the front's Forked) per good fork
    ended: dict[int, int] = {}  # pid -> code reported
    next_pid = 1000
    for kind, arg in script:
        if kind == "fork":
            task = loop.create_task(server.fork(["--version"], {}))
            request = json.loads(await loop.sock_recv(theirs, 1 << 16))
            assert request == {"argv": ["--version"], "env": {}}
            if arg == 1:  # a refusal
                theirs.send(json.dumps({"error": "no"}).encode())
                with pytest.raises(ForkServerError, match="refused: no"):
                    await task
                continue
            next_pid += 1
            pidfd = os.pidfd_open(target)
            socket.send_fds(theirs, [json.dumps({"pid": next_pid}).encode()], [pidfd])
            os.close(pidfd)
            if arg == 2:  # a child that ended at once: its exit is read before fork resumes
                ended[next_pid] = 2
                theirs.send(json.dumps({"exit": next_pid, "code": 2}).encode())
            child = await task
            assert child.pid == next_pid
            forked.append((next_pid, child))
            if arg == 2:
                assert await asyncio.wait_for(child.wait(), 30) == 2
            else:
                assert child.returncode is None
        elif forked:
            pid, child = forked[arg % len(forked)]
            code = ended.setdefault(pid, arg - 3)  # (a repeat reports the first code again)
            theirs.send(json.dumps({"exit": pid, "code": code}).encode())
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert child.returncode == code
    waiting = None
    if close_at_end:
        waiting = loop.create_task(server.fork(["--version"], {}))
        await loop.sock_recv(theirs, 1 << 16)
        theirs.close()
        with pytest.raises(ForkServerError, match="it exited"):
            await waiting
        assert server.lost == "it exited"
    else:
        theirs.close()
        await server.close()
    for pid, child in forked:
        assert child.returncode == ended.get(pid, -signal.SIGKILL)
        assert await child.wait() == child.returncode
