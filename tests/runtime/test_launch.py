"""The launcher seam (``cluster/_launch.py``): the front starts replicas only through a Launcher.

Here a launcher that runs each replica's Worker as a task of the test's own event loop (no
process) stands in for a Ray actor launcher: the whole multi-process path (sealed wire,
hello/ready, runs, streamed frames, loss and restart) works through it unchanged.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import omniflow as of
from omniflow.cluster._launch import Launcher, LaunchSpec, ReplicaHandle, SubprocessLauncher
from omniflow.cluster._replica import ReplicaState
from omniflow.cluster._worker import Worker

from . import mp_graphs as mp

MODULE = str(Path(mp.__file__).resolve())


class TaskHandle(ReplicaHandle):
    def __init__(self, task: asyncio.Task[None], address: str) -> None:
        self.task = task
        self.address = address

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def returncode(self) -> int | None:
        if not self.task.done():
            return None
        return -9 if self.task.cancelled() or self.task.exception() else 0

    async def wait(self) -> int:
        await asyncio.wait([self.task])
        code = self.returncode
        assert code is not None
        return code

    def kill(self) -> None:
        self.task.cancel()


class TaskLauncher(Launcher):
    """Each replica is a Worker task in this loop, bound to an inproc:// address."""

    def __init__(self) -> None:
        self.started: list[LaunchSpec] = []
        #: Times ``close`` was awaited (once, after every replica stopped).
        self.closed = 0

    async def start(self, spec: LaunchSpec) -> TaskHandle:
        self.started.append(spec)
        address = f"inproc://{spec.replica_id}"
        worker = Worker(
            spec.modules,
            spec.roles,
            address,
            replica_id=spec.replica_id,
            heartbeat_interval=spec.heartbeat_interval,
            cluster_key=spec.cluster_key,
            owner=spec.owner,
        )
        task = asyncio.get_running_loop().create_task(worker.run())
        await asyncio.sleep(0)  # bound before the front connects
        return TaskHandle(task, address)

    async def close(self) -> None:
        self.closed += 1


async def test_replicas_started_by_another_launcher_serve_and_are_restarted() -> None:
    rt = of.Runtime(mp.scale, mp.stream, placement=of.Deploy({"r": {}, "s": {}}), validate=True)
    assert rt.remote is not None
    launcher = TaskLauncher()
    rt.remote.fleet.launcher = launcher
    async with rt:
        assert sorted(s.roles for s in launcher.started) == [("r",), ("s",)]
        assert all(s.modules == (MODULE,) for s in launcher.started)
        assert (await rt.run("mp_scale", {"x": 4}))["y"] == [4]
        toks = (await rt.run("mp_stream", {"n": 3, "every": 0.0}))["tok"]
        assert [t[0] for t in toks] == [0, 1, 2]

        [rep] = [r for r in rt.remote.fleet.replicas.values() if "r" in r.roles]
        assert isinstance(rep.process, TaskHandle) and rep.life.state is ReplicaState.READY
        rep.process.kill()
        for _ in range(2000):  # the fleet notices the end, restarts the slot after 0.1 s
            if rt.readiness() == [] and rt.wire_stats()["restarts"]["r"] == 1:
                break
            await asyncio.sleep(0.01)
        assert rt.wire_stats()["restarts"] == {"r": 1, "s": 0}
        assert rep.life.state is ReplicaState.RESTARTING
        assert "ready --lost (its process exited with code -9)--> dead" in rep.life.story()
        assert (await rt.run("mp_scale", {"x": 5}))["y"] == [5]
        assert len(launcher.started) == 3
        # The restart fills the dead replica's slot (a per-slot launcher, Ray's, reuses it).
        restart = launcher.started[2]
        assert (restart.group, restart.slot) == ("r", rep.slot) == ("r", 0)
        assert restart.replica_id != rep.replica_id
        assert launcher.closed == 0
    assert all(r.process is None or r.process.returncode is not None for r in [rep])
    assert launcher.closed == 1


def test_the_subprocess_launcher_is_the_default() -> None:
    rt = of.Runtime(mp.scale, placement="process")
    assert rt.remote is not None and isinstance(rt.remote.fleet.launcher, SubprocessLauncher)


@pytest.mark.parametrize("code", [None, 0])
async def test_stop_waits_then_kills(code: int | None) -> None:
    """``Launcher.stop`` gives a replica its grace, then kills it."""

    async def hangs() -> None:
        if code is None:
            await asyncio.Event().wait()

    handle = TaskHandle(asyncio.get_running_loop().create_task(hangs()), "inproc://x")
    await TaskLauncher().stop(handle, 0.05)
    assert handle.task.done()
    assert handle.returncode == (-9 if code is None else 0)


@pytest.mark.parametrize(("flag", "scheme"), [(None, "uds"), ("1", "uds"), ("0", "ipc")])
async def test_spawned_workers_bind_uds_unless_the_fast_path_is_off(
    monkeypatch: pytest.MonkeyPatch, flag: str | None, scheme: str
) -> None:
    """``OMNIFLOW_FAST_PATH`` picks the same-node wire: plain Unix sockets (default) or pyzmq
    ``ipc://``; the worker inherits the setting, and a call works either way."""
    if flag is None:
        monkeypatch.delenv("OMNIFLOW_FAST_PATH", raising=False)
    else:
        monkeypatch.setenv("OMNIFLOW_FAST_PATH", flag)
    async with of.Runtime(mp.scale, placement=of.Deploy({"r": {}}), validate=True) as rt:
        assert rt.remote is not None
        [rep] = rt.remote.fleet.replicas.values()
        assert rep.address.startswith(f"{scheme}:///") and rep.address.endswith(".sock")
        assert (await rt.run("mp_scale", {"x": 7}))["y"] == [7]
