"""Bytes moved between processes per edge (``omniflow_edge_bytes_total``, issue 37)."""

from __future__ import annotations

import asyncio

import omniflow as of
from omniflow.serve._metrics import HttpMetrics, render


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
