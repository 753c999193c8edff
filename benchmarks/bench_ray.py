"""of.Ray against placement="process", a plain Ray actor call and a Ray Compiled Graph hop.

    .venv/bin/python benchmarks/bench_ray.py            # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_ray.py --quick    # ~1 min

1. **hop**: a 1-node graph (``x -> hop.run -> y``), ``await rt.run`` one call at a time, the
   role placed with ``of.Ray()`` (a Ray actor hosting the worker loop; the front talks ZMQ to
   it) and with ``placement="process"``; against a plain Ray actor method call
   (``ray.get(actor.run.remote(x))``) on the same kind of actor. Rounds interleave the three
   so load bursts hit all alike.
2. **compiled**: the same hop as a Ray Compiled Graph (``actor.run.bind(InputNode())``,
   ``experimental_compile()``, ``ray.get(dag.execute(x))``), measured alone afterwards (its
   channels busy-poll and would slow the others), and the CPU that each setup burns while
   idle for ``--idle`` seconds: the front process plus the actor processes, from /proc.
3. **loss**: a call held open in an actor whose process is SIGKILLed: time until the call
   ends with its NodeError ("replica lost"), and until the restarted actor serves again.

The graphs are module-level objects of this file (a replica imports it by path).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import omniflow as of


class Hop(of.Role):
    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def run(self, x: int) -> dict[str, Any]:
        return {"y": x}


hop = of.Graph("bm_ray_hop", roles={"rhop": Hop()}, inputs=[of.Placeholder("x")], outputs=["y"])


class Holder(of.Role):
    @of.interface(inputs_or=[["hold"]], outputs=["held"])
    async def hold(self, hold: float) -> AsyncIterator[dict[str, Any]]:
        yield {"held": os.getpid()}
        await asyncio.sleep(hold)


held = of.Graph(
    "bm_ray_hold", roles={"rhold": Holder()}, inputs=[of.Placeholder("hold")], outputs=["held"]
)


class PlainHop:
    """The plain Ray actor: the same work, called the Ray way."""

    def run(self, x: int) -> int:
        return x

    def pid(self) -> int:
        return os.getpid()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_cpu(pids: list[int], seconds: float) -> float:
    """CPU percent (of one core) that ``pids`` burn together over ``seconds`` of idling."""
    before = sum(cpu_seconds(p) for p in pids)
    await asyncio.sleep(seconds)
    return 100 * (sum(cpu_seconds(p) for p in pids) - before) / seconds


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def bench_hop(n: int, rounds: int, idle: float) -> dict[str, Any]:
    import ray

    (graph,) = [g for g in of.load_graphs(__file__) if g.name == "bm_ray_hop"]
    samples: dict[str, list[float]] = {"ray": [], "process": [], "actor": []}
    actor = ray.remote(PlainHop).options(num_cpus=1).remote()
    ray.get(actor.run.remote(0))
    async with (
        of.Runtime(graph, placement=of.Ray()) as on_ray,
        of.Runtime(graph, placement="process") as on_proc,
    ):
        for rt in (on_ray, on_proc):  # warm up
            for i in range(50):
                await rt.run("bm_ray_hop", {"x": i})
        for _ in range(rounds):
            for name, rt in (("ray", on_ray), ("process", on_proc)):
                out = samples[name]
                for i in range(n):
                    t = time.perf_counter()
                    await rt.run("bm_ray_hop", {"x": i})
                    out.append(time.perf_counter() - t)
            for i in range(n):
                t = time.perf_counter()
                ray.get(actor.run.remote(i))
                samples["actor"].append(time.perf_counter() - t)
        assert on_ray.remote is not None and on_proc.remote is not None
        ray_pids = [r["pid"] for r in on_ray.remote.fleet.launcher.replicas()]
        proc_pids = [r.pid for r in on_proc.remote.fleet.replicas.values() if r.pid]
        me = os.getpid()
        idle_ray = await idle_cpu([me, *ray_pids], idle)
        idle_proc = await idle_cpu([me, *proc_pids], idle)
    idle_actor = await idle_cpu([me, ray.get(actor.pid.remote())], idle)
    ray.kill(actor)
    return {"samples": samples, "idle": {"ray": idle_ray, "process": idle_proc,
            "actor": idle_actor}}  # fmt: skip


async def bench_compiled(n: int, rounds: int, idle: float) -> dict[str, Any]:
    import ray
    from ray.dag import InputNode

    actor = ray.remote(PlainHop).options(num_cpus=1).remote()
    pid = ray.get(actor.pid.remote())
    with InputNode() as inp:
        dag = actor.run.bind(inp)
    compiled = dag.experimental_compile()
    try:
        for i in range(50):
            ray.get(compiled.execute(i))
        samples = []
        for _ in range(rounds):
            for i in range(n):
                t = time.perf_counter()
                ray.get(compiled.execute(i))
                samples.append(time.perf_counter() - t)
        busy = await idle_cpu([os.getpid(), pid], idle)
    finally:
        compiled.teardown()
        ray.kill(actor)
    return {"samples": samples, "idle": busy}


async def bench_loss(times: int) -> dict[str, list[float]]:
    """Each repetition on a fresh runtime, so every loss is a first one (no respawn backoff)."""
    (graph,) = [g for g in of.load_graphs(__file__) if g.name == "bm_ray_hold"]
    failed, back = [], []
    for _ in range(times):
        async with of.Runtime(graph, placement=of.Ray()) as rt:
            call = rt.call("bm_ray_hold", {"hold": 3600})
            stream = aiter(call)
            victim = (await anext(stream)).value
            t = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            async for _frame in stream:
                pass
            failed.append(time.perf_counter() - t)
            assert call.status == "error" and "replica lost" in call.errors[0].message
            while True:
                if not rt.readiness():
                    out = await rt.run("bm_ray_hold", {"hold": 0})
                    if out["held"] != [victim]:
                        break
                await asyncio.sleep(0.01)
            back.append(time.perf_counter() - t)
    return {"failed": failed, "back": back}


def row(name: str, xs: list[float], base: float) -> str:
    p50, p99 = statistics.median(xs), pct(xs, 0.99)
    return f"| {name} | {len(xs)} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {p50 / base:.2f}x |"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--idle", type=float, default=5.0, help="idle window for CPU cost (s)")
    args = ap.parse_args()
    n, rounds, losses = (100, 5, 3) if args.quick else (200, 10, 5)
    from omniflow.cluster._ray import init_ray

    ray = init_ray(None, num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        hop_res = await bench_hop(n, rounds, args.idle)
        comp = await bench_compiled(n, rounds, args.idle)
        loss = await bench_loss(losses)
    finally:
        ray.shutdown()
    s = hop_res["samples"]
    base = statistics.median(s["ray"])
    print(f"python {platform.python_version()}, ray {ray.__version__}, nproc {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| hop | n | p50 ms | p99 ms | p50 vs of.Ray |")
    print("|---|---:|---:|---:|---:|")
    print(row("omniflow, `of.Ray()`", s["ray"], base))  # the ratios are vs this row
    print(row('omniflow, `placement="process"`', s["process"], base))
    print(row("plain Ray actor call", s["actor"], base))
    print(row("Ray Compiled Graph", comp["samples"], base))
    idle = hop_res["idle"]
    print()
    print(f"idle CPU over {args.idle:g} s (front/driver + actor processes, % of one core):")
    print(f"  of.Ray {idle['ray']:.1f}%  process {idle['process']:.1f}%  "
          f"plain actor {idle['actor']:.1f}%  compiled graph {comp['idle']:.1f}%")  # fmt: skip
    print()
    print(f"actor SIGKILLed mid-call ({losses} times): call failed with NodeError after "
          f"median {statistics.median(loss['failed']) * 1e3:.0f} ms (max "
          f"{max(loss['failed']) * 1e3:.0f} ms); restarted actor served after median "
          f"{statistics.median(loss['back']):.2f} s (max {max(loss['back']):.2f} s)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
