"""``/metrics`` data-plane series: the front's buffer pool, as ``rt.data_plane_stats()`` has it.

The app serves tests/runtime/dp_graphs.py with role ``dp_in`` in a worker process, so a big
``$tensor`` input of ``dp_inbound`` goes from the front's pool to the worker by shared memory.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import omniflow as of
from omniflow.data._pool import SEGMENT_PREFIX_ENV

from .conftest import ROOT, InProcess, metric

Factory = Callable[..., Any]
DP_GRAPHS = str(ROOT / "tests" / "runtime" / "dp_graphs.py")
MIB = 2**20


def tensor(array: np.ndarray) -> dict[str, Any]:
    data = base64.b64encode(array.tobytes()).decode()
    return {"$tensor": {"dtype": array.dtype.name, "shape": list(array.shape), "data": data}}


def pool(text: str) -> dict[str, float]:
    return {
        name: metric(text, f"omniflow_data_{name}")
        for name in ("pool_capacity_bytes", "pool_used_bytes", "pool_live_blocks",
                     "pool_fallbacks_total", "plane_held_bytes")
    }  # fmt: skip


@pytest.fixture
def no_leaked_segments(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Ask for it before ``inproc``: checked after the app (and its worker) closed."""
    prefix = f"omniflow_t{secrets.token_hex(4)}"  # this test's segments (its worker's too)
    monkeypatch.setenv(SEGMENT_PREFIX_ENV, prefix)
    yield
    assert sorted(Path("/dev/shm").glob(f"{prefix}_*")) == []


async def test_metrics_report_the_front_pool(
    no_leaked_segments: None, inproc: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIFLOW_POOL_BYTES", str(MIB))  # the front's pool and the worker's
    s: InProcess = await inproc(DP_GRAPHS, placement=of.Deploy({"dp_in": {}}))
    text = (await s.client.get("/metrics")).text
    assert "# TYPE omniflow_data_pool_live_blocks gauge" in text
    assert "# TYPE omniflow_data_pool_fallbacks_total counter" in text
    assert set(pool(text).values()) == {0}  # no pool until the first big value
    fits = np.arange(128 * 1024, dtype=np.float32)  # 512 KiB: through the front's pool
    too_big = np.arange(512 * 1024, dtype=np.float32)  # 2 MiB: rides the run message
    for array in (fits, too_big):
        r = await s.client.post(
            "/v1/graphs/dp_inbound/call", json={"inputs": {"blob": tensor(array)}, "stream": False}
        )
        (seen,) = r.json()["outputs"]["blob_seen"]
        assert seen[:3] == ["numpy", "float32", [array.size]]
    text = (await s.client.get("/metrics")).text
    assert pool(text) == {"pool_capacity_bytes": MIB, "pool_used_bytes": 0, "pool_live_blocks": 0,
                          "pool_fallbacks_total": 1, "plane_held_bytes": 0}  # fmt: skip
    # A block held right now (as a running call's input would be) shows in the gauges.
    plane = s.state.runtime.plane
    assert plane is not None
    plane.offload("<front>->dp_in.run", "held", 1, 0, {"blob": fits}, ["blob"])
    now = pool((await s.client.get("/metrics")).text)
    assert (now["pool_used_bytes"], now["pool_live_blocks"]) == (512 * 1024, 1)
    plane.cleanup("held")
    now = pool((await s.client.get("/metrics")).text)
    assert (now["pool_used_bytes"], now["pool_live_blocks"]) == (0, 0)
    assert (await s.state.runtime.pool_stats())["<front>"]["offloaded"] == 2
