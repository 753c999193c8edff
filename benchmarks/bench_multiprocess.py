"""The multi-process runtime: cross-process hop latency, a 3-process stream, replica scaling.

    .venv/bin/python benchmarks/bench_multiprocess.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_multiprocess.py --quick    # ~25 s
    .venv/bin/python benchmarks/bench_multiprocess.py --no-profile
    .venv/bin/python benchmarks/bench_multiprocess.py --only hop --only chain   # a subset
    OMNIFLOW_BENCH_OTLP=http://127.0.0.1:4318 .venv/bin/python benchmarks/bench_multiprocess.py \
        --only chain                    # omniflow's runtimes traced, exporting to a collector

1. **hop**: a 1-node graph (``x -> hop.run -> y``), ``await rt.run`` one call at a time, with
   ``placement="process"`` (the role in a worker) and in-process; hop = the difference. The
   worker is reached over ``uds://`` (``OMNIFLOW_FAST_PATH=1``, the default) and, in a second
   runtime of the same run, over pyzmq ``ipc://`` (``OMNIFLOW_FAST_PATH=0``). Against
   a raw pyzmq DEALER/ROUTER ping-pong over ``ipc://`` with an echo process, blocking and
   ``zmq.asyncio`` clients, same run, rounds interleaved so load bursts hit all alike.
2. **stream**: ``src.gen`` (async generator, 10,000 frames) -> ``m1.step`` -> ``m2.step`` ->
   caller, each role in its own worker (``placement="process"``: 3 workers + the front;
   every frame crosses a process boundary 3 times). Frames/s seen by the caller; the
   in-process figure for scale. Then a cProfile of the front process for one stream.
3. **chain**: a 3-node chain (``x -> c1 -> c2 -> c3 -> y``), each role in its own worker, one
   call at a time, over ``uds://`` and (a second runtime) pyzmq ``ipc://``, against a Ray
   Compiled Graph of 3 actors doing the same in the same run (when ``ray`` is installed), and
   against the floor: the same six messages between 3 bare Python processes (``BareChain``:
   socket pairs, msgpack, an event loop; no framework); then the idle CPU of each side
   (front/driver + 3 processes) over ``--idle`` seconds (default 10).
4. **replicas**: a CPU-bound role (a pure-Python loop of ~5 ms) with
   ``Deploy({"cpu": {"replicas": n}})``, n = 1, 2, 4, 200 concurrent calls: calls/s.

The graphs are module-level objects of this file; the front loads them with
``omniflow.load_graphs(__file__)`` so that a worker can import them again by path (a graph
built in ``__main__`` cannot be placed in a worker).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import platform
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import omniflow as of
from omniflow.transport import run_loop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ray import idle_cpu  # the same measure as bench_ray's idle column

# ---------------------------------------------------------------------------------- graphs


class Hop(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"y": x}


hop = of.Graph("bm_hop", roles={"hop": Hop()}, inputs=[of.Placeholder("x")], outputs=["y"])


class Src(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["a"])
    async def gen(self, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            yield {"a": i}


class M1(of.Role):
    @of.interface(inputs_or=[["a"]], outputs=["b"])
    async def step(self, a: int) -> dict[str, Any]:
        return {"b": a + 1}


class M2(of.Role):
    @of.interface(inputs_or=[["b"]], outputs=["c"])
    async def step(self, b: int) -> dict[str, Any]:
        return {"c": b + 1}


stream = of.Graph(
    "bm_stream",
    roles={"src": Src(), "m1": M1(), "m2": M2()},
    inputs=[of.Placeholder("n")],
    outputs=["c"],
)


def spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


class Cpu(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["r"])
    async def run(self, n: int) -> dict[str, Any]:
        return {"r": spin(n) & 0xFF}


cpu = of.Graph("bm_cpu", roles={"cpu": Cpu()}, inputs=[of.Placeholder("n")], outputs=["r"])


class C1(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["x1"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"x1": x + 1}


class C2(of.Role):
    @of.interface(inputs_or=[["x1"]], outputs=["x2"])
    async def run(self, x1: int) -> dict[str, Any]:
        return {"x2": x1 + 1}


class C3(of.Role):
    @of.interface(inputs_or=[["x2"]], outputs=["y"])
    async def run(self, x2: int) -> dict[str, Any]:
        return {"y": x2 + 1}


chain3 = of.Graph(
    "bm_chain3",
    roles={"c1": C1(), "c2": C2(), "c3": C3()},
    inputs=[of.Placeholder("x")],
    outputs=["y"],
)


class PlainStage:
    """A Ray actor stage of the compiled-graph chain: the same work as C1..C3."""

    def run(self, x: int) -> int:
        return x + 1

    def pid(self) -> int:
        return os.getpid()


# ---------------------------------------------------------------------------------- helpers


def load() -> dict[str, of.Graph]:
    """This file's graphs, imported by path (so workers find them)."""
    return {g.name: g for g in of.load_graphs(Path(__file__).resolve())}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


ECHO = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    msg = sock.recv_multipart(copy=False)
    sock.send_multipart(msg, copy=False)
    if msg[1].bytes == b"STOP":
        break
"""


class RawEcho:
    """A ROUTER echo process and two DEALER clients to it (blocking and zmq.asyncio)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="omniflow-bench-")
        self.url = f"ipc://{self.dir}/echo.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ECHO, self.url], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.ctx = zmq.Context()
        self.sync = self.ctx.socket(zmq.DEALER)
        self.sync.connect(self.url)
        self.actx = zmq.asyncio.Context()
        self.asock = self.actx.socket(zmq.DEALER)
        self.asock.connect(self.url)
        self.payload = b"x" * 128  # about the size of a small run message

    def round_sync(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.sync.send(self.payload, copy=False)
            self.sync.recv(copy=False)
            out.append(time.perf_counter() - t0)
        return out

    async def round_async(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await self.asock.send(self.payload, copy=False)
            await self.asock.recv(copy=False)
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.sync.send(b"STOP")
        self.sync.recv()
        self.proc.wait(10)
        for s in (self.sync, self.asock):
            s.close(linger=0)
        self.ctx.term()
        self.actx.term()
        os.unlink(f"{self.dir}/echo.sock") if os.path.exists(f"{self.dir}/echo.sock") else None
        os.rmdir(self.dir)


def in_workers(g: of.Graph, fast_path: bool) -> of.Runtime:
    """``placement="process"``, its workers reached over ``uds://`` (``fast_path``) or pyzmq
    ``ipc://``: the launcher reads ``OMNIFLOW_FAST_PATH`` when the runtime starts, which
    ``async with`` does right after this returns. Traced when ``OMNIFLOW_BENCH_OTLP`` names an
    OTLP/HTTP collector (as in ``bench_hot_path``)."""
    os.environ["OMNIFLOW_FAST_PATH"] = "1" if fast_path else "0"
    url = os.environ.get("OMNIFLOW_BENCH_OTLP")
    if not url:
        return of.Runtime(g, placement="process")
    from omniflow.runtime._tracing import otlp_provider

    return of.Runtime(g, placement="process", tracer_provider=otlp_provider(url))


async def calls(rt: of.Runtime, graph: str, inputs: dict[str, Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await rt.run(graph, inputs)
        out.append(time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------------- 1. hop


async def bench_hop(graphs: dict[str, of.Graph], rounds: int, per_round: int) -> dict[str, Any]:
    g = graphs["bm_hop"]
    echo = RawEcho()
    lat: dict[str, list[float]] = {
        "inproc": [], "process": [], "process_ipc": [], "sync": [], "async": []
    }  # fmt: skip
    async with (
        of.Runtime(g) as inproc,
        in_workers(g, fast_path=False) as proc_ipc,
        in_workers(g, fast_path=True) as proc,
    ):
        await calls(inproc, "bm_hop", {"x": 1}, 300)
        await calls(proc, "bm_hop", {"x": 1}, 300)
        await calls(proc_ipc, "bm_hop", {"x": 1}, 300)
        echo.round_sync(300)
        await echo.round_async(300)
        for _ in range(rounds):
            lat["inproc"] += await calls(inproc, "bm_hop", {"x": 1}, per_round)
            lat["process"] += await calls(proc, "bm_hop", {"x": 1}, per_round)
            lat["process_ipc"] += await calls(proc_ipc, "bm_hop", {"x": 1}, per_round)
            lat["sync"] += echo.round_sync(per_round)
            lat["async"] += await echo.round_async(per_round)
    echo.close()
    return lat


# ---------------------------------------------------------------------------------- 2. stream


async def consume(rt: of.Runtime, n: int) -> float:
    t0 = time.perf_counter()
    got = 0
    async for _frame in rt.call("bm_stream", {"n": n}):
        got += 1
    took = time.perf_counter() - t0
    assert got == n, (got, n)
    return took


async def bench_stream(
    graphs: dict[str, of.Graph], n: int, repeats: int, profile: bool
) -> dict[str, Any]:
    g = graphs["bm_stream"]
    res: dict[str, Any] = {}
    async with of.Runtime(g) as rt:
        await consume(rt, 1000)
        res["inproc"] = [n / await consume(rt, n) for _ in range(repeats)]
    async with of.Runtime(g, placement="process") as rt:
        assert rt.remote is not None and rt.remote.statistics()["replicas"] == 3
        await consume(rt, 1000)
        res["process"] = [n / await consume(rt, n) for _ in range(repeats)]
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            took = await consume(rt, n)
            prof.disable()
            res["profiled_fps"] = n / took
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("tottime").print_stats(22)
            res["profile"] = buf.getvalue()
            res["areas"] = by_area(stats)
    return res


AREAS = (
    ("pyzmq asyncio (zmq/_future.py)", "zmq/_future.py"),
    ("enum flag arithmetic (pyzmq's event masks)", "/enum.py"),
    ("other pyzmq", "/zmq/"),
    ("omniflow codec", "omniflow/transport/_codec.py"),
    ("omniflow transport endpoints", "omniflow/transport/"),
    ("omniflow remote (front side)", "omniflow/cluster/_remote"),
    ("omniflow call core", "omniflow/runtime/callcore/_core.py"),
    ("omniflow runtime shell + call", "omniflow/runtime/"),
    ("asyncio event loop", "/asyncio/"),
)


def by_area(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Self time (tottime) summed by where the code lives, as a share of the total."""
    totals: dict[str, float] = {}
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, _line, _name), (_cc, _nc, tt, _ct, _callers) in raw.items():
        area = next((label for label, key in AREAS if key in filename), "other (builtins, ...)")
        totals[area] = totals.get(area, 0.0) + tt
    whole = sum(totals.values()) or 1.0
    return sorted(((a, t / whole) for a, t in totals.items()), key=lambda x: -x[1])


# ---------------------------------------------------------------------------------- 3. chain


#: Unmeasured calls each path makes at the start of each of its rounds in the chain block.
WARM = 100


async def bench_chain(
    graphs: dict[str, of.Graph], rounds: int, per_round: int, idle: float, with_ray: bool
) -> dict[str, Any]:
    """A 3-worker chain (``x -> c1 -> c2 -> c3 -> y``, each role in its own worker), one call at
    a time, over uds:// with the fast path (worker -> worker runs) and over ipc:// without it
    (``OMNIFLOW_FAST_PATH=0``), against a Ray Compiled Graph of 3 actors doing the same
    (``c3(c2(c1(x)))``), rounds interleaved, each begun with ``WARM`` unmeasured calls. The
    compiled graph is compiled at the start of its block and torn down at its end: its actors
    busy-poll while it exists (two cores' worth here), which would otherwise slow down
    whatever runs beside it. Then each side's idle CPU (front/driver + its 3 processes) over
    ``idle`` s."""
    g = graphs["bm_chain3"]
    res: dict[str, Any] = {"omniflow": [], "omniflow_ipc": [], "ray_cg": [], "bare": []}
    actors: list[Any] = []
    ray = None
    if with_ray:
        from omniflow.cluster._ray import init_ray

        ray = init_ray(None, num_cpus=8, include_dashboard=False, log_to_driver=False)
        actors = [ray.remote(PlainStage).options(num_cpus=1).remote() for _ in range(3)]

    def compiled_block(n: int, keep: bool) -> list[float]:
        from ray.dag import InputNode

        assert ray is not None
        with InputNode() as inp:  # a DAG compiles once: a new one per block
            dag = actors[2].run.bind(actors[1].run.bind(actors[0].run.bind(inp)))
        compiled = dag.experimental_compile()
        try:
            for i in range(WARM):
                assert ray.get(compiled.execute(i)) == i + 3
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                ray.get(compiled.execute(i))
                out.append(time.perf_counter() - t0)
            if keep:
                res["idle_ray_cg"] = 0.0  # measured below, while compiled
                res["_compiled"] = compiled
                return out
        finally:
            if not keep:
                compiled.teardown()
        return out

    bare = BareChain()
    try:
        async with in_workers(g, fast_path=False) as rt_ipc, in_workers(g, True) as rt:
            assert rt.remote is not None
            for i in range(300):
                assert (await rt.run("bm_chain3", {"x": i}))["y"] == [i + 3]
                assert (await rt_ipc.run("bm_chain3", {"x": i}))["y"] == [i + 3]
            await bare.round(300)
            for _ in range(rounds):
                # Each path first gets the unmeasured warm-up the compiled graph gets in its
                # block (``WARM`` calls): the block before it left the caches to another.
                await calls(rt, "bm_chain3", {"x": 1}, WARM)
                res["omniflow"] += await calls(rt, "bm_chain3", {"x": 1}, per_round)
                await calls(rt_ipc, "bm_chain3", {"x": 1}, WARM)
                res["omniflow_ipc"] += await calls(rt_ipc, "bm_chain3", {"x": 1}, per_round)
                await bare.round(WARM)
                res["bare"] += await bare.round(per_round)
                if ray is not None:
                    res["ray_cg"] += compiled_block(per_round, keep=False)
            pids = [r.pid for r in rt.remote.fleet.replicas.values() if r.pid]
            assert len(pids) == 3
            res["idle_omniflow"] = await idle_cpu([os.getpid(), *pids], idle)
        if ray is not None:
            compiled_block(10, keep=True)  # compiled, then left idle
            apids = [ray.get(a.pid.remote()) for a in actors]
            try:
                res["idle_ray_cg"] = await idle_cpu([os.getpid(), *apids], idle)
            finally:
                res.pop("_compiled").teardown()
    finally:
        bare.close()
        if ray is not None:
            for a in actors:
                ray.kill(a)
            ray.shutdown()
    return res


STAGE = """
import asyncio, os, socket, sys
import msgpack
try:
    import uvloop
except ImportError:
    uvloop = None
rx, tx, dn = (socket.socket(fileno=int(fd)) if fd != "-" else None for fd in sys.argv[1:4])

async def main() -> None:
    loop = asyncio.get_running_loop()
    rx.setblocking(False)
    eof = loop.create_future()

    def readable() -> None:
        try:
            data = rx.recv(65536)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(rx.fileno())
            eof.set_result(None)
            return
        msg = msgpack.unpackb(data)
        msg[2] += 1
        tx.send(msgpack.packb(msg))  # the next stage (or the caller)
        if dn is not None:  # and a done to the caller, after the forward, as omniflow's workers
            dn.send(msgpack.packb(["done", msg[1], msg[2], [[0, msg[1]]]]))

    loop.add_reader(rx.fileno(), readable)
    await eof

(uvloop.run if uvloop is not None else asyncio.run)(main())
"""


class BareChain:
    """The floor under omniflow's chain: the same four hops and two accounting messages
    (caller -> s1 -> s2 -> s3 -> caller; s1 and s2 also send a done to the caller), between
    3 bare Python processes on Unix socket pairs, each hop a msgpack decode and encode on an
    event loop (uvloop when installed, as omniflow's workers); the caller waits on its own
    asyncio loop. No framework: what Python and the kernel cost here."""

    def __init__(self) -> None:
        pair = socket.socketpair
        hops = [pair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(4)]
        dones = [pair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
        self.procs = []
        for i in range(3):
            fds = [hops[i][1].fileno(), hops[i + 1][0].fileno()]
            fds += [dones[i][0].fileno()] if i < 2 else []
            args = [str(fd) for fd in fds] + ["-"] * (3 - len(fds))
            self.procs.append(subprocess.Popen([sys.executable, "-c", STAGE, *args], pass_fds=fds))
        self.tx, self.rx = hops[0][0], hops[3][1]
        self.dones = [d[1] for d in dones]
        for s in [hops[0][1], hops[3][0], *hops[1], *hops[2], *(d[0] for d in dones)]:
            s.close()  # (the stages hold their ends)
        self.readers = [self.rx, *self.dones]
        for s in self.readers:
            s.setblocking(False)

    async def round(self, n: int) -> list[float]:
        loop = asyncio.get_running_loop()
        state: dict[str, Any] = {}

        def readable(sock: socket.socket) -> None:
            msgpack.unpackb(sock.recv(65536))
            state["left"] -= 1
            if state["left"] == 0:
                state["fut"].set_result(None)

        for s in self.readers:
            loop.add_reader(s.fileno(), readable, s)
        out = []
        try:
            for i in range(n):
                t0 = time.perf_counter()
                state["left"], state["fut"] = 3, loop.create_future()
                self.tx.send(msgpack.packb(["run", "c1", i, {"routes": [[0, "c2"], [0, "c3"]]}]))
                await state["fut"]
                out.append(time.perf_counter() - t0)
        finally:
            for s in self.readers:
                loop.remove_reader(s.fileno())
        return out

    def close(self) -> None:
        self.tx.close()  # EOF down the chain: each stage exits
        for p in self.procs:
            p.wait(10)
        for s in self.readers:
            s.close()


async def report_chain(graphs: dict[str, of.Graph], rounds: int, per_round: int,
                       idle: float) -> None:  # fmt: skip
    try:
        import ray  # noqa: F401
    except ImportError:
        with_ray = False
    else:
        with_ray = True
    res = await bench_chain(graphs, rounds, per_round, idle, with_ray)
    print(f"\n### 3. 3-stage chain, one call at a time ({len(res['omniflow'])} calls, µs)\n")
    print("| path | p50 | p99 | idle CPU, % of a core |")
    print("|---|---:|---:|---:|")
    o = res["omniflow"]
    print(f"| omniflow, 3 workers (`placement=\"process\"`), uds:// | {us(pct(o, 0.5))} | "
          f"{us(pct(o, 0.99))} | {res['idle_omniflow']:.1f} |")  # fmt: skip
    z = res["omniflow_ipc"]
    print(f"| omniflow, 3 workers, ipc:// (`OMNIFLOW_FAST_PATH=0`) | {us(pct(z, 0.5))} | "
          f"{us(pct(z, 0.99))} | |")  # fmt: skip
    b = res["bare"]
    print(f"| floor: 3 bare Python processes, socket pairs, msgpack (`BareChain`) | "
          f"{us(pct(b, 0.5))} | {us(pct(b, 0.99))} | |")  # fmt: skip
    if res["ray_cg"]:
        r = res["ray_cg"]
        print(f"| Ray Compiled Graph, 3 actors | {us(pct(r, 0.5))} | {us(pct(r, 0.99))} | "
              f"{res['idle_ray_cg']:.1f} |")  # fmt: skip
        ratio = pct(o, 0.5) / pct(r, 0.5)
        print(f"\nomniflow p50 / compiled graph p50: {ratio:.2f}x (target ≤ 1.0x: "
              f"{'met' if ratio <= 1.0 else 'NOT met'})")  # fmt: skip
    else:
        print("\n(ray is not installed: no compiled-graph baseline)")
    print(f"omniflow's own share of a call (p50 - the floor's p50): "
          f"{us(pct(o, 0.5) - pct(b, 0.5))} µs")  # fmt: skip
    print(f"omniflow idle CPU with 3 workers over {idle:g} s: {res['idle_omniflow']:.1f}% "
          f"(target ≤ 2%: {'met' if res['idle_omniflow'] <= 2 else 'NOT met'})")  # fmt: skip


# ---------------------------------------------------------------------------------- 4. replicas


def calibrate(target_s: float) -> int:
    n = 20_000
    while True:
        t0 = time.perf_counter()
        spin(n)
        took = time.perf_counter() - t0
        if took > 0.02:
            return max(1, int(n * target_s / took))
        n *= 2


async def bench_replicas(
    graphs: dict[str, of.Graph], spin_n: int, concurrent: int, repeats: int
) -> dict[str, Any]:
    g = graphs["bm_cpu"]
    res: dict[str, Any] = {}

    async def burst(rt: of.Runtime) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(rt.run("bm_cpu", {"n": spin_n}) for _ in range(concurrent)))
        return concurrent / (time.perf_counter() - t0)

    async with of.Runtime(g) as rt:
        await burst(rt)
        res["inproc"] = [await burst(rt) for _ in range(repeats)]
    for n in (1, 2, 4):
        async with of.Runtime(g, placement=of.Deploy({"cpu": {"replicas": n}})) as rt:
            await burst(rt)
            res[n] = [await burst(rt) for _ in range(repeats)]
    return res


# ---------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (~25 s)")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of the stream")
    ap.add_argument("--idle", type=float, default=10.0, help="idle window for CPU cost (s)")
    ap.add_argument(
        "--only",
        choices=("hop", "stream", "chain", "replicas"),
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    ap.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help=LOOP_HELP,
    )
    ap.add_argument(
        "--workers",
        choices=("auto", "spawn"),
        default="auto",
        help="how the fast path's workers start: auto (forked by the launcher's fork server "
        "where it can, what a front does) or spawn (a fresh `python -m omniflow worker` each, "
        "as with OMNIFLOW_FAST_PATH=0)",
    )
    return ap.parse_args()


async def main(args: argparse.Namespace) -> None:
    graphs = load()
    if args.workers == "spawn":
        from omniflow.cluster import _launch

        _launch.forking_supported = lambda: False  # type: ignore[assignment]
    from omniflow.cluster._launch import forking_supported

    rounds, per_round = (5, 200) if args.quick else (10, 400)
    repeats = 2 if args.quick else 3
    import zmq as _z

    print(
        f"python {platform.python_version()}, pyzmq {_z.pyzmq_version()}, libzmq "
        f"{_z.zmq_version()}, nproc {os.cpu_count()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, front loop "
        f"{type(asyncio.get_running_loop()).__module__.split('.')[0]}, fast-path workers "
        f"{'forked by a fork server' if forking_supported() else 'spawned'}"
    )

    parts = set(args.only or ("hop", "stream", "chain", "replicas"))
    if "hop" in parts:
        await report_hop(graphs, rounds, per_round)
    if "stream" in parts:
        await report_stream(graphs, args.quick, repeats, not args.no_profile)
    if "chain" in parts:
        await report_chain(graphs, rounds, per_round, args.idle)
    if "replicas" in parts:
        await report_replicas(graphs, repeats)


async def report_hop(graphs: dict[str, of.Graph], rounds: int, per_round: int) -> None:
    lat = await bench_hop(graphs, rounds, per_round)
    hop50 = pct(lat["process"], 0.5) - pct(lat["inproc"], 0.5)
    hop99 = pct(lat["process"], 0.99) - pct(lat["inproc"], 0.99)
    ipc50 = pct(lat["process_ipc"], 0.5) - pct(lat["inproc"], 0.5)
    ipc99 = pct(lat["process_ipc"], 0.99) - pct(lat["inproc"], 0.99)
    print(f"\n### 1. Cross-process hop ({len(lat['process'])} calls each, µs p50 / p99)\n")
    print("| | p50 | p99 |")
    print("|---|---:|---:|")
    for name, label in (
        ("inproc", "1-node call, in-process"),
        ("process", "1-node call, role in a worker, uds:// (fast path on)"),
        ("process_ipc", "1-node call, role in a worker, ipc:// (OMNIFLOW_FAST_PATH=0)"),
    ):
        print(f"| {label} | {us(pct(lat[name], 0.5))} | {us(pct(lat[name], 0.99))} |")
    print(f"| **omniflow hop, uds://** (worker - in-process) | **{us(hop50)}** | **{us(hop99)}** |")
    print(f"| omniflow hop, ipc:// (worker - in-process) | {us(ipc50)} | {us(ipc99)} |")
    for name, label in (("sync", "raw pyzmq, blocking"), ("async", "raw pyzmq, zmq.asyncio")):
        print(f"| {label} ping-pong | {us(pct(lat[name], 0.5))} | {us(pct(lat[name], 0.99))} |")
    for name, label in (("sync", "blocking"), ("async", "zmq.asyncio")):
        r50 = hop50 / pct(lat[name], 0.5)
        print(f"\nhop / raw {label} p50: {r50:.2f}x (target ≤ 2x)")


async def report_stream(
    graphs: dict[str, of.Graph], quick: bool, repeats: int, profile: bool
) -> None:
    n = 5_000 if quick else 10_000
    res = await bench_stream(graphs, n, repeats, profile)
    print(f"\n### 2. {n:,}-frame stream through 3 worker processes (frames/s, best of {repeats})\n")
    print("| placement | frames/s (best) | all runs |")
    print("|---|---:|---|")
    for name in ("inproc", "process"):
        runs = ", ".join(f"{x:,.0f}" for x in res[name])
        print(f"| {name} | {max(res[name]):,.0f} | {runs} |")
    print(f"\ntarget ≥ 15,000 frames/s: {'met' if max(res['process']) >= 15_000 else 'NOT met'}")
    if "profile" in res:
        print(f"\ncProfile of the front, one stream ({res['profiled_fps']:,.0f} frames/s):\n")
        print("| where (self time) | share |\n|---|---:|")
        for area, share in res["areas"]:
            print(f"| {area} | {share:.0%} |")
        print()
        print(res["profile"])


async def report_replicas(graphs: dict[str, of.Graph], repeats: int) -> None:
    spin_n = calibrate(0.005)
    concurrent = 200
    rep = await bench_replicas(graphs, spin_n, concurrent, repeats)
    print(
        f"\n### 3. CPU-bound role (~5 ms pure-Python loop, spin({spin_n:,})), {concurrent} "
        f"concurrent calls: calls/s (median of {repeats})\n"
    )
    print("| placement | calls/s | vs 1 replica | runs |")
    print("|---|---:|---:|---|")
    base = statistics.median(rep[1])
    for key, label in (
        ("inproc", "in-process"),
        (1, "1 replica"),
        (2, "2 replicas"),
        (4, "4 replicas"),
    ):
        med = statistics.median(rep[key])
        runs = ", ".join(f"{x:,.0f}" for x in rep[key])
        print(f"| {label} | {med:,.0f} | {med / base:.2f}x | {runs} |")


def run_front(main: Any, loop: str) -> None:
    """Run coroutine ``main`` (the front) on ``loop``: ``auto`` is what ``omniflow serve``
    runs on (``transport.run_loop``), else ``asyncio`` or ``uvloop``."""
    if loop == "asyncio":
        asyncio.run(main)
    elif loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        run_loop(main)


#: The ``--loop`` option of the scripts that run a front (this one, ab_chain, timeline_chain).
LOOP_HELP = (
    "the front's event loop: auto (default) is what `omniflow serve` runs on "
    "(transport.run_loop: uvloop when installed and the fast path is on)"
)


if __name__ == "__main__":
    cli = parse_args()
    run_front(main(cli), cli.loop)
