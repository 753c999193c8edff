"""Running the app under uvicorn, with omniflow's shutdown: drain first, then stop listening.

>>> serve(create_app("graphs/chat.py"), host="127.0.0.1", port=8000)   # doctest: +SKIP
0

Shutdown on SIGTERM or SIGINT, in this order:

1. the app stops admitting calls: new calls get 503, ``/healthz`` answers 503 (a load balancer
   takes the instance out), other routes keep answering;
2. in-flight calls get up to ``drain_timeout`` seconds to finish; the rest are cancelled (their
   streams end with ``{"done": true, "status": "cancelled", ...}``);
3. uvicorn stops: listening socket closed, idle keep-alive connections closed;
4. the Runtime closes (every role's teardown) and ``serve`` returns 0.

A second signal skips what is left of step 2 (cancels at once); a third forces uvicorn out.
uvicorn's own handling would close the listening socket first (clients would see refused
connections, not 503s) and re-raise the signal at the end (exit status -15, not 0), so the
server installs its own handlers.

Connections run uvicorn's h11 protocol with the idle/header timeouts and the connection cap of
the app's ``Limits`` (``_conn``); the process's open-file limit is raised (up to its hard
limit) so that the cap, not ``EMFILE``, is what a flood of connections meets. Logs go to
stderr as text or JSON lines (``_logging``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import socket
import sys
from collections.abc import Callable, Generator

import uvicorn
from starlette.applications import Starlette

from omniflow._exceptions import OmniflowError
from omniflow.serve._conn import protocol_class
from omniflow.serve._logging import configure
from omniflow.serve._state import ServeState
from omniflow.transport import run_loop

__all__ = ["Server", "serve"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Server(uvicorn.Server):
    """uvicorn's server with omniflow's drain-first signal handling and a ready banner."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServeState,
        *,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.on_ready = on_ready
        self._signals = 0
        self._drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        installed = []
        try:
            for sig in _SIGNALS:
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                    continue
                installed.append(sig)
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        elif self._signals == 2:
            asyncio.get_running_loop().create_task(self._stop_now())
        else:
            self.force_exit = True
            self.should_exit = True

    async def _drain(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True

    async def _stop_now(self) -> None:
        await self.state.cancel_all()
        self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # says TCP; with proto 0, Nagle's algorithm and delayed ACKs add ~40 ms to small responses.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OmniflowError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port "
            "(0 picks a free one)"
        ) from exc
    sock.set_inheritable(True)
    return sock


def _raise_file_limit(connections: int) -> None:
    """Let the process hold ``connections`` sockets plus its own files, if the hard limit
    allows; warn when it does not (the cap then cannot be reached)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    if soft != resource.RLIM_INFINITY and soft < want:
        logging.getLogger("omniflow.serve").warning(
            "open-file limit %d is below --max-connections %d + 256; lower the cap or raise "
            "the limit (ulimit -n)",
            soft,
            connections,
        )


def serve(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    access_log: bool = False,
    announce: Callable[[str], None] | None = None,
    log_format: str = "text",
) -> int:
    """Serve ``app`` (from ``create_app``) until SIGTERM/SIGINT; return the exit status (0).

    ``announce`` receives the base URL (``http://host:port``) once the server accepts
    connections; with ``port=0`` the system picks a free port and the URL names it.
    ``log_format`` is ``"text"`` or ``"json"`` (one object per line).
    """
    state: ServeState = app.state.omniflow
    configure(log_level, log_format)
    limits = state.limits
    _raise_file_limit(limits.max_connections)
    protocol, tracker = protocol_class(limits)
    state.http.connections = tracker.counts
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    url = f"http://[{host}]:{bound_port}" if ":" in host else f"http://{host}:{bound_port}"
    config = uvicorn.Config(
        app,
        log_level=log_level,
        log_config=None,  # configure() did it
        access_log=access_log,
        lifespan="on",
        # WebSockets (/v1/realtime) on the websockets package's sans-I/O protocol; one message
        # is capped like a request body (a larger one closes that connection, code 1009).
        ws="websockets-sansio",
        ws_max_size=limits.max_body_bytes,
        ws_per_message_deflate=False,
        http=protocol,
        timeout_keep_alive=limits.idle_timeout,  # type: ignore[arg-type]  # a float works
        # After the drain only idle connections are left; do not wait long for stragglers.
        timeout_graceful_shutdown=5,
    )
    server = Server(config, state, on_ready=(lambda: announce(url)) if announce else None)

    async def main() -> None:
        # Start the runtime here, not in uvicorn's lifespan: a failing role setup then raises
        # an OmniflowError the CLI prints as one line, instead of uvicorn's exit(3).
        await state.start()
        try:
            await server.serve(sockets=[sock])
        finally:
            await state.close()

    try:
        run_loop(main())
    finally:
        sock.close()
    if not server.started:
        print("omniflow serve: the server did not start (see the log above)", file=sys.stderr)
        return 1
    return 0
