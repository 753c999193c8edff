"""Runtime behaviours beyond the placement scenario suite (tests/runtime/test_placement.py
runs the scenarios of the runtime issue in every placement; these need the in-process shell:
fault injection, backpressure, options)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

import omniflow as of


async def test_context_outside_activation_raises() -> None:
    with pytest.raises(of.OmniflowError, match="outside a running interface method"):
        of.context()


async def test_fields_of_one_generator_frame_pair_up_per_frame(runtime: Any) -> None:
    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["p", "q"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                yield {"p": i, "q": -i}

    class Pair(of.Role):
        @of.interface(inputs_or=[["p", "q"]], outputs=["pair"])
        async def run(self, p: int, q: int) -> dict[str, Any]:
            return {"pair": (p, q)}

    g = of.Graph(
        "pairs",
        roles={"gen": Gen(), "pair": Pair()},
        inputs=[of.Placeholder("n")],
        outputs=["pair"],
    )
    assert of.parse(g).diamond_roots[("pair.run", 0)] == "gen.gen"
    rt = await runtime(g)
    assert await rt.run("pairs", {"n": 3}) == {"pair": [(0, 0), (1, -1), (2, -2)]}


async def test_an_internal_error_ends_the_call_not_the_runtime(
    runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omniflow.runtime.callcore import _orders as _session

    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                await asyncio.sleep(0)
                yield {"x": i}

    g = of.Graph("crash", roles={"g": Gen()}, inputs=[of.Placeholder("n")], outputs=["x"])
    rt = await runtime(g)
    original = _session.Orders.emit
    seen = 0

    def flaky(self: Any, *args: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == 3:
            raise RuntimeError("injected")
        original(self, *args)

    monkeypatch.setattr(_session.Orders, "emit", flaky)
    call = rt.call("crash", {"n": 10})
    got = [f.value async for f in call]
    assert got == [0, 1]
    assert call.status == "error"
    assert [e.node for e in call.errors] == ["<runtime>"]
    assert "internal error RuntimeError: injected" in str(call.errors[0])
    monkeypatch.setattr(_session.Orders, "emit", original)
    assert await rt.run("crash", {"n": 3}) == {"x": [0, 1, 2]}


async def test_a_slow_reader_holds_back_a_stream_producer(runtime: Any) -> None:
    produced: list[int] = []

    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                produced.append(i)
                yield {"x": i}

    g = of.Graph("bp", roles={"g": Gen()}, inputs=[of.Placeholder("n")], outputs=["x"])
    rt = await runtime(g, stream_high_water=8)
    call = rt.call("bp", {"n": 100})
    it = call.__aiter__()
    first = await it.__anext__()
    for _ in range(10):
        await asyncio.sleep(0)
    assert first.value == 0
    assert len(produced) <= 10  # the producer waits for the reader
    rest = [f.value async for f in it]
    assert rest == list(range(1, 100))
    # Nobody iterating: no backpressure, so waiting for the end cannot deadlock.
    quiet = rt.call("bp", {"n": 50})
    assert await asyncio.wait_for(quiet.wait(), 5) == "ok"
    assert len([f async for f in quiet]) == 50


class _Counter(of.Role):
    """Yields ``n`` frames; every third one after a loop turn (the reader runs meanwhile)."""

    def __init__(self, produced: list[int] | None = None) -> None:
        self.produced = produced if produced is not None else []

    @of.interface(inputs_or=[["n"]], outputs=["x"])
    async def gen(self, n: int) -> Any:
        for i in range(n):
            if i % 3 == 0:
                await asyncio.sleep(0)
            self.produced.append(i)
            yield {"x": i}


@pytest.mark.parametrize("seed", range(5))
async def test_a_sink_takes_frames_in_the_producers_turn_in_order(runtime: Any, seed: int) -> None:
    g = of.Graph("sink", roles={"g": _Counter()}, inputs=[of.Placeholder("n")], outputs=["x"])
    rt = await runtime(g, stream_high_water=8)
    call = rt.call("sink", {"n": 300})
    rng = random.Random(seed)
    got: list[int] = []
    taken = 0

    def sink(frames: list[of.Frame]) -> bool:
        nonlocal taken
        assert call.buffered == 0  # offered only while nothing is queued
        if rng.random() < 0.5:
            return False
        got.extend(f.value for f in frames)
        taken += len(frames)
        return True

    call.deliver(sink)
    async for frame in call:  # the reader gets what the sink refused
        got.append(frame.value)
    assert got == list(range(300))
    assert 0 < taken < 300
    assert call.status == "ok"


async def test_a_refusing_sink_keeps_the_producers_backpressure(runtime: Any) -> None:
    produced: list[int] = []
    g = of.Graph(
        "bp2", roles={"g": _Counter(produced)}, inputs=[of.Placeholder("n")], outputs=["x"]
    )
    rt = await runtime(g, stream_high_water=8)
    call = rt.call("bp2", {"n": 100})
    call.deliver(lambda frames: False)
    it = call.__aiter__()
    first = await it.__anext__()
    for _ in range(30):
        await asyncio.sleep(0)
    assert first.value == 0
    assert len(produced) <= 10  # the producer waits for the reader
    assert [f.value async for f in it] == list(range(1, 100))


async def test_a_node_cancelled_by_something_else_does_not_end_the_call_ok(runtime: Any) -> None:
    class SelfCancel(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> dict[str, Any]:
            raise asyncio.CancelledError()  # e.g. its worker is shutting down

    g = of.Graph("selfc", roles={"s": SelfCancel()}, inputs=[of.Placeholder("x")], outputs=["y"])
    rt = await runtime(g)
    call = rt.call("selfc", {"x": 1})
    assert await call.collect() == {}
    assert call.status == "cancelled"
    assert [(e.node, e.kind) for e in call.errors] == [("s.run", "cancel")]


async def test_heartbeat_interval_reaches_the_worker_machinery() -> None:
    graph = of.load_graphs(str(Path(__file__).resolve().parents[2] / "graphs" / "t2i.py"))[0]
    rt = of.Runtime(graph, placement="process", heartbeat_interval=0.25)
    assert rt.remote is not None and rt.remote.heartbeat_interval == 0.25
