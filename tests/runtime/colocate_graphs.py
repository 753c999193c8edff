"""Module-level graphs for the co-located pool's start tests (test_colocated_start.py).

A worker process rebuilds the roles by importing this file by path. ``cg_a`` and ``cg_b`` share
one co-located pool (``cg-kv``): ``cg_a`` takes its seat and proposes 300 pages in ``setup()``
(as an engine's ``start()`` does once its weights are loaded); ``cg_b`` takes its seat and its
process dies at once, before it proposes (``os._exit``: no exception, no word to anyone), the way
a role killed while loading its weights dies.
"""

from __future__ import annotations

import os
from typing import Any

import omniflow as of
from omniflow.data.kv import PageLayout

LAYOUT = PageLayout(("l0",), {"k": (2, 4), "v": (2, 4)}, page_tokens=4, dtype="float32")
#: The graph's pool: every process has its instance; the barrier sizes its L1.
KV = of.ParamsPool("cg-kv", LAYOUT, {"l1": 1, "l2": 0, "l3": 0}, device="cpu")
_BARRIER: dict[str, Any] = {}


def barrier() -> Any:
    if "b" not in _BARRIER:
        _BARRIER["b"] = of.KvPoolBarrier("cg-kv", None, members=("cg_a", "cg_b"))
    return _BARRIER["b"]


class CgA(of.Role):
    async def setup(self) -> None:
        seat = barrier().member("cg_a", 300)
        seat.arrive()  # (an engine arrives before it loads its weights ...)
        seat.propose()  # (... and proposes once they are loaded)

    async def teardown(self) -> None:
        await barrier().leave("cg_a")  # (an engine's stop() does this)

    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        pool = await barrier().wait("cg_a")
        return {"y": pool.capacity["l1"]}


class CgB(of.Role):
    async def setup(self) -> None:
        barrier().member("cg_b", 200).arrive()
        os._exit(3)  # dies while "loading its weights", inside the barrier

    @of.interface(inputs_or=[["y"]], outputs=["z"])
    async def run(self, y: int) -> dict[str, Any]:
        return {"z": y}


dies = of.Graph(
    "cg_dies",
    roles={"cg_a": CgA(), "cg_b": CgB()},
    inputs=[of.Placeholder("x")],
    outputs=["z"],
    pools=[KV],
)
