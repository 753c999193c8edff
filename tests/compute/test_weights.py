"""Every tensor of a checkpoint is used or refused by name (``_weights``, ``load_model``)."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniflow.compute import ModelLoadError
from omniflow.compute._config import ModelConfig
from omniflow.compute._loader import load_model
from omniflow.compute._rope import inv_frequencies
from omniflow.compute._weights import expected_tensors

from .conftest import MODELS

BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True}),
        ("llama", {"mlp_bias": True}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 24}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        # flags Qwen2 and Mistral do not read change nothing there (as in transformers)
        ("qwen2", {"attention_bias": False, "mlp_bias": True, "tie_word_embeddings": True}),
        ("mistral", {"attention_bias": True, "mlp_bias": True, "head_dim": 32}),
    ],
)
def test_expected_tensors_are_transformers_parameters(
    model_type: str, extra: dict[str, Any]
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {"model_type": model_type, **BASE, **extra}
    hf_config = AutoConfig.for_model(model_type, **BASE, **extra)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_config(hf_config)
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if hf_config.tie_word_embeddings:
        del want["lm_head.weight"]  # the same tensor as the embedding: not in the checkpoint
    assert expected_tensors(ModelConfig.from_dict(raw)) == want


def _with(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the single-file checkpoint ``src`` whose tensors ``change`` edits."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("model", "name", "why"),
    [
        ("llama", "model.layers.0.self_attn.o_proj.bias", "config.json has attention_bias=false"),
        ("llama", "model.layers.1.mlp.down_proj.bias", "config.json has mlp_bias=false"),
        ("qwen2", "model.layers.0.self_attn.o_proj.bias", "Qwen2 attention has no o_proj bias"),
        ("llama", "model.layers.2.input_layernorm.weight", "config.json has num_hidden_layers=2"),
        ("llama", "model.layers.0.self_attn.q_norm.weight", "Llama .* has no such tensor"),
        ("llama", "vision_tower.proj.weight", r"Llama \(llama, 2 layers.*\) has no such tensor"),
    ],
)
def test_an_unexpected_tensor_is_refused_naming_it(
    model_dirs: Callable[[str], Path], tmp_path: Path, model: str, name: str, why: str
) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.randn(64)

    path = _with(model_dirs(model), tmp_path / "m", add)
    with pytest.raises(ModelLoadError, match=f"unexpected tensor {name}: {why}") as err:
        load_model(path, device="cpu")
    assert err.value.tensor == name


def test_missing_and_misshapen_tensors_are_named(
    model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    gone = _with(model_dirs("llama"), tmp_path / "gone", lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=f"tensor '{name}' is missing") as err:
        load_model(gone, device="cpu")
    assert err.value.tensor == name

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1]

    bad = _with(model_dirs("llama"), tmp_path / "bad", shrink)
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \(127, 64\) .* needs \(128, 64\)"):
        load_model(bad, device="cpu")


def test_a_tied_head_is_accepted_only_when_it_is_the_embedding(
    model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    src = model_dirs("llama3rope")

    def same(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    model = load_model(_with(src, tmp_path / "same", same), device="cpu")
    assert model.lm_head.data_ptr() == model.embed.data_ptr()

    def other(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0

    with pytest.raises(ModelLoadError, match=r"unexpected tensor lm_head\.weight: .*tie_word"):
        load_model(_with(src, tmp_path / "other", other), device="cpu")


def test_saved_rope_frequencies_are_checked_against_the_config(
    model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    src = model_dirs("linrope")  # linear scaling: older transformers saved either set
    cfg = ModelConfig.from_dir(src)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    for kind in ("linear", "default"):
        inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, kind, cfg.rope_params)

        def put(t: dict[str, torch.Tensor], inv: torch.Tensor = inv) -> None:
            t[name] = inv.clone()

        load_model(_with(src, tmp_path / kind, put), device="cpu")

    def wrong(t: dict[str, torch.Tensor]) -> None:
        t[name] = inv_frequencies(cfg.head_dim, 500000.0, "default", {})

    with pytest.raises(ModelLoadError, match=f"unexpected tensor {name}: .*rope_theta=10000"):
        load_model(_with(src, tmp_path / "wrong", wrong), device="cpu")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_checkpoints_leave_no_parameter_at_an_init_constant(
    model_dirs: Callable[[str], Path], name: str
) -> None:
    """Norm gains, biases and weights are all random: a loader that dropped one (transformers
    initialises it to 1 or 0) could not go unnoticed by the equivalence tests."""
    root = model_dirs(name)
    files = sorted(root.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    cfg = ModelConfig.from_dict(json.loads((root / "config.json").read_text()))
    assert set(tensors) == set(expected_tensors(cfg))
    for key, tensor in tensors.items():
        assert tensor.unique().numel() > tensor.numel() // 2, f"{key} is (nearly) constant"
