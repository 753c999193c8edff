"""``TorchEngine.pool`` and the engine agree on dtype and device; the layout check compares
both (``_pool.placement``, ``_pool._check_layout``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omniflow.compute import EngineError, GenerateRequest, TorchEngine
from omniflow.compute._config import ModelConfig
from omniflow.compute._pool import placement, same_device

from .conftest import greedy, hf_greedy, run

pytestmark = pytest.mark.timeout(120)

SMALL = {"l1": 16, "l2": 0, "l3": 0}


@pytest.fixture
def bf16_dir(model_dirs: Callable[[str], Path], tmp_path: Path) -> Path:
    """The tiny Llama, its config saying it was saved in bfloat16 (as hub checkpoints are)."""
    dst = tmp_path / "bf16"
    shutil.copytree(model_dirs("llama"), dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return dst


@pytest.mark.parametrize(
    ("cuda", "want"),
    [(True, (torch.device("cuda"), "bfloat16")), (False, (torch.device("cpu"), "float32"))],
)
def test_auto_resolves_for_the_pool_as_for_the_engine(
    bf16_dir: Path, monkeypatch: pytest.MonkeyPatch, cuda: bool, want: tuple[torch.device, str]
) -> None:
    """On a GPU box "auto" is cuda and the checkpoint's bfloat16 for both (the pool defaulted
    to float32 before, so the documented recipe could not start there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = ModelConfig.from_dir(bf16_dir)
    assert placement(cfg, "auto", "auto") == want
    pool = TorchEngine.pool(bf16_dir, "kv", capacity=SMALL)  # not opened: nothing allocated
    assert pool.layout.dtype == want[1]


async def test_the_pool_is_placed_where_asked(bf16_dir: Path) -> None:
    # meta: a device that is not the cpu, so "auto" takes the checkpoint's dtype there
    pool = TorchEngine.pool(bf16_dir, "kv", capacity=SMALL, device="meta")
    await pool.open()
    try:
        store = pool.storage("layer0", "k")
        assert (store.device.type, store.dtype) == ("meta", torch.bfloat16)
    finally:
        await pool.aclose()


async def test_the_default_pool_serves_the_default_engine(
    model_dirs: Callable[[str], Path], reference: Any
) -> None:
    path = model_dirs("llama")
    pool = TorchEngine.pool(path, "kv", capacity={"l1": 64, "l2": 0, "l3": 0})
    try:
        async with TorchEngine(path, pool=pool) as engine:
            ids = [5 + i * 7 % 300 for i in range(20)]
            got, _ = await run(engine, GenerateRequest(input_ids=ids, sampling=greedy(8)))
        assert got == hf_greedy(reference(path), ids, 8)
        assert pool.stats()["pinned"] == 0
    finally:
        await pool.aclose()


async def test_an_engine_on_a_pool_on_another_device_is_refused_naming_both(
    model_dirs: Callable[[str], Path],
) -> None:
    path = model_dirs("llama")
    pool = TorchEngine.pool(path, "kv", capacity=SMALL, dtype="float32", device="meta")
    engine = TorchEngine(path, pool=pool, device="cpu")
    try:
        with pytest.raises(EngineError, match="pool 'kv' keeps its pages on meta but the engine "
                           "runs on cpu"):  # fmt: skip
            await engine.start()
    finally:
        await engine.stop()
        await pool.aclose()


async def test_an_engine_on_a_pool_of_another_dtype_is_refused(
    model_dirs: Callable[[str], Path],
) -> None:
    path = model_dirs("llama")
    pool = TorchEngine.pool(path, "kv", capacity=SMALL, dtype="bfloat16", device="cpu")
    engine = TorchEngine(path, pool=pool, device="cpu", dtype="float32")
    try:
        with pytest.raises(EngineError, match=r"pool 'kv' has layout .*/bfloat16 .*/float32"):
            await engine.start()
    finally:
        await engine.stop()
        await pool.aclose()


def test_a_bare_cuda_is_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert not same_device(torch.device("cuda"), torch.device("cuda:1"))
    assert not same_device(torch.device("cpu"), torch.device("cuda:0"))
    assert same_device(torch.device("cpu"), torch.device("cpu"))
