"""Tiny random-init checkpoints (Llama, Qwen2, Mistral) with a locally trained tokenizer, and
``transformers`` as the reference they are checked against."""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omniflow.compute import GenerateRequest, SamplingParams, TorchEngine
from omniflow.compute._tiny import make_tiny_model

#: name -> (arch, extra config). Sharded Mistral exercises the safetensors index; the Llama
#: variants cover the RoPE scalings and every flag Llama reads (tied embeddings ride on one of
#: them); Qwen2 slides some layers, Mistral every layer. Each is checked against transformers.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": True,
        },
    ),
    "linrope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "layers": 3}),
    "qwen2": ("qwen2", {"kv_heads": 1}),
    "mistral": ("mistral", {"max_shard_size": "40KB", "sliding_window": 48, "head_dim": 32}),
    "attn_bias": ("llama", {"attention_bias": True}),  # q/k/v and o_proj biases
    "mlp_bias": ("llama", {"mlp_bias": True}),
    "head_dim": ("llama", {"head_dim": 32}),  # not hidden_size // heads (16)
    "yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "max_position_embeddings": 128,
        },
    ),
    # layer 0 attends to everything, layer 1 to its last 24 positions
    "qwen2_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
    ),
}


#: where the forward pass runs (``executor="process"``: the engine's own process, same results)
EXECUTORS = ["thread", "process"]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            arch, extra = MODELS[name]
            extra = dict(extra)
            layers = extra.pop("layers", 2)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made[name] = make_tiny_model(
                    tmp_path_factory.mktemp(name), arch=arch, layers=layers, **extra
                )
        return made[name]

    return get


@pytest.fixture(scope="session")
def reference() -> Callable[[Path], Any]:
    """The transformers model of a directory (cached per directory); it must find exactly the
    tensors it expects, so a tensor it would initialise itself (a bias at 0) cannot hide."""
    cache: dict[Path, Any] = {}

    def get(path: Path) -> Any:
        if path not in cache:
            from transformers import AutoModelForCausalLM

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
            assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
            cache[path] = model.eval()
        return cache[path]

    return get


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` of ``n`` tokens (EOS not special, no padding)."""
    x = torch.tensor([ids])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, len(ids) :].tolist())


def greedy(n: int = 64) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


async def run(engine: TorchEngine, req: GenerateRequest) -> tuple[list[int], int]:
    """(generated ids, cached_tokens) of one request."""
    ids, cached = [], -1
    async for out in engine.generate(req):
        ids.append(out.token_id)
        cached = out.cached_tokens
    return ids, cached


@pytest.fixture
async def engine_factory() -> AsyncIterator[Callable[..., Any]]:
    """Started engines, stopped (and their pools checked) at teardown."""
    engines: list[TorchEngine] = []

    async def make(path: Path, **kwargs: Any) -> TorchEngine:
        engine = TorchEngine(path, **kwargs)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        pool: Any = engine.kv_pool
        if pool is not None:
            pool.validate()
            assert pool.stats()["pinned"] == 0, "a finished test left pages pinned"
        await engine.stop()
