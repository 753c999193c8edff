"""The 3-worker chain of ``bench_multiprocess.py`` alone in a process, for A/B runs of two
trees: nothing else in the process (no compiled graph, no second runtime), one line out.

Run each tree's copy from that tree's root in turn, alternating, several times (this box
drifts by tens of percent within minutes, so only alternated runs compare); the front and
the workers then import that tree's omniflow (copy this file into an older tree's
``benchmarks/`` to compare with it)::

    for i in 1 2 3 4; do for t in <old tree> <new tree>; do
      (cd $t && PYTHONPATH=$PWD <venv>/bin/python benchmarks/ab_chain.py --label $t)
    done; done
"""

from __future__ import annotations

import argparse
import asyncio
import os

import bench_multiprocess as bm  # (beside this file: the script's directory is on sys.path)


async def main(rounds: int, per_round: int, label: str) -> None:
    g = bm.load()["bm_chain3"]
    async with bm.in_workers(g, fast_path=True) as rt:
        for i in range(300):  # connections made, caches warm
            assert (await rt.run("bm_chain3", {"x": i}))["y"] == [i + 3]
        lat: list[float] = []
        for _ in range(rounds):
            lat += await bm.calls(rt, "bm_chain3", {"x": 1}, per_round)
    lat.sort()
    p50, p90 = bm.pct(lat, 0.5), bm.pct(lat, 0.9)
    print(f"{label}: chain p50 {bm.us(p50)} µs, p90 {bm.us(p90)} µs ({len(lat)} calls)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=2000)
    parser.add_argument("--label", default=os.getcwd())
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="uvloop",
        help="the front's event loop (uvloop: what `omniflow serve` runs on when installed; "
        "chosen here by name, so that an older tree's copy runs the same)",
    )
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main(args.rounds, args.per_round, args.label))
    else:
        asyncio.run(main(args.rounds, args.per_round, args.label))
