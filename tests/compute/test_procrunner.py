"""``TorchEngine(executor="process")``: the forward pass in the engine's own process.

Its results are checked against transformers beside the thread executor's (test_equivalence,
test_engine run both); here: what only a second process can get wrong (its start and load
errors, its death, its end with the engine and with the engine's process)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import omniflow as of
from omniflow.compute import EngineError, EngineProcessError, GenerateRequest, ModelLoadError

from .conftest import greedy, run

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [5 + (i * 13 + salt * 7) % 300 for i in range(n)]


def gone(pid: int) -> bool:
    """The process ``pid`` has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1:2] == ["Z"] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


async def test_a_bad_executor_and_a_gpu_device_are_refused(
    model_dirs: Callable[[str], Path],
) -> None:
    with pytest.raises(EngineError, match=r"'thread'.*'process'"):
        of.TorchEngine(model_dirs("llama"), executor="fork")
    engine = of.TorchEngine(model_dirs("llama"), executor="process", device="cuda")
    with pytest.raises(EngineError, match="CPU only"):
        await engine.start()
    assert engine._proc is None


async def test_a_load_error_in_the_engine_process_comes_back_typed(
    model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    broken = tmp_path / "no-weights"
    shutil.copytree(model_dirs("llama"), broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    errors = []
    for executor in ("thread", "process"):
        engine = of.TorchEngine(broken, executor=executor)
        with pytest.raises(ModelLoadError) as info:
            await engine.start()
        errors.append((str(info.value), info.value.path))
        assert engine._proc is None  # the engine process that failed to load is gone
    assert errors[0] == errors[1]  # the same error, wherever the weights were read


async def test_stop_ends_the_engine_process_which_holds_no_secret(
    model_dirs: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIFLOW_CLUSTER_KEY", "k" * 32)
    monkeypatch.setenv("OMNIFLOW_API_KEY", "s3cret")
    engine = of.TorchEngine(model_dirs("llama"), executor="process")
    await engine.start()
    assert engine._proc is not None and engine._proc.pid is not None
    pid = engine._proc.pid
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not [
        v for v in environ if v.startswith((b"OMNIFLOW_CLUSTER_KEY=", b"OMNIFLOW_API_KEY="))
    ]
    assert any(v.startswith(b"PATH=") for v in environ)  # the rest is inherited
    ids, _ = await run(engine, GenerateRequest(input_ids=prompt(20), sampling=greedy(8)))
    assert len(ids) == 8
    await engine.stop()
    assert gone(pid)


async def test_a_killed_engine_process_fails_every_request_and_frees_their_pages(
    model_dirs: Callable[[str], Path],
) -> None:
    engine = of.TorchEngine(model_dirs("llama"), executor="process", max_batch=4)
    await engine.start()
    try:
        pool: Any = engine.kv_pool
        first = [asyncio.Event() for _ in range(3)]

        async def consume(i: int) -> None:
            req = GenerateRequest(input_ids=prompt(30, salt=i), sampling=greedy(100_000))
            async for _ in engine.generate(req):
                first[i].set()

        tasks = [asyncio.ensure_future(consume(i)) for i in range(3)]
        for event in first:
            await event.wait()
        assert engine._proc is not None and engine._proc.pid is not None
        os.kill(engine._proc.pid, signal.SIGKILL)
        for task in tasks:
            with pytest.raises(EngineError) as info:
                await task
            assert isinstance(info.value.__cause__, EngineProcessError)
            assert "exited with code -9" in str(info.value.__cause__)
        assert engine._reaper is not None
        await engine._reaper
        assert pool.stats()["pinned"] == 0
        pool.validate()
        with pytest.raises(EngineError, match=r"failed.*start a new one"):
            await run(engine, GenerateRequest(input_ids=prompt(5), sampling=greedy(2)))
    finally:
        await engine.stop()


def test_the_engine_process_exits_when_its_parent_is_killed(
    model_dirs: Callable[[str], Path],
) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        import omniflow as of

        async def main():
            engine = of.TorchEngine({str(model_dirs("llama"))!r}, executor="process")
            await engine.start()
            print(engine._proc.pid, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), line
        child = int(line)
        assert not gone(child)
        parent.kill()
        parent.wait(60)
        for _ in range(600):  # x 0.1 s: the limit only turns a hang into a failure
            if gone(child):
                break
            time.sleep(0.1)
        assert gone(child), "the engine process outlived the process that started it"
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
