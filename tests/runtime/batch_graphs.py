"""Module-level graphs with batched nodes (``batch=of.Batch(...)``) for test_batching.py.

A worker imports this file by path (``placement="process"`` and Ray), so, as in
scenario_graphs.py, graphs are module-level, graph names start with ``bt_`` and role names are
unique, values are JSON-like, and a test sees a role only through frames, errors and marker
files whose paths arrive as inputs. Graphs whose batches a test counts use a long
``max_wait_ms`` and exactly ``max_size`` activations: the batch runs because it is full, never
because of how fast a machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import omniflow as of

#: Long enough that a batch of the tests that count them only ever runs full.
NEVER_MS = 600_000


def _mark(path: str, text: str) -> None:
    with Path(path).open("a") as f:
        f.write(text + "\n")


class BtEnc(of.Role):
    """One entry per activation: a frame, None, or an exception; "boom" fails the batch."""

    @of.interface(inputs_or=[["x"]], outputs=["y"], batch=of.Batch(4, NEVER_MS))
    async def enc(self, x: list[Any]) -> list[Any]:
        ctxs = of.batch_contexts()
        assert of.context() == ctxs[0]
        calls = [c.call_id for c in ctxs]
        out: list[Any] = []
        for v, call in zip(x, calls, strict=True):
            if v == "boom":
                raise RuntimeError("the whole batch fails")
            if v == "none":
                out.append(None)
            elif v == "bad":
                out.append(ValueError(f"bad input in {call}"))
            else:
                out.append({"y": {"v": v, "size": len(x), "call": call, "calls": calls}})
        return out


lists = of.Graph("bt_lists", roles={"bt_enc": BtEnc()}, inputs=[of.Placeholder("x")], outputs=["y"])


class BtLone(of.Role):
    """A short wait: one activation alone runs once ``max_wait_ms`` passed."""

    @of.interface(inputs_or=[["x"]], outputs=["y"], batch=of.Batch(64, 1))
    async def enc(self, x: list[int]) -> list[dict[str, Any]]:
        return [{"y": v + 1} for v in x]


lone = of.Graph("bt_lone", roles={"bt_lone": BtLone()}, inputs=[of.Placeholder("x")], outputs=["y"])


class BtHold(of.Role):
    """Marks ``<dir>/started``, then holds the batch until ``<dir>/release`` exists; marks
    ``<dir>/cancelled`` when the batch's task is cancelled."""

    @of.interface(inputs_or=[["x", "dir"]], outputs=["y"], batch=of.Batch(2, NEVER_MS))
    async def hold(self, x: list[str], dir: list[str]) -> list[dict[str, Any]]:
        where = dir[0]
        _mark(f"{where}/started", ",".join(x))
        try:
            while not Path(f"{where}/release").exists():
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            _mark(f"{where}/cancelled", ",".join(x))
            raise
        return [{"y": {"v": v, "batch": sorted(x)}} for v in x]


hold = of.Graph(
    "bt_hold",
    roles={"bt_hold": BtHold()},
    inputs=[of.Placeholder("x"), of.Placeholder("dir")],
    outputs=["y"],
)


class BtSrc(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["t"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            if i % 3 == 0:
                await asyncio.sleep(0)
            yield {"t": i}


class BtFree(of.Role):
    """Stateless and batched: finishes out of order within a batch (reversed work)."""

    @of.interface(inputs_or=[["t"]], outputs=["u"], batch=of.Batch(3, 1))
    async def f(self, t: list[int]) -> list[dict[str, Any]]:
        await asyncio.sleep(0)
        return [{"u": v} for v in t]


class BtOrdered(of.Role):
    """A session node, batched: counts its activations per call (they must come in order)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    @of.interface(inputs_or=[["u"]], outputs=["w"], lb="session", batch=of.Batch(4, 1))
    async def f(self, u: list[int]) -> list[dict[str, Any]]:
        out = []
        for v, ctx in zip(u, of.batch_contexts(), strict=True):
            k = self.seen.get(ctx.call_id, 0)
            self.seen[ctx.call_id] = k + 1
            out.append({"w": [v, k]})
        await asyncio.sleep(0)
        return out


session = of.Graph(
    "bt_session",
    roles={"bt_src": BtSrc(), "bt_free": BtFree(), "bt_ordered": BtOrdered()},
    inputs=[of.Placeholder("n")],
    outputs=["u", "w"],
)


class BtA(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["a"])
    async def f(self, x: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"a": x * 2}


class BtB(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["b"], batch=of.Batch(4, 1))
    async def f(self, x: list[int]) -> list[dict[str, Any]]:
        return [{"b": v * 3} for v in x]


class BtJoin(of.Role):
    @of.interface(inputs_or=[["a", "b"]], outputs=["d"], batch=of.Batch(4, 1))
    async def f(self, a: list[int], b: list[int]) -> list[dict[str, Any]]:
        return [{"d": p + q} for p, q in zip(a, b, strict=True)]


diamond = of.Graph(
    "bt_diamond",
    roles={"bt_a": BtA(), "bt_b": BtB(), "bt_join": BtJoin()},
    inputs=[of.Placeholder("x")],
    outputs=["d"],
)


class BtLoop(of.Role):
    """Counts down through itself: n, n-1, ..., 0, then says "done"."""

    @of.interface(inputs_or=[["n"], ["again"]], outputs=["again", "out"], batch=of.Batch(8, 1))
    async def step(
        self, n: list[int | None] | None = None, again: list[int | None] | None = None
    ) -> list[dict[str, Any]]:
        size = len(n if n is not None else again or [])
        out = []
        for i in range(size):
            v = n[i] if n is not None and n[i] is not None else (again or [0] * size)[i]
            assert v is not None
            out.append({"again": v - 1, "out": v} if v > 0 else {"out": "done"})
        return out


loop = of.Graph(
    "bt_loop",
    roles={"bt_loop": BtLoop()},
    inputs=[of.Placeholder("n")],
    outputs=["out"],
    max_iterations=100,
)
