"""The vision encoder's checkpoint: every weight is read or the checkpoint is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omniflow.compute._bytes import save_safetensors
from omniflow.compute._vision import VisionEncoder, make_tiny_vision


def test_an_unexpected_weight_is_refused_by_name(tmp_path: Path) -> None:
    root = make_tiny_vision(tmp_path / "v", projection_dim=32)
    weights = load_file(str(root / "model.safetensors"))
    assert VisionEncoder.from_dir(root).cfg.projection_dim == 32
    extra = {**weights, "blocks.9.attn.qkv.weight": torch.zeros(3, 3)}
    save_safetensors(extra, root / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected weights \['blocks\.9\.attn\.qkv\.weight'\]"):
        VisionEncoder.from_dir(root)


def test_a_batch_encodes_as_each_image_alone(tmp_path: Path) -> None:
    """``forward_batch`` (what a batched role runs) gives each image the rows ``forward`` does."""
    make_tiny_vision(tmp_path, 32, image_size=64, patch_size=16)
    vit = VisionEncoder.from_dir(tmp_path)
    pixels = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    batch = vit.forward_batch(pixels)
    assert batch.shape == (4, 16, 32)
    for i in range(4):
        torch.testing.assert_close(batch[i], vit.forward(pixels[i]), rtol=1e-5, atol=1e-5)
