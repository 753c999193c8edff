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
