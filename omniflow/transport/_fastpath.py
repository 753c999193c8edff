"""Which transport carries same-node traffic: the ``OMNIFLOW_FAST_PATH`` switch, read here only.

>>> import os
>>> os.environ["OMNIFLOW_FAST_PATH"] = "0"
>>> fast_path_enabled(), local_url("/run/of/w0.sock")
(False, 'ipc:///run/of/w0.sock')
>>> del os.environ["OMNIFLOW_FAST_PATH"]
>>> fast_path_enabled(), local_url("/run/of/w0.sock"), is_local("uds:///run/of/w0.sock")
(True, 'uds:///run/of/w0.sock', True)

On (the default): endpoints whose two ends share this node are ``uds://`` (``_uds``, plain
Unix-domain sockets driven by the event loop). Off (``0``, ``false``, ``off``, ``no``): they are
``ipc://`` (pyzmq), as before the fast path existed. Spawned workers inherit the front's
environment, so one setting covers a deployment; a front hands the setting to its Ray actors.

The processes omniflow starts itself (workers, ``omniflow serve``, ``omniflow run``) run their
event loop with ``run_loop``: on uvloop when the fast path is on and uvloop is installed (the
``fast`` extra), else on asyncio's. A runtime embedded in an application runs in that
application's loop, whichever it is.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

from omniflow._exceptions import TransportError

__all__ = [
    "FAST_PATH_ENV",
    "SPIN_ENV",
    "fast_path_enabled",
    "front_spin",
    "is_local",
    "local_url",
    "run_loop",
]

T = TypeVar("T")

#: The environment variable that turns the same-node fast path off (``0``) or on (default).
FAST_PATH_ENV: Final = "OMNIFLOW_FAST_PATH"

#: The environment variable that sets the front's spin (µs; ``0`` turns it off).
SPIN_ENV: Final = "OMNIFLOW_SPIN_US"
#: The front's spin when the fast path is on and ``OMNIFLOW_SPIN_US`` is unset (µs).
DEFAULT_SPIN_US: Final = 500
#: The most a front may spin (µs): a spin is short, or it is busy polling.
MAX_SPIN_US: Final = 10_000

_ON: Final = frozenset({"", "1", "true", "on", "yes"})
_OFF: Final = frozenset({"0", "false", "off", "no"})
#: URL prefixes of socket-file transports (both ends on one node, in different processes).
_LOCAL: Final = ("uds://", "ipc://")


def fast_path_enabled() -> bool:
    """Whether same-node endpoints use ``uds://`` (``OMNIFLOW_FAST_PATH``, default on)."""
    value = os.environ.get(FAST_PATH_ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise TransportError(
        f"{FAST_PATH_ENV}={os.environ[FAST_PATH_ENV]!r} is not a switch; set it to 1 (the "
        "default: same-node endpoints over uds://) or 0 (over pyzmq ipc://), or unset it"
    )


def front_spin() -> float:
    """How long (s) a front keeps polling its workers' sockets without sleeping after its last
    message, while remote work is in flight (``OMNIFLOW_SPIN_US``, µs; default
    ``DEFAULT_SPIN_US`` with the fast path on, 0 with it off). A reply that lands within it is
    read without the process being woken; with nothing in flight the front sleeps at once."""
    raw = os.environ.get(SPIN_ENV, "").strip()
    if not raw:
        return DEFAULT_SPIN_US / 1e6 if fast_path_enabled() else 0.0
    try:
        us = int(raw)
    except ValueError:
        us = -1
    if not 0 <= us <= MAX_SPIN_US:
        raise TransportError(
            f"{SPIN_ENV}={os.environ[SPIN_ENV]!r} is not a spin; set it to whole microseconds "
            f"from 0 (never spin) to {MAX_SPIN_US}, or unset it (default {DEFAULT_SPIN_US} "
            "with the fast path on)"
        )
    return us / 1e6


def local_url(path: str) -> str:
    """The URL of a same-node endpoint at socket file ``path``: ``uds://`` or ``ipc://``."""
    return f"{'uds' if fast_path_enabled() else 'ipc'}://{path}"


def is_local(url: str) -> bool:
    """Whether ``url`` is a socket file on this node (``uds://``, ``ipc://``): its peer is
    another process on the same host."""
    return url.startswith(_LOCAL)


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end in a new event loop and return what it returns: on uvloop when
    the fast path is on and uvloop is installed (its loop wakes up and dispatches a message in
    less time than asyncio's), else on asyncio's (``asyncio.run``). A bad switch raises
    TransportError with ``main`` closed, never run."""
    try:
        uvloop = _uvloop()
    except TransportError:
        main.close()
        raise
    if uvloop is None:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def _uvloop() -> Any:
    """The uvloop module when the fast path is on and it is installed, else None."""
    if not fast_path_enabled():
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop
