"""Module-level graphs for the multi-process acceptance tests (test_multiprocess.py).

A worker process rebuilds its roles by importing this file by path and looking the Graph up by
name, so everything here is a module-level object, the module imports only the standard library
and omniflow, and role names are unique across all graphs of the module. Roles report where they
ran (``os.getpid()``) through their outputs: that is how a test sees which process, and so which
replica, served an activation.

``OMNIFLOW_MP_MARKER`` (read at ``setup()``, inherited by the worker processes the front spawns)
names a file that roles of ``mp_deploy`` append their lifecycle events to.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import omniflow as of

MARKER_ENV = "OMNIFLOW_MP_MARKER"


def _mark(text: str) -> None:
    path = os.environ.get(MARKER_ENV)
    if path:
        with Path(path).open("a") as f:
            f.write(f"{text}\n")


# ---------------------------------------------------------------- Deploy: grouping, lifecycle


class DeployA(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y", "a_pid"])
    async def run(self, x: int) -> dict[str, Any]:
        await asyncio.sleep(0.002)  # let concurrent calls spread over both replicas
        return {"y": x + 1, "a_pid": os.getpid()}


class DeployB(of.Role):
    """Records its lifecycle in the marker file; reports the pid its ``setup()`` ran in."""

    def __init__(self) -> None:
        self.setup_pid: int | None = None

    async def setup(self) -> None:
        self.setup_pid = os.getpid()
        _mark(f"setup b {os.getpid()}")

    async def teardown(self) -> None:
        _mark(f"teardown b {os.getpid()}")

    @of.interface(inputs_or=[["y"]], outputs=["z", "b_pid"])
    async def run(self, y: int) -> dict[str, Any]:
        return {"z": y * 10, "b_pid": [os.getpid(), self.setup_pid]}


class DeployC(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["c_pid"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"c_pid": os.getpid()}


deploy = of.Graph(
    "mp_deploy",
    roles={"a": DeployA(), "b": DeployB(), "c": DeployC()},
    inputs=[of.Placeholder("x")],
    outputs=["z", "a_pid", "b_pid", "c_pid"],
)


# ---------------------------------------------------------------- scale up / down


class Echo(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y", "pid"])
    async def run(self, x: int) -> dict[str, Any]:
        await asyncio.sleep(0.005)
        return {"y": x, "pid": os.getpid()}


scale = of.Graph(
    "mp_scale",
    roles={"r": Echo()},
    inputs=[of.Placeholder("x")],
    outputs=["y", "pid"],
)


# ---------------------------------------------------------------- streams (replica loss, Redis)


class Streamer(of.Role):
    """Yields ``n`` frames, one every ``every`` seconds; each frame says which process sent it."""

    @of.interface(inputs_or=[["n", "every"]], outputs=["tok"])
    async def gen(self, n: int, every: float) -> AsyncIterator[dict[str, Any]]:
        pid = os.getpid()
        for i in range(n):
            yield {"tok": [i, pid]}
            await asyncio.sleep(every)


stream = of.Graph(
    "mp_stream",
    roles={"s": Streamer()},
    inputs=[of.Placeholder("n"), of.Placeholder("every")],
    outputs=["tok"],
)


# ---------------------------------------------------------------- session affinity


class Sessioned(of.Role):
    """A session node whose replica remembers, in its own memory, how often it saw a session."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    @of.interface(inputs_or=[["x"]], outputs=["where"], lb="session")
    async def run(self, x: int) -> dict[str, Any]:
        session = of.context().session
        assert session is not None
        count = self.seen[session] = self.seen.get(session, 0) + 1
        return {"where": [os.getpid(), count]}


session = of.Graph(
    "mp_session",
    roles={"sess": Sessioned()},
    inputs=[of.Placeholder("x")],
    outputs=["where"],
)


# ---------------------------------------------------------------- broadcast


class Everywhere(of.Role):
    """Runs on every replica (lb="broadcast"), each returning its own pid; the replica whose
    pid is ``fail`` raises instead."""

    @of.interface(inputs_or=[["fail"]], outputs=["where"], lb="broadcast")
    async def run(self, fail: int) -> dict[str, Any]:
        if os.getpid() == fail:
            raise ValueError(f"replica {fail} fails")
        return {"where": os.getpid()}


broadcast = of.Graph(
    "mp_broadcast",
    roles={"everywhere": Everywhere()},
    inputs=[of.Placeholder("fail")],
    outputs=["where"],
)
