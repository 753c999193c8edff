"""Control-flow runtime benchmarks: omniflow vs hand-written asyncio vs LangGraph.

    .venv/bin/python benchmarks/bench_runtime.py            # full run (~3-4 min on 2 cores)
    .venv/bin/python benchmarks/bench_runtime.py --quick    # smaller counts (~1 min)

Every shape runs through three implementations in this one process:

* omniflow   -- ``of.Runtime(graph)`` (inproc), ``rt.run`` / ``async for frame in rt.call``.
* plain      -- the glue one would write by hand: awaiting coroutines in sequence,
  ``asyncio.gather`` for fan-out, ``asyncio.Queue`` between tasks for streams.
* langgraph  -- ``StateGraph`` with async nodes, ``ainvoke`` / ``astream``.

Node bodies are trivial (add 1 to an int) so the framework overhead dominates. Latency shapes
interleave the implementations round by round so that background load hits all of them alike,
and report medians. Results are Markdown tables on stdout; ``--no-profile`` skips the cProfile
section at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib.metadata
import io
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypedDict

import psutil
from langgraph.graph import END, START, StateGraph

import omniflow as of

AsyncFn = Callable[[int], Awaitable[Any]]

FAST_S = 0.001  # shape 3: fast branch sleep
SLOW_S = 0.010  # shape 3: slow branch sleep (10x)
ROUNDS = 20  # latency shapes: interleaved rounds (fine-grained, so load bursts hit all impls)


# ====================================================================== omniflow graphs


def _role(method: Callable[..., Any], inputs_or: list[list[str]], outputs: list[str]) -> Any:
    """A one-node Role whose single interface is ``method`` (node name ``<role>.m``)."""
    iface = of.interface(inputs_or=inputs_or, outputs=outputs)(method)
    return type("BenchRole", (of.Role,), {"m": iface})()


def _adder(src: str, dst: str, k: int = 1) -> Callable[..., Any]:
    async def m(self: Any, **kw: Any) -> dict[str, Any]:
        return {dst: kw[src] + k}

    return m


def of_chain(n: int) -> of.Graph:
    """x0 -> n0 -> x1 -> ... -> n{n-1} -> x{n}."""
    roles = {
        f"n{i}": _role(_adder(f"x{i}", f"x{i + 1}"), [[f"x{i}"]], [f"x{i + 1}"]) for i in range(n)
    }
    return of.Graph(f"chain{n}", roles=roles, inputs=[of.Placeholder("x0")], outputs=[f"x{n}"])


def of_fanout_join(k: int = 8) -> of.Graph:
    """src -> b0..b{k-1} -> join; join has one OR group of k fields (a bucket rooted at src)."""
    roles: dict[str, Any] = {"src": _role(_adder("x", "s"), [["x"]], ["s"])}
    for i in range(k):
        roles[f"b{i}"] = _role(_adder("s", f"o{i}", i), [["s"]], [f"o{i}"])
    fields = [f"o{i}" for i in range(k)]

    async def join(self: Any, **kw: Any) -> dict[str, Any]:
        return {"out": sum(kw.values())}

    roles["join"] = _role(join, [fields], ["out"])
    return of.Graph("fanjoin", roles=roles, inputs=[of.Placeholder("x")], outputs=["out"])


async def _fast(self: Any, s: int) -> dict[str, Any]:
    await asyncio.sleep(FAST_S)
    return {"f": s + 1}


async def _slow(self: Any, s: int) -> dict[str, Any]:
    await asyncio.sleep(SLOW_S)
    return {"slow_out": s + 1}


def of_fanout_slow() -> of.Graph:
    """src -> fast (1 ms) -> post -> fast_out;  src -> slow (10 ms) -> slow_out."""
    roles = {
        "src": _role(_adder("x", "s"), [["x"]], ["s"]),
        "fast": _role(_fast, [["s"]], ["f"]),
        "slow": _role(_slow, [["s"]], ["slow_out"]),
        "post": _role(_adder("f", "fast_out"), [["f"]], ["fast_out"]),
    }
    return of.Graph(
        "fanslow", roles=roles, inputs=[of.Placeholder("x")], outputs=["fast_out", "slow_out"]
    )


async def _gen(self: Any, n: int) -> AsyncIterator[dict[str, Any]]:
    for i in range(n):
        yield {"a": i}


def of_stream() -> of.Graph:
    """gen (async generator, n frames) -> n2 -> n3 -> caller."""
    roles = {
        "gen": _role(_gen, [["n"]], ["a"]),
        "n2": _role(_adder("a", "b"), [["a"]], ["b"]),
        "n3": _role(_adder("b", "c"), [["b"]], ["c"]),
    }
    return of.Graph("stream", roles=roles, inputs=[of.Placeholder("n")], outputs=["c"])


# ====================================================================== plain asyncio


async def _p_add(x: int, k: int = 1) -> int:
    return x + k


def plain_chain(n: int) -> AsyncFn:
    async def run(x: int) -> int:
        for _ in range(n):
            x = await _p_add(x)
        return x

    return run


def plain_fanout_join(k: int = 8) -> AsyncFn:
    async def join(vals: list[int]) -> int:
        return sum(vals)

    async def run(x: int) -> int:
        s = await _p_add(x)
        outs = await asyncio.gather(*(_p_add(s, i) for i in range(k)))
        return await join(outs)

    return run


async def plain_fanout_slow(x: int) -> AsyncIterator[tuple[str, int]]:
    """Both branches as tasks; results reach the caller through a queue as they finish."""
    q: asyncio.Queue[tuple[str, int]] = asyncio.Queue()

    async def fast(s: int) -> int:
        await asyncio.sleep(FAST_S)
        return s + 1

    async def slow(s: int) -> int:
        await asyncio.sleep(SLOW_S)
        return s + 1

    async def fast_path(s: int) -> None:
        q.put_nowait(("fast_out", await _p_add(await fast(s))))

    async def slow_path(s: int) -> None:
        q.put_nowait(("slow_out", await slow(s)))

    s = await _p_add(x)
    tasks = [asyncio.create_task(fast_path(s)), asyncio.create_task(slow_path(s))]
    for _ in tasks:
        yield await q.get()
    await asyncio.gather(*tasks)


_DONE = object()


async def plain_stream(n: int) -> AsyncIterator[int]:
    """gen task -> q1 -> n2 task -> q2 -> n3 task -> q3 -> caller (unbounded queues)."""
    q1: asyncio.Queue[Any] = asyncio.Queue()
    q2: asyncio.Queue[Any] = asyncio.Queue()
    q3: asyncio.Queue[Any] = asyncio.Queue()

    async def gen() -> AsyncIterator[int]:
        for i in range(n):
            yield i

    async def source() -> None:
        async for v in gen():
            q1.put_nowait(v)
        q1.put_nowait(_DONE)

    async def stage(qin: asyncio.Queue[Any], qout: asyncio.Queue[Any]) -> None:
        while (v := await qin.get()) is not _DONE:
            qout.put_nowait(await _p_add(v))
        qout.put_nowait(_DONE)

    tasks = [
        asyncio.create_task(source()),
        asyncio.create_task(stage(q1, q2)),
        asyncio.create_task(stage(q2, q3)),
    ]
    try:
        while (v := await q3.get()) is not _DONE:
            yield v
    finally:
        for t in tasks:
            t.cancel()


# ====================================================================== LangGraph


class _X(TypedDict, total=False):
    x: int


def _lg_adder(src: str, dst: str, k: int = 1) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    async def node(state: dict[str, Any]) -> dict[str, Any]:
        return {dst: state[src] + k}

    return node


def lg_chain(n: int) -> Any:
    g = StateGraph(_X)
    prev = START
    for i in range(n):
        g.add_node(f"n{i}", _lg_adder("x", "x"))
        g.add_edge(prev, f"n{i}")
        prev = f"n{i}"
    g.add_edge(prev, END)
    return g.compile()


def lg_fanout_join(k: int = 8) -> Any:
    fields = {"x": int, "s": int, "out": int, **{f"o{i}": int for i in range(k)}}
    state = TypedDict("FanJoin", fields, total=False)  # type: ignore[misc]
    g = StateGraph(state)
    g.add_node("src", _lg_adder("x", "s"))
    g.add_edge(START, "src")
    for i in range(k):
        g.add_node(f"b{i}", _lg_adder("s", f"o{i}", i))
        g.add_edge("src", f"b{i}")

    async def join(st: dict[str, Any]) -> dict[str, Any]:
        return {"out": sum(st[f"o{i}"] for i in range(k))}

    g.add_node("join", join)
    g.add_edge([f"b{i}" for i in range(k)], "join")  # waits for all k branches
    g.add_edge("join", END)
    return g.compile()


class _FanSlow(TypedDict, total=False):
    x: int
    s: int
    f: int
    fast_out: int
    slow_out: int


def lg_fanout_slow() -> Any:
    async def fast(st: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(FAST_S)
        return {"f": st["s"] + 1}

    async def slow(st: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(SLOW_S)
        return {"slow_out": st["s"] + 1}

    g = StateGraph(_FanSlow)
    g.add_node("src", _lg_adder("x", "s"))
    g.add_node("fast", fast)
    g.add_node("slow", slow)
    g.add_node("post", _lg_adder("f", "fast_out"))
    g.add_edge(START, "src")
    g.add_edge("src", "fast")
    g.add_edge("src", "slow")
    g.add_edge("fast", "post")
    g.add_edge("post", END)
    g.add_edge("slow", END)
    return g.compile()


class _Stream(TypedDict, total=False):
    n: int
    i: int
    a: int
    b: int
    c: int


def lg_stream() -> Any:
    """A looping graph: gen emits one item per pass, n2 and n3 transform it, n3 loops back."""

    async def gen(st: dict[str, Any]) -> dict[str, Any]:
        i = st.get("i", 0)
        return {"a": i, "i": i + 1}

    def again(st: dict[str, Any]) -> str:
        return "gen" if st["i"] < st["n"] else END

    g = StateGraph(_Stream)
    g.add_node("gen", gen)
    g.add_node("n2", _lg_adder("a", "b"))
    g.add_node("n3", _lg_adder("b", "c"))
    g.add_edge(START, "gen")
    g.add_edge("gen", "n2")
    g.add_edge("n2", "n3")
    g.add_conditional_edges("n3", again, ["gen", END])
    return g.compile()


# ====================================================================== measurement


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _lat(fn: AsyncFn, n: int) -> list[float]:
    """Per-call latency in µs of ``n`` sequential calls."""
    out = []
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        await fn(i)
        out.append((clock() - t0) / 1000)
    return out


async def latency(
    impls: dict[str, AsyncFn], calls: dict[str, int], rounds: int, warm: int
) -> dict[str, list[float]]:
    """Interleave the implementations round by round; all samples per implementation."""
    for name, fn in impls.items():
        await _lat(fn, min(warm, calls[name]))
    samples: dict[str, list[float]] = {k: [] for k in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            gc.collect()
            samples[name] += await _lat(fn, max(1, calls[name] // rounds))
    return samples


def _us(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def _x(a: float, b: float) -> str:
    return f"{a / b:,.1f}x" if b else "n/a"


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.targets: list[tuple[str, str, bool]] = []

    def out(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def table(self, head: list[str], rows: list[list[str]]) -> None:
        self.out("| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|")
        for r in rows:
            self.out("| " + " | ".join(r) + " |")
        self.out("")

    def target(self, what: str, measured: str, met: bool) -> None:
        self.targets.append((what, measured, met))


# ====================================================================== shapes


async def shape_chain(rep: Report, quick: bool) -> None:
    n_fast = 600 if quick else 2000
    n_lg = 150 if quick else 500
    rows = []
    med1 = 0.0
    for n in (1, 4, 16):
        lg = lg_chain(n)

        async def lg_call(x: int, lg: Any = lg) -> Any:
            return (await lg.ainvoke({"x": x}))["x"]

        async with of.Runtime(of_chain(n)) as rt:
            name, field = f"chain{n}", f"x{n}"

            async def of_call(x: int, rt: Any = rt, name: str = name, field: str = field) -> Any:
                return (await rt.run(name, {"x0": x}))[field][0]

            impls = {"plain": plain_chain(n), "omniflow": of_call, "langgraph": lg_call}
            for fn in impls.values():
                assert await fn(0) == n
            calls = {"plain": n_fast, "omniflow": n_fast, "langgraph": n_lg}
            s = await latency(impls, calls, rounds=ROUNDS, warm=200)
        med = {k: statistics.median(v) for k, v in s.items()}
        p99 = {k: _pct(v, 0.99) for k, v in s.items()}
        hop = (med["omniflow"] - med["plain"]) / n
        if n == 1:
            med1 = med["omniflow"] - med["plain"]
        marginal = (med["omniflow"] - med["plain"] - med1) / (n - 1) if n > 1 else float("nan")
        rows.append(
            [
                str(n),
                _us(med["plain"]),
                _us(p99["plain"]),
                _us(med["omniflow"]),
                _us(p99["omniflow"]),
                _us(med["langgraph"]),
                _us(p99["langgraph"]),
                _x(med["omniflow"], med["plain"]),
                _x(med["langgraph"], med["omniflow"]),
                f"{hop:.2f}",
                "-" if n == 1 else f"{marginal:.2f}",
            ]
        )
        if n == 16:
            rep.target("per-hop overhead on chain-16 ≤ 10 µs (median)", f"{hop:.2f} µs", hop <= 10)
            r = med["langgraph"] / med["omniflow"]
            rep.target("≥ 25x faster than LangGraph per call, chain-16", f"{r:.1f}x", r >= 25)
    rep.out(
        f"### 1. Chain of N nodes: per-call latency (µs; {n_fast} sequential calls for plain "
        f"and omniflow, {n_lg} for LangGraph, {ROUNDS} interleaved rounds, after warm-up)",
        "",
    )
    rep.table(
        [
            "N",
            "plain med",
            "plain p99",
            "omniflow med",
            "omniflow p99",
            "LangGraph med",
            "LangGraph p99",
            "omniflow / plain",
            "LangGraph / omniflow",
            "per-hop overhead µs",
            "marginal µs/hop vs N=1",
        ],
        rows,
    )


async def shape_fanjoin(rep: Report, quick: bool) -> None:
    n_fast = 600 if quick else 2000
    n_lg = 150 if quick else 500
    lg = lg_fanout_join()
    expect = 8 * 1 + sum(range(8))  # x=0: s=1, o_i = 1 + i

    async def lg_call(x: int) -> Any:
        return (await lg.ainvoke({"x": x}))["out"]

    async with of.Runtime(of_fanout_join()) as rt:
        plan = rt.plans["fanjoin"]
        assert ("join.m", 0) in plan.buckets, plan.buckets

        async def of_call(x: int) -> Any:
            return (await rt.run("fanjoin", {"x": x}))["out"][0]

        impls = {"plain": plain_fanout_join(), "omniflow": of_call, "langgraph": lg_call}
        for fn in impls.values():
            assert await fn(0) == expect
        s = await latency(
            impls, {"plain": n_fast, "omniflow": n_fast, "langgraph": n_lg}, rounds=ROUNDS, warm=200
        )
    med = {k: statistics.median(v) for k, v in s.items()}
    p99 = {k: _pct(v, 0.99) for k, v in s.items()}
    rep.out(
        "### 2. Fan-out 8 + join: per-call latency (µs; bucket rooted at the source in "
        f"omniflow, `asyncio.gather` in plain; {n_fast}/{n_fast}/{n_lg} calls)",
        "",
    )
    rep.table(
        ["impl", "median µs", "p99 µs", "vs plain", "LangGraph / this"],
        [
            [
                k,
                _us(med[k]),
                _us(p99[k]),
                _x(med[k], med["plain"]),
                _x(med["langgraph"], med[k]),
            ]
            for k in ("plain", "omniflow", "langgraph")
        ],
    )
    r = med["langgraph"] / med["omniflow"]
    rep.target("≥ 25x faster than LangGraph per call, fan-out 8 + join", f"{r:.1f}x", r >= 25)


async def shape_fanslow(rep: Report, quick: bool) -> None:
    reps = 30 if quick else 80
    lg = lg_fanout_slow()

    async def timed(stream: AsyncIterator[tuple[str, Any]]) -> tuple[float, float]:
        """(ms until fast_out reaches the caller, ms until the stream ends)."""
        t0 = time.perf_counter()
        t_fast = float("nan")
        async for field, _ in stream:
            if field == "fast_out" and t_fast != t_fast:
                t_fast = time.perf_counter() - t0
        return t_fast * 1e3, (time.perf_counter() - t0) * 1e3

    async with of.Runtime(of_fanout_slow()) as rt:

        async def of_stream_(x: int) -> AsyncIterator[tuple[str, Any]]:
            async for fr in rt.call("fanslow", {"x": x}):
                yield fr.field, fr.value

        async def lg_stream_(x: int) -> AsyncIterator[tuple[str, Any]]:
            async for upd in lg.astream({"x": x}, stream_mode="updates"):
                for node, vals in upd.items():
                    for field, v in (vals or {}).items():
                        if node in ("post", "slow"):
                            yield field, v

        impls: dict[str, Callable[[int], AsyncIterator[tuple[str, Any]]]] = {
            "plain": plain_fanout_slow,
            "omniflow": of_stream_,
            "langgraph": lg_stream_,
        }
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in impls}
        for fn in impls.values():  # warm-up
            for _ in range(3):
                await timed(fn(0))
        for i in range(reps):
            for name, fn in impls.items():
                res[name].append(await timed(fn(i)))
    rows = []
    for k in ("plain", "omniflow", "langgraph"):
        fast = statistics.median(a for a, _ in res[k])
        total = statistics.median(b for _, b in res[k])
        waits = "yes" if fast >= SLOW_S * 1e3 else "no"
        rows.append(
            [k, f"{fast:.2f}", f"{_pct([a for a, _ in res[k]], 0.9):.2f}", f"{total:.2f}", waits]
        )
    rep.out(
        f"### 3. Fan-out with a 10x slower sibling (fast {FAST_S * 1e3:.0f} ms → post → caller; "
        f"slow {SLOW_S * 1e3:.0f} ms → caller; {reps} calls each)",
        "",
    )
    rep.table(
        [
            "impl",
            "fast output reaches caller, median ms",
            "p90 ms",
            "whole call, median ms",
            "fast path waits for slow sibling?",
        ],
        rows,
    )


async def shape_stream(rep: Report, quick: bool) -> None:
    n = 10_000
    n_lg = 300 if quick else 1000
    runs = 3 if quick else 5
    lg = lg_stream()

    async with of.Runtime(of_stream()) as rt:

        async def of_run(k: int) -> int:
            m = 0
            async for fr in rt.call("stream", {"n": k}):
                m += fr.value - fr.value + 1
            return m

        async def plain_run(k: int) -> int:
            m = 0
            async for v in plain_stream(k):
                m += v - v + 1
            return m

        async def lg_run(k: int) -> int:
            m = 0
            cfg = {"recursion_limit": 3 * k + 10}
            async for upd in lg.astream({"n": k}, cfg, stream_mode="updates"):
                if "n3" in upd:
                    m += 1
            return m

        impls = {"plain": (plain_run, n), "omniflow": (of_run, n), "langgraph": (lg_run, n_lg)}
        for fn, k in impls.values():  # warm-up and check every frame arrives
            assert await fn(k) == k
        secs: dict[str, list[float]] = {k: [] for k in impls}
        for _ in range(runs):
            for name, (fn, k) in impls.items():
                gc.collect()
                t0 = time.perf_counter()
                await fn(k)
                secs[name].append(time.perf_counter() - t0)
    fps = {name: impls[name][1] / statistics.median(v) for name, v in secs.items()}
    rep.out(
        f"### 4. Stream through 3 nodes (async-generator source → 2 stateless nodes → "
        f"`async for`; median of {runs} runs)",
        "",
    )
    rep.table(
        ["impl", "frames", "median s", "frames/s", "vs plain", "this / LangGraph"],
        [
            [
                k,
                f"{impls[k][1]:,}",
                f"{statistics.median(secs[k]):.4f}",
                f"{fps[k]:,.0f}",
                _x(fps[k], fps["plain"]),
                _x(fps[k], fps["langgraph"]),
            ]
            for k in ("plain", "omniflow", "langgraph")
        ],
    )
    rep.target(
        "≥ 50k frames/s through 3 nodes",
        f"{fps['omniflow']:,.0f} frames/s",
        fps["omniflow"] >= 50_000,
    )


async def shape_concurrent(rep: Report, quick: bool) -> None:
    k = 1000
    runs = 3 if quick else 7
    lg = lg_chain(3)
    plain = plain_chain(3)

    async with of.Runtime(of_chain(3)) as rt:

        async def of_batch() -> list[Any]:
            return await asyncio.gather(*(rt.run("chain3", {"x0": i}) for i in range(k)))

        async def plain_batch() -> list[Any]:
            return await asyncio.gather(*(plain(i) for i in range(k)))

        async def lg_batch() -> list[Any]:
            return await asyncio.gather(*(lg.ainvoke({"x": i}) for i in range(k)))

        impls = {"plain": plain_batch, "omniflow": of_batch, "langgraph": lg_batch}
        for fn in impls.values():
            await fn()
        secs: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(runs):
            for name, fn in impls.items():
                gc.collect()
                t0 = time.perf_counter()
                await fn()
                secs[name].append(time.perf_counter() - t0)
        assert all(v == 0 for v in rt.stats().values()), rt.stats()
    med = {name: statistics.median(v) for name, v in secs.items()}
    rep.out(
        f"### 5. {k:,} concurrent calls through a 3-node chain (`asyncio.gather`; median of "
        f"{runs} batches)",
        "",
    )
    rep.table(
        ["impl", "total ms", "calls/s", "vs plain (time)", "LangGraph / this (time)"],
        [
            [
                name,
                f"{med[name] * 1e3:.1f}",
                f"{k / med[name]:,.0f}",
                _x(med[name], med["plain"]),
                _x(med["langgraph"], med[name]),
            ]
            for name in ("plain", "omniflow", "langgraph")
        ],
    )


async def shape_memory(rep: Report, quick: bool) -> None:
    total = 10_000 if quick else 100_000
    batch = 1000
    checkpoints = 5  # RSS readings along the way: a leak grows linearly, allocator slack does not
    proc = psutil.Process()

    def rss() -> float:
        gc.collect()
        return proc.memory_info().rss / 2**20

    async with of.Runtime(of_chain(3)) as rt:

        async def run_batch(base: int) -> None:
            await asyncio.gather(*(rt.run("chain3", {"x0": base + i}) for i in range(batch)))

        before_any = rss()
        # Warm-up: 20k calls, until the bounded story log (10,000 entries, 2 per call) has
        # turned over and the allocator's pools reached their steady state; with
        # Runtime(story_size=0) RSS is flat from the first batch on.
        for b in range(20):
            await run_batch(b * batch)
        before = rss()
        objs_before = len(gc.get_objects())
        trail: list[tuple[int, float]] = []
        every = total // batch // checkpoints
        secs = 0.0
        for b in range(total // batch):
            t0 = time.perf_counter()
            await run_batch(b * batch)
            secs += time.perf_counter() - t0
            if (b + 1) % every == 0:
                trail.append(((b + 1) * batch, rss()))
        after = trail[-1][1]
        objs_after = len(gc.get_objects())
        stats = rt.stats()
        story = len(rt.story_log or ())
    half = trail[len(trail) // 2 - 1]
    rep.out(
        f"### 6. Memory: RSS around {total:,} finished calls of the 3-node chain "
        f"(batches of {batch:,} concurrent, `gc.collect()` before each reading)",
        "",
    )
    rep.table(
        [
            "RSS fresh runtime MB",
            "RSS after 20k warm-up MB",
            f"RSS after {total // 1000}k calls MB",
            "delta MB",
            f"growth {half[0] // 1000}k→{total // 1000}k MB",
            "gc objects delta",
            "rt.stats() after",
            "story log entries (bounded)",
            "calls/s",
        ],
        [
            [
                f"{before_any:.1f}",
                f"{before:.1f}",
                f"{after:.1f}",
                f"{after - before:+.1f}",
                f"{after - half[1]:+.1f}",
                f"{objs_after - objs_before:+,}",
                f"`{stats}`",
                f"{story:,}",
                f"{total / secs:,.0f}",
            ]
        ],
    )
    rep.out(
        "RSS trail (calls: MB): "
        + ", ".join(f"{n // 1000}k: {m:.1f}" for n, m in [(0, before), *trail]),
        "",
    )
    delta = after - before
    leak_free = abs(objs_after - objs_before) < 100 and after - half[1] <= 0.5
    rep.target(
        f"RSS back to its starting level after {total // 1000}k calls (within 1 MB)",
        f"{delta:+.1f} MB, {objs_after - objs_before:+,} gc objects",
        delta <= 1.0,
    )
    rep.target(
        "no leak: no live objects retained, RSS flat over the second half",
        f"{objs_after - objs_before:+,} objects, {after - half[1]:+.1f} MB "
        f"from {half[0] // 1000}k to {total // 1000}k",
        leak_free,
    )


# ====================================================================== profile


def _profile_text(prof: cProfile.Profile, top: int = 15) -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    lines = [f"{'ncalls':>10} {'tottime s':>10} {'cumtime s':>10}  function"]
    items = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in items:
        where = file.replace(root, "").replace(sys.prefix + os.sep, "")
        if "site-packages" in where:
            where = where.split("site-packages" + os.sep)[-1]
        lines.append(f"{nc:>10} {tt:>10.3f} {ct:>10.3f}  {where}:{line}({fn})")
    return "\n".join(lines)


async def _profile_calls(graph: of.Graph, inputs: dict[str, Any], n: int) -> cProfile.Profile:
    async with of.Runtime(graph) as rt:
        for _ in range(200):
            await rt.run(graph.name, inputs)
        gc.collect()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            await rt.run(graph.name, inputs)
        prof.disable()
    return prof


async def profiles(rep: Report, quick: bool) -> None:
    n_calls = 1000 if quick else 2000
    for title, graph, inputs in (
        ("chain-16", of_chain(16), {"x0": 0}),
        ("fan-out 8 + join", of_fanout_join(), {"x": 0}),
    ):
        prof = await _profile_calls(graph, inputs, n_calls)
        rep.out(
            f"### Profile: omniflow {title}, {n_calls:,} sequential calls (cProfile, top 15 by "
            "tottime)",
            "",
            "```",
            _profile_text(prof),
            "```",
            "",
        )
    async with of.Runtime(of_stream()) as rt:
        async for _ in rt.call("stream", {"n": 1000}):
            pass
        gc.collect()
        prof = cProfile.Profile()
        prof.enable()
        async for _ in rt.call("stream", {"n": 10_000}):
            pass
        prof.disable()
    rep.out(
        "### Profile: omniflow 10k-frame stream through 3 nodes (cProfile, top 15 by tottime)",
        "",
        "```",
        _profile_text(prof),
        "```",
        "",
    )


# ====================================================================== main


def _versions() -> str:
    def v(p: str) -> str:
        try:
            return importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    pk = ", ".join(f"{p} {v(p)}" for p in ("omniflow", "langgraph", "langchain-core", "psutil"))
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        git = "unknown"
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"nproc {os.cpu_count()}, {cpu}, Python {platform.python_version()} "
        f"({platform.python_implementation()}), default asyncio event loop; {pk} (git {git})"
    )


SHAPES = {
    "memory": shape_memory,
    "chain": shape_chain,
    "fanjoin": shape_fanjoin,
    "fanslow": shape_fanslow,
    "stream": shape_stream,
    "concurrent": shape_concurrent,
}


async def main(quick: bool, profile: bool, only: list[str] | None = None) -> None:
    rep = Report()
    rep.out(f"Machine: {_versions()}", f"Mode: {'--quick' if quick else 'full'}", "")
    t0 = time.perf_counter()
    # Memory first, while the process is young, so that freed arenas from other shapes do
    # not hide growth.
    for name, shape in SHAPES.items():
        if only is None or name in only:
            await shape(rep, quick)
    rep.out("### Targets", "")
    rep.table(
        ["target", "measured", "met?"],
        [[w, m, "yes" if ok else "**no**"] for w, m, ok in rep.targets],
    )
    if profile:
        await profiles(rep, quick)
    rep.out(f"Total benchmark wall time: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller counts (~1 minute)")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile section")
    ap.add_argument(
        "--only",
        action="append",
        choices=sorted(SHAPES),
        help="run only this shape (repeatable); memory is measured first either way",
    )
    args = ap.parse_args()
    asyncio.run(main(args.quick, not args.no_profile, args.only))
