"""Graphs for "media values behave the same in every placement" (contract §9).

``MediaSrc.make`` returns ``of.Audio`` and ``of.Image`` values as outputs of their own (which
the data plane places) and nested in a dict (which the codec carries); ``MediaProbe.check``
reports what it received: equal, same type, arrays writable (it writes into them).
Module-level, so a worker process can import them by path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import omniflow as of


def media(n: int) -> dict[str, Any]:
    t = np.arange(4800, dtype=np.float32)
    return {
        "clip": of.Audio((np.sin(t / 7 + n) * 9000).astype(np.int16), sample_rate=24000),
        "fclip": of.Audio(np.cos(t / 5 + n).astype(np.float32) / 2, sample_rate=16000),
        "pic": of.Image(((np.arange(48 * 64 * 3) + n) % 251).astype(np.uint8).reshape(48, 64, 3)),
        "nested": {"pics": [of.Image(np.full((2, 3, 3), n, np.uint8))], "n": n},
    }


def report(got: dict[str, Any], n: int) -> dict[str, Any]:
    """Per key: (equal and of the same type, every array writable)."""
    want = media(n)
    out: dict[str, Any] = {}
    for key in ("clip", "fclip", "pic"):
        value = got[key]
        array = value.samples if isinstance(value, of.Audio) else value.pixels
        writable = bool(array.flags.writeable)
        if writable:
            array.flat[0] = array.flat[0]  # really writable (raises on read-only memory)
        out[key] = (type(value) is type(want[key]) and value == want[key], writable)
    inner = got["nested"]["pics"][0]
    out["nested"] = (type(inner) is of.Image and inner == want["nested"]["pics"][0], True)
    return out


class MediaSrc(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["clip", "fclip", "pic", "nested"])
    async def make(self, n: int) -> dict[str, Any]:
        return media(n)


class MediaProbe(of.Role):
    @of.interface(inputs_or=[["clip", "fclip", "pic", "nested", "n"]], outputs=["report", "back"])
    async def check(self, clip: Any, fclip: Any, pic: Any, nested: Any, n: int) -> dict[str, Any]:
        got = {"clip": clip, "fclip": fclip, "pic": pic, "nested": nested}
        return {"report": report(got, n), "back": got}


made = of.Graph(
    "media_made",
    roles={"src": MediaSrc(), "probe": MediaProbe()},
    inputs=[of.Placeholder("n")],
    outputs=["report", "back"],
)

given = of.Graph(
    "media_given",
    roles={"probe2": MediaProbe()},
    inputs=[of.Placeholder(k) for k in ("clip", "fclip", "pic", "nested", "n")],
    outputs=["report", "back"],
)
