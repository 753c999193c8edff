"""Module-level graphs for the call-lifecycle tests (test_lifecycle.py).

Like scenario_graphs.py, everything here is a module-level object of a module that imports
only the standard library and omniflow, so a worker process can rebuild every role by
importing this file by path. Graph names start with ``lg_``; role names are unique.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import omniflow as of

# ---------------------------------------------------------------- a generator's whole life


class LgGen(of.Role):
    """Awaits before its first yield, between yields and after its last one: every await
    point of a generator's life is a place where a cancel can land."""

    @of.interface(inputs_or=[["n"]], outputs=["x"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        await asyncio.sleep(0)
        for i in range(n):
            yield {"x": i}
            await asyncio.sleep(0)
        await asyncio.sleep(0)


class LgInc(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"y": x + 1}


class LgFan(of.Role):
    """A generator downstream of a generator: two streams of one call to cancel."""

    @of.interface(inputs_or=[["y"]], outputs=["z"])
    async def gen(self, y: int) -> AsyncIterator[dict[str, Any]]:
        yield {"z": y}
        await asyncio.sleep(0)
        yield {"z": -y}


life = of.Graph(
    "lg_life",
    roles={"lg_gen": LgGen(), "lg_inc": LgInc(), "lg_fan": LgFan()},
    inputs=[of.Placeholder("n")],
    outputs=["y", "z"],
)


class LgStream(of.Role):
    """Yields at once, with nothing to await before its first frame (the shortest life)."""

    @of.interface(inputs_or=[["n"]], outputs=["x"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"x": i}


quick = of.Graph(
    "lg_quick", roles={"lg_stream": LgStream()}, inputs=[of.Placeholder("n")], outputs=["x"]
)


# ---------------------------------------------------------------- a loop through a generator


class LpGen(of.Role):
    @of.interface(inputs_or=[["start"], ["back"]], outputs=["v"])
    async def gen(
        self, start: int | None = None, back: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        v = (start if start is not None else back or 0) + 1
        yield {"v": v}
        yield {"v": v}  # two frames: the loop fans out, so lp_back exceeds max_iterations
        # while lp_gen tasks it just created have not taken their first step


class LpBack(of.Role):
    @of.interface(inputs_or=[["v"]], outputs=["back", "seen"])
    async def run(self, v: int) -> dict[str, Any]:
        return {"back": v, "seen": v}


loop = of.Graph(
    "lg_loop",
    roles={"lp_gen": LpGen(), "lp_back": LpBack()},
    inputs=[of.Placeholder("start")],
    outputs=["seen"],
    max_iterations=5,
)


# ---------------------------------------------------------------- deadlines


class DlSlow(of.Role):
    """Sleeps ``s`` seconds, then answers."""

    @of.interface(inputs_or=[["s"]], outputs=["slept"])
    async def run(self, s: float) -> dict[str, Any]:
        await asyncio.sleep(s)
        return {"slept": s}


class DlTick(of.Role):
    """Streams one frame per ``s`` seconds, ``n`` of them."""

    @of.interface(inputs_or=[["slept"]], outputs=["tick"])
    async def gen(self, slept: float) -> AsyncIterator[dict[str, Any]]:
        for i in range(1000):
            yield {"tick": i}
            await asyncio.sleep(slept)


deadline = of.Graph(
    "lg_deadline",
    roles={"dl_slow": DlSlow(), "dl_tick": DlTick()},
    inputs=[of.Placeholder("s")],
    outputs=["slept", "tick"],
)


# ---------------------------------------------------------------- sessions


class SnKeep(of.Role):
    """Appends ``job`` to the session's history and reports the history (and the time)."""

    @of.interface(inputs_or=[["job"]], outputs=["hist"])
    async def run(self, job: str) -> dict[str, Any]:
        hist = of.context().params["sn_history"]
        hist.append(job)
        await asyncio.sleep(0.05 if job.startswith("slow") else 0)
        return {"hist": [list(hist), time.time()]}


session = of.Graph(
    "lg_session",
    roles={"sn_keep": SnKeep()},
    inputs=[of.Placeholder("job")],
    outputs=["hist"],
    params=[of.GlobalParameters("sn_history", factory=list)],
)


# ---------------------------------------------------------------- setup failures


class BadSetup(of.Role):
    async def setup(self) -> None:
        raise RuntimeError("weights not found at /nowhere")

    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"y": x}


bad_setup = of.Graph(
    "lg_bad_setup", roles={"vae": BadSetup()}, inputs=[of.Placeholder("x")], outputs=["y"]
)
