"""Graphs for "values behave the same in every placement" (CONTRACT §5).

``ValSrc.make`` builds values that stress the wire (a big numpy array that goes through the
data plane, a mid-sized one that rides as an out-of-band frame, ints beyond 64 bits, a list
nested 150 deep, bytes); ``ValProbe.check`` reports what it received: equal to the expected
values, same types, arrays writable (it writes into them). Module-level, so a worker process
can import them by path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import omniflow as of

DEPTH = 150


def deep(levels: int = DEPTH) -> list[Any]:
    root: list[Any] = []
    cur = root
    for _ in range(levels):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return root


def values(n: int) -> dict[str, Any]:
    return {
        "n": n,
        "big": 2**70 + n,
        "neg": -(2**70) - n,
        "edges": [2**64 - 1, 2**64, -(2**63), -(2**63) - 1],
        "deep": deep(),
        "arr": np.arange(300_000, dtype="f8") + n,  # 2.4 MB: the data plane
        "mid": np.arange(20_000, dtype="f8") - n,  # 160 KB: an out-of-band frame
        "small": np.arange(10, dtype="i4"),
        "blob": bytes(range(256)) * 400,  # 100 KB of bytes
    }


def report(v: dict[str, Any]) -> dict[str, Any]:
    """What a consumer sees: per key, equal and same type; per array, writable."""
    want = values(v["n"])
    out: dict[str, Any] = {"keys": sorted(v) == sorted(want)}
    for key, expected in want.items():
        got = v[key]
        same_type = type(got) is type(expected)
        if isinstance(expected, np.ndarray):
            equal = same_type and got.dtype == expected.dtype and bool((got == expected).all())
            writable = same_type and bool(got.flags.writeable)
            if writable:
                got[0] = got[0]  # really writable (raises on read-only memory)
            out[key] = (equal, writable)
        else:
            out[key] = (same_type and got == expected, True)
    return out


class ValSrc(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["v"])
    async def make(self, n: int) -> dict[str, Any]:
        return {"v": values(n)}


class ValProbe(of.Role):
    @of.interface(inputs_or=[["v"]], outputs=["report", "back"])
    async def check(self, v: dict[str, Any]) -> dict[str, Any]:
        return {"report": report(v), "back": v}


made = of.Graph(
    "values_made",
    roles={"src": ValSrc(), "probe": ValProbe()},
    inputs=[of.Placeholder("n")],
    outputs=["report", "back"],
)

given = of.Graph(
    "values_given",
    roles={"probe2": ValProbe()},
    inputs=[of.Placeholder("v")],
    outputs=["report", "back"],
)
