"""Regression tests: the smallest graphs behind runtime bugs found by test_random_graphs.py.

Each test is deterministic (explicit events, no sleeps) and bounded by a timeout, since the
bugs they pin down used to end in a call that never finished.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

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
# entry (the root stamps nothing). n1.run is a join fed by one frame of n0.run; a bucket keeps
# every entry all its frames share (issue 10, defect 1), so n1.run's f0b still descends from
# n0.run's one frame, and meets n0.run's own f0b in n4.run's bucket [f0b] (Rule C: one root
# frame, one bucket). Two frames of a plain field in one bucket are a NodeError naming the
# node and the field, whichever way the buckets are keyed; tables cut at the join used to
# split them into two activations.


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


class _N4c(of.Role):
    @of.interface(inputs_or=[["f0a"], ["f0b"]], outputs=["f4a"], collect=["f0a", "f0b"])
    async def run(self, f0a: Any = None, f0b: Any = None) -> Any:
        return {"f4a": ("a", f0a) if f0b is None else ("b", f0b)}


async def test_frames_below_a_join_keep_the_entry_of_the_one_frame_they_share() -> None:
    graph = of.Graph(
        "join_between",
        roles={"n0": _J0(), "n1": _J1(), "n4": _N4()},
        inputs=[of.Placeholder("p0")],
        outputs=["f4a"],
    )
    call, frames = await _run(graph, {"p0": 0})
    assert call.status == "error"
    assert [(e.node, e.field) for e in call.errors] == [("n4.run", "f0b")]
    assert "collect=['f0b']" in str(call.errors[0])
    # Collected, both frames meet in one activation.
    graph = of.Graph(
        "join_between_collect",
        roles={"n0": _J0(), "n1": _J1(), "n4": _N4c()},
        inputs=[of.Placeholder("p0")],
        outputs=["f4a"],
    )
    call, frames = await _run(graph, {"p0": 0})
    assert call.status == "ok", call.errors
    assert sorted(f.value for f in frames) == [("a", ["a"]), ("b", ["from-n0", "from-n1"])]


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


# ---------------------------------------------------------------- issues 10 and 18, by reference
#
# The graphs of semantics_graphs.py (run in both placements by test_placement.py) through the
# sequential reference evaluator, with their real methods as behaviours: the answers the
# placement tests expect are the reference's.

from omniflow.dsl._context import ActivationContext, _current  # noqa: E402

from . import semantics_graphs as sm  # noqa: E402
from .reference import evaluate  # noqa: E402


def _freeze(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


def _behave(plan: of.StaticPlan) -> Any:
    def behave(node: str, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        spec = plan.specs[node]
        group = next(g for g, fs in enumerate(spec.groups) if set(fs) == set(kwargs))
        method = getattr(plan.roles[spec.role], spec.method)
        kw = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}

        async def run() -> list[Any]:
            _current.set(ActivationContext(plan.graph, None, "ref", node, group, {}, 0, 0))
            out = method(**kw)
            if hasattr(out, "__aiter__"):
                return [f async for f in out]
            got = await out
            return [] if got is None else [got]

        return [{f: _freeze(v) for f, v in fr.items()} for fr in asyncio.run(run())]

    return behave


SEMANTICS: list[tuple[of.Graph, dict[str, Any], dict[str, list[Any]], set[tuple[str, str]]]] = [
    (sm.d1_collect, {"x": 1}, {"out": [["y1", ["y1"]]]}, set()),
    (sm.d1_all, {"x": 1}, {"out": [["y1", ["y1"]]]}, set()),
    (sm.d1_two_producers, {"x": 1}, {"out": [["a", "s1"]]}, set()),
    (sm.i18, {"x": 0}, {"out": [["e0", "e1"]]}, set()),
    (sm.i18, {"x": 2}, {"out": [["e0x3", "e1", "e1.1", "e1.2"]]}, set()),
    (sm.i18_all, {"x": 0}, {"out": [["e0", "e1"]]}, set()),
    (sm.i18_all, {"x": 2}, {"out": [["e0x3", "e1", "e1.1", "e1.2"]]}, set()),
    (sm.nested, {"x": 0}, {"out": [["e0", "e1"]]}, set()),
    (
        sm.nested,
        {"x": 2},
        {
            "out": [
                ["e0x3", "e1", "e1.1", "e1.2"],
                ["e0x2", "e1", "e1.1"],
                ["e0", "e1"],
            ]
        },
        set(),
    ),
    (sm.d3_collect, {"x": 0}, {"out": [[1, 2]]}, {("d3col.run", "y")}),
    (sm.d3_all, {"x": 0}, {"out": [[1, 2]]}, {("d3all.run", "y")}),
    (sm.and_rule, {"x": 1}, {}, set()),
    (sm.and_rule, {"x": 2}, {"out": [["p", "qa"]]}, set()),
    (sm.and_optional, {"x": 1}, {"out": [["p", None]]}, set()),
    (sm.latch, {"prompt": "a b c"}, {"audio": ["a/alto", "b/alto", "c/alto"]}, set()),
    (sm.latch, {"prompt": "mute b c"}, {}, set()),
]


@pytest.mark.parametrize(("graph", "inputs", "want", "errors"), SEMANTICS)
def test_semantics_graphs_match_the_reference(
    graph: of.Graph, inputs: dict[str, Any], want: dict[str, list[Any]], errors: set[Any]
) -> None:
    plan = of.parse(graph)
    ref = evaluate(plan, _behave(plan), inputs)
    expect = Counter((f, _freeze(v)) for f, vs in want.items() for v in vs)
    if errors:
        # Past an error the call stops; the outputs before it are what the runtime shows too.
        assert ref.errors == errors
        assert ref.outputs <= expect
    else:
        assert ref.errors == set()
        assert ref.outputs == expect


# ---------------------------------------------------------------- a settled bucket keeps its rules
#
# random_graphs seed 6 (600 graphs). j1.run [f0b, s1o] holds a bucket rooted at n0.run's frame:
# f0b has two producers (n0.run, and n1.run, which waits for ALL of n0.run's f0a), s1o one
# (s1.run, ALL of f0b). j1.run's bk0 loops back to n0.run (it never produces it), so n1.run and
# s1.run wait on j1.run's bucket and it on them: nothing else is live, and the call settles the
# earliest bucket in plan order, j1.run, as if its open slots had ended (CONTRACT §1). s1o never
# came, so it is DEAD. Then n1.run fires and its f0b is a second frame of a plain field for that
# same bucket: a NodeError, "never silently paired or dropped" (CONTRACT §1). The quiescent
# settle used to forget the DEAD bucket's input rules (the liveness path kept them), so the
# straggler vanished: the call ended "ok" (the same bucket beside j2.run, outside the loop: only
# j2.run's error was reported).


class _L0(of.Role):
    @of.interface(inputs_or=[["p0"], ["bk0"]], outputs=["f0a", "f0b"])
    async def run(self, p0: Any = None, bk0: Any = None) -> Any:
        return {"f0a": "a", "f0b": "from-n0"}


class _L1(of.Role):
    @of.interface(inputs_or=[["f0a"]], outputs=["f0b"], activate_by_count={"f0a": of.ALL})
    async def run(self, f0a: list[Any]) -> Any:
        return {"f0b": "from-n1"}


def _all_of(src: str, out: str) -> of.Role:
    async def run(self: Any, **kw: Any) -> Any:
        return {out: tuple(kw[src])}

    iface = of.interface(inputs_or=[[src]], outputs=[out], activate_by_count={src: of.ALL})
    return type(f"All_{out}", (of.Role,), {"run": iface(run)})()  # type: ignore[no-any-return]


def _join(fields: list[str], outs: list[str]) -> of.Role:
    async def run(self: Any, **kw: Any) -> Any:
        return {outs[0]: tuple(kw[f] for f in fields)}  # never the loop's bk0

    iface = of.interface(inputs_or=[fields], outputs=outs)
    return type(f"Join_{outs[0]}", (of.Role,), {"run": iface(run)})()  # type: ignore[no-any-return]


def _loop_graph(beside: bool) -> of.Graph:
    roles: dict[str, Any] = {
        "n0": _L0(),
        "n1": _L1(),
        "s1": _all_of("f0b", "s1o"),
        "j1": _join(["f0b", "s1o"], ["j1o", "bk0"]),
    }
    if beside:
        roles |= {"s2": _all_of("f0b", "s2o"), "j2": _join(["f0b", "s2o"], ["j2o"])}
    return of.Graph(
        "settled_rules",
        roles=roles,
        inputs=[of.Placeholder("p0")],
        outputs=["j1o", "j2o"] if beside else ["j1o"],
    )


@pytest.mark.parametrize("beside", [False, True])
def test_a_bucket_settled_in_a_cycle_still_reports_a_second_frame(beside: bool) -> None:
    graph = _loop_graph(beside)
    plan = of.parse(graph)
    assert ("j1.run", 0) in plan.buckets and "j1.run" in plan.cycle_nodes
    want = {("j1.run", "f0b"), ("j2.run", "f0b")} if beside else {("j1.run", "f0b")}
    assert evaluate(plan, _behave(plan), {"p0": 0}).errors == want
    call, frames = asyncio.run(_run(graph, {"p0": 0}))  # sync: the reference runs its own loops
    assert frames == []
    assert call.status == "error"
    assert {(e.node, e.field) for e in call.errors} == want
    assert all("collect=['f0b']" in str(e) for e in call.errors)
