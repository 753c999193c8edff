"""A diffusion transformer whose attention reads the LLM's KV pages in place (paper §5.3).

>>> # dit = load_dit("ckpt/dit"); x = dit.denoise(noise, k_pages, v_pages, ctx_len, steps=8)

Unified models (HunyuanImage-3, BAGEL) condition image generation on the LLM's context: DiT layer
``i`` attends jointly over the LLM's keys/values of layer ``i`` for the prompt and over its own
image tokens. Here the prompt's keys/values are the pool pages the LLM prefill wrote: the DiT is
handed the page *views* (``ParamsPool.view``: zero-copy tensors over the pool's storage) and reads
them with the same paged read the LLM's attention uses (``_model._read_pages``) — nothing is
serialized or copied between the roles' pools. Heads and head size must match the LLM's (they
share the pool layout). Each denoising step is one pass of the image tokens (a sequence of
``num_tokens`` rows, bidirectional among themselves) with the timestep as an extra input; the
sampler is Euler on a velocity field, ``x <- x + (t_next - t) * v(x, t)``.

Checkpoints are safetensors directories whose ``config.json`` says
``"architectures": ["OmniflowDiT"]``; ``make_tiny_dit`` writes random-init ones for tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from omniflow.compute._errors import ModelLoadError
from omniflow.compute._loader import load_weights
from omniflow.compute._model import _read_pages, rms_norm

__all__ = ["ARCH", "DitConfig", "DitModel", "load_dit", "make_tiny_dit", "timestep_embedding"]

ARCH = "OmniflowDiT"


@dataclass(frozen=True, slots=True)
class DitConfig:
    """The DiT's shape; ``num_heads``/``num_kv_heads``/``head_dim`` match the LLM's."""

    latent_dim: int  #: channels per image token (patch)
    num_tokens: int  #: image tokens per picture
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: Path) -> DitConfig:
        cfg_path = path / "config.json"
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {cfg_path}: {exc}", path=str(cfg_path)) from exc
        if ARCH not in raw.get("architectures", []):
            raise ModelLoadError(
                f"{cfg_path}: architectures {raw.get('architectures')!r} does not name {ARCH!r}; "
                "this loader reads omniflow DiT checkpoints only",
                path=str(cfg_path),
            )
        fields = cls.__dataclass_fields__
        try:
            return cls(**{k: raw[k] for k in fields if k in raw or k != "rms_norm_eps"})
        except KeyError as exc:
            raise ModelLoadError(
                f"{cfg_path}: missing field {exc.args[0]!r}", path=str(cfg_path)
            ) from exc


def timestep_embedding(t: float, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of a scalar timestep in [0, 1], float32 (dim,)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    ang = t * 1000.0 * freqs
    return torch.cat([torch.cos(ang), torch.sin(ang)])


class DitModel:
    """Weights and the denoising loop; pure compute over the pages it is handed."""

    def __init__(self, cfg: DitConfig, w: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = w
        self.scale = cfg.head_dim**-0.5

    def velocity(
        self,
        x: torch.Tensor,
        t: float,
        k_pages: list[list[torch.Tensor]],
        v_pages: list[list[torch.Tensor]],
        ctx_len: int,
    ) -> torch.Tensor:
        """v(x, t) for latents ``x`` (num_tokens, latent_dim) conditioned on the pages."""
        cfg, w = self.cfg, self.w
        temb = timestep_embedding(t, cfg.hidden).to(x.dtype)
        h = F.linear(x, w["in_proj.weight"]) + F.linear(F.silu(temb), w["t_proj.weight"])
        n = x.shape[0]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            a = rms_norm(h, w[p + "ln1.weight"], cfg.rms_norm_eps)
            q = F.linear(a, w[p + "q.weight"]).view(n, cfg.num_heads, cfg.head_dim)
            k = F.linear(a, w[p + "k.weight"]).view(n, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(a, w[p + "v.weight"]).view(n, cfg.num_kv_heads, cfg.head_dim)
            keys = torch.cat([_read_pages(k_pages[i], ctx_len), k]) if ctx_len else k
            vals = torch.cat([_read_pages(v_pages[i], ctx_len), v]) if ctx_len else v
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
                vals.to(q.dtype).transpose(0, 1).unsqueeze(0),
                scale=self.scale,
                enable_gqa=True,
            )
            h = h + F.linear(o.squeeze(0).transpose(0, 1).reshape(n, -1), w[p + "o.weight"])
            m = rms_norm(h, w[p + "ln2.weight"], cfg.rms_norm_eps)
            h = h + F.linear(F.gelu(F.linear(m, w[p + "up.weight"])), w[p + "down.weight"])
        return F.linear(rms_norm(h, w["norm.weight"], cfg.rms_norm_eps), w["out_proj.weight"])

    @torch.inference_mode()
    def denoise(
        self,
        noise: torch.Tensor,
        k_pages: list[list[torch.Tensor]],
        v_pages: list[list[torch.Tensor]],
        ctx_len: int,
        steps: int,
        every: int = 0,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``steps`` Euler steps from t=1 (noise) to t=0; with ``every`` > 0 also the latents
        after every ``every``-th step (preview frames)."""
        x = noise.clone()
        previews: list[torch.Tensor] = []
        for s in range(steps):
            t, t_next = 1.0 - s / steps, 1.0 - (s + 1) / steps
            x = x + (t_next - t) * self.velocity(x, t, k_pages, v_pages, ctx_len)
            if every and (s + 1) % every == 0 and s + 1 < steps:
                previews.append(x.clone())
        return x, previews


def load_dit(path: str | Path, dtype: torch.dtype = torch.float32) -> DitModel:
    """Read a DiT checkpoint directory (config naming ``OmniflowDiT`` + safetensors)."""
    root = Path(path)
    cfg = DitConfig.from_dir(root)
    weights = load_weights(root, torch.device("cpu"), dtype)
    need = ["in_proj.weight", "t_proj.weight", "norm.weight", "out_proj.weight"]
    for i in range(cfg.num_layers):
        need += [f"layers.{i}.{n}.weight" for n in ("ln1", "q", "k", "v", "o", "ln2", "up", "down")]
    missing = [n for n in need if n not in weights]
    if missing:
        raise ModelLoadError(f"{root}: no tensor for {missing[:6]}", path=str(root))
    return DitModel(cfg, weights)


def make_tiny_dit(
    out: str | Path,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    layers: int,
    latent_dim: int = 8,
    num_tokens: int = 16,
    seed: int = 0,
) -> Path:
    """Write a random-init DiT whose attention fits an LLM with those heads/head_dim/layers."""
    from safetensors.torch import save_file

    cfg = DitConfig(latent_dim, num_tokens, layers, heads, kv_heads, head_dim, 4 * heads * head_dim)
    gen = torch.Generator().manual_seed(seed)
    hid = cfg.hidden

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    w = {
        "in_proj.weight": rnd(hid, latent_dim),
        "t_proj.weight": rnd(hid, hid),
        "norm.weight": torch.ones(hid),
        "out_proj.weight": rnd(latent_dim, hid),
    }
    kvd = kv_heads * head_dim
    for i in range(layers):
        p = f"layers.{i}."
        w |= {
            p + "ln1.weight": torch.ones(hid),
            p + "ln2.weight": torch.ones(hid),
            p + "q.weight": rnd(hid, hid),
            p + "k.weight": rnd(kvd, hid),
            p + "v.weight": rnd(kvd, hid),
            p + "o.weight": rnd(hid, hid),
            p + "up.weight": rnd(cfg.intermediate_size, hid),
            p + "down.weight": rnd(hid, cfg.intermediate_size),
        }
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    save_file(w, str(root / "model.safetensors"))
    conf = {
        "architectures": [ARCH],
        "model_type": "omniflow_dit",
        **{k: getattr(cfg, k) for k in DitConfig.__dataclass_fields__},
    }
    (root / "config.json").write_text(json.dumps(conf, indent=2))
    return root
