"""The runtime scenarios, run for every placement with the same assertions.

Each test here mirrors one of test_scenarios.py, rewritten so that what it checks comes back
through the call (frames, status, errors), ``rt.stats()``, ``rt.story()``, session
GlobalParameters copied into outputs, timestamps, or marker files: with
``placement="process"`` the roles live in other processes, where no closure, list or event of
the test can reach. The graphs are module-level objects of scenario_graphs.py, which a worker
imports by path.

The placements are ``"inproc"``, ``"process"`` and ``of.Ray()`` (the "ray" parameter: every
role a Ray actor; one local Ray instance for the module, skipped where ray is not installed).
A placement that this build does not have yet is skipped, and only when the Runtime
constructor says exactly that; every other error fails the test.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import omniflow as of

from . import scenario_graphs as sg
from .conftest import GRAPHS, ZERO, started_runtimes


@pytest.fixture(params=["inproc", "process", "ray"])
def placement(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":  # one Ray instance for the whole module
        request.getfixturevalue("ray_local")
    return str(request.param)


def build(placement: str, *graphs: of.Graph, **kw: Any) -> of.Runtime:
    """``of.Runtime(*graphs, placement=placement, validate=True, **kw)``, or skip the test
    when (and only when) the build says it lacks that placement."""
    kw.setdefault("validate", True)
    try:
        where = of.Ray() if placement == "ray" else placement
        return of.Runtime(*graphs, placement=where, **kw)
    except of.OmniflowError as exc:
        missing = f"placement={placement!r} is not available in this build"
        if placement != "inproc" and str(exc).startswith(missing):
            pytest.skip(f"{missing} yet")
        raise


Factory = Callable[..., Any]


@pytest.fixture
async def runtime(placement: str) -> AsyncIterator[Factory]:
    """Factory: ``rt = await runtime(graph, ...)`` for the test's placement; every runtime is
    checked for leftover work and closed after the test."""
    async with started_runtimes(functools.partial(build, placement)) as make:
        yield make


def graph_file(name: str) -> of.Graph:
    """The Graph of graphs/<name>.py, loaded by path (so a worker can load it again)."""
    (graph,) = of.load_graphs(GRAPHS / f"{name}.py")
    return graph


async def eventually(check: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s}s waiting for {what}")
        await asyncio.sleep(0.005)


def by_field(frames: list[of.Frame], field: str) -> list[of.Frame]:
    return [f for f in frames if f.field == field]


# ---------------------------------------------------------------- Fig. 3


async def test_fig3_mixed_frames_pick_or_groups_per_frame(runtime: Factory) -> None:
    rt = await runtime(sg.fig3)
    parts = [{"text": "ab"}, {"image": [1, 2]}, {"text": "c"}, {"image": [3]}, {"image": [5, 6]}]
    call = rt.call("sc_fig3", {"request": {"parts": parts}}, session="s")
    frames = [f async for f in call]
    assert call.status == "ok", call.errors
    assert rt.stats() == ZERO
    # One llm activation per part, in parse order (llm is a session node), with the right group.
    seen = [f.value for f in by_field(frames, "llm_seen")]
    assert {f.node for f in by_field(frames, "llm_seen")} == {"f3_llm.generate"}
    assert [g for g, _, _ in seen] == [0, 1, 0, 1, 1]
    for g, keys, _ in seen:
        assert keys == (["text_emb"] if g == 0 else ["vae_feat", "vit_feat"])
    # Image buckets pair the features of the same image: vit 2v + vae v+0.5 = 3v + 0.5.
    img = [values for g, _, values in seen if g == 1]
    for (vae, vit), image in zip(img, ([1, 2], [3], [5, 6]), strict=True):
        assert vit == [2.0 * v for v in image]
        assert vae == [v + 0.5 for v in image]
    tokens = [f.value for f in by_field(frames, "token")]
    kinds = [t.split(":")[0][:3] for t in tokens]
    assert kinds == ["txt"] * 2 + ["img"] * 2 + ["txt"] + ["img"] * 3
    assert [f.seq for f in by_field(frames, "token")] == list(range(8))
    (picture,) = by_field(frames, "picture")
    assert picture.node == "f3_vae.decode" and len(picture.value) == 8


async def test_fig3_concurrent_calls_with_jitter_never_mix_buckets(runtime: Factory) -> None:
    rt = await runtime(sg.mix)
    calls = [rt.call("sc_mix", {"req": [i * 1000 + k for k in range(3)]}) for i in range(200)]
    results = await asyncio.gather(*(c.collect() for c in calls))
    for i, (call, out) in enumerate(zip(calls, results, strict=True)):
        assert call.status == "ok", call.errors
        assert sorted(out["pair"]) == [[["a", i * 1000 + k], ["b", i * 1000 + k]] for k in range(3)]
    assert rt.stats() == ZERO


# ---------------------------------------------------------------- ordering


async def test_token_stream_through_reordering_node_arrives_in_order(runtime: Factory) -> None:
    rt = await runtime(sg.tok)
    call = rt.call("sc_tok", {"prompt": 30}, session="s")
    frames = [f async for f in call]
    assert call.status == "ok", call.errors
    assert rt.stats() == ZERO
    assert [f.value for f in by_field(frames, "text")] == [f"t{i}" for i in range(30)]
    assert [f.seq for f in by_field(frames, "text")] == list(range(30))
    assert [f.value for f in by_field(frames, "echo")] == [f"t{i}" for i in range(30)]
    assert [f.seq for f in by_field(frames, "echo")] == list(range(30))
    # The session node ran its activations in stream order: its k-th activation had seen 0..k.
    orders = [f.value for f in by_field(frames, "sink_order")]
    assert orders == [list(range(k + 1)) for k in range(30)]


async def test_ordering_skips_seqs_that_produce_nothing(runtime: Factory) -> None:
    rt = await runtime(sg.skip)
    out = await rt.run("sc_skip", {"n": 20}, session="s")
    assert rt.stats() == ZERO
    expected = [i for i in range(20) if i % 3]
    assert out["y"] == expected
    assert out["z"] == expected
    assert out["skip_order"][-1] == expected


# ---------------------------------------------------------------- independence


async def test_fast_branch_does_not_wait_for_slow_sibling(runtime: Factory, tmp_path: Path) -> None:
    """The slow sibling ends only after the fast frame reached the caller (a gate the test opens
    then): the order is forced by the graph, not raced against a sleep."""
    gate = tmp_path / "gate"
    rt = await runtime(sg.sib)
    call = rt.call("sc_sib", {"x": 1, "gate": str(gate)})
    it = call.__aiter__()
    first = await asyncio.wait_for(it.__anext__(), sg.GATE_S / 2)
    assert (first.field, first.node, first.value) == ("fast", "sib_fast2.run", [3])
    gate.touch()
    rest = [f async for f in it]
    assert call.status == "ok", call.errors
    assert rt.stats() == ZERO
    assert [(f.field, f.node, f.value) for f in rest] == [("slow", "sib_slow.run", [1, True])]


async def test_join_behind_conditional_skip_fires(runtime: Factory) -> None:
    plan = of.parse(sg.skipjoin)
    assert ("sj_join.run", 0) in plan.buckets
    assert ("sj_join.run", 0, "branch") not in plan.critical_slots
    rt = await runtime(sg.skipjoin)
    assert await asyncio.wait_for(rt.run("sc_skipjoin", {"x": 4}), 5) == {"out": [["even:4", 4]]}
    assert rt.stats() == ZERO
    assert await asyncio.wait_for(rt.run("sc_skipjoin", {"x": 3}), 5) == {"out": [["odd:3", 3]]}
    assert rt.stats() == ZERO


async def test_critical_slot_unreachable_kills_bucket_and_skips_downstream(
    runtime: Factory,
) -> None:
    rt = await runtime(sg.dead)
    assert await rt.run("sc_dead", {"x": 0}) == {"z": [0]}
    assert rt.stats() == ZERO
    call = rt.call("sc_dead", {"x": 5})
    assert await call.collect() == {}
    assert call.status == "ok" and call.errors == []
    assert rt.stats() == ZERO
    assert any(ev == "dead" for ev, _ in rt.story(call.call_id))


# ---------------------------------------------------------------- joins


async def test_t2i_join_fires_once_for_0_1_n_images(runtime: Factory) -> None:
    rt = await runtime(graph_file("t2i"))
    for n_images in (0, 1, 4):
        images = [[i, i + 1] for i in range(n_images)]
        call = rt.call("t2i", {"request": {"prompt": "a red cat", "images": images}})
        frames = [f async for f in call]
        assert call.status == "ok", call.errors
        assert rt.stats() == ZERO
        conds = [[3 * v + 1 for v in img] for img in images]
        bias = sum(sum(c) for c in conds)
        # Exactly one picture: the join fired once, with every condition (or none).
        assert [(f.field, f.node, f.value) for f in frames] == [
            (
                "picture",
                "vae.decode",
                {"n_cond": n_images, "pixels": [10 * (e + bias) for e in (1, 3, 3)]},
            )
        ]


async def test_count_threshold_fires_at_n_and_rejects_extra_frames(runtime: Factory) -> None:
    rt = await runtime(sg.batch)
    assert await rt.run("sc_batch", {"n": 3}) == {"batch": [[0, 1, 2]]}
    assert rt.stats() == ZERO
    assert await rt.run("sc_batch", {"n": 2}) == {"batch": [[0, 1]]}  # stream ended short
    assert rt.stats() == ZERO
    with pytest.raises(of.NodeError) as info:
        await rt.run("sc_batch", {"n": 5})
    assert info.value.node == "batch_b.run" and info.value.field == "x"
    assert rt.stats() == ZERO


async def test_appendix_a_cases(runtime: Factory) -> None:
    """Case 1 (root multi-frame -> one bucket per root frame), Case 2 (intermediate
    multi-frame -> accumulation in one bucket with collect), Case 3 (both nested)."""
    plan = of.parse(sg.appa)
    assert plan.diamond_roots[("appa_sink.run", 0)] == "appa_root.run"
    rt = await runtime(sg.appa)
    # Case 2: one root frame, intermediate yields 4 frames -> accumulate in order.
    out = await rt.run("sc_appa", {"req": [4]}, session="s")
    assert out == {"joined": [["#4", [40, 41, 42, 43]]]}
    assert rt.stats() == ZERO
    # Case 1 + 3: root yields several frames -> one bucket per root frame, released in order.
    # The root frame 0 makes no piece: a collected critical slot that ends empty is DEAD.
    out = await rt.run("sc_appa", {"req": [2, 3, 0, 1]}, session="s")
    assert out == {"joined": [["#2", [20, 21]], ["#3", [30, 31, 32]], ["#1", [10]]]}
    assert rt.stats() == ZERO


async def test_second_frame_for_plain_field_is_an_error_naming_node_and_field(
    runtime: Factory,
) -> None:
    rt = await runtime(sg.twice)
    with pytest.raises(of.NodeError) as info:
        await rt.run("sc_twice", {"x": 1, "y": 2})
    assert info.value.node == "tw_join.run" and info.value.field == "a"
    assert "collect" in str(info.value)
    assert rt.stats() == ZERO


# ---------------------------------------------------------------- loops


async def test_agent_loop_with_tool_calls(runtime: Factory) -> None:
    rt = await runtime(graph_file("agent_loop"))
    call = rt.call("agent", {"prompt": "2 + 3 * 4 - 1"}, session="u1")
    frames = [(f.field, f.value) async for f in call]
    assert call.status == "ok", call.errors
    assert rt.stats() == ZERO
    assert frames == [
        ("step", "call 2 + 3"),
        ("step", "call 5 * 4"),
        ("step", "call 20 - 1"),
        ("step", "answer 19"),
        ("answer", 19),
    ]


async def test_loop_over_max_iterations_ends_the_call_with_node_error(runtime: Factory) -> None:
    rt = await runtime(sg.forever)
    call = rt.call("sc_forever", {"start": 0})
    seen = [f.value async for f in call]
    assert call.status == "error"
    assert rt.stats() == ZERO
    errs = [e for e in call.errors if e.kind == "error"]
    assert len(errs) == 1 and "max_iterations=50" in str(errs[0])
    assert errs[0].node in {"fv_ping.run", "fv_pong.run"}
    assert 45 <= len(seen) <= 50
    assert seen == list(range(1, len(seen) + 1))


async def test_long_stream_is_not_bounded_by_max_iterations(runtime: Factory) -> None:
    rt = await runtime(sg.long, validate=False)
    out = await rt.run("sc_long", {"n": 5000})
    assert out["y"] == list(range(1, 5001))
    assert rt.stats() == ZERO


# ---------------------------------------------------------------- errors and cancellation


async def test_node_exception_surfaces_and_skips_dependents(runtime: Factory) -> None:
    rt = await runtime(sg.err)
    call = rt.call("sc_err", {"x": 7})
    out = await call.collect()
    assert out == {"ok": [7]}  # nothing from err_dep: it never ran
    assert call.status == "error"
    assert rt.stats() == ZERO
    (e,) = call.errors
    assert e.node == "err_bad.run" and e.kind == "error" and "cannot handle 7" in str(e)
    with pytest.raises(of.NodeError, match=r"err_bad\.run"):
        await rt.run("sc_err", {"x": 1})
    assert rt.stats() == ZERO


async def test_early_exit_cancels_the_producer(runtime: Factory, tmp_path: Path) -> None:
    marker = tmp_path / "inf_gen.cancelled"
    rt = await runtime(sg.inf)
    call = rt.call("sc_inf", {"marker": str(marker)})
    got = []
    async for frame in call:
        got.append(frame.value)
        if len(got) == 5:
            break
    await asyncio.wait_for(call.wait(), 5)
    await eventually(marker.exists, "the producer to see its cancellation")
    assert marker.read_text().split() in (["CancelledError"], ["GeneratorExit"])
    assert got == [0, 1, 2, 3, 4]
    assert call.status == "cancelled"
    assert [(e.node, e.kind) for e in call.errors] == [("inf_gen.gen", "cancel")]
    assert rt.stats() == ZERO


async def test_explicit_cancel_mid_bucket_leaves_nothing(runtime: Factory, tmp_path: Path) -> None:
    marker = tmp_path / "cx_slow.cancelled"
    rt = await runtime(sg.cx)
    call = rt.call("sc_cx", {"req": {"x": 1, "marker": str(marker)}})
    mid_bucket = {"open_buckets": 1, "inflight": 1, "active_calls": 1, "data_plane_bytes": 0}
    await eventually(lambda: rt.stats() == mid_bucket, f"stats {mid_bucket}")
    await asyncio.sleep(0.05)
    assert rt.stats() == mid_bucket  # and it stays there: cx_slow is sleeping
    await call.cancel()
    assert call.status == "cancelled"
    assert [(e.node, e.kind) for e in call.errors] == [("cx_slow.run", "cancel")]
    assert rt.stats() == ZERO
    await eventually(marker.exists, "cx_slow to see its cancellation")
    assert marker.read_text().split() == ["CancelledError"]


async def test_bad_frames_are_node_errors(runtime: Factory) -> None:
    rt = await runtime(sg.bad)
    with pytest.raises(of.NodeError, match=r"'z'.*not among its declared outputs") as info:
        await rt.run("sc_bad", {"x": 1})
    assert info.value.node == "bad_b.run"
    assert rt.stats() == ZERO
    with pytest.raises(of.NodeError, match="return or yield a dict") as info:
        await rt.run("sc_bad", {"x": 0})
    assert info.value.node == "bad_b.run"
    assert rt.stats() == ZERO


async def test_input_errors_are_raised_at_once(runtime: Factory) -> None:
    rt = await runtime(sg.bad)
    with pytest.raises(of.InputError, match="unknown graph 'nope'"):
        rt.call("nope", {})
    with pytest.raises(of.InputError, match="missing input 'x'") as info:
        rt.call("sc_bad", {})
    assert isinstance(info.value, ValueError)
    with pytest.raises(of.InputError, match="unknown input 'extra'"):
        rt.call("sc_bad", {"x": 1, "extra": 1})
    assert rt.stats() == ZERO


async def test_runtime_used_outside_its_lifetime(placement: str) -> None:
    rt = build(placement, sg.batch)
    with pytest.raises(of.RuntimeClosedError, match="async with"):
        rt.call("sc_batch", {"n": 1})
    async with rt:
        assert await rt.run("sc_batch", {"n": 1}) == {"batch": [[0]]}
        assert rt.stats() == ZERO
    with pytest.raises(of.RuntimeClosedError):
        rt.call("sc_batch", {"n": 1})


# ---------------------------------------------------------------- sessions


def _done(out: dict[str, list[Any]]) -> list[Any]:
    """The one ``[job, history, session, t0, t1, met]`` report of a sc_sess call."""
    (done,) = out["done"]
    return list(done)


def meet(tmp: Path, peers: dict[str, list[str]]) -> Callable[[str], str]:
    """``job(name)``: the sc_sess job that meets the peers ``peers[name]`` lists (in ``tmp``)."""
    (tmp / "meet.json").write_text(json.dumps(peers))
    return lambda name: f"{name}@{tmp}" if name in peers else name


async def test_per_session_fifo_and_cross_session_overlap(runtime: Factory, tmp_path: Path) -> None:
    job = meet(tmp_path, {"a1": ["b1"], "b1": ["a1"]})
    rt = await runtime(sg.sess)
    calls = [
        rt.call("sc_sess", {"job": job("a1")}, session="A"),
        rt.call("sc_sess", {"job": "a2"}, session="A"),
        rt.call("sc_sess", {"job": job("b1")}, session="B"),
        rt.call("sc_sess", {"job": "a3"}, session="A"),
    ]
    assert rt.stats()["active_calls"] == 4
    a1, a2, b1, a3 = [_done(out) for out in await asyncio.gather(*(c.collect() for c in calls))]
    assert [c.status for c in calls] == ["ok"] * 4
    assert rt.stats() == ZERO
    assert a1[:3] == ["a1", ["a1"], "A"]
    assert a2[:3] == ["a2", ["a1", "a2"], "A"]
    assert a3[:3] == ["a3", ["a1", "a2", "a3"], "A"]
    assert b1[:3] == ["b1", ["b1"], "B"]
    # Session A ran one call after another, in submission order ...
    assert a1[4] <= a2[3] and a2[4] <= a3[3]
    # ... while B ran alongside A's first call: each waited until the other had started.
    assert (a1[5], b1[5]) == (True, True)
    assert rt.sessions() == ["A", "B"]
    await rt.close_session("A")
    assert rt.sessions() == ["B"]
    assert _done(await rt.run("sc_sess", {"job": "a4"}, session="A"))[:3] == ["a4", ["a4"], "A"]
    assert rt.stats() == ZERO


async def test_session_less_calls_are_independent(runtime: Factory, tmp_path: Path) -> None:
    jobs = [f"j{i}" for i in range(3)]
    job = meet(tmp_path, {j: [k for k in jobs if k != j] for j in jobs})
    rt = await runtime(sg.sess)
    outs = [
        _done(o) for o in await asyncio.gather(*(rt.run("sc_sess", {"job": job(j)}) for j in jobs))
    ]
    assert rt.stats() == ZERO
    assert [o[:3] for o in outs] == [[f"j{i}", [f"j{i}"], None] for i in range(3)]
    # All three ran at once: each waited until the other two had started.
    assert [o[5] for o in outs] == [True, True, True]


async def test_cancel_a_call_queued_behind_its_session(runtime: Factory) -> None:
    rt = await runtime(sg.sess)
    first = rt.call("sc_sess", {"job": "x1"}, session="S")
    second = rt.call("sc_sess", {"job": "x2"}, session="S")
    await second.cancel()
    assert second.status == "cancelled"
    assert _done(await first.collect())[:3] == ["x1", ["x1"], "S"]
    assert first.status == "ok"
    assert rt.stats() == ZERO
    # x2 never ran: the session's history went straight from x1 to x3.
    assert _done(await rt.run("sc_sess", {"job": "x3"}, session="S"))[:2] == ["x3", ["x1", "x3"]]
    assert rt.stats() == ZERO


# ---------------------------------------------------------------- concurrency limits


async def test_max_concurrency_throttles_one_node_only(runtime: Factory) -> None:
    rt = await runtime(sg.mc)
    out = await rt.run("sc_mc", {"n": 12})
    assert rt.stats() == ZERO
    assert sorted(x for x, _ in out["h"]) == list(range(12))
    assert out["l"] == list(range(12))
    assert max(running for _, running in out["h"]) == 2


# ---------------------------------------------------------------- role lifecycle


async def test_roles_setup_and_teardown_once_across_graphs(placement: str, tmp_path: Path) -> None:
    marker = tmp_path / "shared.teardown"
    async with build(placement, sg.g1, sg.g2) as rt:
        (y2,) = (await rt.run("sc_g2", {"x": 2, "marker": str(marker)}))["y"]
        (y1,) = (await rt.run("sc_g1", {"x": 3, "marker": str(marker)}))["y"]
        assert rt.stats() == ZERO
        assert not marker.exists()
    assert [y2[0], y1[0]] == [4, 6]
    # One instance (same process, same object) serves both graphs, set up exactly once ...
    assert y2[1:] == y1[1:] and y1[1] == 1
    # ... and torn down exactly once, when the runtime closed.
    assert marker.read_text().splitlines() == ["teardown 0"]


# ---------------------------------------------------------------- issues 10 and 18: semantics
#
# The graphs of semantics_graphs.py; the expected answers are the reference evaluator's
# (test_regressions.py::test_semantics_graphs_match_the_reference).


async def _call(rt: of.Runtime, graph: str, inputs: dict[str, Any]) -> tuple[of.Call, list[Any]]:
    call = rt.call(graph, inputs)
    frames = await asyncio.wait_for(_values(call), 30)
    assert rt.stats() == ZERO
    return call, frames


async def _values(call: of.Call) -> list[Any]:
    return [f.value async for f in call]


async def test_join_beside_a_collect_of_the_same_source_fires_once(runtime: Factory) -> None:
    """Issue 10, defect 1: s.run's frame keeps a.run's entry, so j.run gets y and s."""
    from . import semantics_graphs as sm

    rt = await runtime(sm.d1_collect, sm.d1_all, sm.d1_two_producers)
    for name in ("sm_d1_collect", "sm_d1_all"):
        call, got = await _call(rt, name, {"x": 1})
        assert (call.status, call.errors, call.warnings, got) == ("ok", [], [], [["y1", ["y1"]]])
    call, got = await _call(rt, "sm_d1_two", {"x": 1})
    assert (call.status, got) == ("ok", [["a", "s1"]])


async def test_collect_waits_for_buckets_upstream_on_a_loop(runtime: Factory) -> None:
    """Issue 18: j.run collects e from both OR groups of m.run, whatever the loop does."""
    from . import semantics_graphs as sm

    rt = await runtime(sm.i18, sm.i18_all, sm.nested)
    for name in ("sm_i18", "sm_i18_all"):
        call, got = await _call(rt, name, {"x": 0})
        assert (call.status, call.errors, got) == ("ok", [], [["e0", "e1"]])
        call, got = await _call(rt, name, {"x": 2})
        assert (call.status, got) == ("ok", [["e0x3", "e1", "e1.1", "e1.2"]])
    call, got = await _call(rt, "sm_nested", {"x": 2})
    assert call.status == "ok", call.errors
    assert got == [["e0x3", "e1", "e1.1", "e1.2"], ["e0x2", "e1", "e1.1"], ["e0", "e1"]]


async def test_late_frame_errors_fit_the_fields_mode(runtime: Factory) -> None:
    """Issue 10, defect 3: a collect or ALL field re-entered on a loop after its bucket fired."""
    from . import semantics_graphs as sm

    rt = await runtime(sm.d3_collect, sm.d3_all)
    for name, node, mode in (
        ("sm_d3_collect", "d3col.run", "collect"),
        ("sm_d3_all", "d3all.run", "ALL"),
    ):
        call, got = await _call(rt, name, {"x": 0})
        assert call.status == "error" and got == [[1, 2]]
        errs = [e for e in call.errors if e.kind == "error"]
        assert errs and {(e.node, e.field) for e in errs} == {(node, "y")}
        text = str(errs[0])
        assert "already fired" in text and "loop" in text and mode in text
        assert "Declare collect" not in text and "=None" not in text


async def test_and_rule_optional_and_warnings(runtime: Factory) -> None:
    from . import semantics_graphs as sm

    rt = await runtime(sm.and_rule, sm.and_optional)
    call, got = await _call(rt, "sm_and", {"x": 1})
    assert (call.status, call.errors, got) == ("ok", [], [])
    assert [(w["node"], w["field"]) for w in call.warnings] == [("andc.run", "q")]
    assert "optional" in call.warnings[0]["message"]
    call, got = await _call(rt, "sm_and", {"x": 2})
    assert (call.status, call.warnings, got) == ("ok", [], [["p", "qa"]])
    call, got = await _call(rt, "sm_and_optional", {"x": 1})
    assert (call.status, call.warnings, got) == ("ok", [], [["p", None]])


async def test_latch_pairs_one_value_with_every_frame(runtime: Factory) -> None:
    from . import semantics_graphs as sm

    rt = await runtime(sm.latch)
    call, got = await _call(rt, "sm_latch", {"prompt": "a b c"})
    assert (call.status, call.warnings) == ("ok", [])
    assert sorted(got) == ["a/alto", "b/alto", "c/alto"]
    call, got = await _call(rt, "sm_latch", {"prompt": "mute b c"})
    assert (call.status, got) == ("ok", [])
    assert [(w["node"], w["field"]) for w in call.warnings] == [("lttts.speak", "voice")] * 3


async def test_session_node_runs_one_index_in_or_group_order(runtime: Factory) -> None:
    from . import semantics_graphs as sm

    rt = await runtime(sm.session_order)
    call, got = await _call(rt, "sm_session_order", {"x": 3})
    assert (call.status, got) == ("ok", ["a0", "b0", "a1", "b1", "a2", "b2"])


# ---------------------------------------------------------------- values in every placement


@pytest.mark.timeout(120)
async def test_values_are_equal_and_writable_in_every_placement(runtime: Factory) -> None:
    """Big numpy arrays (data plane and out-of-band frames), ints beyond 64 bits, lists nested
    150 deep and bytes reach a method equal, of the same type and writable, whether they were
    produced by another method or given by the caller, and come back to the caller the same."""
    from . import value_graphs as vg

    rt = await runtime(vg.made, vg.given)
    for graph, inputs, n in [("values_made", {"n": 3}, 3), ("values_given", None, 5)]:
        out = await rt.run(graph, inputs if inputs is not None else {"v": vg.values(5)})
        [rep] = out["report"]
        assert rep == {"keys": True, **{k: (True, True) for k in vg.values(0)}}, rep
        [back] = out["back"]
        assert vg.report(back) == rep  # the caller's copy too
        assert back["n"] == n


@pytest.mark.timeout(120)
async def test_media_values_are_equal_and_writable_in_every_placement(
    runtime: Factory, placement: str
) -> None:
    """of.Audio and of.Image (contract §9) reach a method equal, of the same type and writable,
    produced by another method or given by the caller, and come back to the caller the same;
    between processes they move on the data plane (each output its own block), whatever their
    size, and a nested one rides the codec's media ext as an out-of-band array."""
    from . import media_graphs as mg

    rt = await runtime(mg.made, mg.given)
    want = dict.fromkeys(("clip", "fclip", "pic", "nested"), (True, True))
    out = await rt.run("media_made", {"n": 3})
    assert out["report"] == [want]
    assert mg.report(out["back"][0], 3) == want  # the caller's copy too
    made = await rt.pool_stats()
    given = mg.media(5)
    out = await rt.run("media_given", {**given, "n": 5})
    assert out["report"] == [want]
    assert mg.report(out["back"][0], 5) == want
    offloaded = {name: s["offloaded"] for name, s in (await rt.pool_stats()).items()}
    if placement == "inproc":
        assert set(offloaded.values()) <= {0}  # one process: the objects themselves
    else:
        # media_made: the source's three top-level media outputs, in the source's process;
        # media_given: the caller's three, put in the front's pool for the probe's process.
        assert sum(s["offloaded"] for n, s in made.items() if n != "<front>") == 3, made
        assert offloaded["<front>"] == 3, offloaded
    assert rt.stats() == ZERO
