"""Regression tests: the smallest graphs behind runtime bugs found by test_random_graphs.py.

Each test is deterministic (explicit events, no sleeps) and bounded by a timeout, since the
bugs they pin down used to end in a call that never finished.
"""

from __future__ import annotations

import asyncio
from typing import Any

import omniflow as of

ZERO = {"open_buckets": 0, "inflight": 0, "active_calls": 0}


async def _run(graph: of.Graph, inputs: dict[str, Any]) -> tuple[of.Call, list[of.Frame]]:
    rt = of.Runtime(graph, validate=True)
    await rt.start()
    try:
        call = rt.call(graph.name, inputs)
        frames = await asyncio.wait_for(_drain(call), 5)
        stats = rt.stats()
        assert {k: stats.get(k, 0) for k in ZERO} == ZERO, stats
        return call, frames
    finally:
        await asyncio.wait_for(rt.close(), 5)


async def _drain(call: of.Call) -> list[of.Frame]:
    return [f async for f in call]


# ---------------------------------------------------------------- input rules after DEAD
#
# Bucket c.run [x, y]: x has two producers (a.run, b.run), y one (y.run). y.run ends with no
# frame, so the bucket is DEAD as soon as it holds a.run's x; b.run's x arrives after that. Two
# frames of a plain field in one bucket are a NodeError (CONTRACT §1, "never silently paired
# or dropped"); the runtime used to drop the straggler silently, so whether such a call
# failed depended on whether the bucket had been found DEAD before the second frame came.


class _A(of.Role):
    @of.interface(inputs_or=[["p"]], outputs=["x"])
    async def run(self, p: Any) -> Any:
        return {"x": "a"}


class _B(of.Role):
    def __init__(self) -> None:
        self.go = asyncio.Event()

    @of.interface(inputs_or=[["p"]], outputs=["x"])
    async def run(self, p: Any) -> Any:
        await self.go.wait()
        return {"x": "b"}


class _Y(of.Role):
    def __init__(self, b: _B) -> None:
        self.b = b

    @of.interface(inputs_or=[["p"]], outputs=["y"])
    async def run(self, p: Any) -> Any:
        self.b.go.set()  # b.run resumes only after this activation (and the bucket) ended
        return None


class _C(of.Role):
    @of.interface(inputs_or=[["x", "y"]], outputs=["out"])
    async def run(self, x: Any, y: Any) -> Any:
        return {"out": (x, y)}


async def test_dead_bucket_still_reports_a_second_frame_of_a_plain_field() -> None:
    b = _B()
    graph = of.Graph(
        "dead_straggler",
        roles={"a": _A(), "b": b, "y": _Y(b), "c": _C()},
        inputs=[of.Placeholder("p")],
        outputs=["out"],
    )
    call, frames = await _run(graph, {"p": 0})
    assert frames == []
    assert call.status == "error"
    assert [(e.node, e.field) for e in call.errors] == [("c.run", "x")]
    assert "collect=['x']" in str(call.errors[0])


# ---------------------------------------------------------------- SeqId through a bucket
#
# src.gen yields a=0, a=1; fan.gen turns each into a stream of b; sink.run collects b per src
# frame (a bucket rooted at src.gen, so its activations carry src.gen's SeqId). The fan for a=0
# is slow. The SeqId settlement only followed paths without SeqId producers, so it did not see
# that the live fan.gen work for index 0 could still bring sink.run (and what follows it) an
# activation with index 0: the caller's queue skipped index 0 and then crashed on the late
# frame ("index 0 arrived after 1 settled", the call never finished), and the session node
# after sink.run ran index 1 before index 0.


class _Src(of.Role):
    @of.interface(inputs_or=[["p"]], outputs=["a"])
    async def gen(self, p: Any) -> Any:
        yield {"a": 0}
        yield {"a": 1}


class _Fan(of.Role):
    def __init__(self) -> None:
        self.go = asyncio.Event()

    @of.interface(inputs_or=[["a"]], outputs=["b"])
    async def gen(self, a: int) -> Any:
        if a == 0:
            await self.go.wait()
        yield {"b": a}
        if a == 1:
            self.go.set()  # index 0's fan finishes only after index 1's whole path ran


class _Sink(of.Role):
    @of.interface(inputs_or=[["b"]], outputs=["out"], collect=["b"])
    async def run(self, b: list[int]) -> Any:
        return {"out": b}


class _Log(of.Role):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    @of.interface(inputs_or=[["out"]], outputs=["logged"], lb="session")
    async def run(self, out: list[int]) -> Any:
        self.seen.append(out)
        return {"logged": out}


async def test_bucket_after_a_generator_keeps_its_roots_seq_order() -> None:
    log = _Log()
    graph = of.Graph(
        "seq_through_bucket",
        roles={"src": _Src(), "fan": _Fan(), "sink": _Sink(), "log": log},
        inputs=[of.Placeholder("p")],
        outputs=["out", "logged"],
    )
    assert of.parse(graph).diamond_roots[("sink.run", 0)] == "src.gen"
    call, frames = await _run(graph, {"p": 0})
    assert call.status == "ok", call.errors
    for fld in ("out", "logged"):
        got = [(f.value, f.seq) for f in frames if f.field == fld]
        assert got == [([0], 0), ([1], 1)], fld
    assert log.seen == [[0], [1]]
