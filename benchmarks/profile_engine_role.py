"""cProfile of the event-loop thread while 16 role calls stream tokens from one TorchEngine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_engine_role.py

Same model and role graph as bench_engine.py's measure 4; prints the role and direct
aggregate tokens/s of this run and the top functions by own time.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_engine as b

import omniflow as of
from omniflow.compute._tiny import make_tiny_model


async def main() -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = make_tiny_model(Path(tmp) / "m", hidden_size=256, layers=4, heads=8, kv_heads=4)
        engine = of.TorchEngine(path, max_batch=16, max_step_tokens=2112, pool_pages=2048)
        await engine.start()
        async with of.Runtime(b.bench_graph(engine)) as rt:
            await b.role_concurrent(rt, 2, 4, 32)  # warm-up
            prof = cProfile.Profile()
            prof.enable()
            role = await b.role_concurrent(rt, 16, 64, 32)
            prof.disable()
            direct = await b.engine_concurrent(engine, 16, 64, 32)
        print(f"role {role:.0f} tok/s, direct {direct:.0f} tok/s")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        await engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
