"""Code that runs in spawned processes for the cross-process pool tests (and the sample data).

Kept apart from the test modules so a spawned child imports only this, numpy and omniflow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omniflow.data import BlockHandle, PoolAttachment


def sample_arrays() -> list[np.ndarray]:
    """Arrays of several dtypes and shapes, including non-contiguous views and NaN payloads."""
    rng = np.random.default_rng(1234)
    base = rng.standard_normal((16, 24))
    weird = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-310], dtype=np.float64)
    return [
        base.astype(np.float32),
        base.T,  # Fortran-ordered view
        base[::3, 1::2],  # strided view
        base[::-1, ::-2].astype(np.float16),  # negative strides
        rng.integers(-(2**62), 2**62, size=(3, 4, 5), dtype=np.int64),
        rng.integers(0, 255, size=1000, dtype=np.uint8),
        rng.random((7, 3)) > 0.5,
        (base[:4, :4] + 1j * base[4:8, :4]).astype(np.complex64),
        weird,
        np.array(3.5),  # 0-d
        np.zeros((0, 5), dtype=np.int32),  # empty
        np.array(["omni", "flow", "données"], dtype="<U7"),
        np.array([0, 10**18, -5], dtype="datetime64[ns]"),
        base.astype(">f8")[2:5],  # big-endian
    ]


def sample_tensors() -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    base = torch.randn(12, 20, generator=gen)
    return [
        base,
        base.t(),  # non-contiguous
        base[::2, 1::3],
        base.to(torch.bfloat16),
        base.to(torch.float16)[:, 1::2],
        base.to(torch.float64).unsqueeze(0).expand(3, 12, 20),  # stride-0 view
        (base > 0),
        torch.randint(-128, 127, (5, 7), dtype=torch.int8, generator=gen),
        torch.randint(0, 255, (64,), dtype=torch.uint8, generator=gen),
        torch.randint(-(2**40), 2**40, (4, 4), dtype=torch.int64, generator=gen),
        torch.complex(base[:3], base[3:6]),
        torch.tensor(2.5),  # 0-d
        torch.empty(0, 3),
        torch.tensor([float("nan"), -0.0, float("inf")]),
    ]


def tensor_bytes(tensor: Any) -> bytes:
    """The bytes of a tensor in C order, for bit-identical comparisons (NaN-safe)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else b""


def read_arrays(name: str, handles: list[BlockHandle]) -> list[tuple[str, tuple[int, ...], bytes]]:
    with PoolAttachment(name) as slab:
        out = []
        for handle in handles:
            array = slab.get_array(handle)
            out.append((array.dtype.str, array.shape, array.tobytes()))
            del array
        return out


def write_arrays(name: str, handles: list[BlockHandle]) -> list[BlockHandle]:
    with PoolAttachment(name) as slab:
        return [slab.write_array(h, a) for h, a in zip(handles, sample_arrays(), strict=True)]


def read_tensors(name: str, handles: list[BlockHandle]) -> list[tuple[str, tuple[int, ...], bytes]]:
    with PoolAttachment(name) as slab:
        out = []
        for handle in handles:
            tensor = slab.get_tensor(handle)
            out.append((str(tensor.dtype), tuple(tensor.shape), tensor_bytes(tensor)))
            del tensor
        return out


def write_tensors(name: str, handles: list[BlockHandle]) -> list[BlockHandle]:
    with PoolAttachment(name) as slab:
        return [slab.write_tensor(h, t) for h, t in zip(handles, sample_tensors(), strict=True)]
