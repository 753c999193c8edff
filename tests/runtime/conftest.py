from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import omniflow as of

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"

ZERO = {"open_buckets": 0, "inflight": 0, "active_calls": 0, "data_plane_bytes": 0}


def load_graph_module(name: str) -> ModuleType:
    """Import graphs/<name>.py (fresh roles each time, so tests do not share state)."""
    path = GRAPHS / f"{name}.py"
    mod_name = f"_test_graphs_{name}_{len(sys.modules)}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Logical resources of the Ray instance the tests start (one per test module): enough CPUs
#: for every replica of a scenario graph, and fake GPUs for the placement tests.
RAY_CPUS = 64
RAY_GPUS = 4


@pytest.fixture(scope="module")
def ray_local() -> Any:
    """A local Ray instance for one test module (skip when ray is not installed); a Ray this
    process already runs is reused and left running."""
    ray = pytest.importorskip(
        "ray", reason="of.Ray needs the 'ray' extra (pip install 'omniflow[ray]')"
    )
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=RAY_CPUS, num_gpus=RAY_GPUS, include_dashboard=False)
    yield ray
    if started:
        ray.shutdown()


@contextlib.asynccontextmanager
async def started_runtimes(
    build: Callable[..., of.Runtime],
) -> AsyncIterator[Callable[..., Awaitable[of.Runtime]]]:
    """``rt = await make(graph, ...)``: ``build(graph, ...)`` started; at exit every runtime
    is checked for work left behind (``ZERO``) and closed."""
    opened: list[of.Runtime] = []

    async def make(*graphs: of.Graph, **kw: Any) -> of.Runtime:
        rt = build(*graphs, **kw)
        await rt.start()
        opened.append(rt)
        return rt

    yield make
    for rt in opened:
        stats = rt.stats()
        await rt.close()
        assert stats == ZERO, f"runtime left work behind: {stats}"


def _validated(*graphs: of.Graph, **kw: Any) -> of.Runtime:
    return of.Runtime(*graphs, **{"validate": True, **kw})


@pytest.fixture
async def runtime() -> AsyncIterator[Callable[..., Awaitable[of.Runtime]]]:
    """Factory: ``rt = await runtime(graph, ...)``; every runtime is checked and closed after."""
    async with started_runtimes(_validated) as make:
        yield make
