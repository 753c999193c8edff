"""A diffusion transformer whose attention reads the LLM's KV pages in place (paper §5.3).

>>> # model = load_dit("ckpt/dit"); v = model.forward(batch)   # one denoising step, batched

Unified models (HunyuanImage-3, BAGEL) condition image generation on the LLM's context: DiT layer
``i`` attends jointly over the LLM's keys/values of layer ``i`` for the prompt and over its own
image tokens. Here a picture being denoised is a *sequence* like the LLM's: its first pages are
the pool pages the LLM's prefill wrote (matched, not copied), then pages of its own for its
``num_tokens`` image tokens. One step is one forward pass over a ``ForwardBatch`` of such
sequences — the image latents and timesteps ride as its ``extra`` fields — through the same paged
attention as the LLM (``_model._write_pages`` writes the image tokens' K/V into their pages,
``_read_store``/``_read_pages`` read context + image K/V back, SDPA attends; image tokens see
each other bidirectionally). Nothing is serialized or copied between the roles. Heads, KV heads,
head size and layer count match the LLM's (they share the pool layout). ``DiTEngine``
(``_dit_engine``) batches the steps of concurrent pictures; the sampler is Euler on a velocity
field, ``x <- x + (t_next - t) * v(x, t)``.

Checkpoints are safetensors directories whose ``config.json`` says
``"architectures": ["OmniflowDiT"]``; ``make_tiny_dit`` writes random-init ones for tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from omniflow.compute._config import read_config_json
from omniflow.compute._errors import ModelLoadError
from omniflow.compute._loader import checkpoint_mismatch, load_checkpoint
from omniflow.compute._model import (
    ForwardBatch,
    PagedGroup,
    SeqSlice,
    attend_one,
    paged_kv,
    rms_norm,
)

__all__ = [
    "ARCH",
    "DitConfig",
    "DitModel",
    "dit_tensor_names",
    "load_dit",
    "make_tiny_dit",
    "timestep_embedding",
]

ARCH = "OmniflowDiT"


@dataclass(frozen=True, slots=True)
class DitConfig:
    """The DiT's shape; ``num_layers``/``num_kv_heads``/``head_dim`` match the LLM's."""

    latent_dim: int  #: channels per image token (patch)
    num_tokens: int  #: image tokens per picture
    num_layers: int  #: one per LLM layer: layer i attends over the LLM's layer-i K/V
    num_heads: int  #: query heads
    num_kv_heads: int  #: key/value heads (the LLM's)
    head_dim: int  #: per-head width (the LLM's)
    intermediate_size: int  #: MLP width
    rms_norm_eps: float = 1e-6  #: RMSNorm epsilon
    torch_dtype: str | None = None  #: the dtype the checkpoint was saved in

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: Path) -> DitConfig:
        cfg_path = path / "config.json"
        raw = read_config_json(path)
        if ARCH not in raw.get("architectures", []):
            raise ModelLoadError(
                f"{cfg_path}: architectures {raw.get('architectures')!r} does not name {ARCH!r}; "
                "this loader reads omniflow DiT checkpoints only",
                path=str(cfg_path),
            )
        known = fields(cls)
        missing = [f.name for f in known if f.default is MISSING and f.name not in raw]
        if missing:
            raise ModelLoadError(f"{cfg_path}: missing field {missing[0]!r}", path=str(cfg_path))
        return cls(**{f.name: raw[f.name] for f in known if f.name in raw})


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of timesteps in [0, 1]: (T,) -> float32 (T, dim)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    )
    ang = t.to(torch.float32)[:, None] * 1000.0 * freqs[None, :]
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)


class DitModel:
    """Weights and the velocity field over paged context; pure compute over the pages it is
    handed (like ``LlamaModel``)."""

    def __init__(self, cfg: DitConfig, w: dict[str, torch.Tensor], device: torch.device) -> None:
        self.cfg = cfg  #: the model's shape
        self.w = w  #: tensors by checkpoint name
        self.device = device  #: where weights and activations live
        self.dtype = w["in_proj.weight"].dtype  #: compute dtype
        self.scale = cfg.head_dim**-0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """v(x, t) (T, latent_dim) for every image token of the batch.

        ``batch.extra["latents"]`` (T, latent_dim) and ``batch.extra["timesteps"]`` (T,) give
        each row's latent and its picture's timestep; each ``SeqSlice`` is one picture: its
        context (``start`` positions in its first pages) and ``q_len == num_tokens`` image rows
        whose K/V go into the pages after the context."""
        cfg, w = self.cfg, self.w
        x = batch.extra["latents"].to(self.dtype)
        temb = timestep_embedding(batch.extra["timesteps"], cfg.hidden).to(self.dtype)
        index = torch.cat([torch.arange(s.q_len, device=x.device) for s in batch.seqs])
        h = (
            F.linear(x, w["in_proj.weight"])
            + F.linear(F.silu(temb), w["t_proj.weight"])
            + w["pos_embed.weight"][index]
        )
        group = _PictureGroup.build(batch.seqs)
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            a = rms_norm(h, w[p + "ln1.weight"], cfg.rms_norm_eps)
            q = F.linear(a, w[p + "q.weight"]).view(-1, cfg.num_heads, cfg.head_dim)
            k = F.linear(a, w[p + "k.weight"]).view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(a, w[p + "v.weight"]).view(-1, cfg.num_kv_heads, cfg.head_dim)
            attn = (
                group.attend(i, q, k, v, self.scale)
                if group is not None
                else self._attention(i, q, k, v, batch.seqs)
            )
            h = h + F.linear(attn, w[p + "o.weight"])
            m = rms_norm(h, w[p + "ln2.weight"], cfg.rms_norm_eps)
            h = h + F.linear(F.gelu(F.linear(m, w[p + "up.weight"])), w[p + "down.weight"])
        return F.linear(rms_norm(h, w["norm.weight"], cfg.rms_norm_eps), w["out_proj.weight"])

    def _attention(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: list[SeqSlice]
    ) -> torch.Tensor:
        """Per picture: write its image K/V after the context, read context + image K/V from
        the pages (the LLM's paged read), attend without a mask (bidirectional). Used when some
        page is not a local L1 page (no block table); ``_PictureGroup`` otherwise."""
        outs: list[torch.Tensor] = []
        row = 0
        for s in seqs:
            rows = slice(row, row + s.q_len)
            keys, values = paged_kv(s, li, k[rows], v[rows])
            outs.append(attend_one(q[rows], keys, values, self.scale))
            row += s.q_len
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class _PictureGroup(PagedGroup):
    """Every picture of a step whose pages sit in the pool's L1 arrays, attended as one padded
    batch (as the LLM's ``_DecodeGroup`` does for decode steps): the image tokens' K/V go into
    their pages with one indexed store, each picture's context + image K/V are gathered with one
    ``index_select`` over a padded page table, and one SDPA call masks each picture to its own
    length. All pictures of a DiT have the same ``num_tokens``."""

    __slots__ = ("tokens",)

    def __init__(
        self,
        stores: list[tuple[torch.Tensor, torch.Tensor]],
        size: int,
        tokens: int,
        pages: torch.Tensor,
        offs: torch.Tensor,
        table: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        super().__init__(stores, size, pages, offs, table, mask)
        self.tokens = tokens  #: image tokens per picture

    @classmethod
    def build(cls, seqs: list[SeqSlice]) -> _PictureGroup | None:
        if not seqs or any(s.stores is None or s.block is None for s in seqs):
            return None
        stores = seqs[0].stores
        assert stores is not None
        tokens = seqs[0].q_len
        if any(s.q_len != tokens for s in seqs):
            return None
        page_tokens = stores[0][0].shape[1]
        blocks = [s.block[: -(-s.ctx_len // page_tokens)] for s in seqs if s.block is not None]
        width = max(b.shape[0] for b in blocks)
        # pad with the picture's own first page: written, finite data (masked out anyway; an
        # unwritten page could hold NaN bit patterns, and 0 * NaN poisons the softmax sum)
        table = torch.stack([F.pad(b, (0, width - b.shape[0]), value=int(b[0])) for b in blocks])
        device = table.device
        pos = torch.cat([torch.arange(s.start, s.ctx_len, device=device) for s in seqs])
        rows = torch.arange(len(seqs), device=device).repeat_interleave(tokens)
        pages = table[rows, pos // page_tokens]
        lens = torch.tensor([s.ctx_len for s in seqs], device=device)
        mask = torch.arange(width * page_tokens, device=device)[None, :] < lens[:, None]
        return cls(stores, len(seqs), tokens, pages, pos % page_tokens, table, mask[:, None, None])

    def attend(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        keys, values = self.store_and_gather(li, k, v)
        b, n = self.size, self.tokens
        qs = q.view(b, n, *q.shape[1:]).transpose(1, 2)  # (B, heads, n, d)
        o = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(b * n, -1)


def dit_tensor_names(cfg: DitConfig) -> list[str]:
    """Every tensor a checkpoint of ``cfg`` must hold."""
    need = ["in_proj.weight", "t_proj.weight", "pos_embed.weight", "norm.weight", "out_proj.weight"]
    for i in range(cfg.num_layers):
        need += [f"layers.{i}.{n}.weight" for n in ("ln1", "q", "k", "v", "o", "ln2", "up", "down")]
    return need


def load_dit(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    share: bool = False,
) -> DitModel:
    """Read a DiT checkpoint directory (config naming ``OmniflowDiT`` + safetensors; ``share``:
    the node's one copy of the weights)."""
    root = Path(path)
    cfg = DitConfig.from_dir(root)
    dev, weights = load_checkpoint(root, cfg, device, dtype, share=share)
    names = dit_tensor_names(cfg)
    missing = [n for n in names if n not in weights]
    if missing:
        raise checkpoint_mismatch(root, f"no tensor for {missing[:6]}", f"{cfg.num_layers} layers")
    unexpected = sorted(set(weights) - set(names))
    if unexpected:  # never dropped: a tensor the forward pass does not read is refused
        raise ModelLoadError(
            f"{root}: unexpected tensor {unexpected[0]}: OmniflowDiT ({cfg.num_layers} layers) "
            f"has no such tensor ({len(unexpected)} unexpected in all)",
            path=str(root),
            tensor=unexpected[0],
        )
    return DitModel(cfg, weights, dev)


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
    from omniflow.compute._bytes import save_safetensors

    cfg = DitConfig(latent_dim, num_tokens, layers, heads, kv_heads, head_dim, 4 * heads * head_dim)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    gen = torch.Generator().manual_seed(seed)
    hid = cfg.hidden

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    w = {
        "in_proj.weight": rnd(hid, latent_dim),
        "t_proj.weight": rnd(hid, hid),
        "pos_embed.weight": rnd(num_tokens, hid),
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
    save_safetensors(w, root / "model.safetensors")
    conf = {
        "architectures": [ARCH],
        "model_type": "omniflow_dit",
        **{f.name: getattr(cfg, f.name) for f in fields(DitConfig) if f.name != "torch_dtype"},
        "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(conf, indent=2))
    return root
