"""Rotary position embeddings with the config's scaling (default, linear, llama3, yarn).

>>> import torch
>>> from omniflow.compute._rope import inv_frequencies
>>> inv_frequencies(8, 10000.0, "default", {}).shape
torch.Size([4])

The frequencies and the cos/sin tables are computed in float32 exactly as the reference
implementation does (transformers' ``ROPE_INIT_FUNCTIONS``), so logits match it token for token.
YaRN also scales cos and sin by its ``attention_factor``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RotaryEmbedding", "apply_rotary", "attention_scaling", "inv_frequencies"]


def inv_frequencies(
    head_dim: int, theta: float, rope_type: str, params: dict[str, float]
) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding for ``head_dim``, after scaling."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv = 1.0 / (theta**exps)
    if rope_type == "linear":
        return inv / params["factor"]
    if rope_type == "llama3":
        return _llama3(inv, params)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, params)
    return inv


def attention_scaling(rope_type: str, params: dict[str, float]) -> float:
    """The factor cos and sin are scaled by (YaRN's ``attention_factor``; 1 for the others)."""
    return params["attention_factor"] if rope_type == "yarn" else 1.0


def _llama3(inv: torch.Tensor, p: dict[str, float]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, p: dict[str, float]) -> torch.Tensor:
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding:
    """cos/sin for arbitrary positions; one instance per model, on the model's device."""

    __slots__ = ("inv_freq", "scaling")

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq  #: (head_dim // 2,) float32
        self.scaling = scaling  #: cos and sin are scaled by it (``attention_scaling``)

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, head_dim) for integer ``positions`` of shape (T,)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (T, heads, head_dim) by per-token ``cos``/``sin`` (T, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
