"""What the tests of ``omniflow serve`` through the official ``openai`` client share:
messages, the realtime event loop's reader, and the /metrics gauges that must be back to zero
once every call ended (tests/serve/test_openai_media.py, tests/serve/test_openai_real.py)."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest

from .conftest import ServerProc, metric

#: The server's ``rt.stats()`` and calls in flight, as /metrics exposes them.
STATS = (
    "omniflow_open_buckets",
    "omniflow_inflight_activations",
    "omniflow_active_calls",
    "omniflow_data_plane_held_bytes",
    "omniflow_http_calls_inflight",
)

#: The openai client opens its realtime WebSocket with websockets' ``connect()`` outside a
#: ``with`` (its own code, not ours), which websockets >= 17.1 warns about.
OPENAI_WS_WARNING = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)


def user(content: Any) -> list[Any]:
    """One user message with ``content`` (text, or a list of parts)."""
    return [{"role": "user", "content": content}]


def runtime_stats(server: ServerProc, key: str | None = None) -> dict[str, float]:
    """The ``STATS`` gauges of ``server`` (``key``: its ``--api-key``)."""
    headers = {"x-api-key": key} if key is not None else {}
    text = httpx.get(server.url + "/metrics", headers=headers).text
    assert all(f"\n{name} " in text for name in STATS), text  # (metric() reads absent as 0)
    return {name: metric(text, name) for name in STATS}


def until(rt: Any, kind: str) -> list[Any]:
    """Realtime events up to and including the first of type ``kind``."""
    seen = []
    while True:
        event = rt.recv()
        seen.append(event)
        if event.type == kind:
            return seen


def turn(rt: Any, pcm: bytes) -> None:
    """Say ``pcm`` (16-bit mono at 24 kHz) into a realtime session and commit it."""
    rt.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
    rt.input_audio_buffer.commit()


def respond(rt: Any, pcm: bytes) -> list[Any]:
    """One realtime turn on ``pcm`` and its response: the events up to ``response.done``,
    which open with the commit, the conversation item and the response."""
    turn(rt, pcm)
    rt.response.create()
    events = until(rt, "response.done")
    assert [e.type for e in events][:3] == [
        "input_audio_buffer.committed",
        "conversation.item.created",
        "response.created",
    ], events[:3]
    return events
