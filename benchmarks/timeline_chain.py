"""Where a call of the 3-worker chain spends its µs, across the front and the workers.

Each process (the front here, and each worker through a ``sitecustomize`` this script puts
first on the workers' ``PYTHONPATH``) stamps ``time.perf_counter()`` (CLOCK_MONOTONIC: one
clock for every process on the machine) on entry to, and where marked on exit from, a few
functions of the hop's path. The stamps of all processes are merged per call (the front's
window around ``await rt.run(...)``) and each step is printed at its median time from the
call's start, with its median gap from the step before. Workers are named c1, c2, c3 by the
order their runs start. The wrappers cost ~0.5 µs a stamp: read differences, not absolutes.

    .venv/bin/python benchmarks/timeline_chain.py              # 3,000 calls, a few seconds
"""

from __future__ import annotations

import argparse
import bisect
import os
import pickle
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import bench_multiprocess as bm  # (beside this file: the script's directory is on sys.path)

#: The hooks, installed in every process that imports this text (the workers through the
#: ``sitecustomize`` it becomes; the front by ``exec``). ``TRACE_DIR`` names the folder each
#: process writes its stamps to; nothing happens without it.
HOOKS = """
import atexit, os, pickle, time

STAMPS = []


def dump():
    if STAMPS:
        with open(os.path.join(os.environ["OMNIFLOW_TRACE_DIR"], f"{os.getpid()}.pkl"), "ab") as f:
            pickle.dump(STAMPS[:], f)
        STAMPS.clear()


def _wrap(owner, name, tag, leave):
    f = getattr(owner, name)
    now, stamps = time.perf_counter, STAMPS

    def entered(*a, **k):
        stamps.append((tag, now()))
        return f(*a, **k)

    def both(*a, **k):
        stamps.append((tag, now()))
        try:
            return f(*a, **k)
        finally:
            stamps.append((tag + "/x", now()))
            if len(stamps) > 50_000:
                dump()

    setattr(owner, name, both if leave else entered)


def install():
    from omniflow.cluster import _remote, _worker
    from omniflow.runtime import _call, _runtime
    from omniflow.transport import _udsendpoint, _udswire

    for owner, name, tag, leave in (
        (_runtime.Runtime, "_submit", "submit", False),
        (_remote.RemoteRoles, "submit", "run bound or sent", False),
        (_remote.RemoteRoles, "_on_message", "message", True),
        (_call.Call, "_finish", "finish", False),
        (_udsendpoint.UdsEndpoint, "_on_readable", "readable", True),
        (_udsendpoint.UdsEndpoint, "try_send", "send", True),
        (_udswire.Conn, "read", "read", True),
        (_worker.Worker, "_take", "take", False),
        (_worker, "decode_msg", "decode", True),
        (_worker.Worker, "_run", "run", False),
        (_worker, "first_step", "method", True),
        (_worker.Worker, "_done", "done", True),
        (_worker.Worker, "_link_send", "forward", True),
    ):
        _wrap(owner, name, tag, leave)
    atexit.register(dump)


if os.environ.get("OMNIFLOW_TRACE_DIR"):
    install()
"""


def load(folder: Path) -> dict[int, list[tuple[str, float]]]:
    out: dict[int, list[tuple[str, float]]] = {}
    for path in folder.glob("*.pkl"):
        stamps: list[tuple[str, float]] = []
        with path.open("rb") as f:
            while True:
                try:
                    stamps += pickle.load(f)
                except EOFError:
                    break
        out[int(path.stem)] = stamps
    return out


def report(windows: list[tuple[float, float]], stamps: dict[int, list[tuple[str, float]]]) -> None:
    front = os.getpid()
    merged = sorted((t, pid, tag) for pid, ss in stamps.items() for tag, t in ss)
    times = [m[0] for m in merged]
    per_call = []
    for t0, t1 in windows:
        i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        per_call.append((t0, t1, merged[i:j]))
    # Workers by the order their runs start (the order of the chain).
    order = Counter()
    for _t0, _t1, events in per_call:
        starts = [pid for _t, pid, tag in events if tag == "run" and pid != front]
        order[tuple(dict.fromkeys(starts))] += 1
    chain = order.most_common(1)[0][0] if order else ()
    name = {pid: f"c{k + 1}" for k, pid in enumerate(chain)} | {front: "front"}
    at: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for t0, _t1, events in per_call:
        seen: Counter[tuple[str, str]] = Counter()
        for t, pid, tag in events:
            who = name.get(pid, str(pid))
            seen[(who, tag)] += 1
            at[(who, tag, seen[(who, tag)])].append((t - t0) * 1e6)
    total = [(t1 - t0) * 1e6 for t0, t1, _ in per_call]
    at[("front", "caller resumed", 1)] = total
    steps = sorted(
        ((statistics.median(v), key) for key, v in at.items() if len(v) >= 0.9 * len(per_call)),
    )
    print(f"{len(per_call)} calls, p50 {statistics.median(total):.0f} µs (traced)\n")
    print("| process | step | at (µs, median) | after the step before |")
    print("|---|---|---:|---:|")
    prev = 0.0
    for t, (who, tag, k) in steps:
        label = tag if k == 1 else f"{tag} #{k}"
        print(f"| {who} | {label} | {t:.1f} | +{t - prev:.1f} |")
        prev = t


async def main(calls: int) -> None:
    with tempfile.TemporaryDirectory(prefix="omniflow-trace-") as name:
        folder = Path(name)
        (folder / "sitecustomize.py").write_text(HOOKS)
        os.environ["OMNIFLOW_TRACE_DIR"] = name
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (name, os.getcwd(), os.environ.get("PYTHONPATH", "")) if p
        )
        hooks: dict[str, object] = {"__name__": "omniflow_trace_hooks"}
        exec(HOOKS, hooks)
        g = bm.load()["bm_chain3"]
        windows = []
        async with bm.in_workers(g, fast_path=True) as rt:
            for i in range(300):
                await rt.run("bm_chain3", {"x": i})
            hooks["STAMPS"].clear()  # type: ignore[attr-defined]
            for _ in range(calls):
                t0 = time.perf_counter()
                await rt.run("bm_chain3", {"x": 1})
                windows.append((t0, time.perf_counter()))
        hooks["dump"]()  # type: ignore[operator]
        stamps = load(folder)
    report(windows, stamps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument(
        "--loop", choices=("auto", "asyncio", "uvloop"), default="auto", help=bm.LOOP_HELP
    )
    args = parser.parse_args()
    bm.run_front(main(args.calls), args.loop)
