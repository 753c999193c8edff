"""Bytes moved between processes per edge (``omniflow_edge_bytes_total``, issue 37)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import omniflow as of
from omniflow.cluster._remote_edges import wire_size
from omniflow.serve._metrics import HttpMetrics, render
from omniflow.transport._codec import encode


class A(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def a(self, x: bytes) -> dict[str, bytes]:
        return {"y": x}


class B(of.Role):
    @of.interface(inputs_or=[["y"]], outputs=["z"])
    async def b(self, y: bytes) -> dict[str, bytes]:
        return {"z": y}


class C(of.Role):
    @of.interface(inputs_or=[["z"]], outputs=["out"])
    async def c(self, z: bytes) -> dict[str, int]:
        return {"out": len(z)}


chain = of.Graph(
    "edges", roles={"a": A(), "b": B(), "c": C()}, inputs=[of.Placeholder("x")],
    outputs=["out"],
)  # fmt: skip


async def test_in_process_graph_has_no_cross_process_edges() -> None:
    async with of.Runtime(chain, metrics=True) as rt:
        assert (await rt.run("edges", {"x": b"abc"})) == {"out": [3]}
        assert rt.edge_bytes() == {}
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    assert "omniflow_edge_bytes_total" not in text


async def _totals(rt: of.Runtime, size: int, n: int) -> dict[tuple[str, str, str, str], int]:
    before = rt.edge_bytes()
    for _ in range(n):
        assert (await rt.run("edges", {"x": b"v" * size})) == {"out": [size]}
    forwarded = (("edges", "a.a", "y", "b.b"), ("edges", "b.b", "z", "c.c"))
    for _ in range(600):  # each worker's counts come with its next heartbeat (a hang guard)
        after = rt.edge_bytes()
        if all(after.get(f, 0) > before.get(f, 0) for f in forwarded):
            break
        await asyncio.sleep(0.05)
    return {k: v - before.get(k, 0) for k, v in after.items()}


async def test_process_chain_counts_bytes_per_edge_growing_with_value_size() -> None:
    async with of.Runtime(chain, placement="process", metrics=True, heartbeat_interval=0.05) as rt:
        small = await _totals(rt, 10, 5)
        big = await _totals(rt, 20_000, 5)
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    run_edge = ("edges", "<input>", "x", "a.a")  # the front's runs to a's worker
    assert small[run_edge] > 0 and big[run_edge] > small[run_edge]
    # a's worker forwards y to b's, b's forwards z to c's (the fast path is on by default)
    for fwd in (("edges", "a.a", "y", "b.b"), ("edges", "b.b", "z", "c.c")):
        assert small.get(fwd, 0) > 0 and big.get(fwd, 0) > small.get(fwd, 0), (fwd, small, big)
    assert 'omniflow_edge_bytes_total{dst="a.a",field="x",graph="edges",src="<input>"}' in text
    assert 'omniflow_edge_bytes_total{dst="b.b",field="y",graph="edges",src="a.a"}' in text


# ------------------------------------------------- both directions, and the data plane


class W(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["t", "s"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"t": np.arange(x, dtype="f4"), "s": f"n={x}"}


class F(of.Role):
    @of.interface(inputs_or=[["t"]], outputs=["n"])
    async def sum(self, t: Any) -> dict[str, int]:
        return {"n": int(t.sum())}


back = of.Graph(
    "back", roles={"w": W(), "f": F()}, inputs=[of.Placeholder("x")], outputs=["s", "n"]
)
SIZES = (4096, 8192)  # floats: 16 and 32 KiB, above the data threshold (1 KiB here)


def _wire(value: Any) -> int:
    """What a value weighs in a message: its encoded bytes on its own."""
    return sum(memoryview(b).nbytes for b in encode(value, pickle=True))


def _expected(all_remote: bool) -> dict[tuple[str, str, str, str], int]:
    """The edges of ``back`` after one call per SIZES, from the values each carried: the
    front's runs of x to w, w's frames of s back to the caller, the payload of t read by f
    from w's pool, and, with f in a worker too, f's frames of n back."""
    runs = [(x, np.arange(x, dtype="f4")) for x in SIZES]
    out = {
        ("back", "<input>", "x", "w.run"): sum(_wire(x) for x, _ in runs),
        ("back", "w.run", "s", "<output>"): sum(_wire(f"n={x}") for x, _ in runs),
        ("back", "w.run", "t", "f.sum"): sum(t.nbytes for _, t in runs),
    }
    if all_remote:
        out[("back", "f.sum", "n", "<output>")] = sum(_wire(int(t.sum())) for _, t in runs)
    return out


async def _count_back(rt: of.Runtime, want: dict[tuple[str, str, str, str], int]) -> Any:
    for x in SIZES:
        out = await rt.run("back", {"x": x})
        assert out == {"s": [f"n={x}"], "n": [int(np.arange(x, dtype="f4").sum())]}
    got = rt.edge_bytes()
    for _ in range(600):  # what workers counted comes with their next heartbeat (a hang guard)
        if got == want:
            break
        await asyncio.sleep(0.05)
        got = rt.edge_bytes()
    return got


@pytest.mark.parametrize("placement", [of.Deploy({"w": {}}), "process"], ids=["front_f", "all"])
async def test_bytes_back_to_the_front_and_through_the_data_plane_are_counted_exactly(
    placement: Any,
) -> None:
    # w in a worker, f on the front (f reads t from w's pool, the caller gets s from w), or f
    # in a worker too (its worker reads t and reports it; the caller gets n from f's).
    async with of.Runtime(
        back, placement=placement, metrics=True, data_threshold=1024, heartbeat_interval=0.05
    ) as rt:
        want = _expected(all_remote=placement == "process")
        assert await _count_back(rt, want) == want
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    assert 'omniflow_edge_bytes_total{dst="f.sum",field="t",graph="back",src="w.run"}' in text
    assert 'omniflow_edge_bytes_total{dst="<output>",field="s",graph="back",src="w.run"}' in text


async def test_edge_bytes_are_not_counted_with_metrics_off() -> None:
    async with of.Runtime(
        back, placement=of.Deploy({"w": {}}), data_threshold=1024, heartbeat_interval=0.05
    ) as rt:
        for x in SIZES:
            await rt.run("back", {"x": x})
        assert rt.edge_bytes() == {}
        assert rt.remote is not None and rt.remote.edge_bytes is None
        assert not rt.remote.fleet.launcher.edge_bytes  # (its workers count nothing either)
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    assert "omniflow_edge_bytes_total" not in text


async def test_ray_replicas_count_their_reads_and_frames_exactly(ray_local: Any) -> None:
    # Every role in an actor: f's replica reads t from w's pool and says so in its heartbeats.
    async with of.Runtime(
        back, placement=of.Ray(), metrics=True, data_threshold=1024, heartbeat_interval=0.05
    ) as rt:
        want = _expected(all_remote=True)
        assert await _count_back(rt, want) == want


async def test_big_values_count_their_payload_once_per_read_along_a_chain() -> None:
    # x (the caller's) goes through the front's pool, y and z through a's and b's: each
    # is read once, by the next worker, and the front's runs carry refs only.
    size = 300_000  # above the default data threshold (256 KiB)
    async with of.Runtime(chain, placement="process", metrics=True, heartbeat_interval=0.05) as rt:
        assert (await rt.run("edges", {"x": b"v" * size})) == {"out": [size]}
        want = {
            ("edges", "<input>", "x", "a.a"): size,  # the front's ref, named by the plan
            ("edges", "a.a", "y", "b.b"): size,
            ("edges", "b.b", "z", "c.c"): size,
            ("edges", "c.c", "out", "<output>"): _wire(size),
        }
        got = rt.edge_bytes()
        for _ in range(600):  # the workers' reads come with their next heartbeats
            if got == want:
                break
            await asyncio.sleep(0.05)
            got = rt.edge_bytes()
    assert got == want


def test_wire_size_is_the_encoded_size_and_never_raises() -> None:
    assert wire_size(b"v" * 300) == _wire(b"v" * 300) > 300
    assert wire_size(np.zeros(100_000, "f4")) == _wire(np.zeros(100_000, "f4")) > 400_000

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise TypeError("no")

    assert wire_size(Unpicklable()) == 0  # (counted as nothing; the frame still goes on)
