"""A ViT-style patch encoder whose output rows enter the LLM as ``embeds`` segments.

>>> # enc = VisionEncoder.from_dir(path)          # config.json + model.safetensors
>>> # rows = enc.encode(png_bytes)                 # (num_patches, projection_dim) float32

The shape of LLaVA's vision side, small: the image is decoded (PNG/JPEG/... through Pillow),
converted to RGB, resized to ``image_size`` and normalised; non-overlapping ``patch_size`` patches
are projected to ``hidden_size``, a learned position embedding is added, ``num_layers`` pre-norm
transformer blocks (multi-head self-attention, GELU MLP) run over the patches, a final LayerNorm,
then a two-layer GELU projector maps every patch to the LLM's hidden size (``projection_dim``).
One output row per patch, so an image is ``(image_size // patch_size) ** 2`` embedding rows.

Weights come from a directory (``config.json`` with ``"model_type": "omniflow_vit"`` and
``model.safetensors``); ``make_tiny_vision`` writes a random-init one (seeded, so every process
that makes it gets the same encoder).
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omniflow.compute._errors import RequestError

__all__ = ["VisionConfig", "VisionEncoder", "decode_image", "make_tiny_vision"]

MODEL_TYPE = "omniflow_vit"
#: CLIP's per-channel normalisation (what LLaVA's encoders expect).
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The encoder's shape (``config.json``)."""

    projection_dim: int  #: the LLM's hidden size: width of every output row
    image_size: int = 32  #: images are resized to image_size x image_size
    patch_size: int = 8  #: square patches; image_size must be a multiple
    num_channels: int = 3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision config: image_size {self.image_size} is not a multiple of "
                f"patch_size {self.patch_size}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision config: hidden_size {self.hidden_size} is not a multiple of "
                f"num_heads {self.num_heads}"
            )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionConfig:
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"vision encoder: cannot read {file}: {exc}") from exc
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(
                f"vision encoder: {file} has model_type {raw.get('model_type')!r}; "
                f"expected {MODEL_TYPE!r}"
            )
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})

    def save(self, path: str | Path) -> None:
        data = {"model_type": MODEL_TYPE, **asdict(self)}
        (Path(path) / "config.json").write_text(json.dumps(data, indent=2))


def _weight_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, m, p = cfg.hidden_size, cfg.intermediate_size, cfg.projection_dim
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (h, cfg.num_channels * cfg.patch_size**2),
        "patch_embed.bias": (h,),
        "pos_embed": (cfg.num_patches, h),
        "norm.weight": (h,),
        "norm.bias": (h,),
        "projector.fc1.weight": (p, h),
        "projector.fc1.bias": (p,),
        "projector.fc2.weight": (p, p),
        "projector.fc2.bias": (p,),
    }
    for i in range(cfg.num_layers):
        b = f"blocks.{i}."
        shapes |= {
            b + "norm1.weight": (h,),
            b + "norm1.bias": (h,),
            b + "attn.qkv.weight": (3 * h, h),
            b + "attn.qkv.bias": (3 * h,),
            b + "attn.proj.weight": (h, h),
            b + "attn.proj.bias": (h,),
            b + "norm2.weight": (h,),
            b + "norm2.bias": (h,),
            b + "mlp.fc1.weight": (m, h),
            b + "mlp.fc1.bias": (m,),
            b + "mlp.fc2.weight": (h, m),
            b + "mlp.fc2.bias": (h,),
        }
    return shapes


def make_tiny_vision(path: str | Path, projection_dim: int, *, seed: int = 0, **shape: Any) -> Path:
    """Write a random-init encoder (config.json + model.safetensors) to ``path``."""
    from omniflow.compute._bytes import save_safetensors

    cfg = VisionConfig(projection_dim=projection_dim, **shape)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shp in _weight_shapes(cfg).items():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
            weights[name] = torch.ones(shp)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shp)
        else:
            weights[name] = torch.randn(shp, generator=gen) * shp[-1] ** -0.5
    save_safetensors(weights, out / "model.safetensors")
    cfg.save(out)
    return out


def decode_image(data: bytes, size: int) -> torch.Tensor:
    """Image file bytes -> (3, size, size) float32 RGB in [0, 1]; RequestError if no image."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - pillow is in the compute extra
        raise RequestError(
            "decoding images needs Pillow: pip install 'omniflow[compute]'", field="image"
        ) from exc
    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RequestError(
            f"image: {len(data)} bytes that Pillow cannot decode as an image ({exc})",
            field="image",
        ) from exc
    raw = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return raw.view(size, size, 3).permute(2, 0, 1).float() / 255.0


class VisionEncoder:
    """Loaded weights and the forward pass (CPU, float32, inference only)."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor]) -> None:
        expected = _weight_shapes(cfg)
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise ValueError(f"vision encoder: weights missing {missing[:4]}")
        unexpected = sorted(set(weights) - set(expected))
        if unexpected:  # never dropped: a weight the forward pass does not read is refused
            raise ValueError(f"vision encoder: unexpected weights {unexpected[:4]}")
        for name, shp in expected.items():
            if tuple(weights[name].shape) != shp:
                raise ValueError(
                    f"vision encoder: weight {name!r} has shape {tuple(weights[name].shape)}, "
                    f"config says {shp}"
                )
        self.cfg = cfg  #: the encoder's shape
        self.w = {k: v.float() for k, v in weights.items()}  #: weights by name
        self.mean = torch.tensor(_MEAN).view(3, 1, 1)
        self.std = torch.tensor(_STD).view(3, 1, 1)

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionEncoder:
        from safetensors.torch import load_file

        cfg = VisionConfig.from_dir(path)
        return cls(cfg, load_file(str(Path(path) / "model.safetensors")))

    def encode(self, image: bytes) -> torch.Tensor:
        """Image file bytes -> (num_patches, projection_dim) rows."""
        return self.forward(decode_image(image, self.cfg.image_size))

    def encode_batch(self, images: list[bytes]) -> list[torch.Tensor]:
        """Several images in one forward pass (a batched role, ``of.Batch``): one
        (num_patches, projection_dim) tensor per image, as ``encode`` gives each."""
        size = self.cfg.image_size
        pixels = torch.stack([decode_image(im, size) for im in images])
        return list(self.forward_batch(pixels).unbind(0))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(3, image_size, image_size) in [0, 1] -> (num_patches, projection_dim)."""
        return self.forward_batch(pixels.unsqueeze(0))[0].contiguous()

    @torch.inference_mode()
    def forward_batch(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, image_size, image_size) in [0, 1] -> (B, num_patches, projection_dim)."""
        cfg, w = self.cfg, self.w
        x = (pixels - self.mean) / self.std
        p, b_ = cfg.patch_size, x.shape[0]
        # (B, C, H, W) -> (B, num_patches, C * p * p), patches in row-major order
        patches = (
            x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b_, -1, 3 * p * p)
        )
        h = F.linear(patches, w["patch_embed.weight"], w["patch_embed.bias"]) + w["pos_embed"]
        heads, d = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        eps = cfg.layer_norm_eps
        n = h.shape[1]
        for i in range(cfg.num_layers):
            b = f"blocks.{i}."
            y = F.layer_norm(h, (cfg.hidden_size,), w[b + "norm1.weight"], w[b + "norm1.bias"], eps)
            qkv = F.linear(y, w[b + "attn.qkv.weight"], w[b + "attn.qkv.bias"])
            q, k, v = qkv.view(b_, n, 3, heads, d).permute(2, 0, 3, 1, 4)  # each (B, heads, n, d)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b_, n, -1)
            h = h + F.linear(a, w[b + "attn.proj.weight"], w[b + "attn.proj.bias"])
            y = F.layer_norm(h, (cfg.hidden_size,), w[b + "norm2.weight"], w[b + "norm2.bias"], eps)
            y = F.gelu(F.linear(y, w[b + "mlp.fc1.weight"], w[b + "mlp.fc1.bias"]))
            h = h + F.linear(y, w[b + "mlp.fc2.weight"], w[b + "mlp.fc2.bias"])
        h = F.layer_norm(h, (cfg.hidden_size,), w["norm.weight"], w["norm.bias"], eps)
        h = F.gelu(F.linear(h, w["projector.fc1.weight"], w["projector.fc1.bias"]))
        return F.linear(h, w["projector.fc2.weight"], w["projector.fc2.bias"]).contiguous()
