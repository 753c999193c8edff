"""Fixtures: the app in-process (httpx ASGITransport) and ``omniflow serve`` subprocesses.

ASGITransport buffers a whole response before returning it, so streaming, disconnects,
SIGTERM and memory are tested against real servers on real sockets.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from omniflow.serve import ServeState, create_app

ROOT = Path(__file__).resolve().parents[2]
TEST_GRAPHS = str(Path(__file__).with_name("_graphs.py"))
CHAT = str(ROOT / "graphs" / "chat.py")
FIG3 = str(ROOT / "graphs" / "fig3.py")
ZERO = {"open_buckets": 0, "inflight": 0, "active_calls": 0, "data_plane_bytes": 0}


# -- in-process ----------------------------------------------------------------------------


@dataclass
class InProcess:
    app: Starlette
    client: httpx.AsyncClient

    @property
    def state(self) -> ServeState:
        state: ServeState = self.app.state.omniflow
        return state


@pytest.fixture
async def inproc() -> AsyncIterator[Callable[..., Any]]:
    """Factory: ``s = await inproc(**create_app_kwargs)``; lifespan run, client closed after,
    and the runtime must have nothing left of any call."""
    async with contextlib.AsyncExitStack() as stack:
        apps: list[Starlette] = []

        async def make(*sources: str, **kw: Any) -> InProcess:
            app = create_app(list(sources) or [TEST_GRAPHS, CHAT], **kw)
            await stack.enter_async_context(app.router.lifespan_context(app))
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://localhost"
            )
            await stack.enter_async_context(client)
            apps.append(app)
            return InProcess(app, client)

        yield make
        for app in apps:
            state: ServeState = app.state.omniflow
            assert state.runtime.stats() == ZERO
            assert not state.calls


# -- subprocess servers --------------------------------------------------------------------


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


@contextlib.contextmanager
def run_server(
    *args: str, tmp: Path, env: dict[str, str] | None = None, start_timeout: float = 20.0
) -> Iterator[ServerProc]:
    """``python -m omniflow serve ARGS --port 0``; waits for the banner; always killed."""
    log = tmp / f"server-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "omniflow", "serve", *args, "--port", "0"]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=full_env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], start_timeout)
        line = proc.stdout.readline().decode() if ready else ""
        m = re.search(r"http://[^\s]+", line)
        if m is None:
            _stop(proc)
            raise AssertionError(f"server did not start: {line!r}\n{log.read_text()}")
        yield ServerProc(proc, m.group(0), log)
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the tests that leave it running: the test graphs and graphs/chat.py."""
    tmp = tmp_path_factory.mktemp("shared_server")
    with run_server(TEST_GRAPHS, CHAT, tmp=tmp) as server:
        yield server


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus exposition (0 when absent); label order free."""
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    return 0.0
