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


# ---------------------------------------------------------------- once-per-call roots
#
# The runtime keys the buckets of a diamond root that fires once per call by the call's own
# entry (the root stamps nothing). That is only the same bucket as the root's entry when every
# frame keeps that entry on its way: here n1.run is a join, whose frames carry only the call's
# entry, so n4.run's f0b frames from n0.run and from n1.run belong to two buckets (two
# activations). Keying by the call's entry merged them into one, and the second frame of the
# plain field broke its rule (found by test_random_dag_matches_reference).


class _J0(of.Role):
    @of.interface(inputs_or=[["p0"]], outputs=["f0a", "f0b"], activate_by_count={"p0": of.ALL})
    async def run(self, p0: list[Any]) -> Any:
        return {"f0a": "a", "f0b": "from-n0"}


class _J1(of.Role):
    @of.interface(inputs_or=[["f0a"]], outputs=["f0b"], activate_by_count={"f0a": of.ALL})
    async def run(self, f0a: list[Any]) -> Any:
        return {"f0b": "from-n1"}


class _N4(of.Role):
    @of.interface(inputs_or=[["f0a"], ["f0b"]], outputs=["f4a"], collect=["f0a"])
    async def run(self, f0a: Any = None, f0b: Any = None) -> Any:
        return {"f4a": ("a", f0a) if f0b is None else ("b", f0b)}


async def test_root_whose_entry_a_join_drops_keeps_its_own_buckets() -> None:
    graph = of.Graph(
        "join_between",
        roles={"n0": _J0(), "n1": _J1(), "n4": _N4()},
        inputs=[of.Placeholder("p0")],
        outputs=["f4a"],
    )
    call, frames = await _run(graph, {"p0": 0})
    assert call.status == "ok", call.errors
    assert sorted(f.value for f in frames) == [("a", ["a"]), ("b", "from-n0"), ("b", "from-n1")]


# A once-per-call root with only direct-fire nodes below it (the fan-out + join shape): its
# bucket is keyed by the call's entry. Branches end without a frame (a critical slot: DEAD) or
# fail on negative inputs; the answers must be those of a stamped root.


class _Seed(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["s"])
    async def run(self, x: int) -> Any:
        return {"s": x}


def _branch(i: int, mode: str) -> of.Role:
    async def run(self: Any, s: int) -> Any:
        await asyncio.sleep(0)  # some branches suspend, some finish in their first step
        if s < 0 and mode == "none":
            return None
        if s < 0 and mode == "raise":
            raise ValueError(f"branch {i} failed")
        return {f"o{i}": s + i}

    iface = of.interface(inputs_or=[["s"]], outputs=[f"o{i}"])(run)
    return type(f"Branch{i}", (of.Role,), {"run": iface})()  # type: ignore[no-any-return]


class _Meet(of.Role):
    @of.interface(inputs_or=[["o0", "o1", "o2"]], outputs=["out"])
    async def run(self, o0: int, o1: int, o2: int) -> Any:
        return {"out": (o0, o1, o2)}


def _fan(modes: tuple[str, str, str]) -> of.Graph:
    roles: dict[str, Any] = {"src": _Seed(), "join": _Meet()}
    roles.update({f"b{i}": _branch(i, m) for i, m in enumerate(modes)})
    return of.Graph("fan", roles=roles, inputs=[of.Placeholder("x")], outputs=["out"])


async def test_once_per_call_root_keys_its_bucket_by_the_call() -> None:
    graph = _fan(("ok", "none", "raise"))
    rt = of.Runtime(graph, validate=True)
    assert rt.plans["fan"].diamond_roots[("join.run", 0)] == "src.run"  # the plan is unchanged
    compiled = rt._compiled["fan"]
    assert "src.run" not in compiled.stamping
    call, frames = await _run(graph, {"x": 1})
    assert call.status == "ok" and [f.value for f in frames] == [(1, 2, 3)]
    _, frames = await _run(_fan(("ok", "none", "ok")), {"x": -1})
    assert frames == []  # o1 never arrives: the bucket is DEAD, the call still ends "ok"
    call, frames = await _run(graph, {"x": -1})
    assert frames == [] and call.status == "error"
    assert [e.node for e in call.errors] == ["b2.run"]
