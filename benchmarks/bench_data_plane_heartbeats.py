"""How long a worker goes silent, as the front's supervisor sees it, while big values move inline.

    .venv/bin/python benchmarks/bench_data_plane_heartbeats.py [--size-mb 512] [--calls 2]
        [--interval 1.0]

Heartbeats leave from the worker's event loop, so whatever holds the loop (sealing, opening,
copying a big inline value; a method's synchronous work) silences them, and a replica silent
for ``heartbeat_misses`` intervals is killed. This runs bench_data_plane's two-node graph with
``placement="process"`` and ``data_threshold=2**62`` (the tensor rides the control messages,
worker -> front -> worker), ``heartbeat_misses`` out of the way, and a task in the front that
looks at every replica's ``last_seen`` at the supervisor's tick (a quarter interval), skipping
ticks where the front's own loop stalled, as the supervisor does. It prints the longest
silence seen, in seconds and in intervals: ``heartbeat_misses`` must stay well above it (see
docs/failure.md, *Heartbeats*).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_data_plane as dp

import omniflow as of


async def longest_silence(size_mb: int, calls: int, interval: float) -> tuple[float, float]:
    """(longest silence in seconds, seconds per call)."""
    (g,) = of.load_graphs(dp.__file__)
    async with of.Runtime(
        g,
        placement="process",
        data_threshold=2**62,
        heartbeat_interval=interval,
        heartbeat_misses=1_000_000,
    ) as rt:
        assert rt.remote is not None
        remote = rt.remote
        await rt.run("bench_dp", {"nbytes": dp.MB})
        worst = 0.0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal worst
            loop = asyncio.get_running_loop()
            tick = interval / 4
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(tick)
                now = loop.time()
                stalled, last = now - last > tick + interval / 2, now
                if stalled:
                    continue
                for rep in remote._replicas.values():
                    if rep.alive:
                        worst = max(worst, now - rep.last_seen)

        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter()
        for _ in range(calls):
            await rt.run("bench_dp", {"nbytes": size_mb * dp.MB})
        took = (time.perf_counter() - t0) / calls
        done.set()
        await watcher
    return worst, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s")
    args = parser.parse_args()
    os.environ["OMNIFLOW_POOL_BYTES"] = str(max(256, 2 * args.size_mb) * dp.MB)
    worst, took = asyncio.run(longest_silence(args.size_mb, args.calls, args.interval))
    print(
        f"{args.size_mb} MiB inline, interval {args.interval} s, load average "
        f"{os.getloadavg()[0]:.1f}: longest silence {worst:.2f} s = "
        f"{worst / args.interval:.2f} intervals ({took:.2f} s per call)"
    )


if __name__ == "__main__":
    main()
