"""Greedy generation equals transformers' ``generate`` token for token (float32), and the logits
of every tiny checkpoint (one per config flag, ``conftest.MODELS``) are transformers' logits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omniflow.compute import GenerateRequest
from omniflow.compute._loader import load_model
from omniflow.compute._model import ForwardBatch, SeqSlice

from .conftest import EXECUTORS, MODELS, greedy, hf_greedy, run

pytestmark = pytest.mark.timeout(300)

LENGTHS = (3, 17, 40, 8, 33, 1, 64, 21)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [5 + (i * 7 + salt * 13) % 300 for i in range(n)]


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_single_request_matches_transformers(
    name: str, model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any
) -> None:
    path = model_dirs(name)
    engine = await engine_factory(path, max_batch=4)
    ids = prompt(29)
    got, cached = await run(engine, GenerateRequest(input_ids=ids, sampling=greedy()))
    assert got == hf_greedy(reference(path), ids, 64)
    assert cached == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_transformers(
    name: str, model_dirs: Callable[[str], Path], reference: Any
) -> None:
    """A 70-token prompt (past every window and YaRN's original context) prefilled in two
    chunks, the second reading the first from its pages: the last row's logits are the ones
    transformers computes for the whole prompt."""
    path = model_dirs(name)
    model = load_model(path, device="cpu", dtype="float32")
    cfg = model.cfg
    ids = torch.tensor(prompt(70))

    def pages() -> list[list[torch.Tensor]]:
        return [
            [torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(5)]
            for _ in range(cfg.num_layers)
        ]

    k, v = pages(), pages()
    first = ForwardBatch(ids[:40], torch.arange(40), [SeqSlice(0, 40, k, v, want_logits=False)])
    model.forward(first)
    second = ForwardBatch(ids[40:], torch.arange(40, 70), [SeqSlice(40, 30, k, v)])
    got = model.forward(second)[0]
    with torch.no_grad():
        want = reference(path)(ids[None]).logits[0, -1].float()
    assert torch.allclose(got, want, atol=2e-5, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("executor", EXECUTORS)
async def test_eight_concurrent_requests_match_transformers(
    name: str, model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any, executor: str
) -> None:
    path = model_dirs(name)
    # a small step budget forces chunked prefill next to decoding streams
    engine = await engine_factory(path, max_batch=8, max_step_tokens=24, executor=executor)
    prompts = [prompt(n, salt=i) for i, n in enumerate(LENGTHS)]
    results = await asyncio.gather(
        *(run(engine, GenerateRequest(input_ids=p, sampling=greedy())) for p in prompts)
    )
    ref = reference(path)
    for p, (got, _) in zip(prompts, results, strict=True):
        assert got == hf_greedy(ref, p, 64), f"prompt of {len(p)} tokens diverged"


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("executor", EXECUTORS)
async def test_second_turn_with_prefix_hit_matches_transformers(
    name: str, model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any, executor: str
) -> None:
    path = model_dirs(name)
    engine = await engine_factory(path, executor=executor)
    ref = reference(path)
    turn1 = prompt(50)
    reply, cached1 = await run(
        engine, GenerateRequest(input_ids=turn1, session="s", sampling=greedy())
    )
    assert cached1 == 0
    turn2 = [*turn1, *reply, *prompt(9, salt=3)]
    got, cached2 = await run(
        engine, GenerateRequest(input_ids=turn2, session="s", sampling=greedy())
    )
    # every full page of turn 1 (prompt + reply, except the never-fed last token) is reused
    assert cached2 == (len(turn1) + len(reply) - 1) // 16 * 16
    assert got == hf_greedy(ref, turn2, 64)
    # another session sees none of it
    other, cached3 = await run(
        engine, GenerateRequest(input_ids=turn2, session="t", sampling=greedy())
    )
    assert cached3 == 0 and other == got


async def test_incremental_step_matches_full_resend(
    model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any
) -> None:
    path = model_dirs("llama")
    engine = await engine_factory(path)
    turn1 = prompt(40)
    reply, _ = await run(engine, GenerateRequest(input_ids=turn1, session="s", sampling=greedy(16)))
    extra = prompt(7, salt=5)
    # step=-1: append to the whole history the engine holds (prompt + reply)
    got, cached = await run(
        engine, GenerateRequest(input_ids=extra, session="s", step=-1, sampling=greedy(16))
    )
    full = [*turn1, *reply, *extra]
    assert got == hf_greedy(reference(path), full, 16)
    assert cached == (len(turn1) + len(reply) - 1) // 16 * 16
    # step=k: the client holds only the first 40 positions (the prompt); the reply is dropped
    got2, cached2 = await run(
        engine, GenerateRequest(input_ids=extra, session="s", step=40, sampling=greedy(16))
    )
    assert got2 == hf_greedy(reference(path), [*turn1, *extra], 16)
    assert cached2 == 32


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_evicted_pages_are_recomputed_not_wrong(
    model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any, executor: str
) -> None:
    path = model_dirs("llama")
    # 24 pages: turn 1 publishes 7; a second session needs 19 more, evicting part of the chain
    engine = await engine_factory(path, pool_pages=24, executor=executor)
    ref = reference(path)
    turn1 = prompt(64)
    reply, _ = await run(engine, GenerateRequest(input_ids=turn1, session="a", sampling=greedy()))
    published = (len(turn1) + len(reply) - 1) // 16
    stats = engine.kv_pool.stats()
    await run(
        engine, GenerateRequest(input_ids=prompt(300, salt=9), session="b", sampling=greedy(8))
    )
    assert engine.kv_pool.stats()["evictions"] > stats["evictions"]
    turn2 = [*turn1, *reply, 7, 8, 9]
    got, cached = await run(
        engine, GenerateRequest(input_ids=turn2, session="a", sampling=greedy())
    )
    assert cached < published * 16  # some of the chain was lost ...
    assert got == hf_greedy(ref, turn2, 64)  # ... and recomputed from the host-side tokens


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_garbage_in_fresh_pool_memory_never_leaks_into_attention(
    model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any, executor: str
) -> None:
    """The pool's arrays start uninitialised (torch.empty): poison them with NaN first."""
    path = model_dirs("llama")
    engine = await engine_factory(path, max_batch=8, max_step_tokens=24, executor=executor)
    for name in engine._kv.names:
        for sl in ("k", "v"):
            engine.kv_pool.storage(name, sl).fill_(float("nan"))
    prompts = [prompt(n, salt=i) for i, n in enumerate(LENGTHS)]
    results = await asyncio.gather(
        *(run(engine, GenerateRequest(input_ids=p, sampling=greedy(24))) for p in prompts)
    )
    ref = reference(path)
    for p, (got, _) in zip(prompts, results, strict=True):
        assert got == hf_greedy(ref, p, 24)


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_preempted_requests_are_recomputed_on_new_pages(
    model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any, executor: str
) -> None:
    """Too few pages for four requests at once: some are preempted (pages released, tokens
    kept) and recomputed later on other pages; a request that finds every page held by
    sequences about to finish waits for them instead of failing."""
    path = model_dirs("llama")
    engine = await engine_factory(path, max_batch=4, pool_pages=12, executor=executor)
    prompts = [prompt(40, salt=i) for i in range(4)]
    results = await asyncio.gather(
        *(run(engine, GenerateRequest(input_ids=p, sampling=greedy(48))) for p in prompts)
    )
    assert engine.statistics()["preemptions"] > 0
    ref = reference(path)
    for p, (got, _) in zip(prompts, results, strict=True):
        assert got == hf_greedy(ref, p, 48)
