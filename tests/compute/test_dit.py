"""DiTEngine: denoising steps as sequences on the engine base, reading the LLM's KV pages in place
(published by TorchEngine.prefill into the same pool), equal to a contiguous-KV reference."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

import omniflow as of
from omniflow.compute import (
    DenoiseOutput,
    DenoiseRequest,
    DiTEngine,
    EngineError,
    GenerateRequest,
    ModelLoadError,
    PublishedPrefix,
    RequestError,
    TorchEngine,
)
from omniflow.compute._dit import DitModel, _PictureGroup, load_dit, make_tiny_dit
from omniflow.compute._loader import load_model
from omniflow.compute._model import ForwardBatch, SeqSlice
from omniflow.compute._tiny import make_tiny_model

pytestmark = pytest.mark.timeout(300)

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]  # 40 tokens: 2 full pages of 16 + 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dit")
    llm = make_tiny_model(root / "llm", hidden_size=64, layers=2, heads=4, kv_heads=2)
    dit = make_tiny_dit(root / "dit", heads=4, kv_heads=2, head_dim=16, layers=2)
    return llm, dit


@pytest.fixture
async def engines(dirs: tuple[Path, Path]) -> AsyncIterator[tuple[TorchEngine, DiTEngine, Any]]:
    """An LLM and a DiT engine over one pool; at teardown nothing is left pinned."""
    pool = TorchEngine.pool(dirs[0], "kv", capacity={"l1": 32, "l2": 0, "l3": 0}, device="cpu")
    llm = TorchEngine(dirs[0], pool=pool, device="cpu")
    dit = DiTEngine(dirs[1], pool=pool, device="cpu", max_batch=4)
    await llm.start()
    await dit.start()
    yield llm, dit, pool
    pool.validate()
    assert pool.stats()["pinned"] == 0, "a finished test left pages pinned"
    await dit.stop()
    await llm.stop()
    await pool.aclose()


def reference(
    dit: DitModel,
    noise: torch.Tensor,
    ctx_k: list[torch.Tensor],
    ctx_v: list[torch.Tensor],
    steps: int,
) -> torch.Tensor:
    """Written apart from DitModel: explicit softmax attention, repeated KV heads, one contiguous
    (ctx_len, kv_heads, head_dim) tensor per layer for the LLM's context."""
    cfg, w = dit.cfg, dit.w

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    x = noise.clone()
    n, rep = x.shape[0], cfg.num_heads // cfg.num_kv_heads
    for s in range(steps):
        t, t2 = 1.0 - s / steps, 1.0 - (s + 1) / steps
        half = cfg.hidden // 2
        f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        temb = torch.cat([torch.cos(t * 1000.0 * f), torch.sin(t * 1000.0 * f)])
        h = x @ w["in_proj.weight"].T + torch.nn.functional.silu(temb) @ w["t_proj.weight"].T
        h = h + w["pos_embed.weight"]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            a = norm(h, w[p + "ln1.weight"])
            q = (a @ w[p + "q.weight"].T).view(n, cfg.num_heads, cfg.head_dim)
            k = torch.cat([ctx_k[i], (a @ w[p + "k.weight"].T).view(n, cfg.num_kv_heads, -1)])
            v = torch.cat([ctx_v[i], (a @ w[p + "v.weight"].T).view(n, cfg.num_kv_heads, -1)])
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim**-0.5
            o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, -1)
            h = h + o @ w[p + "o.weight"].T
            m = norm(h, w[p + "ln2.weight"])
            h = h + torch.nn.functional.gelu(m @ w[p + "up.weight"].T) @ w[p + "down.weight"].T
        x = x + (t2 - t) * (norm(h, w["norm.weight"]) @ w["out_proj.weight"].T)
    return x


def contiguous_kv(llm_dir: Path, ids: list[int], n: int) -> tuple[list[Any], list[Any]]:
    """The LLM's K/V of the first ``n`` positions as one tensor per layer, from a private
    prefill (no pool involved)."""
    llm = load_model(llm_dir, device="cpu", dtype="float32")
    cfg = llm.cfg
    pages = -(-len(ids) // 16)
    layers = range(cfg.num_layers)
    pk = [[torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(pages)] for _ in layers]
    pv = [[torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(pages)] for _ in layers]
    batch = ForwardBatch(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(0, len(ids), pk, pv)])
    llm.forward(batch)
    return [torch.cat(p)[:n].clone() for p in pk], [torch.cat(p)[:n].clone() for p in pv]


def noise_of(seed: int, dit: DitModel) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(dit.cfg.num_tokens, dit.cfg.latent_dim, generator=gen)


async def denoise(dit: DiTEngine, req: DenoiseRequest) -> list[DenoiseOutput]:
    return [out async for out in dit.generate(req)]


def spy_steps(dit: DiTEngine) -> list[list[tuple[str, list[int], list[int]]]]:
    """Per forward pass: (request id, its slots, data_ptr of its layer-0 key page views)."""
    seen: list[list[tuple[str, list[int], list[int]]]] = []
    real = dit._runner.step

    def step(seqs: Any) -> Any:
        views = dit._runner._views
        seen.append(
            [
                (s.request_id, list(s.slots), [t.data_ptr() for t in views[s.request_id][0][0]])
                for s in seqs
            ]
        )
        return real(seqs)

    dit._runner.step = step  # type: ignore[method-assign]
    return seen


async def test_dit_reads_llm_pages_in_place_and_matches_reference(
    dirs: tuple[Path, Path], engines: tuple[TorchEngine, DiTEngine, Any]
) -> None:
    llm, dit, pool = engines
    prefix = await llm.prefill(GenerateRequest(input_ids=PROMPT, session="s"))
    assert prefix.tokens == 32 and len(prefix.hashes) == 2 and prefix.session == "s"
    probe = await pool.match("s", list(prefix.hashes), "probe")
    published = list(probe.slots)
    await pool.release("probe")
    moved = pool.stats()["bytes_moved"]
    seen = spy_steps(dit)

    steps = 6
    outs = await denoise(
        dit, DenoiseRequest(context=prefix.as_dict(), steps=steps, preview_every=2, seed=1)
    )
    assert [(o.step, o.finished) for o in outs] == [(2, False), (4, False), (6, True)]
    assert outs[-1].context_tokens == 32 and outs[-1].finish_reason == "length"
    # the pool moved no byte between the roles, and the DiT's sequence starts with the very
    # pages the LLM published: its views point at those pages of the pool's storage
    assert pool.stats()["bytes_moved"] == moved
    assert len(seen) == steps
    for (_, slots, ptrs), *_ in seen:
        assert slots[:2] == published and len(slots) == 3  # + one own page for 16 image tokens
        assert ptrs[:2] == [pool.view(s, "layer0", "k").data_ptr() for s in published]
    store = pool.storage("layer0", "k")
    lo, hi = store.data_ptr(), store.data_ptr() + store.numel() * store.element_size()
    assert all(lo <= p < hi for p in seen[0][0][2])

    model = dit._runner.model
    ck, cv = contiguous_kv(dirs[0], PROMPT, 32)
    ref = reference(model, noise_of(1, model), ck, cv, steps)
    final = outs[-1].latents
    assert final.dtype == torch.float32
    torch.testing.assert_close(final, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(final, noise_of(1, model))  # it did something
    # the prompt's pages do condition the picture
    blind = (await denoise(dit, DenoiseRequest(steps=steps, seed=1)))[-1].latents
    assert not torch.allclose(blind, final, atol=1e-3)
    empty = [torch.zeros(0, 2, 16)] * 2
    torch.testing.assert_close(
        blind, reference(model, noise_of(1, model), empty, empty, steps), rtol=1e-5, atol=1e-5
    )


async def test_dit_reads_pages_an_engine_process_wrote(dirs: tuple[Path, Path]) -> None:
    """The LLM's forward in a process of its own (executor="process") writes the prompt's KV
    into the shared L1 arrays; the DiT in this process reads those pages in place and gets
    the reference picture."""
    pool = TorchEngine.pool(dirs[0], "kv", capacity={"l1": 32, "l2": 0, "l3": 0}, device="cpu")
    llm = TorchEngine(dirs[0], pool=pool, device="cpu", executor="process")
    dit = DiTEngine(dirs[1], pool=pool, device="cpu", max_batch=4)
    async with llm, dit:
        prefix = await llm.prefill(GenerateRequest(input_ids=PROMPT, session="s"))
        steps = 4
        outs = await denoise(dit, DenoiseRequest(context=prefix, steps=steps, seed=1))
        model = dit._runner.model
        ck, cv = contiguous_kv(dirs[0], PROMPT, 32)
        ref = reference(model, noise_of(1, model), ck, cv, steps)
        torch.testing.assert_close(outs[-1].latents, ref, rtol=1e-5, atol=1e-5)
        assert pool.stats()["pinned"] == 0
    await pool.aclose()


async def test_concurrent_pictures_batch_in_one_loop(
    engines: tuple[TorchEngine, DiTEngine, Any],
) -> None:
    """Three pictures submitted while the engine thread is busy run their steps together, and
    each equals the same picture denoised alone."""
    llm, dit, _ = engines
    a = await llm.prefill(GenerateRequest(input_ids=PROMPT, session="a"))
    b = await llm.prefill(GenerateRequest(input_ids=PROMPT[::-1], session="b"))
    reqs = [
        lambda: DenoiseRequest(context=a, steps=5, preview_every=2, seed=3),
        lambda: DenoiseRequest(context=b, steps=5, seed=4),
        lambda: DenoiseRequest(steps=5, seed=5),
    ]
    alone = [(await denoise(dit, make()))[-1].latents for make in reqs]
    steps_before = dit.statistics()["steps"]
    seen = spy_steps(dit)

    gate = threading.Event()
    assert dit._executor is not None
    blocker = asyncio.get_running_loop().run_in_executor(dit._executor, gate.wait)
    tasks = [asyncio.ensure_future(denoise(dit, make())) for make in reqs]
    while dit.statistics()["running"] + dit.statistics()["waiting"] < 3:
        await asyncio.sleep(0)  # admission is done on the event loop, not by the thread
    gate.set()
    await blocker
    results = await asyncio.gather(*tasks)

    # the step that was planned before the others arrived holds at least one picture; all
    # later steps hold all three until they finish together
    assert dit.statistics()["steps"] - steps_before <= 5 + 1
    assert max(len(step) for step in seen) == 3
    for got, want in zip(results, alone, strict=True):
        torch.testing.assert_close(got[-1].latents, want, rtol=1e-5, atol=1e-5)
    assert [o.step for o in results[0]] == [2, 4, 5]


async def test_leaving_the_iterator_releases_the_pictures_pins(
    engines: tuple[TorchEngine, DiTEngine, Any],
) -> None:
    llm, dit, pool = engines
    prefix = await llm.prefill(GenerateRequest(input_ids=PROMPT, session="s"))
    gen = dit.generate(DenoiseRequest(context=prefix, steps=50, preview_every=1))
    first = await gen.__anext__()
    assert first.step == 1 and pool.stats()["pinned"] > 0
    await gen.aclose()
    assert pool.stats()["pinned"] == 0
    assert dit.statistics()["running"] == 0


async def test_bad_requests_get_typed_actionable_errors(
    engines: tuple[TorchEngine, DiTEngine, Any],
) -> None:
    llm, dit, pool = engines
    with pytest.raises(RequestError, match="steps") as info:
        DenoiseRequest(steps=0)
    assert info.value.field == "steps"
    with pytest.raises(RequestError, match="preview_every"):
        DenoiseRequest(preview_every=-1)
    with pytest.raises(RequestError, match="lacks") as info:
        DenoiseRequest(context={"session": "s"})
    assert info.value.field == "context"
    with pytest.raises(RequestError, match=r"\(16, 8\)") as info:
        await denoise(dit, DenoiseRequest(noise=torch.zeros(3, 3)))
    assert info.value.field == "noise"
    with pytest.raises(RequestError, match="session"):
        await llm.prefill(GenerateRequest(input_ids=PROMPT))
    prefix = await llm.prefill(GenerateRequest(input_ids=PROMPT, session="s"))
    never = PublishedPrefix("other-session", prefix.hashes, prefix.tokens)
    with pytest.raises(EngineError, match="only 0 of the 2 context pages of session"):
        await denoise(dit, DenoiseRequest(context=never))
    odd = PublishedPrefix("s", prefix.hashes, 20)
    with pytest.raises(RequestError, match="16 tokens") as info:
        await denoise(dit, DenoiseRequest(context=odd))
    assert info.value.field == "context.tokens"
    assert pool.stats()["pinned"] == 0


async def test_each_engine_runs_only_its_architecture(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="run it with DiTEngine"):
        await TorchEngine(dirs[1], device="cpu").start()
    with pytest.raises(ModelLoadError, match="run it with TorchEngine"):
        await DiTEngine(dirs[0], device="cpu").start()
    # an architecture nobody claims is left to the loader (TorchEngine reads model_type)
    old = shutil.copytree(dirs[0], tmp_path / "old")
    cfg = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**cfg, "architectures": ["LLaMAForCausalLM"]}))
    async with TorchEngine(old, device="cpu") as engine:
        assert engine.config is not None and engine.config.model_type == "llama"
    with pytest.raises(EngineError, match="not started"):
        await denoise(DiTEngine(dirs[1]), DenoiseRequest())
    assert of.DiTEngine is DiTEngine


def test_dit_config_must_name_the_architecture(tmp_path: Path) -> None:
    root = make_tiny_dit(tmp_path / "d", heads=2, kv_heads=1, head_dim=8, layers=1)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ModelLoadError, match="OmniflowDiT"):
        load_dit(root)
    root = make_tiny_dit(tmp_path / "e", heads=2, kv_heads=1, head_dim=8, layers=1)
    (root / "config.json").write_text('{"architectures": ["OmniflowDiT"], "latent_dim": 8}')
    with pytest.raises(ModelLoadError, match="missing field 'num_tokens'"):
        load_dit(root)


def test_every_dit_tensor_is_used_or_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from omniflow.compute._bytes import save_safetensors

    root = make_tiny_dit(tmp_path / "d", heads=2, kv_heads=1, head_dim=8, layers=1)
    weights = load_file(str(root / "model.safetensors"))
    load_dit(root)  # exactly what it reads
    save_safetensors(
        {**weights, "layers.1.q.weight": torch.zeros(16, 16)}, root / "model.safetensors"
    )
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor layers\.1\.q\.weight: OmniflowDiT"
    ):
        load_dit(root)


async def test_private_pool_denoises_unconditioned(dirs: tuple[Path, Path]) -> None:
    async with DiTEngine(dirs[1], device="cpu", pool_pages=4) as dit:
        outs = await denoise(dit, DenoiseRequest(steps=3, seed=2))
        assert outs[-1].finished and outs[-1].context_tokens == 0
        assert dit.kv_pool is not None and dit.kv_pool.stats()["pinned"] == 0


async def test_pictures_a_private_pool_cannot_hold_together_wait_their_turn(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Pool I/O the scheduler planned: with room for one picture's pages at a time the others
    wait (never more pages pinned than the pool's size) and each equals the picture denoised
    alone; a picture the pool cannot hold even alone fails with an error saying what to do."""
    reqs = [lambda i=i: DenoiseRequest(steps=2, seed=i, preview_every=1) for i in range(3)]
    async with DiTEngine(dirs[1], device="cpu", pool_pages=4) as roomy:
        alone = [(await denoise(roomy, make()))[-1].latents for make in reqs]
    async with DiTEngine(dirs[1], device="cpu", pool_pages=1, max_batch=4) as dit:
        seen = spy_steps(dit)
        outs = await asyncio.gather(*(denoise(dit, make()) for make in reqs))
        assert max(len(step) for step in seen) == 1  # one picture's page at a time
        assert dit._sched.held == 0 and dit.kv_pool is not None
        assert dit.kv_pool.stats()["pinned"] == 0
    for got, want in zip(outs, alone, strict=True):
        assert torch.equal(got[-1].latents, want)
    big = make_tiny_dit(tmp_path / "d40", heads=4, kv_heads=2, head_dim=16, layers=2, num_tokens=40)
    async with DiTEngine(big, device="cpu", pool_pages=2) as dit:
        with pytest.raises(
            EngineError, match=r"40 image tokens \(3 pages\).*even alone \("
        ) as info:
            await denoise(dit, DenoiseRequest(steps=2, request_id="big"))
        assert "'big'" in str(info.value) and "budget is 2" in str(info.value)


async def test_paged_views_and_the_grouped_attention_agree(
    engines: tuple[TorchEngine, DiTEngine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages in the pool's L1 arrays take the one-SDPA grouped path; without a block table the
    per-picture view path runs. Both give the same picture."""
    llm, dit, _ = engines
    prefix = await llm.prefill(GenerateRequest(input_ids=PROMPT, session="s"))
    grouped: list[int] = []
    real = _PictureGroup.attend

    def attend(self: _PictureGroup, *args: Any) -> torch.Tensor:
        grouped.append(self.size)
        return real(self, *args)

    monkeypatch.setattr(_PictureGroup, "attend", attend)
    req = lambda: DenoiseRequest(context=prefix, steps=3, seed=9)  # noqa: E731
    fast = (await denoise(dit, req()))[-1].latents
    assert grouped
    grouped.clear()
    monkeypatch.setattr(dit._runner, "_stores", None)  # as if a page were not a local L1 page
    slow = (await denoise(dit, req()))[-1].latents
    assert not grouped
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


async def test_garbage_in_fresh_pool_memory_never_reaches_a_picture(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """20 image tokens leave 12 unwritten positions in the picture's second page, which the
    grouped attention gathers (masked): poison the whole pool with NaN first."""
    dit_dir = make_tiny_dit(
        tmp_path / "d20", heads=4, kv_heads=2, head_dim=16, layers=2, num_tokens=20
    )
    pool = TorchEngine.pool(dirs[0], "kv", capacity={"l1": 16, "l2": 0, "l3": 0}, device="cpu")
    await pool.open()
    for layer in ("layer0", "layer1"):
        for sl in ("k", "v"):
            pool.storage(layer, sl).fill_(float("nan"))
    llm = TorchEngine(dirs[0], pool=pool, device="cpu")
    dit = DiTEngine(dit_dir, pool=pool, device="cpu")
    async with llm, dit:
        prefix = await llm.prefill(GenerateRequest(input_ids=PROMPT, session="s"))
        outs = await asyncio.gather(
            *(denoise(dit, DenoiseRequest(context=prefix, steps=3, seed=i)) for i in (1, 2))
        )
    model = load_dit(dit_dir)
    ck, cv = contiguous_kv(dirs[0], PROMPT, 32)
    for i, out in zip((1, 2), outs, strict=True):
        assert torch.isfinite(out[-1].latents).all()
        ref = reference(model, noise_of(i, model), ck, cv, 3)
        torch.testing.assert_close(out[-1].latents, ref, rtol=1e-5, atol=1e-5)
    await pool.aclose()
