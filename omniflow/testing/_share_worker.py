"""A process that holds an MLP through ``of.shared_module`` (or a private copy) and answers a line
protocol on stdin/stdout, for the sharing tests and ``benchmarks/bench_sharing.py``.

    python -m omniflow.testing._share_worker shared|private KEY WEIGHTS_DIR WIDTH DEPTH

Prints ``base <pss_kb>`` once torch is imported, then ``ready <pss_kb> <owner 0|1>``; then per
command line: ``run`` -> ``out <sha256 of the output bytes>``, ``weights`` -> ``w <sha256 of every
weight>``, ``pss`` -> ``pss <kb>``, ``load <dir>`` -> ``loaded`` (load_state_dict of that
checkpoint into the module), ``quit`` -> exits.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def pss_kb(pid: int | str = "self") -> int:
    """Proportional set size from ``/proc/PID/smaps_rollup``, in kB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def build_mlp(width: int, depth: int) -> torch.nn.Module:
    import torch

    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def make_weights(path: str, width: int, depth: int, seed: int = 0) -> None:
    """A random checkpoint for ``build_mlp(width, depth)`` at ``path/model.safetensors``."""
    import os

    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(depth):
        tensors[f"{2 * i}.weight"] = torch.randn(width, width, generator=gen) / width**0.5
        tensors[f"{2 * i}.bias"] = torch.randn(width, generator=gen) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


async def _main(mode: str, key: str, weights: str, width: int, depth: int) -> None:
    import torch

    torch.set_num_threads(1)  # bit-identical matmuls across processes
    out = sys.stdout
    out.write(f"base {pss_kb()}\n")
    out.flush()
    owner = 1
    if mode == "shared":
        from omniflow.compute import SkipCopyParameter, shared_module

        module = await shared_module(key, lambda: build_mlp(width, depth), weights)
        owner = int(not isinstance(next(module.parameters()), SkipCopyParameter))
    else:
        from safetensors.torch import load_file

        module = build_mlp(width, depth)
        module.load_state_dict(load_file(weights + "/model.safetensors"))
        module.requires_grad_(False)
    x = torch.linspace(-1, 1, 4 * width).reshape(4, width)
    out.write(f"ready {pss_kb()} {owner}\n")
    out.flush()
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "run":
            with torch.no_grad():
                out.write(f"out {_digest([module(x)])}\n")
        elif cmd == "weights":
            out.write(f"w {_digest(list(module.state_dict().values()))}\n")
        elif cmd == "pss":
            out.write(f"pss {pss_kb()}\n")
        elif cmd == "load":
            from safetensors.torch import load_file

            module.load_state_dict(load_file(arg + "/model.safetensors"))
            out.write("loaded\n")
        elif cmd == "quit":
            return
        out.flush()


if __name__ == "__main__":
    _mode, _key, _weights, _width, _depth = sys.argv[1:6]
    asyncio.run(_main(_mode, _key, _weights, int(_width), int(_depth)))
