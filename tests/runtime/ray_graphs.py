"""Module-level graphs for the of.Ray tests (test_ray.py, test_ray_multinode.py): every role
runs in a Ray actor that imports this module by path, so what a test checks comes back through
the call (pids, environment, digests)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

import omniflow as of

#: CUDA_VISIBLE_DEVICES when this module was imported in the replica's process: where a real
#: role would import torch, so a colocated role must already see its bundle's devices here.
IMPORT_CUDA = os.environ.get("CUDA_VISIBLE_DEVICES")


def _env() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_at_import": IMPORT_CUDA,
    }


class Reporter(of.Role):
    """Says where it runs, from every replica (broadcast)."""

    def __init__(self, field: str) -> None:
        self.field = field

    async def setup(self) -> None:
        self.cuda_at_setup = os.environ.get("CUDA_VISIBLE_DEVICES")

    @of.interface(inputs_or=[["go"]], outputs=["llm_env", "dit_env"], lb="broadcast")
    async def report(self, go: Any) -> dict[str, Any]:
        return {self.field: {**_env(), "cuda_at_setup": self.cuda_at_setup}}


gpu = of.Graph(
    "ray_gpu",
    roles={"gpu_llm": Reporter("llm_env"), "gpu_dit": Reporter("dit_env")},
    inputs=[of.Placeholder("go")],
    outputs=["llm_env", "dit_env"],
)

#: Elements of the array that crosses nodes: 8 Mi int64 = 64 MiB.
BLOB_ITEMS = 8 * 2**20


def blob(seed: int) -> np.ndarray:
    """The 64 MiB array for ``seed`` (a test computes the same digest locally)."""
    x = np.arange(BLOB_ITEMS, dtype=np.uint64)
    x *= np.uint64(0x9E3779B97F4A7C15)
    x ^= np.uint64(seed)
    return x


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a)).cast("B")).hexdigest()


class Source(of.Role):
    @of.interface(inputs_or=[["seed"]], outputs=["blob"])
    async def make(self, seed: int) -> dict[str, Any]:
        return {"blob": blob(seed)}


class Sink(of.Role):
    def __init__(self, field: str) -> None:
        self.field = field

    @of.interface(inputs_or=[["blob"]], outputs=["far_digest", "near_digest"])
    async def check(self, blob: np.ndarray) -> dict[str, Any]:
        return {self.field: (digest(blob), blob.nbytes, os.getpid())}


class Holder(of.Role):
    """Holds a call open for ``hold`` seconds (to lose its actor mid-call)."""

    @of.interface(inputs_or=[["hold"]], outputs=["held"])
    async def hold(self, hold: float) -> AsyncIterator[dict[str, Any]]:
        yield {"held": os.getpid()}
        await asyncio.sleep(hold)


nodes = of.Graph(
    "ray_nodes",
    roles={"mn_src": Source(), "mn_far": Sink("far_digest"), "mn_near": Sink("near_digest")},
    inputs=[of.Placeholder("seed")],
    outputs=["far_digest", "near_digest"],
)

hold = of.Graph(
    "ray_hold", roles={"mn_hold": Holder()}, inputs=[of.Placeholder("hold")], outputs=["held"]
)
