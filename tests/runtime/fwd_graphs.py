"""Module-level graphs for the fast-path fault tests (test_forward_faults.py).

A worker process rebuilds its roles by importing this file by path, so everything here is a
module-level object and the module imports only the standard library and omniflow. Each value
says which process made it (``os.getpid()``), so a test sees where a frame went.

``fw_chain``: ``src`` (an async generator) -> ``m1`` -> ``m2``, and ``src`` -> ``boom``, each
edge direct-fire with one producer: with the roles in different workers the fast path starts
every run of m1, m2 and boom worker to worker. ``hold`` keeps several m1 runs in flight at
once; ``boom`` fails on frame ``fail`` (-1: never) and otherwise makes nothing.

``fw_pad``: ``psrc`` -> ``pm1`` -> ``pm2`` as in ``fw_chain``, with ``n`` frames of ``size`` bytes
each, ``every`` s apart (enough of them fill a socket to a stopped worker).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import omniflow as of


class Source(of.Role):
    @of.interface(inputs_or=[["n", "every", "hold", "fail"]], outputs=["a"])
    async def gen(
        self, n: int, every: float, hold: float, fail: int
    ) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"a": {"i": i, "src": os.getpid(), "hold": hold, "fail": fail}}
            await asyncio.sleep(every)


class Step1(of.Role):
    @of.interface(inputs_or=[["a"]], outputs=["b"])
    async def run(self, a: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(a["hold"])
        return {"b": {**a, "m1": os.getpid()}}


class Step2(of.Role):
    @of.interface(inputs_or=[["b"]], outputs=["c"])
    async def run(self, b: dict[str, Any]) -> dict[str, Any]:
        return {"c": {**b, "m2": os.getpid()}}


class Boom(of.Role):
    @of.interface(inputs_or=[["a"]], outputs=["d"])
    async def run(self, a: dict[str, Any]) -> dict[str, Any] | None:
        if a["i"] == a["fail"]:
            raise ValueError(f"boom at frame {a['i']}")
        return None


chain = of.Graph(
    "fw_chain",
    roles={"src": Source(), "m1": Step1(), "m2": Step2(), "boom": Boom()},
    inputs=[of.Placeholder(p) for p in ("n", "every", "hold", "fail")],
    outputs=["c", "d"],
)

#: Three workers: src, m1, and m2 with boom (so m1 -> m2 and src -> boom cross processes).
DEPLOY = {
    "src": {"process": "w_src"},
    "m1": {"process": "w_m1"},
    "m2": {"process": "w_m2"},
    "boom": {"process": "w_m2"},
}


class PaddedSource(of.Role):
    @of.interface(inputs_or=[["n", "size", "every"]], outputs=["a"])
    async def gen(self, n: int, size: int, every: float) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"a": {"i": i, "src": os.getpid(), "hold": 0.0, "pad": "x" * size}}
            await asyncio.sleep(every)


padded = of.Graph(
    "fw_pad",
    roles={"psrc": PaddedSource(), "pm1": Step1(), "pm2": Step2()},
    inputs=[of.Placeholder("n"), of.Placeholder("size"), of.Placeholder("every")],
    outputs=["c"],
)

#: Three workers, one role each.
DEPLOY_PAD = {
    "psrc": {"process": "w_psrc"},
    "pm1": {"process": "w_pm1"},
    "pm2": {"process": "w_pm2"},
}
