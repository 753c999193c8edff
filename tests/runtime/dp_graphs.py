"""Module-level graphs for the data-plane tests (test_data_plane.py).

Worker processes import this file by path and look the Graphs up by name, so everything here
is a module-level object and role names are unique across the module's graphs. Values are
built from their names (``sample(name)``) with fixed seeds, so the producer in one process and
the test in another build bit-identical expectations without shipping them around; consumers
answer with ``describe(value)``: type, dtype, shape and a SHA-256 of the raw bytes.

torch is imported only where a torch value is made or described, so the workers of the
numpy-only graphs start without it (a second less per test).

``OMNIFLOW_DP_MARKER`` (inherited by the workers the front spawns) names a file that
``DpHold`` writes its pid to once it holds its input: the test's cue to SIGKILL it mid-read.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

import omniflow as of

MARKER_ENV = "OMNIFLOW_DP_MARKER"

#: name -> (library, dtype, shape, view): ``view`` makes the value a non-contiguous view.
SPECS: dict[str, tuple[str, str, tuple[int, ...], str]] = {
    "np_f32_2d": ("numpy", "float32", (64, 96), ""),
    "np_f64_T": ("numpy", "float64", (48, 80), "T"),
    "np_i64_step": ("numpy", "int64", (3000,), "step"),
    "np_bool": ("numpy", "bool", (37, 41), ""),
    "np_f16_3d": ("numpy", "float16", (4, 16, 33), ""),
    "np_0d": ("numpy", "float32", (), ""),
    "np_u8_9mib": ("numpy", "uint8", (9 * 2**20,), ""),
    "t_bf16": ("torch", "bfloat16", (32, 50), ""),
    "t_f16_T": ("torch", "float16", (40, 24), "T"),
    "t_i64_cols": ("torch", "int64", (30, 60), "step"),
    "t_bool": ("torch", "bool", (513,), ""),
    "t_0d": ("torch", "int64", (), ""),
    "t_f32_8mib": ("torch", "float32", (2**21 + 7,), ""),
    "bytes_1mib": ("bytes", "uint8", (2**20 + 3,), ""),
    "np_be_f8_neg": ("numpy", ">f8", (30, 20), "neg"),
    "t_expand": ("torch", "float64", (1, 70), "expand"),
    "t_empty": ("torch", "float32", (0, 5), ""),
}


def sample(name: str) -> Any:
    """The value called ``name``: random bit patterns (NaNs included), fixed per name."""
    lib, dtype, shape, view = SPECS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if lib == "torch":
        import torch
    if dtype == "bool":
        raw = rng.integers(0, 2, size=shape, dtype=np.uint8).astype(np.bool_)
        return raw if lib == "numpy" else torch.from_numpy(raw)
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    n = int(np.prod(shape)) if shape else 1
    raw = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    if lib == "bytes":
        return raw.tobytes()
    if lib == "numpy":
        arr = raw.view(np.dtype(dtype)).reshape(shape)
    elif n == 0:
        arr = torch.empty(shape, dtype=getattr(torch, dtype))
    else:
        arr = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    if view == "T":
        arr = arr.T
    elif view == "step":
        arr = arr[::3] if arr.ndim == 1 else arr[:, ::2]
    elif view == "neg":
        arr = arr[::-1, ::-2]
    elif view == "expand":
        arr = arr.expand(9, 70)  # stride 0 along the first axis
    return arr


def describe(value: Any) -> tuple[str, str, tuple[int, ...], str]:
    """(library, dtype, shape, sha256 of the C-order bytes): equal iff bit-identical."""
    if isinstance(value, bytes | bytearray | memoryview):
        return ("bytes", "uint8", (memoryview(value).nbytes,), hashlib.sha256(value).hexdigest())
    if type(value).__module__.startswith("torch"):
        import torch

        flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
        data = flat.numpy().tobytes()
        dtype = str(value.dtype).removeprefix("torch.")
        return ("torch", dtype, tuple(value.shape), hashlib.sha256(data).hexdigest())
    arr = np.ascontiguousarray(value)
    return ("numpy", str(arr.dtype), tuple(arr.shape), hashlib.sha256(arr.tobytes()).hexdigest())


def expected(name: str) -> tuple[str, str, tuple[int, ...], str]:
    return describe(sample(name))


#: Values the producer made, by (call id, name): what an in-process consumer must get itself.
MADE: dict[tuple[str, str], Any] = {}


# ---------------------------------------------------------------- producer -> consumer


class DpSrc(of.Role):
    """Yields one frame per name: ``t`` (a consumer's input: the data plane's) and
    ``t_out`` (a caller field: it rides the control message)."""

    @of.interface(inputs_or=[["names"]], outputs=["t", "t_out"])
    async def run(self, names: list[str]) -> AsyncIterator[dict[str, Any]]:
        call_id = of.context().call_id
        for name in names:
            value = sample(name)
            MADE[(call_id, name)] = value
            yield {"t": value, "t_out": value}


class DpDst(of.Role):
    """Describes what it received, and whether it is the producer's very object."""

    @of.interface(inputs_or=[["t"]], outputs=["seen"])
    async def run(self, t: Any) -> dict[str, Any]:
        call_id = of.context().call_id
        same = [name for (c, name), v in MADE.items() if c == call_id and v is t]
        readonly = bool(isinstance(t, np.ndarray) and not t.flags.writeable)
        return {"seen": {"desc": describe(t), "same_object": same, "readonly": readonly,
                         "pid": os.getpid()}}  # fmt: skip


pair = of.Graph(
    "dp_pair",
    roles={"dp_src": DpSrc(), "dp_dst": DpDst()},
    inputs=[of.Placeholder("names")],
    outputs=["t_out", "seen"],
)


# ---------------------------------------------------------------- caller -> worker


class DpIn(of.Role):
    """Gets a caller's input (the front's pool) and describes it."""

    @of.interface(inputs_or=[["blob"]], outputs=["blob_seen"])
    async def run(self, blob: Any) -> dict[str, Any]:
        return {"blob_seen": describe(blob)}


inbound = of.Graph(
    "dp_inbound",
    roles={"dp_in": DpIn()},
    inputs=[of.Placeholder("blob")],
    outputs=["blob_seen"],
)


# ---------------------------------------------------------------- cancel / error / dead / kill


class DpStream(of.Role):
    """Yields 2 MiB arrays (every element ``i``) until cancelled (``n`` < 0) or ``n`` of them."""

    @of.interface(inputs_or=[["n"]], outputs=["chunk"])
    async def run(self, n: int) -> AsyncIterator[dict[str, Any]]:
        i = 0
        while n < 0 or i < n:
            yield {"chunk": np.full(2**19, i, dtype=np.float32)}
            i += 1
            await asyncio.sleep(0.001)


class DpSink(of.Role):
    """Sums a chunk, holding it 20 ms (so several blocks are in flight at any time); raises
    on the chunk numbered ``$OMNIFLOW_DP_FAIL_AT``."""

    @of.interface(inputs_or=[["chunk"]], outputs=["total"])
    async def run(self, chunk: np.ndarray) -> dict[str, Any]:
        i = int(chunk[0])
        await asyncio.sleep(0.02)
        if i == int(os.environ.get("OMNIFLOW_DP_FAIL_AT", "-1")):
            raise ValueError(f"sink refuses chunk {i}")
        return {"total": float(chunk.sum())}


stream = of.Graph(
    "dp_stream",
    roles={"dp_stream": DpStream(), "dp_sink": DpSink()},
    inputs=[of.Placeholder("n")],
    outputs=["total"],
)


class DpGather(of.Role):
    """Collects a whole stream of chunks: a list of refs, resolved item by item."""

    @of.interface(inputs_or=[["chunk"]], outputs=["sums"], collect=["chunk"])
    async def run(self, chunk: list[np.ndarray]) -> dict[str, Any]:
        return {"sums": [float(c.sum()) for c in chunk]}


gather = of.Graph(
    "dp_gather",
    roles={"dp_stream3": DpStream(), "dp_gather": DpGather()},
    inputs=[of.Placeholder("n")],
    outputs=["sums"],
)


class DpBig(of.Role):
    @of.interface(inputs_or=[["k"]], outputs=["big"])
    async def run(self, k: int) -> dict[str, Any]:
        return {"big": np.full(2**20, k, dtype=np.float32)}


class DpNothing(of.Role):
    """Produces nothing: the join's critical slot ``other`` ends empty, the bucket is DEAD."""

    @of.interface(inputs_or=[["k"]], outputs=["other"])
    async def run(self, k: int) -> None:
        await asyncio.sleep(0.05)  # ``big`` is already in the bucket when this ends


class DpJoin(of.Role):
    @of.interface(inputs_or=[["big", "other"]], outputs=["joined"])
    async def run(self, big: np.ndarray, other: Any) -> dict[str, Any]:
        return {"joined": float(big.sum())}


dead = of.Graph(
    "dp_dead",
    roles={"dp_big": DpBig(), "dp_nothing": DpNothing(), "dp_join": DpJoin()},
    inputs=[of.Placeholder("k")],
    outputs=["joined"],
)


class DpHold(of.Role):
    """Holds a view of its input and waits (to be SIGKILLed mid-read)."""

    @of.interface(inputs_or=[["big"]], outputs=["held"])
    async def run(self, big: np.ndarray) -> dict[str, Any]:
        total = float(big[:: 4096 // big.itemsize].sum())  # touch one element per page
        marker = os.environ.get(MARKER_ENV)
        if marker:
            Path(marker).write_text(str(os.getpid()))
        await asyncio.sleep(30)
        return {"held": total}


kill = of.Graph(
    "dp_kill",
    roles={"dp_big2": DpBig(), "dp_hold": DpHold()},
    inputs=[of.Placeholder("k")],
    outputs=["held"],
)
