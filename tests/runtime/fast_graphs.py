"""Module-level graphs for the cross-process fast path tests (test_fast_path.py).

Workers import this file by path, so everything is module-level and role names are unique.
Roles report what the runtime told them (``of.context()``: SeqId index, OR group) through
their outputs, so a test can compare the fast path with the front-sent path and in-process.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

import omniflow as of

#: A frame value this big goes through the producer's data plane (the default threshold is
#: 256 KiB), so it is never forwarded worker to worker.
BIG = 512 * 1024


def _seen() -> list[Any]:
    ctx = of.context()
    return [ctx.node, ctx.seq, ctx.or_group]


# ---------------------------------------------------------------- a 3-stage chain


class ChainA(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["x1", "seen_a"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"x1": x + 1, "seen_a": _seen()}


class ChainB(of.Role):
    @of.interface(inputs_or=[["x1"]], outputs=["x2", "seen_b"])
    async def run(self, x1: int) -> dict[str, Any]:
        return {"x2": x1 * 2, "seen_b": _seen()}


class ChainC(of.Role):
    @of.interface(inputs_or=[["x2"]], outputs=["y", "seen_c"])
    async def run(self, x2: int) -> dict[str, Any]:
        return {"y": x2 - 3, "seen_c": _seen()}


fp_chain = of.Graph(
    "fp_chain",
    roles={"fa": ChainA(), "fb": ChainB(), "fc": ChainC()},
    inputs=[of.Placeholder("x")],
    outputs=["y", "seen_a", "seen_b", "seen_c"],
)


# ---------------------------------------------------------------- a stream through two stages


class StreamSrc(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["a"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"a": i}
            if i % 7 == 3:
                await asyncio.sleep(0)  # frames leave in batches of several sizes


class StreamM1(of.Role):
    @of.interface(inputs_or=[["a"]], outputs=["b", "seq1"])
    async def step(self, a: int) -> dict[str, Any]:
        if a % 5 == 0:
            await asyncio.sleep(0.001)  # out of order with its neighbours
        return {"b": a * 10, "seq1": of.context().seq}


class StreamM2(of.Role):
    @of.interface(inputs_or=[["b"]], outputs=["c"])
    async def step(self, b: int) -> dict[str, Any] | None:
        if b % 30 == 10:
            return None  # no frame at all for some
        return {"c": b + 1}


fp_stream = of.Graph(
    "fp_stream",
    roles={"ss": StreamSrc(), "s1": StreamM1(), "s2": StreamM2()},
    inputs=[of.Placeholder("n")],
    outputs=["c", "seq1"],
)


# ---------------------------------------------------------------- small and big frames


class MixedSrc(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["v"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            if i % 3 == 2:  # a big one: through the data plane, never forwarded
                yield {"v": np.full(BIG // 8, i, dtype=np.int64)}
            else:
                yield {"v": i}


class MixedSink(of.Role):
    @of.interface(inputs_or=[["v"]], outputs=["w"])
    async def run(self, v: Any) -> dict[str, Any]:
        if isinstance(v, np.ndarray):
            return {"w": ["big", int(v[0]), int(v.size), os.getpid()]}
        return {"w": ["small", v, 1, os.getpid()]}


fp_mixed = of.Graph(
    "fp_mixed",
    roles={"mx": MixedSrc(), "mk": MixedSink()},
    inputs=[of.Placeholder("n")],
    outputs=["w"],
)


# ---------------------------------------------------------------- failures and cancels


class FailSrc(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["a", "e"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"a": i, "e": i}


class FailSlow(of.Role):
    """The forwarded stage: slow enough that runs are in flight when the call fails."""

    @of.interface(inputs_or=[["a"]], outputs=["b"])
    async def run(self, a: int) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"b": a}


class FailAt(of.Role):
    """The other branch: raises at frame ``e == 5``."""

    @of.interface(inputs_or=[["e"]], outputs=["f"])
    async def run(self, e: int) -> dict[str, Any]:
        if e == 5:
            raise ValueError("frame 5 is bad")
        return {"f": e}


fp_fail = of.Graph(
    "fp_fail",
    roles={"fs": FailSrc(), "fw": FailSlow(), "fx": FailAt()},
    inputs=[of.Placeholder("n")],
    outputs=["b", "f"],
)


class Forever(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["t"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        i = 0
        while True:
            yield {"t": i}
            i += 1
            await asyncio.sleep(0.001)


class Echo(of.Role):
    @of.interface(inputs_or=[["t"]], outputs=["u"])
    async def run(self, t: int) -> dict[str, Any]:
        await asyncio.sleep(0.002)
        return {"u": t}


fp_forever = of.Graph(
    "fp_forever",
    roles={"fe": Forever(), "fo": Echo()},
    inputs=[of.Placeholder("n")],
    outputs=["u"],
)


# ---------------------------------------------------------------- a run that stays quiet


class Quiet(of.Role):
    """Sends nothing for an hour (the test cancels it): remote work in flight, no messages."""

    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"y": x}


fp_quiet = of.Graph("fp_quiet", roles={"fq": Quiet()}, inputs=[of.Placeholder("x")], outputs=["y"])
