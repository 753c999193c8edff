"""config.json parsing, RoPE scalings against transformers, safetensors loading and dtypes."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omniflow.compute import ModelLoadError, _loader
from omniflow.compute._config import ModelConfig
from omniflow.compute._loader import load_model, resolve_device, shares_weights
from omniflow.compute._model import ForwardBatch, SeqSlice
from omniflow.compute._rope import attention_scaling, inv_frequencies

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
    ("raw", "field", "match"),
    [
        ({**BASE, "model_type": "gpt2"}, "model_type", "not supported"),
        ({k: v for k, v in BASE.items() if k != "vocab_size"}, "vocab_size", "vocab_size"),
        (
            {**BASE, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling",
            "'dynamic' .*frequencies change with the length",
        ),
        (
            {**BASE, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "rope_parameters",
            "'longrope'",
        ),
        ({**BASE, "rope_scaling": {"rope_type": "linear"}}, "rope_scaling", "factor"),
        ({**BASE, "partial_rotary_factor": 0.5}, "partial_rotary_factor", "whole head"),
        ({**BASE, "hidden_act": "gelu"}, "hidden_act", "'gelu' is not supported"),
        (
            {**BASE, "model_type": "qwen2", "use_sliding_window": True, "layer_types": ["x", "y"]},
            "layer_types",
            "layer_types",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_field(
    raw: dict[str, Any], field: str, match: str
) -> None:
    with pytest.raises(ModelLoadError, match=match) as err:
        ModelConfig.from_dict(raw)
    assert err.value.field == field
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("model_type", "extra", "windows"),
    [
        ("llama", {"sliding_window": 8}, [None, None]),  # Llama does not read it
        ("mistral", {}, [4096, 4096]),  # transformers' default
        ("mistral", {"sliding_window": None}, [None, None]),
        ("qwen2", {"sliding_window": 8}, [None, None]),  # without use_sliding_window
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, [None, None]),  # layer < 28
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
            [None, 8],
        ),
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            [8, None],
        ),
    ],
)
def test_sliding_windows_per_layer_are_transformers(
    model_type: str, extra: dict[str, Any], windows: list[int | None]
) -> None:
    from transformers import AutoConfig

    raw = {**BASE, "model_type": model_type, **extra}
    cfg = ModelConfig.from_dict(raw)
    assert [cfg.window(i) for i in range(2)] == windows
    hf = AutoConfig.for_model(**raw)
    types = getattr(hf, "layer_types", None) or ["full_attention"] * 2
    want = [
        getattr(hf, "sliding_window", None)
        if model_type == "mistral" or t != "full_attention"
        else None
        for t in types
    ]
    assert want == windows


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
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "yarn", "factor": 8.0, "truncate": False, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 2.0, "mscale": 0.7, "mscale_all_dim": 0.5},
        {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5},
        {"type": "yarn", "factor": None, "original_max_position_embeddings": 1024},
    ],
)
def test_rope_frequencies_equal_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "model_type"},
        max_position_embeddings=4096,
        rope_scaling=None if scaling is None else dict(scaling),
    )
    cfg = ModelConfig.from_dict({**BASE, "max_position_embeddings": 4096, "rope_scaling": scaling})
    ours = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_params)
    if scaling is None:
        want, factor = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)), 1.0
    else:
        want, factor = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf, "cpu")
    assert torch.equal(ours, want)
    assert attention_scaling(cfg.rope_type, cfg.rope_params) == factor


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


def test_sharing_on_a_gpu_says_once_that_the_weights_stay_private(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``share_weights`` is on by default; on cuda (tested by its condition, no GPU needed) the
    load is private, and the log says so once per process and device."""
    monkeypatch.setattr(_loader, "_PRIVATE_LOGGED", set())
    root = Path("ckpt/llm")
    with caplog.at_level("INFO", logger="omniflow.compute"):
        assert shares_weights(torch.device("cpu"), True, root)
        assert not shares_weights(torch.device("cpu"), False, root)
        assert not shares_weights(torch.device("cuda"), False, root)  # not asked: nothing said
        assert caplog.records == []
        assert not shares_weights(torch.device("cuda"), True, root)
        assert not shares_weights(torch.device("cuda"), True, root)
        assert not shares_weights(torch.device("cuda", 1), True, root)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # once per device: cuda, cuda:1
    assert "CPU-only" in said[0] and "private copy of its weights on cuda" in said[0]
    assert "ckpt/llm" in said[0] and "share_weights=False" in said[0]
    assert "on cuda:1" in said[1]
