"""DiTEngine: pictures denoised together vs one at a time, conditioned on the LLM's pages in place.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_dit.py            # ~1 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_dit.py --quick    # smaller

One random-init LLM (TorchEngine) and a DiT of matching heads/layers (DiTEngine) share one pool;
the LLM prefills a prompt per picture (``prefill`` publishes its pages). Measured, each round
running both contenders (order alternating, so machine load hits them alike), ratios the median
of the per-round ratios:
  1. pictures/s: N pictures submitted together (batched steps) vs the same N one after another,
     wall clock and CPU seconds of this process (the latter moves less with other jobs' load)
  2. bytes the pool moved while the DiT read the prompts' KV (0: read in place) against the
     bytes a serializing hand-off (the LLM's per-layer K/V of every prompt) would have copied
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import omniflow as of
from omniflow.compute._dit import make_tiny_dit
from omniflow.compute._tiny import make_tiny_model


async def _one(dit: of.DiTEngine, req: of.DenoiseRequest) -> torch.Tensor:
    final = None
    async for out in dit.generate(req):
        final = out
    assert final is not None and final.finished
    return final.latents


async def bench(args: argparse.Namespace, root: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm_dir = make_tiny_model(
            root / "llm", hidden_size=args.hidden, layers=args.layers, heads=8, kv_heads=4
        )
    dit_dir = make_tiny_dit(
        root / "dit",
        heads=8,
        kv_heads=4,
        head_dim=args.hidden // 8,
        layers=args.layers,
        latent_dim=16,
        num_tokens=args.tokens,
    )
    pool = of.TorchEngine.pool(llm_dir, "kv", capacity={"l1": 2048, "l2": 0, "l3": 0}, device="cpu")
    llm = of.TorchEngine(llm_dir, pool=pool, device="cpu")
    dit = of.DiTEngine(dit_dir, pool=pool, device="cpu", max_batch=args.pictures)
    await llm.start()
    await dit.start()
    prefixes = [
        await llm.prefill(
            of.GenerateRequest(
                input_ids=[(7 * i + p) % 300 + 5 for i in range(64)], session=f"p{p}"
            )
        )
        for p in range(args.pictures)
    ]

    def reqs() -> list[of.DenoiseRequest]:
        return [
            of.DenoiseRequest(context=pre, steps=args.steps, seed=i)
            for i, pre in enumerate(prefixes)
        ]

    async def sequential() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for r in reqs():
            await _one(dit, r)
        return time.perf_counter() - t0, time.process_time() - c0

    async def together() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(_one(dit, r) for r in reqs()))
        return time.perf_counter() - t0, time.process_time() - c0

    await together()  # warm-up
    moved = pool.stats()["bytes_moved"]
    ratios, cpu_ratios, seq_s, bat_s = [], [], [], []
    for rnd in range(args.rounds):
        if rnd % 2:
            b, s = await together(), await sequential()
        else:
            s, b = await sequential(), await together()
        seq_s.append(s[0])
        bat_s.append(b[0])
        ratios.append(s[0] / b[0])
        cpu_ratios.append(s[1] / b[1])
    moved = pool.stats()["bytes_moved"] - moved
    cfg = llm.config
    assert cfg is not None
    ctx = sum(p.tokens for p in prefixes)
    per_round = ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    n = args.pictures
    print(
        f"LLM hidden {args.hidden} x {args.layers} layers; DiT {args.tokens} image tokens, "
        f"{args.steps} steps; {n} pictures, each on a {prefixes[0].tokens}-token prompt; "
        f"torch threads={torch.get_num_threads()}"
    )
    print(
        f"(1) one at a time {n / statistics.median(seq_s):6.2f} pictures/s, together "
        f"{n / statistics.median(bat_s):6.2f} pictures/s: {statistics.median(ratios):.2f}x "
        f"(per-round {min(ratios):.2f}..{max(ratios):.2f}, {args.rounds} rounds); CPU seconds "
        f"of this process: {statistics.median(cpu_ratios):.2f}x fewer together "
        f"({min(cpu_ratios):.2f}..{max(cpu_ratios):.2f})"
    )
    runs = 2 * args.rounds
    print(
        f"(2) pool bytes_moved while the DiT read the prompts' KV: {moved} over {runs} runs of "
        f"{n} pictures; a serializing hand-off would copy {per_round / 2**20:.2f} MiB per run "
        f"({per_round * runs / 2**20:.1f} MiB in all)"
    )
    await dit.stop()
    await llm.stop()
    await pool.aclose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pictures", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on shared cores)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.steps = 3, 4
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(bench(args, Path(tmp)))


if __name__ == "__main__":
    main()
