"""CPU per frame of each process of the 10,000-frame stream (front, src, m1, m2).

    (cd <tree> && PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_stream_cpu.py [rounds] [n])

The stream of ``bench_multiprocess.py`` (``src.gen -> m1.step -> m2.step``, each role in its
own worker): after a 2,000-frame warm-up, ``rounds`` streams of ``n`` frames (default 4 of
30,000); each process's utime + stime from ``/proc/<pid>/stat`` before and after each round.
Prints the best round of each process in µs per frame (the resolution is one clock tick,
10 ms here: 0.3 µs a frame at n = 30,000), each round's frames/s and each round's front µs
per frame (a round whose results came before their binding frames shows there). CPU time, unlike
frames/s, barely moves with what else runs on a shared box. Run each tree from its own root:
the workers import ``omniflow`` from the working directory.
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_multiprocess as bm

import omniflow as of

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid``, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def main(rounds: int, n: int) -> None:
    async with of.Runtime(bm.stream, placement="process") as rt:
        assert rt.remote is not None
        pids = {"front": os.getpid()}
        for rep in rt.remote.fleet.replicas.values():
            assert rep.pid is not None
            pids[rep.roles[0]] = rep.pid
        await bm.consume(rt, 2000)
        best = dict.fromkeys(pids, float("inf"))
        fps = []
        front = []
        for _ in range(rounds):
            before = {k: cpu_s(p) for k, p in pids.items()}
            took = await bm.consume(rt, n)
            after = {k: cpu_s(p) for k, p in pids.items()}
            fps.append(n / took)
            front.append((after["front"] - before["front"]) / n * 1e6)
            for k in pids:
                best[k] = min(best[k], (after[k] - before[k]) / n * 1e6)
    per = " ".join(f"{k}={v:.1f}" for k, v in sorted(best.items()))
    print(f"µs CPU per frame, best round: {per} (sum {sum(best.values()):.1f})")
    print("frames/s per round:", ", ".join(f"{x:,.0f}" for x in fps))
    print("front µs per frame per round:", ", ".join(f"{x:.1f}" for x in front))


if __name__ == "__main__":
    asyncio.run(
        main(
            int(sys.argv[1]) if len(sys.argv) > 1 else 4,
            int(sys.argv[2]) if len(sys.argv) > 2 else 30000,
        )
    )
