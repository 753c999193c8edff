"""Scenario tests: real graphs through the in-process runtime, one behaviour each."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

import omniflow as of

from .conftest import ZERO, load_graph_module

# ---------------------------------------------------------------- Fig. 3


async def test_fig3_mixed_frames_pick_or_groups_per_frame(runtime: Any) -> None:
    fig3 = load_graph_module("fig3")
    seen: list[tuple[int, dict[str, Any]]] = []
    llm = fig3.graph.roles["llm"]
    original = type(llm).generate

    async def spy(self: Any, **kw: Any) -> Any:
        ctx = of.context()
        seen.append((ctx.or_group, {k: v for k, v in kw.items() if v is not None}))
        async for frame in original(self, **kw):
            yield frame

    spy.__omniflow_interface__ = original.__omniflow_interface__  # type: ignore[attr-defined]
    type(llm).generate = spy
    try:
        rt = await runtime(fig3.graph)
        parts = [
            {"text": "ab"},
            {"image": [1, 2]},
            {"text": "c"},
            {"image": [3]},
            {"image": [5, 6]},
        ]
        call = rt.call("fig3", {"request": {"parts": parts}}, session="s")
        frames = [f async for f in call]
    finally:
        type(llm).generate = original
    assert call.status == "ok", call.errors
    # One llm activation per part, in parse order (llm is a session node), with the right group.
    assert [g for g, _ in seen] == [0, 1, 0, 1, 1]
    for g, kw in seen:
        assert set(kw) == ({"text_emb"} if g == 0 else {"vit_feat", "vae_feat"})
    # Image buckets pair the features of the same image: vit 2v + vae v+0.5 = 3v + 0.5.
    img = [kw for g, kw in seen if g == 1]
    assert [len(kw["vit_feat"]) for kw in img] == [2, 1, 2]
    for kw, image in zip(img, ([1, 2], [3], [5, 6]), strict=True):
        assert kw["vit_feat"] == [2.0 * v for v in image]
        assert kw["vae_feat"] == [v + 0.5 for v in image]
    tokens = [f.value for f in frames if f.field == "token"]
    assert [t.split(":")[0][:3] for t in tokens] == ["txt"] * 2 + ["img"] * 2 + ["txt"] + [
        "img"
    ] * 3
    assert [f.seq for f in frames if f.field == "token"] == list(range(8))
    pictures = [f for f in frames if f.field == "picture"]
    assert len(pictures) == 1 and len(pictures[0].value) == 8
    assert rt.stats() == ZERO


async def test_fig3_concurrent_calls_with_jitter_never_mix_buckets(runtime: Any) -> None:
    rng = random.Random(7)

    class Parse(of.Role):
        @of.interface(inputs_or=[["req"]], outputs=["image"])
        async def run(self, req: list[int]) -> Any:
            for v in req:
                await asyncio.sleep(rng.random() / 2000)
                yield {"image": v}

    class Enc(of.Role):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        @of.interface(inputs_or=[["image"]], outputs=["feat"])
        async def encode(self, image: int) -> dict[str, Any]:
            await asyncio.sleep(rng.random() / 1000)
            return {"feat": (self.tag, image)}

    class EncB(Enc):
        @of.interface(inputs_or=[["image"]], outputs=["feat_b"])
        async def encode(self, image: int) -> dict[str, Any]:
            await asyncio.sleep(rng.random() / 1000)
            return {"feat_b": (self.tag, image)}

    class Join(of.Role):
        @of.interface(inputs_or=[["feat", "feat_b"]], outputs=["pair"])
        async def join(self, feat: Any, feat_b: Any) -> dict[str, Any]:
            return {"pair": (feat, feat_b)}

    g = of.Graph(
        "mix",
        roles={"parse": Parse(), "a": Enc("a"), "b": EncB("b"), "j": Join()},
        inputs=[of.Placeholder("req")],
        outputs=["pair"],
    )
    rt = await runtime(g)
    calls = [rt.call("mix", {"req": [i * 1000 + k for k in range(3)]}) for i in range(200)]
    results = await asyncio.gather(*(c.collect() for c in calls))
    for i, (call, out) in enumerate(zip(calls, results, strict=True)):
        assert call.status == "ok"
        pairs = sorted(out["pair"])
        assert pairs == [(("a", i * 1000 + k), ("b", i * 1000 + k)) for k in range(3)]
    assert rt.stats() == ZERO


# ---------------------------------------------------------------- ordering


def _token_graph(order: list[int], seen_at_session: list[int]) -> of.Graph:
    class Llm(of.Role):
        @of.interface(inputs_or=[["prompt"]], outputs=["tok"])
        async def gen(self, prompt: int) -> Any:
            for i in range(prompt):
                yield {"tok": i}

    class Detok(of.Role):
        """Stateless, and finishes out of order on purpose."""

        @of.interface(inputs_or=[["tok"]], outputs=["text"])
        async def run(self, tok: int) -> dict[str, Any]:
            await asyncio.sleep(order[tok % len(order)] / 1000)
            return {"text": f"t{tok}"}

    class Sink(of.Role):
        @of.interface(inputs_or=[["text"]], outputs=["echo"], lb="session")
        async def take(self, text: str) -> dict[str, Any]:
            seen_at_session.append(int(text[1:]))
            await asyncio.sleep(0)
            return {"echo": text}

    return of.Graph(
        "tok",
        roles={"llm": Llm(), "detok": Detok(), "sink": Sink()},
        inputs=[of.Placeholder("prompt")],
        outputs=["text", "echo"],
    )


async def test_token_stream_through_reordering_node_arrives_in_order(runtime: Any) -> None:
    seen: list[int] = []
    rt = await runtime(_token_graph([5, 1, 3, 0, 2, 4], seen))
    call = rt.call("tok", {"prompt": 30}, session="s")
    frames = [f async for f in call]
    texts = [f.value for f in frames if f.field == "text"]
    echoes = [f.value for f in frames if f.field == "echo"]
    assert texts == [f"t{i}" for i in range(30)]
    assert [f.seq for f in frames if f.field == "text"] == list(range(30))
    assert seen == list(range(30))
    assert echoes == [f"t{i}" for i in range(30)]
    assert [f.seq for f in frames if f.field == "echo"] == list(range(30))


async def test_ordering_skips_seqs_that_produce_nothing(runtime: Any) -> None:
    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                yield {"x": i}

    class Filter(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> dict[str, Any] | None:
            await asyncio.sleep((7 - x % 7) / 2000)
            return None if x % 3 == 0 else {"y": x}

    class Sess(of.Role):
        def __init__(self) -> None:
            self.seen: list[int] = []

        @of.interface(inputs_or=[["y"]], outputs=["z"], lb="session")
        async def run(self, y: int) -> dict[str, Any]:
            self.seen.append(y)
            return {"z": y}

    sess = Sess()
    g = of.Graph(
        "skip",
        roles={"gen": Gen(), "f": Filter(), "s": sess},
        inputs=[of.Placeholder("n")],
        outputs=["y", "z"],
    )
    rt = await runtime(g)
    out = await rt.run("skip", {"n": 20})
    expected = [i for i in range(20) if i % 3]
    assert out["y"] == expected
    assert out["z"] == expected
    assert sess.seen == expected


# ---------------------------------------------------------------- independence


async def test_fast_branch_does_not_wait_for_slow_sibling(runtime: Any) -> None:
    slow_started = asyncio.Event()
    release_slow = asyncio.Event()

    class Src(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"a": x, "b": x}

    class Slow(of.Role):
        @of.interface(inputs_or=[["a"]], outputs=["slow"])
        async def run(self, a: int) -> dict[str, Any]:
            slow_started.set()
            await release_slow.wait()
            return {"slow": a}

    class Fast(of.Role):
        @of.interface(inputs_or=[["b"]], outputs=["fast1"])
        async def run(self, b: int) -> dict[str, Any]:
            await asyncio.sleep(0)
            return {"fast1": b + 1}

    class Fast2(of.Role):
        @of.interface(inputs_or=[["fast1"]], outputs=["fast"])
        async def run(self, fast1: int) -> dict[str, Any]:
            return {"fast": fast1 + 1}

    g = of.Graph(
        "sib",
        roles={"src": Src(), "slow": Slow(), "fast": Fast(), "fast2": Fast2()},
        inputs=[of.Placeholder("x")],
        outputs=["slow", "fast"],
    )
    rt = await runtime(g)
    call = rt.call("sib", {"x": 1})
    it = call.__aiter__()
    first = await asyncio.wait_for(it.__anext__(), 5)
    assert (first.field, first.value) == ("fast", 3)
    assert slow_started.is_set() and not release_slow.is_set()
    release_slow.set()
    rest = [f async for f in it]
    assert [(f.field, f.value) for f in rest] == [("slow", 1)]


async def test_join_behind_conditional_skip_fires(runtime: Any) -> None:
    class Router(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["even", "odd", "raw"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"even" if x % 2 == 0 else "odd": x, "raw": x}

    class Even(of.Role):
        @of.interface(inputs_or=[["even"]], outputs=["branch"])
        async def run(self, even: int) -> dict[str, Any]:
            await asyncio.sleep(0.001)
            return {"branch": f"even:{even}"}

    class Odd(of.Role):
        @of.interface(inputs_or=[["odd"]], outputs=["branch"])
        async def run(self, odd: int) -> dict[str, Any]:
            return {"branch": f"odd:{odd}"}

    class Join(of.Role):
        @of.interface(inputs_or=[["branch", "raw"]], outputs=["out"])
        async def run(self, branch: str, raw: int) -> dict[str, Any]:
            return {"out": (branch, raw)}

    g = of.Graph(
        "skipjoin",
        roles={"r": Router(), "e": Even(), "o": Odd(), "j": Join()},
        inputs=[of.Placeholder("x")],
        outputs=["out"],
    )
    plan = of.parse(g)
    assert ("j.run", 0) in plan.buckets
    assert ("j.run", 0, "branch") not in plan.critical_slots
    rt = await runtime(g)
    assert await asyncio.wait_for(rt.run("skipjoin", {"x": 4}), 5) == {"out": [("even:4", 4)]}
    assert await asyncio.wait_for(rt.run("skipjoin", {"x": 3}), 5) == {"out": [("odd:3", 3)]}


async def test_critical_slot_unreachable_kills_bucket_and_skips_downstream(runtime: Any) -> None:
    class Src(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"a": x} if x else {"a": x, "b": x}

    class J(of.Role):
        @of.interface(inputs_or=[["a", "b"]], outputs=["y"])
        async def run(self, a: int, b: int) -> dict[str, Any]:
            return {"y": a + b}

    class After(of.Role):
        @of.interface(inputs_or=[["y"]], outputs=["z"])
        async def run(self, y: int) -> dict[str, Any]:
            return {"z": y}

    g = of.Graph(
        "dead",
        roles={"s": Src(), "j": J(), "after": After()},
        inputs=[of.Placeholder("x")],
        outputs=["z"],
    )
    rt = await runtime(g)
    assert await rt.run("dead", {"x": 0}) == {"z": [0]}
    call = rt.call("dead", {"x": 5})
    assert await call.collect() == {}
    assert call.status == "ok" and call.errors == []
    assert any(ev == "dead" for ev, _ in rt.story(call.call_id))


# ---------------------------------------------------------------- joins


@pytest.mark.parametrize("n_images", [0, 1, 4])
async def test_t2i_join_fires_once_for_0_1_n_images(runtime: Any, n_images: int) -> None:
    t2i = load_graph_module("t2i")
    calls: list[int] = []
    diffusion = t2i.graph.roles["diffusion"]
    original = type(diffusion).denoise

    async def counting(self: Any, text_emb: list[int], cond: list[list[int]]) -> Any:
        calls.append(len(cond))
        return await original(self, text_emb=text_emb, cond=cond)

    counting.__omniflow_interface__ = original.__omniflow_interface__  # type: ignore[attr-defined]
    type(diffusion).denoise = counting
    try:
        rt = await runtime(t2i.graph)
        images = [[i, i + 1] for i in range(n_images)]
        out = await rt.run("t2i", {"request": {"prompt": "a red cat", "images": images}})
    finally:
        type(diffusion).denoise = original
    assert calls == [n_images]
    conds = [[3 * v + 1 for v in img] for img in images]
    bias = sum(sum(c) for c in conds)
    assert out == {
        "picture": [{"n_cond": n_images, "pixels": [10 * (e + bias) for e in (1, 3, 3)]}]
    }


async def test_count_threshold_fires_at_n_and_rejects_extra_frames(runtime: Any) -> None:
    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                yield {"x": i}

    class Batch(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["batch"], activate_by_count={"x": 3})
        async def run(self, x: list[int]) -> dict[str, Any]:
            return {"batch": x}

    g = of.Graph(
        "batch",
        roles={"g": Gen(), "b": Batch()},
        inputs=[of.Placeholder("n")],
        outputs=["batch"],
    )
    rt = await runtime(g)
    assert await rt.run("batch", {"n": 3}) == {"batch": [[0, 1, 2]]}
    assert await rt.run("batch", {"n": 2}) == {"batch": [[0, 1]]}  # stream ended short
    with pytest.raises(of.NodeError) as info:
        await rt.run("batch", {"n": 5})
    assert info.value.node == "b.run" and info.value.field == "x"


async def test_appendix_a_cases(runtime: Any) -> None:
    """Case 1 (root multi-frame -> one bucket per root frame), Case 2 (intermediate
    multi-frame -> accumulation in one bucket with collect), Case 3 (both nested)."""

    class Root(of.Role):
        @of.interface(inputs_or=[["req"]], outputs=["item"])
        async def run(self, req: list[int]) -> Any:
            for v in req:
                yield {"item": v}

    class Multi(of.Role):
        @of.interface(inputs_or=[["item"]], outputs=["piece"])
        async def run(self, item: int) -> Any:
            for k in range(item):
                await asyncio.sleep(random.random() / 3000)
                yield {"piece": item * 10 + k}

    class Single(of.Role):
        @of.interface(inputs_or=[["item"]], outputs=["tag"])
        async def run(self, item: int) -> dict[str, Any]:
            await asyncio.sleep(random.random() / 3000)
            return {"tag": f"#{item}"}

    class Sink(of.Role):
        @of.interface(
            inputs_or=[["piece", "tag"]], outputs=["joined"], collect=["piece"], lb="session"
        )
        async def run(self, piece: list[int], tag: str) -> dict[str, Any]:
            return {"joined": (tag, piece)}

    g = of.Graph(
        "appa",
        roles={"root": Root(), "multi": Multi(), "single": Single(), "sink": Sink()},
        inputs=[of.Placeholder("req")],
        outputs=["joined"],
    )
    plan = of.parse(g)
    assert plan.diamond_roots[("sink.run", 0)] == "root.run"
    rt = await runtime(g)
    # Case 2: one root frame, intermediate yields 4 frames -> accumulate in order.
    assert await rt.run("appa", {"req": [4]}, session="s") == {"joined": [("#4", [40, 41, 42, 43])]}
    # Case 1 + 3: root yields several frames -> one bucket per root frame, released in order.
    # The root frame 0 makes no piece: a collected critical slot that ends empty is DEAD.
    out = await rt.run("appa", {"req": [2, 3, 0, 1]}, session="s")
    assert out == {"joined": [("#2", [20, 21]), ("#3", [30, 31, 32]), ("#1", [10])]}


async def test_second_frame_for_plain_field_is_an_error_naming_node_and_field(
    runtime: Any,
) -> None:
    class A(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["a"])
        async def run(self, x: int) -> Any:
            yield {"a": 1}
            yield {"a": 2}

    class B(of.Role):
        @of.interface(inputs_or=[["y"]], outputs=["b"])
        async def run(self, y: int) -> dict[str, Any]:
            await asyncio.sleep(0.01)
            return {"b": y}

    class J(of.Role):
        @of.interface(inputs_or=[["a", "b"]], outputs=["out"])
        async def run(self, a: int, b: int) -> dict[str, Any]:
            return {"out": a + b}

    g = of.Graph(
        "twice",
        roles={"a": A(), "b": B(), "j": J()},
        inputs=[of.Placeholder("x"), of.Placeholder("y")],
        outputs=["out"],
    )
    rt = await runtime(g)
    with pytest.raises(of.NodeError) as info:
        await rt.run("twice", {"x": 1, "y": 2})
    assert info.value.node == "j.run" and info.value.field == "a"
    assert "collect" in str(info.value)


# ---------------------------------------------------------------- loops


async def test_agent_loop_with_tool_calls(runtime: Any) -> None:
    agent = load_graph_module("agent_loop")
    rt = await runtime(agent.graph)
    call = rt.call("agent", {"prompt": "2 + 3 * 4 - 1"}, session="u1")
    frames = [(f.field, f.value) async for f in call]
    assert call.status == "ok", call.errors
    assert frames == [
        ("step", "call 2 + 3"),
        ("step", "call 5 * 4"),
        ("step", "call 20 - 1"),
        ("step", "answer 19"),
        ("answer", 19),
    ]


async def test_loop_over_max_iterations_ends_the_call_with_node_error(runtime: Any) -> None:
    class Ping(of.Role):
        @of.interface(inputs_or=[["start"], ["pong"]], outputs=["ping"])
        async def run(self, start: int | None = None, pong: int | None = None) -> dict[str, Any]:
            return {"ping": (start if start is not None else pong or 0) + 1}

    class Pong(of.Role):
        @of.interface(inputs_or=[["ping"]], outputs=["pong", "seen"])
        async def run(self, ping: int) -> dict[str, Any]:
            return {"pong": ping, "seen": ping}

    g = of.Graph(
        "forever",
        roles={"ping": Ping(), "pong": Pong()},
        inputs=[of.Placeholder("start")],
        outputs=["seen"],
        max_iterations=50,
    )
    rt = await runtime(g)
    call = rt.call("forever", {"start": 0})
    seen = [f.value async for f in call]
    assert call.status == "error"
    errs = [e for e in call.errors if e.kind == "error"]
    assert len(errs) == 1 and "max_iterations=50" in str(errs[0])
    assert errs[0].node in {"ping.run", "pong.run"}
    assert 45 <= len(seen) <= 50
    assert rt.stats() == ZERO


async def test_long_stream_is_not_bounded_by_max_iterations(runtime: Any) -> None:
    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                yield {"x": i}

    class Inc(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"y": x + 1}

    g = of.Graph(
        "long",
        roles={"g": Gen(), "i": Inc()},
        inputs=[of.Placeholder("n")],
        outputs=["y"],
        max_iterations=10,
    )
    rt = await runtime(g, validate=False)
    out = await rt.run("long", {"n": 5000})
    assert out["y"] == list(range(1, 5001))


# ---------------------------------------------------------------- errors and cancellation


async def test_node_exception_surfaces_and_skips_dependents(runtime: Any) -> None:
    ran: list[str] = []

    class Src(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"a": x, "b": x}

    class Bad(of.Role):
        @of.interface(inputs_or=[["a"]], outputs=["bad"])
        async def run(self, a: int) -> dict[str, Any]:
            await asyncio.sleep(0)
            raise ValueError(f"cannot handle {a}")

    class Dep(of.Role):
        @of.interface(inputs_or=[["bad"]], outputs=["dep"])
        async def run(self, bad: int) -> dict[str, Any]:
            ran.append("dep")
            return {"dep": bad}

    class Ok(of.Role):
        @of.interface(inputs_or=[["b"]], outputs=["ok"])
        async def run(self, b: int) -> dict[str, Any]:
            return {"ok": b}

    g = of.Graph(
        "err",
        roles={"src": Src(), "bad": Bad(), "dep": Dep(), "good": Ok()},
        inputs=[of.Placeholder("x")],
        outputs=["dep", "ok"],
    )
    rt = await runtime(g)
    call = rt.call("err", {"x": 7})
    out = await call.collect()
    assert out == {"ok": [7]}
    assert call.status == "error"
    (err,) = call.errors
    assert err.node == "bad.run" and err.kind == "error" and "cannot handle 7" in str(err)
    assert ran == []
    with pytest.raises(of.NodeError, match=r"bad\.run"):
        await rt.run("err", {"x": 1})


async def test_early_exit_cancels_the_producer(runtime: Any) -> None:
    cancelled = asyncio.Event()

    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            try:
                i = 0
                while True:
                    yield {"x": i}
                    i += 1
                    await asyncio.sleep(0.001)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    g = of.Graph("inf", roles={"g": Gen()}, inputs=[of.Placeholder("n")], outputs=["x"])
    rt = await runtime(g)
    call = rt.call("inf", {"n": 0})
    got = []
    async for frame in call:
        got.append(frame.value)
        if len(got) == 5:
            break
    await asyncio.wait_for(cancelled.wait(), 5)
    await asyncio.wait_for(call.wait(), 5)
    assert got == [0, 1, 2, 3, 4]
    assert call.status == "cancelled"
    assert [e.kind for e in call.errors] == ["cancel"]
    assert rt.stats() == ZERO


async def test_explicit_cancel_mid_bucket_leaves_nothing(runtime: Any) -> None:
    gate = asyncio.Event()

    class Src(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["a", "b"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"a": x, "b": x}

    class Slow(of.Role):
        @of.interface(inputs_or=[["a"]], outputs=["sa"])
        async def run(self, a: int) -> dict[str, Any]:
            await gate.wait()
            return {"sa": a}

    class J(of.Role):
        @of.interface(inputs_or=[["sa", "b"]], outputs=["out"])
        async def run(self, sa: int, b: int) -> dict[str, Any]:
            return {"out": sa + b}

    g = of.Graph(
        "cx",
        roles={"s": Src(), "slow": Slow(), "j": J()},
        inputs=[of.Placeholder("x")],
        outputs=["out"],
    )
    rt = await runtime(g)
    call = rt.call("cx", {"x": 1})
    for _ in range(5):
        await asyncio.sleep(0)
    assert rt.stats()["open_buckets"] == 1 and rt.stats()["inflight"] == 1
    await call.cancel()
    assert call.status == "cancelled"
    assert [(e.node, e.kind) for e in call.errors] == [("slow.run", "cancel")]
    assert rt.stats() == ZERO


async def test_bad_frames_are_node_errors(runtime: Any) -> None:
    class Bad(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> Any:
            return {"z": x} if x else [x]

    g = of.Graph("bad", roles={"b": Bad()}, inputs=[of.Placeholder("x")], outputs=["y"])
    rt = await runtime(g)
    with pytest.raises(of.NodeError, match=r"'z'.*not among its declared outputs"):
        await rt.run("bad", {"x": 1})
    with pytest.raises(of.NodeError, match="return or yield a dict"):
        await rt.run("bad", {"x": 0})


async def test_input_errors_are_raised_at_once(runtime: Any) -> None:
    fig3 = load_graph_module("fig3")
    rt = await runtime(fig3.graph)
    with pytest.raises(of.InputError, match="unknown graph 'nope'"):
        rt.call("nope", {})
    with pytest.raises(of.InputError, match="missing input 'request'") as info:
        rt.call("fig3", {})
    assert isinstance(info.value, ValueError)
    with pytest.raises(of.InputError, match="unknown input 'extra'"):
        rt.call("fig3", {"request": {}, "extra": 1})
    assert rt.stats() == ZERO


async def test_runtime_used_outside_its_lifetime() -> None:
    fig3 = load_graph_module("fig3")
    rt = of.Runtime(fig3.graph)
    with pytest.raises(of.RuntimeClosedError, match="async with"):
        rt.call("fig3", {"request": {}})
    async with rt:
        pass
    with pytest.raises(of.RuntimeClosedError):
        rt.call("fig3", {"request": {}})


# ---------------------------------------------------------------- sessions


def _session_graph(log: list[tuple[str, str, str]]) -> of.Graph:
    class Work(of.Role):
        @of.interface(inputs_or=[["job"]], outputs=["done"])
        async def run(self, job: str) -> dict[str, Any]:
            ctx = of.context()
            hist = ctx.params["history"]
            log.append(("start", ctx.session or "-", job))
            hist.append(job)
            await asyncio.sleep(0.01)
            log.append(("end", ctx.session or "-", job))
            return {"done": (job, list(hist))}

    return of.Graph(
        "sess",
        roles={"w": Work()},
        inputs=[of.Placeholder("job")],
        outputs=["done"],
        params=[of.GlobalParameters("history", factory=list)],
    )


async def test_per_session_fifo_and_cross_session_overlap(runtime: Any) -> None:
    log: list[tuple[str, str, str]] = []
    rt = await runtime(_session_graph(log))
    calls = [
        rt.call("sess", {"job": "a1"}, session="A"),
        rt.call("sess", {"job": "a2"}, session="A"),
        rt.call("sess", {"job": "b1"}, session="B"),
        rt.call("sess", {"job": "a3"}, session="A"),
    ]
    assert rt.stats()["active_calls"] == 4
    outs = await asyncio.gather(*(c.collect() for c in calls))
    a_events = [(ev, job) for ev, s, job in log if s == "A"]
    assert a_events == [
        ("start", "a1"),
        ("end", "a1"),
        ("start", "a2"),
        ("end", "a2"),
        ("start", "a3"),
        ("end", "a3"),
    ]
    # B ran while A's first call was still running.
    assert log.index(("start", "B", "b1")) < log.index(("end", "A", "a1"))
    assert outs[2] == {"done": [("b1", ["b1"])]}
    assert outs[3] == {"done": [("a3", ["a1", "a2", "a3"])]}
    assert rt.sessions() == ["A", "B"]
    await rt.close_session("A")
    assert rt.sessions() == ["B"]
    assert await rt.run("sess", {"job": "a4"}, session="A") == {"done": [("a4", ["a4"])]}


async def test_session_less_calls_are_independent(runtime: Any) -> None:
    log: list[tuple[str, str, str]] = []
    rt = await runtime(_session_graph(log))
    outs = await asyncio.gather(*(rt.run("sess", {"job": f"j{i}"}) for i in range(3)))
    assert outs == [{"done": [(f"j{i}", [f"j{i}"])]} for i in range(3)]
    starts = [i for i, e in enumerate(log) if e[0] == "start"]
    assert starts == [0, 1, 2]  # all three started before any ended


async def test_cancel_a_call_queued_behind_its_session(runtime: Any) -> None:
    log: list[tuple[str, str, str]] = []
    rt = await runtime(_session_graph(log))
    first = rt.call("sess", {"job": "x1"}, session="S")
    second = rt.call("sess", {"job": "x2"}, session="S")
    await second.cancel()
    assert second.status == "cancelled"
    assert await first.collect() == {"done": [("x1", ["x1"])]}
    assert [job for _ev, _s, job in log] == ["x1", "x1"]


# ---------------------------------------------------------------- concurrency limits


async def test_max_concurrency_throttles_one_node_only(runtime: Any) -> None:
    running = 0
    peak = 0

    class Heavy(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["h"], max_concurrency=2)
        async def run(self, x: int) -> dict[str, Any]:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.002)
            running -= 1
            return {"h": x}

    class Light(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["l"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"l": x}

    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                yield {"x": i}

    g = of.Graph(
        "mc",
        roles={"g": Gen(), "heavy": Heavy(), "light": Light()},
        inputs=[of.Placeholder("n")],
        outputs=["h", "l"],
    )
    rt = await runtime(g)
    out = await rt.run("mc", {"n": 12})
    assert sorted(out["h"]) == list(range(12)) and out["l"] == list(range(12))
    assert peak == 2


async def test_context_outside_activation_raises() -> None:
    with pytest.raises(of.OmniflowError, match="outside a running interface method"):
        of.context()


async def test_roles_setup_and_teardown_once_across_graphs() -> None:
    events: list[str] = []

    class Shared(of.Role):
        async def setup(self) -> None:
            events.append("setup")

        async def teardown(self) -> None:
            events.append("teardown")

        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> dict[str, Any]:
            return {"y": x * 2}

    shared = Shared()
    g1 = of.Graph("g1", roles={"s": shared}, inputs=[of.Placeholder("x")], outputs=["y"])
    g2 = of.Graph("g2", roles={"s": of.RoleRef("s")}, inputs=[of.Placeholder("x")], outputs=["y"])
    async with of.Runtime(g1, g2) as rt:
        assert await rt.run("g2", {"x": 2}) == {"y": [4]}
        assert await rt.run("g1", {"x": 3}) == {"y": [6]}
    assert events == ["setup", "teardown"]


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
    from omniflow.runtime import _core

    class Gen(of.Role):
        @of.interface(inputs_or=[["n"]], outputs=["x"])
        async def gen(self, n: int) -> Any:
            for i in range(n):
                await asyncio.sleep(0)
                yield {"x": i}

    g = of.Graph("crash", roles={"g": Gen()}, inputs=[of.Placeholder("n")], outputs=["x"])
    rt = await runtime(g)
    original = _core.CallCore._emit
    seen = 0

    def flaky(self: Any, *args: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == 3:
            raise RuntimeError("injected")
        original(self, *args)

    monkeypatch.setattr(_core.CallCore, "_emit", flaky)
    call = rt.call("crash", {"n": 10})
    got = [f.value async for f in call]
    assert got == [0, 1]
    assert call.status == "error"
    assert [e.node for e in call.errors] == ["<runtime>"]
    assert "internal error RuntimeError: injected" in str(call.errors[0])
    monkeypatch.setattr(_core.CallCore, "_emit", original)
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
