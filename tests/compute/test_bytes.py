"""Tensor bytes and safetensors files without numpy (``_bytes``), read back by safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from omniflow.compute._bytes import save_safetensors, tensor_bytes


def test_tensor_bytes_are_numpy_s_where_numpy_can_say() -> None:
    for t in (torch.randn(3, 4), torch.randn(4, 3).T, torch.arange(10), torch.zeros(0)):
        assert tensor_bytes(t) == t.contiguous().numpy().tobytes()
    bf16 = torch.randn(5, dtype=torch.bfloat16)  # numpy has no bfloat16
    assert tensor_bytes(bf16) == tensor_bytes(bf16.view(torch.int16))
    assert len(tensor_bytes(bf16)) == 10


def test_safetensors_files_read_back_exactly(tmp_path: Path) -> None:
    tensors = {
        "b.weight": torch.randn(7, 3),
        "a.bias": torch.randn(3, dtype=torch.bfloat16),
        "half": torch.randn(2, 2, dtype=torch.float16),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(3, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6)[:, ::2],
    }
    path = tmp_path / "m.safetensors"
    save_safetensors(tensors, path, {"format": "pt", "note": "x"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}


def test_a_dtype_without_a_code_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="complex64"):
        save_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")
