"""A private, throwaway ``redis-server`` for tests.

>>> with redis_server() as server:                      # doctest: +SKIP
...     registry = RedisRegistry(server.url)
...     server.restart()                                # same port, empty data

The server listens on 127.0.0.1 on a free port (never the machine's 6379), keeps nothing on
disk (``--save "" --appendonly no``, a temporary directory), and is killed on exit. If
``redis-server`` is not installed it is installed from Debian's ``redis-server`` package when
running as root (apt-get), else :class:`RedisServerError` says what to install.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = ["RedisServer", "RedisServerError", "find_redis_server", "redis_server"]


class RedisServerError(RuntimeError):
    """The test Redis server could not be installed, started or reached."""


def find_redis_server(*, install: bool = True) -> str:
    """Path of ``redis-server``; apt-get installs it when missing and we are root."""
    path = shutil.which("redis-server")
    if path is not None:
        return path
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RedisServerError(
            "redis-server is not installed; install it (Debian/Ubuntu: `apt-get install "
            "redis-server`) to run the Redis registry tests"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RedisServerError(
                f"redis-server is missing and `{' '.join(cmd)}` failed "
                f"(exit {done.returncode}): {done.stderr.strip()[-500:]}"
            )
    path = shutil.which("redis-server")
    if path is None:
        raise RedisServerError("apt-get installed redis-server but it is not on PATH")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _server_pid(port: int, timeout: float = 0.2) -> int | None:
    """The pid of the redis-server answering on ``port`` (None if nothing answers yet).

    Asking for the pid, not just for PONG, tells our server from another one on that port.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                reply += chunk
    except OSError:
        return None
    for line in reply.split(b"\r\n"):
        if line.startswith(b"process_id:"):
            return int(line.split(b":", 1)[1])
    return None


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port``; start/stop/restart it at will."""

    def __init__(self, port: int | None = None, *, executable: str | None = None) -> None:
        #: The TCP port; chosen free on first start unless given.
        self.port = port if port is not None else _free_port()
        self._executable = executable
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers (itself, not another server)."""
        if self.running:
            return
        executable = self._executable or find_redis_server()
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="omniflow-redis-")
        directory = Path(self._dir.name)
        self._log = open(directory / "redis.log", "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [
                executable,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(directory),
                "--daemonize", "no",
                "--protected-mode", "yes",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while _server_pid(self.port) != self._proc.pid:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_tail()
                self.stop()
                raise RedisServerError(
                    f"redis-server on port {self.port} did not come up; its log ends with:\n{log}"
                )
            time.sleep(0.01)

    def stop(self) -> None:
        """Kill the server (data is lost: nothing is persisted)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, *, timeout: float = 10.0) -> None:
        """Stop and start again on the same port, empty."""
        self.stop()
        self.start(timeout=timeout)

    def log_tail(self, lines: int = 20) -> str:
        if self._dir is None:
            return ""
        with contextlib.suppress(OSError):
            text = (Path(self._dir.name) / "redis.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def close(self) -> None:
        self.stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RedisServer {self.url} {'running' if self.running else 'stopped'}>"


@contextlib.contextmanager
def redis_server(*, attempts: int = 3) -> Iterator[RedisServer]:
    """A started private server (a new free port per attempt if the first is taken)."""
    executable = find_redis_server()
    for attempt in range(attempts):
        server = RedisServer(executable=executable)
        try:
            server.start()
        except RedisServerError:
            server.close()
            if attempt == attempts - 1:
                raise
            continue
        with server:
            yield server
        return
