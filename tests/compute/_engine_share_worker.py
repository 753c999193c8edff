"""One TorchEngine replica in its own process, for the weight-sharing test and benchmark.

    python -m tests.compute._engine_share_worker shared|private MODEL_DIR

Prints ``base <pss_kb>`` once torch and the engine are imported, then ``out <token ids>`` after
a greedy generation (every weight touched); then blocks on a line from stdin before it exits.
The parent reads each replica's PSS from outside (``pss_kb(pid)``) only once every replica has
printed ``out``: a replica's own reading right after its generation could come before another
replica mapped the shared copy, and would then count the whole copy as its own.
"""

from __future__ import annotations

import asyncio
import sys

from omniflow.compute import GenerateRequest, SamplingParams, TorchEngine
from omniflow.testing._share_worker import pss_kb


async def main(mode: str, model_dir: str) -> None:
    print("base", pss_kb(), flush=True)
    engine = TorchEngine(
        model_dir, share_weights=mode == "shared", dtype="float32", device="cpu", pool_pages=16
    )
    await engine.start()
    req = GenerateRequest(
        input_ids=list(range(1, 9)), sampling=SamplingParams(max_new_tokens=8, temperature=0.0)
    )
    ids = [out.token_id async for out in engine.generate(req)]
    print("out", ",".join(map(str, ids)), flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await engine.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
