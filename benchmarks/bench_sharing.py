"""Weight memory of 3 processes holding one ~200 MB model: ``of.shared_module`` vs private copies.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_sharing.py [--width 2048] [--depth 12]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_sharing.py --engines [--layers 16]

``--engines``: two ``TorchEngine`` replicas of one tiny-Llama checkpoint (~250 MB with the
default 16 layers) in two processes (``tests.compute._engine_share_worker``), alive together,
with shared weights (the default) and with ``share_weights=False``: the sum of their PSS above
baseline against one copy (the checkpoint's safetensors size), and their greedy tokens compared
with each other's. Each replica's PSS is read from outside (``/proc/PID/smaps_rollup``) once
both have generated, so neither counts the shared copy as its own before the other mapped it.

Each process (``omniflow.testing._share_worker``) reads its proportional set size (``Pss`` of
``/proc/self/smaps_rollup``) once torch is imported (its baseline), then loads the MLP either
through ``of.shared_module`` (one host-shm copy, the first process loads it) or privately
(``load_state_dict``), runs one forward pass (so every weight page is touched) and reads its PSS
again. The sum over the three of (PSS - baseline) is compared with one copy's size. The outputs
of every process are hashed and compared with a private copy's, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid

from omniflow.testing._share_worker import make_weights, pss_kb


def _spawn(mode: str, key: str, wdir: str, width: int, depth: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omniflow.testing._share_worker",
            mode,
            key,
            wdir,
            str(width),
            str(depth),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _line(proc: subprocess.Popen[str], word: str) -> list[str]:
    assert proc.stdout is not None
    parts = proc.stdout.readline().split()
    if not parts or parts[0] != word:
        raise RuntimeError(f"worker said {parts!r}, expected {word!r}")
    return parts[1:]


def _ask(proc: subprocess.Popen[str], cmd: str, word: str) -> list[str]:
    assert proc.stdin is not None
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return _line(proc, word)


def run(mode: str, wdir: str, width: int, depth: int) -> tuple[int, set[str], float]:
    key = f"bench-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    procs = [_spawn(mode, key, wdir, width, depth) for _ in range(3)]
    bases = [int(_line(p, "base")[0]) for p in procs]
    for p in procs:
        _line(p, "ready")
    ready_s = time.perf_counter() - t0
    outs = {_ask(p, "run", "out")[0] for p in procs}
    total = sum(int(_ask(p, "pss", "pss")[0]) - b for p, b in zip(procs, bases, strict=True))
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("quit\n")
        p.stdin.close()
        p.wait()
        assert p.stdout is not None
        p.stdout.close()
    return total, outs, ready_s


def run_engines(mode: str, model: str, n: int = 2) -> tuple[int, set[str], float]:
    """``n`` TorchEngine replicas of ``model``, alive together: (sum of PSS above baseline in
    KiB, their greedy token ids, seconds until all generated)."""
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.compute._engine_share_worker", mode, model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        bases = [int(_line(p, "base")[0]) for p in procs]
        outs = {_line(p, "out")[0] for p in procs}
        ready_s = time.perf_counter() - t0
        # every replica has generated and blocks on stdin: read each PSS from outside now
        total = sum(pss_kb(p.pid) - b for p, b in zip(procs, bases, strict=True))
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    return total, outs, ready_s


def engines(layers: int) -> None:
    from omniflow.compute._tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            os.path.join(tmp, "m"), hidden_size=640, layers=layers, heads=10, kv_heads=10
        )
        copy_kb = sum(f.stat().st_size for f in model.glob("*.safetensors")) // 1024
        print(f"checkpoint: tiny Llama, {layers} layers, float32 = {copy_kb / 1024:.1f} MiB")
        results = {}
        for mode in ("shared", "private"):
            total, outs, ready_s = run_engines(mode, str(model))
            results[mode] = outs
            print(
                f"{mode:8s}: 2 TorchEngine replicas use {total / 1024:7.1f} MiB PSS above "
                f"baseline = {total / copy_kb:.2f}x one copy (generated after {ready_s:.1f} s)"
            )
        same = len(results["shared"] | results["private"]) == 1
        print(f"tokens of the 2 shared and 2 private replicas identical: {same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--engines", action="store_true", help="two TorchEngine replicas instead")
    ap.add_argument("--layers", type=int, default=16, help="--engines: the checkpoint's layers")
    args = ap.parse_args()
    if args.engines:
        engines(args.layers)
        return
    copy_kb = args.depth * (args.width * args.width + args.width) * 4 // 1024
    with tempfile.TemporaryDirectory() as tmp:
        wdir = os.path.join(tmp, "w")
        make_weights(wdir, args.width, args.depth)
        print(
            f"model: {args.depth} x Linear({args.width}, {args.width}) float32 = "
            f"{copy_kb / 1024:.1f} MiB per copy"
        )
        results = {}
        for mode in ("shared", "private"):
            total, outs, ready_s = run(mode, wdir, args.width, args.depth)
            results[mode] = outs
            print(
                f"{mode:8s}: 3 processes use {total / 1024:7.1f} MiB PSS above baseline = "
                f"{total / copy_kb:.2f}x one copy (all ready after {ready_s:.1f} s)"
            )
        same = len(results["shared"] | results["private"]) == 1
        print(f"outputs of the 3 shared and 3 private processes identical bit for bit: {same}")


if __name__ == "__main__":
    main()
