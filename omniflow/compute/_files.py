"""The weight files of a Hugging Face-format checkpoint directory (the loader and
``shared_module`` read the same shards).

>>> shard_files(Path("models/tiny"))                          # doctest: +SKIP
[PosixPath('models/tiny/model.safetensors')]
"""

from __future__ import annotations

import json
from pathlib import Path

from omniflow.compute._errors import ModelLoadError

__all__ = ["shard_files"]


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise ModelLoadError(
                f"{index} names shards that are not on disk: {missing}", path=str(index)
            )
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"model directory {str(model_dir)!r} has no *.safetensors weights "
            "(pytorch_model.bin is not read: convert it with "
            "save_pretrained(safe_serialization=True))",
            path=str(model_dir),
        )
    return files
