"""TorchEngine against transformers' generate, on one random-init Llama, same process, same threads.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_engine.py            # ~2 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_engine.py --quick    # smaller, ~40 s

Measures (goals from issue 13):
  1. decode tokens/s of one request, TorchEngine vs transformers generate   (goal >= 1.0x)
  2. aggregate tokens/s, 16 concurrent requests vs one                        (goal >= 4x)
  3. time to first token of turn 2 with a 2,048-token history,
     prefix hit (same session) vs no reuse (a fresh session)                  (goal >= 5x)
  4. the engine as an omniflow role (in-process Runtime, 16 concurrent calls streaming token
     frames) vs calling it directly: aggregate tokens/s                    (goal <= 5% slower)
Each round runs every contender once, so machine load hits them alike; ratios are the median of
the per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import omniflow as of
from omniflow.compute._tiny import make_tiny_model


def hf_decode(model: Any, ids: list[int], n: int) -> float:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    dt = time.perf_counter() - t
    assert out.shape[1] == len(ids) + n
    return n / dt


async def engine_decode(engine: of.TorchEngine, ids: list[int], n: int) -> float:
    req = of.GenerateRequest(
        input_ids=ids, sampling=of.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    )
    t = time.perf_counter()
    count = 0
    async for _ in engine.generate(req):
        count += 1
    dt = time.perf_counter() - t
    assert count == n
    return n / dt


async def engine_concurrent(engine: of.TorchEngine, k: int, n: int, plen: int) -> float:
    prompts = [[5 + (i * 7 + j) % 300 for j in range(plen)] for i in range(k)]
    t = time.perf_counter()
    counts = await asyncio.gather(*(_count(engine, p, n) for p in prompts))
    dt = time.perf_counter() - t
    return sum(counts) / dt


async def _count(engine: of.TorchEngine, ids: list[int], n: int) -> int:
    req = of.GenerateRequest(
        input_ids=ids, sampling=of.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    )
    return sum([1 async for _ in engine.generate(req)])


def _role_graph(engine: of.TorchEngine) -> of.Graph:
    class Llm(of.Role):
        @of.interface(inputs_or=[["ids"]], outputs=["token"])
        async def generate(self, ids: list[int]) -> Any:
            req = of.GenerateRequest(
                input_ids=ids,
                sampling=of.SamplingParams(max_new_tokens=N_ROLE, temperature=0, ignore_eos=True),
            )
            async for out in engine.generate(req):
                yield {"token": out.token_id}

    return of.Graph("llm", roles={"llm": Llm()}, inputs=[of.Placeholder("ids")], outputs=["token"])


N_ROLE = 128


async def role_concurrent(rt: of.Runtime, k: int, n: int, plen: int) -> float:
    global N_ROLE
    N_ROLE = n
    prompts = [[5 + (i * 7 + j) % 300 for j in range(plen)] for i in range(k)]

    async def one(ids: list[int]) -> int:
        return sum([1 async for _ in rt.call("llm", {"ids": ids})])

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    dt = time.perf_counter() - t
    assert sum(counts) == k * n, counts
    return sum(counts) / dt


async def ttft(engine: of.TorchEngine, ids: list[int], session: str) -> tuple[float, int]:
    req = of.GenerateRequest(
        input_ids=ids,
        session=session,
        sampling=of.SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
    )
    t = time.perf_counter()
    async for out in engine.generate(req):
        return time.perf_counter() - t, out.cached_tokens
    raise AssertionError("no token")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_decode = 64 if args.quick else 128
    rounds = 3 if args.quick else args.rounds
    history = 2048
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = make_tiny_model(
            Path(tmp) / "m", hidden_size=args.hidden, layers=args.layers, heads=8, kv_heads=4
        )
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(path).eval()
        engine = of.TorchEngine(path, max_batch=16, max_step_tokens=2048 + 64, pool_pages=2048)
        await engine.start()
        prompt = [5 + i % 300 for i in range(32)]
        await engine_decode(engine, prompt, 8)  # warm-up both
        hf_decode(ref, prompt, 8)

        ours, theirs, agg, role = [], [], [], []
        runtime = of.Runtime(_role_graph(engine))
        await runtime.__aenter__()
        await role_concurrent(runtime, 2, 4, 32)  # warm-up
        for _ in range(rounds):
            ours.append(await engine_decode(engine, prompt, n_decode))
            theirs.append(hf_decode(ref, prompt, n_decode))
            agg.append(await engine_concurrent(engine, 16, n_decode, 32))
            role.append(await role_concurrent(runtime, 16, n_decode, 32))
        await runtime.__aexit__(None, None, None)
        one = statistics.median(ours)
        r1 = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
        r2 = statistics.median(a / b for a, b in zip(agg, ours, strict=True))
        r4 = statistics.median(1 - a / b for a, b in zip(role, agg, strict=True))
        print(
            f"model: llama hidden={args.hidden} layers={args.layers} heads=8/4 float32, "
            f"torch threads={torch.get_num_threads()}, device={engine._runner.model.device}, "
            f"rounds={rounds}"
        )
        print(
            f"1. decode, one request, {n_decode} tokens: TorchEngine {one:.0f} tok/s, "
            f"transformers {statistics.median(theirs):.0f} tok/s -> {r1:.2f}x (goal >= 1.0x)"
        )
        print(
            f"2. aggregate, 16 concurrent x {n_decode} tokens: {statistics.median(agg):.0f} tok/s"
            f" vs one request {one:.0f} tok/s -> {r2:.2f}x (goal >= 4x)"
        )
        print(
            f"4. as an omniflow role (in-process Runtime, 16 concurrent calls): "
            f"{statistics.median(role):.0f} tok/s vs direct {statistics.median(agg):.0f} tok/s "
            f"-> {r4 * 100:+.1f}% slower (goal <= 5%)"
        )

        hit, miss = [], []
        for r in range(rounds):
            turn1 = [5 + (i * 13 + r) % 300 for i in range(history)]
            first = of.GenerateRequest(
                input_ids=turn1,
                session=f"s{r}",
                sampling=of.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
            )
            reply = [out.token_id async for out in engine.generate(first)]
            turn2 = [*turn1, *reply, *range(40, 56)]
            t_hit, cached = await ttft(engine, turn2, f"s{r}")
            assert cached >= history, cached
            t_miss, cached0 = await ttft(engine, turn2, f"fresh{r}")
            assert cached0 == 0
            hit.append(t_hit)
            miss.append(t_miss)
        h, m = statistics.median(hit), statistics.median(miss)
        print(
            f"3. TTFT of turn 2 ({len(turn2)} tokens, {history}-token history): prefix hit "
            f"{h * 1000:.1f} ms vs no reuse {m * 1000:.1f} ms -> {m / h:.1f}x (goal >= 5x)"
        )
        await engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
