"""The Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

>>> # model = LlamaModel(cfg, weights, device, dtype); logits = model.forward(batch)

One forward pass takes a *flattened* batch: the new tokens of every scheduled sequence laid end to
end (decode steps contribute one token, prefill chunks many), their absolute positions, and per
sequence the KV pages of every layer. Each layer writes the new tokens' keys and values into those
pages, then attends over the pages (the cached prefix plus what was just written). The model knows
nothing of pools or schedulers: it computes and writes into the pages it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from omniflow.compute._config import ModelConfig
from omniflow.compute._rope import (
    RotaryEmbedding,
    apply_rotary,
    attention_scaling,
    inv_frequencies,
)

__all__ = ["ForwardBatch", "LlamaModel", "SeqSlice"]


@dataclass(slots=True)
class SeqSlice:
    """One sequence's share of a forward batch."""

    start: int  #: tokens already in the KV pages (the cached/computed prefix)
    q_len: int  #: new tokens this step (1 for decode)
    k_pages: list[
        list[torch.Tensor]
    ]  #: per layer, the page views (page_tokens, kv_heads, head_dim)
    v_pages: list[list[torch.Tensor]]  #: same for values
    want_logits: bool = True  #: False for a prefill chunk that is not the prompt's last
    #: per layer, the pool's whole L1 (keys, values) arrays when the pages are local, so the
    #: context is read with one ``index_select`` over ``block`` instead of a concatenation
    stores: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    block: torch.Tensor | None = None  #: L1 indices of the pages, in chain order
    block_ids: list[int] | None = None  #: the same as Python ints (decode tables are built
    #: from these with one tensor per step instead of a pad per sequence)

    @property
    def ctx_len(self) -> int:
        return self.start + self.q_len


@dataclass(slots=True)
class ForwardBatch:
    """The flattened inputs of one step."""

    input_ids: torch.Tensor  #: (T,) token ids; rows replaced by ``embeds`` are ignored
    positions: torch.Tensor  #: (T,) absolute positions
    seqs: list[SeqSlice]  #: in the order their tokens appear in input_ids
    embeds: torch.Tensor | None = None  #: (E, hidden) rows to place at ``embed_rows``
    embed_rows: torch.Tensor | None = None  #: (E,) indices into the T flattened tokens
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  #: reserved for model I/O keys


class _Layer:
    """One decoder layer's tensors; a bias is None where the architecture has none."""

    __slots__ = (
        "down", "down_b", "gate", "gate_b", "k", "k_b", "ln1", "ln2", "o", "o_b", "q", "q_b",
        "up", "up_b", "v", "v_b",
    )  # fmt: skip

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig) -> None:
        a, m = prefix + "self_attn.", prefix + "mlp."

        def linear(name: str, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
            return w[name + ".weight"], w[name + ".bias"] if bias else None

        self.q, self.q_b = linear(a + "q_proj", cfg.attention_bias)
        self.k, self.k_b = linear(a + "k_proj", cfg.attention_bias)
        self.v, self.v_b = linear(a + "v_proj", cfg.attention_bias)
        self.o, self.o_b = linear(a + "o_proj", cfg.o_bias)
        self.gate, self.gate_b = linear(m + "gate_proj", cfg.mlp_bias)
        self.up, self.up_b = linear(m + "up_proj", cfg.mlp_bias)
        self.down, self.down_b = linear(m + "down_proj", cfg.mlp_bias)
        self.ln1 = w[prefix + "input_layernorm.weight"]
        self.ln2 = w[prefix + "post_attention_layernorm.weight"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight (as the reference does)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class LlamaModel:
    """Weights of a Llama-family decoder and its forward pass over paged KV.

    ``weights`` must hold what ``_weights.expected_tensors(cfg)`` lists (``load_model``
    checks that first); every tensor listed is used."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device
    ) -> None:
        self.cfg = cfg  #: the model's shape
        self.device = device  #: where weights and activations live
        self.embed = weights["model.embed_tokens.weight"]  #: (vocab, hidden)
        #: (vocab, hidden) output head: the embedding itself when tied
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]  #: final RMSNorm
        self.layers = [_Layer(weights, f"model.layers.{i}.", cfg) for i in range(cfg.num_layers)]
        self.dtype = self.embed.dtype  #: compute dtype (float32, bfloat16, float16)
        inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_params)
        scaling = attention_scaling(cfg.rope_type, cfg.rope_params)
        self.rope = RotaryEmbedding(inv.to(device), scaling)
        self.scale = cfg.head_dim**-0.5
        #: each layer's sliding window (None: full attention)
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; returns float32 logits (N, vocab) for the sequences that want them."""
        cfg = self.cfg
        h = F.embedding(batch.input_ids, self.embed)
        if batch.embeds is not None and batch.embed_rows is not None:
            h[batch.embed_rows] = batch.embeds.to(h.dtype)
        cos, sin = self.rope(batch.positions, h.dtype)
        # masks and the decode group per distinct window (Qwen2 may mix full and sliding)
        plans = {
            w: ([_mask(s, w, h.device) for s in batch.seqs], _DecodeGroup.build(batch.seqs, w))
            for w in set(self.windows)
        }
        for li, layer in enumerate(self.layers):
            masks, decode = plans[self.windows[li]]
            x = rms_norm(h, layer.ln1, cfg.rms_norm_eps)
            q = F.linear(x, layer.q, layer.q_b).view(-1, cfg.num_heads, cfg.head_dim)
            k = F.linear(x, layer.k, layer.k_b).view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(x, layer.v, layer.v_b).view(-1, cfg.num_kv_heads, cfg.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            attn = self._attention(li, q, k, v, batch.seqs, masks, decode)
            h = h + F.linear(attn, layer.o, layer.o_b)
            x = rms_norm(h, layer.ln2, cfg.rms_norm_eps)
            gate = F.silu(F.linear(x, layer.gate, layer.gate_b))
            h = h + F.linear(gate * F.linear(x, layer.up, layer.up_b), layer.down, layer.down_b)
        last = _last_rows(batch.seqs, h.device)
        out = rms_norm(h[last], self.norm, cfg.rms_norm_eps)
        return F.linear(out, self.lm_head).float()

    def _attention(
        self,
        li: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqs: list[SeqSlice],
        masks: list[torch.Tensor | None],
        decode: _DecodeGroup | None,
    ) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        row = 0
        if decode is not None:  # the leading decode steps, as one batched attention
            outs.append(
                decode.attend(li, q[: decode.size], k[: decode.size], v[: decode.size], self.scale)
            )
            row = decode.size
        for s, mask in zip(seqs[row:], masks[row:], strict=True):
            rows = slice(row, row + s.q_len)
            keys, values = paged_kv(s, li, k[rows], v[rows], new_only=s.start == 0)
            causal = mask is None and s.q_len > 1
            outs.append(attend_one(q[rows], keys, values, self.scale, mask=mask, causal=causal))
            row += s.q_len
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class PagedGroup:
    """Sequences of a step whose pages all sit in the pool's L1 arrays, attended as one padded
    batch: the new K/V go into their pages with one indexed store, every member's pages are
    gathered with one ``index_select`` over a padded page table, and the caller's one SDPA call
    masks each member to its own positions (``_DecodeGroup`` here, ``_dit._PictureGroup``)."""

    __slots__ = ("mask", "offs", "pages", "size", "stores", "table")

    def __init__(
        self,
        stores: list[tuple[torch.Tensor, torch.Tensor]],
        size: int,
        pages: torch.Tensor,
        offs: torch.Tensor,
        table: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        self.stores = stores  #: per layer the pool's L1 (k, v) arrays
        self.size = size  #: members of the group
        self.pages = pages  #: (new rows,) L1 page each new row's K/V is written to
        self.offs = offs  #: (new rows,) offset in that page
        self.table = table  #: (B, max_pages) L1 pages of each member, padded
        self.mask = mask  #: (B, 1, 1, max_pages * page_tokens) which positions each attends

    def store_and_gather(
        self, li: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new rows' K/V of layer ``li`` at ``(pages, offs)``; every member's keys and
        values as (B, kv_heads, max_pages * page_tokens, d)."""
        k_store, v_store = self.stores[li]
        k_store[self.pages, self.offs] = k
        v_store[self.pages, self.offs] = v
        flat, shape = self.table.flatten(), (self.size, -1, *k_store.shape[2:])
        keys = k_store.index_select(0, flat).view(shape).transpose(1, 2)
        values = v_store.index_select(0, flat).view(shape).transpose(1, 2)
        return keys, values


class _DecodeGroup(PagedGroup):
    """The leading one-token steps of a batch whose pages sit in the pool's L1 arrays: their
    KV is written with one indexed store and read with one gather, and attention runs as one
    padded batch (the per-layer cost no longer grows with a Python loop over sequences)."""

    __slots__ = ()

    @classmethod
    def build(cls, seqs: list[SeqSlice], window: int | None) -> _DecodeGroup | None:
        group: list[SeqSlice] = []
        for s in seqs:
            if s.q_len != 1 or s.start == 0 or s.stores is None or s.block is None:
                break
            group.append(s)
        if len(group) < 2:
            return None
        stores = group[0].stores
        assert stores is not None
        page_tokens = stores[0][0].shape[1]
        used = [-(-s.ctx_len // page_tokens) for s in group]
        width = max(used)
        # pad with the sequence's own first page: written, finite data (masked out anyway;
        # an unwritten page could hold NaN bit patterns, and 0 * NaN poisons the softmax sum)
        rows: list[list[int]] = []
        device = stores[0][0].device
        for s, n in zip(group, used, strict=True):
            assert s.block is not None
            ids: list[int] = s.block_ids if s.block_ids is not None else s.block.tolist()
            rows.append(ids[:n] + [ids[0]] * (width - n))
        table = torch.tensor(rows, dtype=torch.long, device=device)
        starts = [s.start for s in group]
        last = torch.tensor(starts, device=device)
        pages = torch.tensor(
            [row[p // page_tokens] for row, p in zip(rows, starts, strict=True)], device=device
        )
        offs = torch.tensor([p % page_tokens for p in starts], device=device)
        k_pos = torch.arange(width * page_tokens, device=device)[None, :]
        mask = k_pos <= last[:, None]
        if window is not None:
            mask &= k_pos > last[:, None] - window
        return cls(stores, len(group), pages, offs, table, mask[:, None, None, :])

    def attend(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        keys, values = self.store_and_gather(li, k, v)
        b = self.size
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=self.mask, scale=scale, enable_gqa=True
        )
        return o.reshape(b, -1)


def paged_kv(
    s: SeqSlice, li: int, k: torch.Tensor, v: torch.Tensor, *, new_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a slice's new K/V (rows ``start`` on) into its layer-``li`` pages and return its
    K/V up to ``ctx_len``: read from the pool's L1 arrays when it has a block table, else from
    its pages; ``new_only`` (nothing before the new rows) returns ``(k, v)`` themselves."""
    _write_pages(s.k_pages[li], s.start, k)
    _write_pages(s.v_pages[li], s.start, v)
    if new_only:
        return k, v
    if s.stores is not None and s.block is not None:
        return (
            _read_store(s.stores[li][0], s.block, s.ctx_len),
            _read_store(s.stores[li][1], s.block, s.ctx_len),
        )
    return _read_pages(s.k_pages[li], s.ctx_len), _read_pages(s.v_pages[li], s.ctx_len)


def attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA of one sequence: ``q`` (n, heads, d) over ``keys``/``values`` (L, kv_heads, d);
    (n, heads * d) out."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)


def _write_pages(pages: list[torch.Tensor], start: int, new: torch.Tensor) -> None:
    page_tokens = pages[0].shape[0]
    pos, end, src = start, start + new.shape[0], 0
    while pos < end:
        page, off = divmod(pos, page_tokens)
        n = min(page_tokens - off, end - pos)
        pages[page][off : off + n].copy_(new[src : src + n])
        pos, src = pos + n, src + n


def _read_pages(pages: list[torch.Tensor], length: int) -> torch.Tensor:
    page_tokens = pages[0].shape[0]
    used = -(-length // page_tokens)
    return torch.cat(pages[:used])[:length] if used > 1 else pages[0][:length]


def _read_store(store: torch.Tensor, block: torch.Tensor, length: int) -> torch.Tensor:
    used = -(-length // store.shape[1])
    return store.index_select(0, block[:used]).flatten(0, 1)[:length]


def _mask(s: SeqSlice, window: int | None, device: torch.device) -> torch.Tensor | None:
    """A bool mask (q_len, ctx_len) where plain causal (or nothing, for one token) will not do."""
    if s.q_len == 1 and (window is None or s.ctx_len <= window):
        return None
    if s.start == 0 and (window is None or s.ctx_len <= window):
        return None  # is_causal handles it
    q_pos = torch.arange(s.start, s.ctx_len, device=device)[:, None]
    k_pos = torch.arange(s.ctx_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _last_rows(seqs: list[SeqSlice], device: torch.device) -> torch.Tensor:
    rows, end = [], 0
    for s in seqs:
        end += s.q_len
        if s.want_logits:
            rows.append(end - 1)
    return torch.tensor(rows, dtype=torch.long, device=device)
