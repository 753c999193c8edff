"""The DiT reads the LLM's KV pages straight from the pool and matches a contiguous reference."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from omniflow.compute import ModelLoadError
from omniflow.compute._dit import DitModel, load_dit, make_tiny_dit
from omniflow.compute._kv import layer_names
from omniflow.compute._loader import load_model
from omniflow.compute._model import ForwardBatch, SeqSlice
from omniflow.compute._pool import pool_for
from omniflow.compute._tiny import make_tiny_model
from omniflow.data.kv import chain_hashes

pytestmark = pytest.mark.timeout(300)


def _reference(
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


@pytest.mark.slow
def test_dit_reads_llm_pages_in_place_and_matches_reference(tmp_path: Path) -> None:
    llm_dir = make_tiny_model(tmp_path / "llm", hidden_size=64, layers=2, heads=4, kv_heads=2)
    llm = load_model(llm_dir, device="cpu", dtype="float32")
    cfg = llm.cfg
    dit = load_dit(
        make_tiny_dit(
            tmp_path / "dit",
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            layers=cfg.num_layers,
        )
    )
    prompt = [(7 * i + 3) % 300 + 5 for i in range(40)]  # 40 tokens: 2.5 pages of 16
    names = layer_names(cfg.num_layers)
    steps = 6
    noise = torch.randn(
        dit.cfg.num_tokens, dit.cfg.latent_dim, generator=torch.Generator().manual_seed(1)
    )

    async def go() -> tuple[torch.Tensor, torch.Tensor]:
        pool = pool_for(cfg, "kv", capacity={"l1": 8, "l2": 0, "l3": 0})
        await pool.open()
        # the LLM role: prefill into pool pages, publish them
        slots = await pool.alloc("llm-call", 3)
        kp = [[pool.view(s, n, "k") for s in slots] for n in names]
        vp = [[pool.view(s, n, "v") for s in slots] for n in names]
        ids = torch.tensor(prompt)
        llm.forward(
            ForwardBatch(ids, torch.arange(len(prompt)), [SeqSlice(0, len(prompt), kp, vp)])
        )
        pages = [prompt[i : i + 16] for i in range(0, 32, 16)]  # full pages only
        hashes = chain_hashes(pages)
        await pool.publish("s", hashes, slots[:2])
        moved = pool.stats()["bytes_moved"]
        # the DiT role: match the session's chain, read the pages where they are
        m = await pool.match("s", hashes, "dit-call")
        assert m.pages == 2 and list(m.slots) == slots[:2]
        dk = [[pool.view(s, n, "k") for s in m.slots] for n in names]
        dv = [[pool.view(s, n, "v") for s in m.slots] for n in names]
        store = pool.storage(names[0], "k")
        lo, hi = store.data_ptr(), store.data_ptr() + store.numel() * store.element_size()
        assert all(lo <= t.data_ptr() < hi for t in dk[0])  # views of the pool, not copies
        out, previews = dit.denoise(noise, dk, dv, 32, steps, every=2)
        assert pool.stats()["bytes_moved"] == moved  # nothing moved between the roles
        assert len(previews) == 2
        blind, _ = dit.denoise(noise, dk, dv, 0, steps)
        assert not torch.allclose(blind, out)  # the prompt's pages do condition the output
        await pool.release("dit-call")
        await pool.release("llm-call")
        await pool.aclose()
        # the reference gets the same context as one contiguous tensor, from a private prefill
        pk = [[torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(3)] for _ in names]
        pv = [[torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(3)] for _ in names]
        llm.forward(
            ForwardBatch(ids, torch.arange(len(prompt)), [SeqSlice(0, len(prompt), pk, pv)])
        )
        ck = [torch.cat(p)[:32].clone() for p in pk]
        assert all(c.abs().sum() > 0 for c in ck)
        cv = [torch.cat(p)[:32].clone() for p in pv]
        return out, _reference(dit, noise, ck, cv, steps)

    out, ref = asyncio.run(go())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, noise)  # it did something


def test_dit_config_must_name_the_architecture(tmp_path: Path) -> None:
    root = make_tiny_dit(tmp_path / "d", heads=2, kv_heads=1, head_dim=8, layers=1)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ModelLoadError, match="OmniflowDiT"):
        load_dit(root)
