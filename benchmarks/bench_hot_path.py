"""In-process hot path of one source tree, in CPU time: chain-1/16 per call and a 10k-frame stream.

    PYTHONPATH=<tree> .venv/bin/python benchmarks/bench_hot_path.py

Compare trees by running it from each (alternating, a few times) and keeping the best of each:
CPU time (``time.process_time``) instead of wall time, and the minimum over 7 blocks of 300
calls instead of one median, so that neighbours on a loaded machine move the numbers much
less than with ``bench_runtime.py`` (whose wall-clock medians are what the targets name).
Prints one line: chain-1 and chain-16 µs per call, the marginal µs per extra hop, and the
stream's frames per second. The graphs are ``bench_runtime``'s.
``OMNIFLOW_BENCH_OTLP=URL`` runs them traced, exporting to an OTLP/HTTP collector at URL.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_runtime as br

import omniflow as of


def _kw() -> dict[str, object]:
    """Runtime options: tracing on when ``OMNIFLOW_BENCH_OTLP`` names a collector."""
    url = os.environ.get("OMNIFLOW_BENCH_OTLP")
    if not url:
        return {}
    from omniflow.runtime._tracing import otlp_provider

    return {"tracer_provider": otlp_provider(url)}


async def chain(n: int) -> float:
    """Best median per-call CPU time (µs) of ``rt.run`` on an n-node chain."""
    async with of.Runtime(br.of_chain(n), **_kw()) as rt:
        name = f"chain{n}"
        for _ in range(200):
            await rt.run(name, {"x0": 0})
        meds = []
        for _ in range(7):
            ts = []
            for _ in range(300):
                t0 = time.process_time()
                await rt.run(name, {"x0": 0})
                ts.append(time.process_time() - t0)
            meds.append(statistics.median(ts))
        return min(meds) * 1e6


async def stream(k: int = 10_000) -> float:
    """Best frames/s (CPU time) of a k-frame stream through 3 nodes, of 3 runs."""
    async with of.Runtime(br.of_stream(), **_kw()) as rt:

        async def run(n: int) -> int:
            m = 0
            async for _fr in rt.call("stream", {"n": n}):
                m += 1
            return m

        assert await run(2000) == 2000
        best = float("inf")
        for _ in range(3):
            gc.collect()
            t0 = time.process_time()
            assert await run(k) == k
            best = min(best, time.process_time() - t0)
        return k / best


async def main() -> None:
    c1, c16 = await chain(1), await chain(16)
    fps = await stream()
    print(
        f"chain-1 {c1:.1f} µs, chain-16 {c16:.1f} µs, marginal {(c16 - c1) / 15:.2f} µs/hop, "
        f"stream {fps:,.0f} frames/s"
    )


if __name__ == "__main__":
    asyncio.run(main())
