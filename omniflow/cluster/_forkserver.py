"""Workers forked from a fork server: the same ``omniflow worker`` command, started by ``fork``.

A front's ``SubprocessLauncher`` (``_launch``) starts each worker as ``python -m omniflow
worker ...``: a fresh interpreter that imports omniflow and then the graph's modules. With the
fast path on (``OMNIFLOW_FAST_PATH``, Linux), it asks a *fork server* instead: one process per
launcher, started the same way on the first start, which imports the worker's stack (omniflow's
command line, runtime, transport and codec; uvloop) once and then forks a child per worker.
The child runs exactly the command line, environment and working directory the spawned worker
would have had (``ForkServer.fork``), in a session of its own. Two things are gained:

- A hop between workers is cheaper: the workers' copies of what the fork server imported are
  the same physical pages until one of them writes there, so the three workers of a chain that
  run in turn on one CPU share cache lines instead of evicting three copies of the same code
  (measured: the 3-worker chain's p50 18-24% lower, benchmarks/README, *Workers forked by a fork
  server*).
- A worker starts in a fork, not an interpreter start and a few hundred imports (restarts of
  a crashed replica included).

What a forked worker shares with its fork server was made in the server before any request:
imports only (no thread runs there, which ``serve`` checks before each fork; no event loop, no
socket but its control connection, which the child closes). The hash seed is the one the
server drew (one per deployment instead of one per process). Only a request made with the
server's own working directory and environment (but for the variables that differ per
worker, which nothing reads before the worker runs: the cluster key, the start-error file) is
served by it: the imports it made read no other state, so the child
cannot tell that it was not spawned; a front whose directory or environment changed gets a
fork server of its own for them (``SubprocessLauncher``).

Supervision stays with the front. The control connection is a ``socketpair`` (nothing else
can reach it: no address, no key needed). The server answers a fork with the child's pid and a
*pidfd* for it (``SCM_RIGHTS``), opened before the server could have reaped the child, so the
front's kill (``pidfd_send_signal``) can never hit a recycled pid; it reports each child's
exit code when it reaps it (``SIGCHLD``). The server leaves when the front closes the
connection or goes away; a worker watches its front itself (``Worker._watch_parent``, on a
pidfd), so a front that crashes takes its forked workers with it as it does spawned ones. A
fork server that dies under a front (killed, OOM) takes its workers' supervision with it:
the front kills them (they end with -SIGKILL, and the fleet's supervisor respawns them, by a
new fork server).

Wire (both ways): one JSON object per ``SOCK_SEQPACKET`` message. Front to server:
``{"argv": [...], "env": {...}}``. Server to front: ``{"pid": N}`` with the pidfd, or
``{"error": "..."}``, answering requests in order; ``{"exit": N, "code": C}`` whenever a child
ends (``C`` as ``Popen.returncode``: negative for a signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from omniflow._exceptions import OmniflowError

__all__ = ["ForkServer", "ForkServerError", "Forked", "forking_supported"]

logger = logging.getLogger("omniflow.runtime")

#: The server's program: the command-line layer's ``fork_server``, which imports the worker's
#: stack and then runs ``main`` (``python -c``: the directory it starts in is first on its
#: path, as for ``python -m omniflow``).
ENTRY: Final = "import sys; from omniflow._cli_worker import fork_server; sys.exit(fork_server())"
#: How long a fork may take to be answered (the first includes the server's start and imports,
#: on a loaded machine) before the server is given up (the launcher then spawns).
REPLY_TIMEOUT: Final = 60.0
#: The largest message either side sends (a request carries the whole environment).
MAX_MESSAGE: Final = 1 << 20


class ForkServerError(OmniflowError):
    """The fork server could not start, refused a fork, or is gone."""


def forking_supported() -> bool:
    """Whether this platform has what a fork server needs (Linux: pidfds, fd passing)."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "pidfd_open")
        and hasattr(signal, "pidfd_send_signal")
        and hasattr(socket, "recv_fds")
    )


# ---------------------------------------------------------------------------- the server side


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """The fork server's loop, in the server process: fork a child per request and report each
    child's end. Returns None when the front closed the connection, and in a forked child (only
    there) the request that child must run, with the server's state already dropped."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # (the wake-up fd does the work)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    children: set[int] = set()
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is sock:
                    raw = sock.recv(MAX_MESSAGE)
                    if not raw:
                        return None  # the front closed the connection (or is gone)
                    request = _parse_request(raw)
                    if isinstance(request, str):
                        _send(sock, {"error": request})
                        continue
                    if threading.active_count() != 1:
                        _send(sock, {"error": "the fork server runs threads; it forks no more"})
                        continue
                    pid = os.fork()
                    if pid == 0:
                        # The child: nothing of the server's may outlive the fork.
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        sel.close()
                        sock.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        return request
                    children.add(pid)
                    pidfd = os.pidfd_open(pid)  # (not reaped before this: we reap, below)
                    try:
                        _send(sock, {"pid": pid}, [pidfd])
                    finally:
                        os.close(pidfd)
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    _reap(sock, children)
    except (BrokenPipeError, ConnectionResetError):
        return None  # the front went away mid-message


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Report every child that ended (reaped here, so its pid is free again only now)."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _parse_request(raw: bytes) -> dict[str, Any] | str:
    """The request in ``raw``, or why it is not one (the front is trusted, but a bad request
    must get an answer, not kill the server)."""
    try:
        request = json.loads(raw)
    except ValueError as exc:
        return f"a request that is not JSON: {exc}"
    if (
        type(request) is not dict
        or type(request.get("argv")) is not list
        or not all(type(a) is str for a in request["argv"])
        or type(request.get("env")) is not dict
        or not all(type(k) is str and type(v) is str for k, v in request["env"].items())
    ):
        return "a request must be {'argv': [str, ...], 'env': {str: str}}"
    return request


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def become(request: dict[str, Any], run: Callable[[list[str]], int], program: str) -> int:
    """In a forked child: become the process the request describes, as ``python -m omniflow
    ARGV`` (``program``: omniflow's ``__main__``) with that environment would be, and return
    ``run(ARGV)``, its exit status."""
    os.setsid()  # a session of its own, as a spawned worker (Ctrl-C is the front's to handle)
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    # What ``python -m omniflow`` has: its __main__ as the program, the directory it started
    # in first on the path (the server's ``python -c`` put "" there).
    sys.argv = [program, *argv]
    if sys.path and sys.path[0] == "":
        sys.path[0] = os.getcwd()
    return run(argv)


def main(fd: int, run: Callable[[list[str]], int], program: str) -> int:
    """The fork server's loop on the control connection at ``fd``, in a process that imported
    what its children share (``omniflow._cli_worker.fork_server``, the program ``ENTRY``
    runs); in each forked child, ``become``."""
    request = serve(socket.socket(fileno=fd))
    if request is None:
        return 0
    return become(request, run, program)


# ---------------------------------------------------------------------------- the front side


class Forked:
    """A child of the fork server, as the front sees it: its pid, a pidfd, how it ended."""

    __slots__ = ("_ended", "pid", "pidfd", "returncode")

    def __init__(self, pid: int, pidfd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.returncode: int | None = None
        self._ended: asyncio.Future[int] = loop.create_future()

    def ended(self, code: int) -> None:
        """It ended with ``code`` (reported by the server, or -SIGKILL when the server was
        lost and the front killed it)."""
        if self.returncode is None:
            self.returncode = code
            self._ended.set_result(code)
            os.close(self.pidfd)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    def kill(self) -> None:
        """SIGKILL, through the pidfd: never another process that took a recycled pid."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


class ForkServer:
    """The front's end of one fork server (see the module docstring)."""

    def __init__(self, cwd: str, env: dict[str, str], vary: tuple[str, ...] = ()) -> None:
        #: The working directory and environment it runs in and serves, but for ``vary``:
        #: variables a request may set per worker (read by the worker only once it runs).
        self.vary = frozenset(vary)
        self.cwd = cwd
        self.env = self._shared(env)
        self.process: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replies: deque[asyncio.Future[Forked]] = deque()
        self._children: dict[int, Forked] = {}
        self._lock = asyncio.Lock()
        self.lost: str | None = None  #: why it is gone, once it is

    def serves(self, cwd: str, env: dict[str, str]) -> bool:
        """Whether a worker with this working directory and environment may be forked here."""
        return self.lost is None and cwd == self.cwd and self._shared(env) == self.env

    def _shared(self, env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in self.vary}

    async def start(self) -> None:
        """Start the server process; ForkServerError if it cannot be."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-c", ENTRY, str(theirs.fileno()),
                pass_fds=[theirs.fileno()], stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True, env=self.env, cwd=self.cwd,
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            raise ForkServerError(f"the fork server could not start: {exc}") from exc
        finally:
            theirs.close()
        self.attach(ours)

    def attach(self, sock: socket.socket) -> None:
        """Talk to the server at the other end of ``sock`` (a ``SOCK_SEQPACKET`` connection)
        from this event loop."""
        sock.setblocking(False)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)

    async def fork(self, argv: list[str], env: dict[str, str]) -> Forked:
        """Fork a child that runs ``omniflow ARGV`` with environment ``env``."""
        async with self._lock:  # one request at a time: answers come in order
            sock, loop = self._sock, self._loop
            if sock is None or loop is None or self.lost is not None:
                raise ForkServerError(f"the fork server is gone: {self.lost or 'not started'}")
            reply: asyncio.Future[Forked] = loop.create_future()
            self._replies.append(reply)
            try:
                await loop.sock_sendall(sock, json.dumps({"argv": argv, "env": env}).encode())
            except OSError as exc:
                self._replies.remove(reply)
                self._lose(f"writing to it failed: {exc}")
                raise ForkServerError(f"the fork server is gone: {self.lost}") from exc
            try:
                return await asyncio.wait_for(reply, REPLY_TIMEOUT)
            except TimeoutError:
                self._lose(f"it did not answer a fork in {REPLY_TIMEOUT:.0f} s")
                raise ForkServerError(f"the fork server is gone: {self.lost}") from None

    def _readable(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            raw, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except BlockingIOError:
            return
        except ConnectionResetError:  # (it exited with our request unread)
            raw, fds = b"", []
        except OSError as exc:
            self._lose(f"reading from it failed: {exc}")
            return
        if not raw:
            for fd in fds:
                os.close(fd)
            self._lose("it exited")
            return
        try:
            message = json.loads(raw)
        except ValueError:
            message = None
        if type(message) is dict and "exit" in message:
            child = self._children.pop(message["exit"], None)
            if child is not None:
                child.ended(int(message["code"]))
            return
        if self._replies and type(message) is dict:
            self._answer(self._replies.popleft(), message, fds)
            return
        for fd in fds:
            os.close(fd)
        self._lose(f"it sent {raw[:80]!r}, which answers nothing asked")

    def _answer(
        self, reply: asyncio.Future[Forked], message: dict[str, Any], fds: list[int]
    ) -> None:
        """The answer to the fork ``reply`` waits for. A child is registered here, as its
        answer is read, not when ``fork`` resumes: its exit report may be the very next
        message (a worker that fails at once), read before then. A child whose fork was given
        up on (cancelled) is killed; its exit is still reported, and reaped."""
        pid = message.get("pid")
        if type(pid) is not int or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if not reply.done():
                error = message.get("error", message)
                reply.set_exception(ForkServerError(f"the fork server refused: {error}"))
            return
        assert self._loop is not None
        child = self._children[pid] = Forked(pid, fds[0], self._loop)
        if reply.done():
            child.kill()
        else:
            reply.set_result(child)

    def _lose(self, why: str) -> None:
        """The server is gone (or broke the protocol): no more forks through it; its children,
        which nobody can reap for the front now, are killed and end as killed."""
        if self.lost is not None:
            return
        self.lost = why
        self._disconnect()
        while self._replies:
            reply = self._replies.popleft()
            if not reply.done():  # (one given up on is cancelled)
                reply.set_exception(ForkServerError(f"the fork server: {why}"))
        if self._children:
            logger.warning(
                "the fork server (pid %s) is lost (%s): killing its %d workers, to be respawned",
                self.process.pid if self.process else "?", why, len(self._children),
            )  # fmt: skip
        self._kill_children()

    def _kill_children(self) -> None:
        """Kill the children still running; each ends as killed (nobody can reap them for the
        front once the connection is gone)."""
        for child in self._children.values():
            child.kill()
            child.ended(-signal.SIGKILL)
        self._children.clear()

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.remove_reader(sock.fileno())
            sock.close()

    async def close(self) -> None:
        """Close the connection (the server leaves) and wait for the server's exit. Its
        children are the launcher's to stop first: one still running is killed."""
        if self.lost is None:
            self.lost = "closed"
            self._disconnect()
        self._kill_children()
        if self.process is not None:
            await self.process.wait()
