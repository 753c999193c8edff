"""The server's limits and their safe defaults, and the Host / Origin rules.

>>> Limits().max_body_bytes
16777216
>>> host_of(b"[::1]:8000"), host_of(b"LocalHost:80"), host_of(b"example.com")
('::1', 'localhost', 'example.com')
>>> origin_host(b"http://localhost:3000"), origin_host(b"null")
('localhost', None)

Which limit is enforced where:

    ==================  ==========  ===========================================================
    limit               default     where, and what the client sees
    ==================  ==========  ===========================================================
    max_body_bytes      16 MiB      app (``_guard``): 413 from ``Content-Length`` before the
                                    body is read, or as soon as a chunked body passes it
    body_timeout        60 s        app: 408 when the whole body has not arrived by then
    header_timeout      10 s        connection (``_conn``): closed when a request's headers
                                    have not all arrived this long after its first byte
    idle_timeout        5 s         connection: closed after this long without a request
                                    (before the first one, and between keep-alive requests)
    max_connections     1024        connection: at the cap a new connection evicts the oldest
                                    one that has no request running; when every connection
                                    runs a request, the new one gets 503 and is closed (an
                                    open WebSocket counts as a running request)
    ws_idle_timeout     60 s        app (``_realtime``): a WebSocket closed (1000) after this
                                    long with no client event while no response runs
    (WebSocket message) 16 MiB      ``max_body_bytes`` caps one message too: a larger one
                                    closes that connection (1009), no other
    ==================  ==========  ===========================================================

Session ids are at most ``MAX_SESSION_BYTES`` (400 beyond), so that every session can be
closed by ``DELETE /v1/sessions/{id}``; idle ones close after the Runtime's ``session_ttl``.

``allowed_hosts`` (``create_app``) are the ``Host`` names served (``"*"``: any); requests with
another ``Host`` get 403, so a DNS-rebinding page cannot reach a loopback server. A request
with an ``Origin`` header is served only when the origin's host is the request's own ``Host``
(a page of another site gets 403). ``/healthz`` and ``/readyz`` skip both checks (probes use
whatever address they have, and these routes reveal nothing a caller could use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omniflow._exceptions import OmniflowError

__all__ = [
    "LOOPBACK_HOSTS",
    "MAX_SESSION_BYTES",
    "Limits",
    "bad_session",
    "host_of",
    "is_loopback",
    "origin_host",
]

#: The names a loopback-bound server answers to by default.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

MiB = 2**20

#: Longest session id (UTF-8 bytes). A session lives until TTL or ``DELETE
#: /v1/sessions/{id}``, whose id travels in the request line: h11 caps a request head at
#: 16 KiB, and this keeps every id (even percent-encoded) deletable by URL.
MAX_SESSION_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """Server limits; every one has a safe default (see the module docstring)."""

    max_body_bytes: int = 16 * MiB
    body_timeout: float = 60.0
    header_timeout: float = 10.0
    idle_timeout: float = 5.0
    max_connections: int = 1024
    ws_idle_timeout: float = 60.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise OmniflowError naming the first limit that makes no sense."""
        if self.max_body_bytes < 0:
            raise OmniflowError(f"max_body_bytes must be >= 0, got {self.max_body_bytes}")
        for name in ("body_timeout", "header_timeout", "idle_timeout", "ws_idle_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise OmniflowError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.max_connections < 1:
            raise OmniflowError(f"max_connections must be >= 1, got {self.max_connections}")


def bad_session(session: object) -> str | None:
    """Why ``session`` (from a call body) cannot name a session, or None when it can."""
    if session is None:
        return None
    if not isinstance(session, str):
        return f"'session' must be a string or null, got {type(session).__name__}"
    size = len(session.encode("utf-8", "surrogatepass"))
    if not session or size > MAX_SESSION_BYTES:
        return (
            f"'session' must be 1 to {MAX_SESSION_BYTES} bytes long, got {size}; use a short "
            "id (a UUID) and keep per-session data in the session's state"
        )
    return None


def host_of(value: bytes) -> str:
    """The lower-cased host name of a ``Host`` header value, without its port."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        return text[1:end] if end > 0 else text
    name, sep, port = text.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        return name
    return text


def origin_host(value: bytes) -> str | None:
    """The host of an ``Origin`` header (``scheme://host[:port]``); None for ``null`` or junk."""
    text = value.decode("latin-1").strip()
    scheme, sep, rest = text.partition("://")
    if not sep or not scheme or not rest or "/" in rest:
        return None
    return host_of(rest.encode("latin-1"))


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` serves only this machine."""
    h = host.strip("[]").lower()
    return h in LOOPBACK_HOSTS or h.startswith("127.")
