"""uvicorn's h11 protocol with connection limits: idle and header timeouts, a connection cap.

>>> config = uvicorn.Config(app, http=protocol_class(Limits()))        # doctest: +SKIP

h11 and uvicorn bound a request's header size (16 KiB) but not its time: a client that sends
one header byte a second (slowloris) or opens connections and sends nothing would hold them
forever, and enough of them exhaust the process's file descriptors. Each connection here has
one timer for the phase it is in:

    waiting   (connected, or its last response done; no byte of a new request yet)
              closed after ``idle_timeout`` (after a response, uvicorn's keep-alive timer,
              set to the same value, does it)
    headers   (first byte of a request received, headers incomplete)
              closed after ``header_timeout`` from that first byte
    request   (headers complete, the app runs it): no timer here; the body's time is the
              app's ``body_timeout`` (``_guard``), a response may stream as long as it needs

Closing after an answer that did not read the request (413, 408, a refused connection) is a
lingering close, as nginx does it: the server sends FIN, then reads and discards what the
client still sends for up to ``LINGER_SECONDS`` before it closes. Closing at once with unread
bytes would make the kernel send RST, and the client would lose the answer it has not read.

The cap: at ``max_connections`` open connections, a new one evicts the oldest connection that
has no request running (waiting or in headers); when every connection runs a request, the new
one gets a 503 and is closed. Idle clients therefore never lock out a new one (``/healthz``
stays reachable with any number of idle connections open), and only running requests count
against the cap.

A WebSocket upgrade hands the socket to uvicorn's WebSocket protocol: the connection then
counts against the cap as a running request until the WebSocket closes (never evicted, no idle
or header timer: the realtime route has its own idle timeout, ``--ws-idle-timeout``).

A streaming response's body chunks have a short way out: each request's scope carries the
extension ``WRITE_BODY`` (``scope["extensions"]["omniflow.write_body"]``), a synchronous
``write(chunk) -> bool`` that frames the chunk as HTTP/1.1 chunked encoding, exactly the bytes
h11 would write, and hands it to the socket at once. It returns False (the caller then uses
the ASGI ``send``) whenever it is not that simple: the response has not started or is
complete, its body is not chunked (HTTP/1.0 peer, a Content-Length, HEAD), the client is gone,
or the socket's buffer is full (``send`` waits for it to drain: backpressure is unchanged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

# h11's private writer class tells whether the body is chunked; if h11 ever moves it, the
# chunk writer says no and every chunk goes through ASGI (tests/serve/test_conn.py fails).
from h11._writers import ChunkedWriter
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from omniflow.serve._limits import Limits

__all__ = ["LINGER_SECONDS", "WRITE_BODY", "ConnectionTracker", "protocol_class"]

#: The scope extension of the synchronous body-chunk writer (see the module docstring).
WRITE_BODY = "omniflow.write_body"

#: How long a closing connection keeps discarding what its client still sends.
LINGER_SECONDS = 2.0

log = logging.getLogger("omniflow.serve")

_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: 76\r\n\r\n"
    b'{"error": "the server is at its connection cap (--max-connections); retry"}\n'
)
assert len(_FULL.partition(b"\r\n\r\n")[2]) == 76


class ConnectionTracker:
    """The open connections of one server: which have no request running (oldest first)."""

    __slots__ = ("evicted", "limits", "open", "refused", "timed_out", "waiting")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        #: Connections counted against the cap.
        self.open: set[_Protocol] = set()
        #: Open connections with no request running, oldest first (dict as an ordered set).
        self.waiting: dict[_Protocol, None] = {}
        #: Connections closed to make room for a new one.
        self.evicted = 0
        #: New connections refused because every open one runs a request.
        self.refused = 0
        #: Connections closed by the idle or header timeout.
        self.timed_out = 0

    def admit(self, conn: _Protocol) -> bool:
        """Count ``conn`` in, evicting an idle connection at the cap; False: refuse it."""
        if len(self.open) >= self.limits.max_connections:
            if not self.waiting:
                self.refused += 1
                return False
            victim = next(iter(self.waiting))
            self.evicted += 1
            victim.close_quietly()
        self.open.add(conn)
        self.waiting[conn] = None
        return True

    def counts(self) -> tuple[int, dict[str, int]]:
        """(open connections, {reason: connections closed}) for /metrics."""
        closed = {"evicted": self.evicted, "refused": self.refused, "timeout": self.timed_out}
        return len(self.open), closed

    def validate(self) -> None:
        assert set(self.waiting) <= self.open, "a waiting connection is not open"
        assert len(self.open) <= self.limits.max_connections, "over the connection cap"


class _Lingering:
    """A transport whose ``close()`` lingers (see the module docstring); the rest forwards."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._t = transport
        self._loop = loop
        self.lingering = False
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def close(self) -> None:
        if self.lingering or self._t.is_closing():
            return
        if not self._t.can_write_eof():
            self._t.close()
            return
        self.lingering = True
        self._t.write_eof()  # FIN once the answer is flushed
        self._t.resume_reading()
        self._timer = self._loop.call_later(LINGER_SECONDS, self._t.close)

    def hard_close(self) -> None:
        """Close now (nothing of the client's is left unanswered)."""
        self.cancel_timer()
        self._t.close()

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Protocol(H11Protocol):
    tracker: ConnectionTracker

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._in_headers = False
        self._counted = False
        base = self.ws_protocol_class
        if base is not None:
            self.ws_protocol_class = _tracked_ws(base, self)

    def handle_websocket_upgrade(self, event: Any) -> None:
        # From now on the connection is a running WebSocket: no timer, never evicted; it is
        # uncounted when the WebSocket protocol loses the connection (``_tracked_ws``).
        self._in_headers = False
        self._disarm()
        self.tracker.waiting.pop(self, None)
        super().handle_websocket_upgrade(event)

    # -------------------------------------------------------------- timers

    def _arm(self, seconds: float, phase: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expire, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self.tracker.timed_out += 1
        log.debug("closing a connection from %s: %s timeout", self.client, phase)
        self.close_quietly()

    def close_quietly(self) -> None:
        """Close the connection (no request of it is running) and stop counting it."""
        self._disarm()
        self._uncount()
        self._lingering.hard_close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.tracker.open.discard(self)
            self.tracker.waiting.pop(self, None)

    def _running(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    # -------------------------------------------------------------- protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._lingering = _Lingering(transport, self.loop)
        super().connection_made(self._lingering)  # type: ignore[arg-type]
        if not self.tracker.admit(self):
            log.warning("connection cap (%d) reached: refusing a connection",
                        self.tracker.limits.max_connections)  # fmt: skip
            transport.write(_FULL)
            self._lingering.close()
            return
        self._counted = True
        self._arm(self.tracker.limits.idle_timeout, "idle")

    def data_received(self, data: bytes) -> None:
        if not self._counted or self._lingering.lingering:  # closing: discard
            return
        cycle = self.cycle
        if not self._running() and not self._in_headers:
            self._in_headers = True
            self._arm(self.tracker.limits.header_timeout, "header")
        super().data_received(data)
        self._check_started(cycle)

    def _check_started(self, before: Any) -> None:
        if self.cycle is not before and self._running():  # the headers are complete
            self._in_headers = False
            self._disarm()
            self.tracker.waiting.pop(self, None)
            cycle = self.cycle
            # (The app's task has not run yet: it sees the extension from its first step.)
            extensions = cast("dict[str, Any]", cycle.scope.setdefault("extensions", {}))
            extensions[WRITE_BODY] = self._body_writer(cycle)

    def _body_writer(self, cycle: RequestResponseCycle) -> Callable[[bytes], bool]:
        raw = self._lingering._t
        flow = self.flow

        def write_body(chunk: bytes) -> bool:
            if (
                not chunk
                or cycle is not self.cycle
                or not cycle.response_started
                or cycle.response_complete
                or cycle.disconnected
                or flow.write_paused
                or self._lingering.lingering
                or raw.is_closing()
                or type(getattr(cycle.conn, "_writer", None)) is not ChunkedWriter
            ):
                return False
            raw.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))  # h11's ChunkedWriter framing
            return True

        return write_body

    def on_response_complete(self) -> None:
        if self._counted:  # back to waiting (at the end: the oldest are evicted first)
            self.tracker.waiting.pop(self, None)
            self.tracker.waiting[self] = None
        cycle = self.cycle
        super().on_response_complete()  # arms uvicorn's keep-alive timer (idle_timeout)
        self._check_started(cycle)  # a pipelined request may have started already

    def shutdown(self) -> None:
        if self._running():
            super().shutdown()  # closes after its response
        else:  # idle: nothing to answer, no reason to linger
            self.close_quietly()

    def eof_received(self) -> None:  # None: asyncio closes the transport itself
        if self._lingering.lingering:  # the client has read the answer and closed: close now
            self._lingering.hard_close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lingering.cancel_timer()
        self._disarm()
        self._uncount()
        super().connection_lost(exc)


def _tracked_ws(base: type[asyncio.Protocol], owner: _Protocol) -> Any:
    """A factory of ``base`` WebSocket protocols that uncount ``owner`` when they close."""

    def make(**kwargs: Any) -> asyncio.Protocol:
        protocol = base(**kwargs)
        lost = protocol.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            owner._lingering.cancel_timer()
            owner._uncount()
            lost(exc)

        protocol.connection_lost = connection_lost  # type: ignore[method-assign]
        return protocol

    return make


def protocol_class(limits: Limits) -> tuple[type[asyncio.Protocol], ConnectionTracker]:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits``, and its tracker."""
    tracker = ConnectionTracker(limits)
    cls = type("OmniflowH11Protocol", (_Protocol,), {"tracker": tracker})
    return cls, tracker
