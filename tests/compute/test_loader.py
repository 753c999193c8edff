"""config.json parsing, RoPE scalings against transformers, safetensors loading and dtypes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omniflow.compute import ModelLoadError
from omniflow.compute._config import ModelConfig
from omniflow.compute._loader import load_model, resolve_device
from omniflow.compute._model import ForwardBatch, SeqSlice
from omniflow.compute._rope import inv_frequencies

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}


def test_transformers_4_style_rope_fields_are_read() -> None:
    cfg = ModelConfig.from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_params) == (500000.0, "linear", {"factor": 4.0})


def test_qwen2_defaults_to_biases_and_no_window() -> None:
    cfg = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096})
    assert cfg.attention_bias and cfg.sliding_window is None


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({**BASE, "model_type": "gpt2"}, "not supported"),
        ({k: v for k, v in BASE.items() if k != "vocab_size"}, "vocab_size"),
        ({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        ({**BASE, "rope_scaling": {"rope_type": "linear"}}, "factor"),
    ],
)
def test_bad_configs_are_named(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 3.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ],
)
def test_rope_frequencies_equal_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"}, rope_scaling=scaling)
    cfg = ModelConfig.from_dict(json.loads(hf.to_json_string()))
    ours = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_params)
    if scaling is None:
        want = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    assert torch.equal(ours, want)


def test_missing_directory_and_files_are_named(
    tmp_path: Path, model_dirs: Callable[[str], Path]
) -> None:
    with pytest.raises(ModelLoadError, match="config\\.json"):
        load_model(tmp_path)
    shutil.copy(model_dirs("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(tmp_path)


def test_sharded_index_naming_a_missing_shard(
    tmp_path: Path, model_dirs: Callable[[str], Path]
) -> None:
    src = model_dirs("mistral")
    assert (src / "model.safetensors.index.json").exists()  # the fixture really is sharded
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="not on disk"):
        load_model(dst)


def test_tied_embeddings_share_the_matrix(model_dirs: Callable[[str], Path]) -> None:
    model = load_model(model_dirs("llama3rope"), device="cpu")
    assert model.cfg.tie_word_embeddings
    assert model.lm_head.data_ptr() == model.embed.data_ptr()


def test_device_auto_is_cpu_without_cuda() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precisions_load_and_agree_with_float32(
    dtype: str, model_dirs: Callable[[str], Path]
) -> None:
    path = model_dirs("qwen2")
    ids = torch.tensor([5, 9, 33, 70, 120, 7, 8, 9])

    def logits(model: Any) -> torch.Tensor:
        pages = [[torch.zeros(16, 1, 16, dtype=model.dtype)] for _ in range(2)]
        vpages = [[torch.zeros(16, 1, 16, dtype=model.dtype)] for _ in range(2)]
        batch = ForwardBatch(ids, torch.arange(8), [SeqSlice(0, 8, pages, vpages)])
        out: torch.Tensor = model.forward(batch)[0]
        return out

    half = load_model(path, device="cpu", dtype=dtype)
    assert half.dtype == getattr(torch, dtype)
    full = logits(load_model(path, device="cpu", dtype="float32"))
    got = logits(half)
    assert torch.allclose(got, full, atol=0.1, rtol=0.05)
