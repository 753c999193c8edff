"""Tensors as bytes without numpy (``omniflow[compute]`` does not install numpy): a tensor's raw
bytes, and a ``.safetensors`` file of tensors.

>>> import torch
>>> list(tensor_bytes(torch.tensor([1, 258], dtype=torch.int16)))
[1, 0, 2, 1]

Page keys (``_kv.page_keys``) and encoder-cache keys hash tensor contents: ``Tensor.numpy()``
would need numpy and cannot hold bfloat16 anyway. The bytes are the tensor's in memory order once
on the cpu and contiguous: the same as ``t.numpy().tobytes()`` where numpy can say it.

``safetensors.torch.save_file`` goes through numpy too, so the tiny checkpoints are written by
``save_safetensors``: the format is an 8-byte little-endian header length, a JSON header
(``dtype``, ``shape``, ``data_offsets`` per tensor; ``__metadata__``) padded with spaces to 8
bytes, then the tensors' bytes end to end, as the reference writer lays them out.
"""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["save_safetensors", "tensor_bytes"]

#: torch dtype name -> safetensors dtype code.
_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of ``tensor``'s bytes (moved to the cpu and made contiguous first)."""
    flat = tensor.detach().to("cpu").contiguous()
    size = flat.numel() * flat.element_size()
    if size == 0:
        return b""
    return ctypes.string_at(flat.data_ptr(), size)  # ``flat`` holds the memory until it returns


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format (readable by ``safe_open``)."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _CODES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors code here")
        data = tensor_bytes(tensor)
        header[name] = {
            "dtype": _CODES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in chunks:
            f.write(data)
