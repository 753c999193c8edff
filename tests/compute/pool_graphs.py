"""Module-level graphs for ``test_pool_recipe.py`` (a worker process imports this file by path).

``owned``: a method that allocates pages under ``of.context().call_id`` and ends ok, raises or
waits to be cancelled; another reports the pool's pinned pages from the process that holds
them. ``llm``: CONTRACT §8's recipe as written, a role whose ``__init__`` builds
``TorchEngine(model_dir, pool="kv")`` and whose ``setup()`` starts it; its tiny model is made
at import (under ``OMNIFLOW_POOL_RECIPE_DIR``, which the test sets before workers start).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import omniflow as of

OWNED = of.ParamsPool(
    "owned",
    of.PageLayout(("l0",), {"k": (2, 4)}, page_tokens=4, dtype="float32"),
    capacity={"l1": 16, "l2": 0, "l3": 0},
)


class Holder(of.Role):
    """``mode``: "ok" ends normally, "error" raises, "hang" waits to be cancelled; each first
    pins 3 pages for the call. "probe" answers the pinned count where the pages live."""

    @of.interface(inputs_or=[["mode"]], outputs=["held"])
    async def hold(self, mode: str) -> dict[str, Any]:
        ctx = of.context()
        pool = ctx.pools["owned"]
        if mode == "probe":
            return {"held": pool.stats()["pinned"]}
        slots = await pool.alloc(ctx.call_id, 3)
        if mode == "error":
            raise RuntimeError("boom after alloc")
        if mode == "hang":
            await asyncio.sleep(3600)
        return {"held": len(slots)}


owned = of.Graph(
    "owned",
    roles={"holder": Holder()},
    inputs=[of.Placeholder("mode")],
    outputs=["held"],
    pools=[OWNED],
)


def _model_dir() -> Path:
    root = Path(os.environ.get("OMNIFLOW_POOL_RECIPE_DIR") or tempfile.gettempdir())
    path = root / "pool-recipe-llama"
    if not (path / "config.json").exists():
        from omniflow.compute._tiny import make_tiny_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_tiny_model(path, arch="llama", layers=2)
    return path


MODEL_DIR = _model_dir()


class Llm(of.Role):
    """CONTRACT §8's example, word for word but for a short generation."""

    def __init__(self, model_dir: Path, pool: str = "kv") -> None:
        self.engine = of.TorchEngine(model_dir, pool=pool, max_batch=16)

    async def setup(self) -> None:
        await self.engine.start()

    async def teardown(self) -> None:
        await self.engine.stop()

    @of.interface(inputs_or=[["prompt"]], outputs=["token"], lb="session")
    async def generate(self, prompt: str) -> Any:
        req = of.GenerateRequest(
            prompt=prompt,
            session=of.context().session,
            sampling=of.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
        )
        async for out in self.engine.generate(req):
            yield {"token": out.token_id}


llm = of.Graph(
    "llm",
    roles={"llm": Llm(MODEL_DIR)},
    inputs=[of.Placeholder("prompt")],
    outputs=["token"],
    pools=[of.TorchEngine.pool(MODEL_DIR, "kv", capacity={"l1": 64, "l2": 0, "l3": 0})],
)
