"""Tensors between two worker processes through the omniflow runtime, vs. the alternatives.

    .venv/bin/python benchmarks/bench_data_plane.py [--sizes-mb 1,64,512] [--repeats 30,8,3]
    .venv/bin/python benchmarks/bench_data_plane.py --sizes-mb 64 --repeats 8 --only zmq

A float32 tensor of each size (MiB) goes from a producer node in one worker process to a
consumer node in another, and the consumer sums one element per 4 KiB page of what it got
(so every page is touched, and a lazily mapped view pays its page faults). Timed, median over
the repeats after one warm-up:

(a) omniflow shm: ``Runtime(graph, placement="process")``; the producer's worker puts the
    tensor in its buffer pool, a DataRef rides the control messages, the consumer reads a
    zero-copy view of the producer's slab.
(b) omniflow zmq pull: the same, with ``connectors={edge: "zmq"}``: the consumer pulls the
    block's bytes from the producer over ZMQ (the cross-host path, here on one host).
(c) omniflow inline ("pickle over ZMQ"): the same runtime with ``data_threshold=2**62``, so
    the tensor rides the control messages through the codec, worker -> front -> worker.
(d) torch.multiprocessing Queue: a fresh tensor ``put`` by this process (which moves it into
    a new shared-memory segment) and ``get`` by a spawned consumer that touches every page.
(e) memcpy: a single-core ``np.copyto`` of the same bytes into a preallocated array.

Transfer time runs from the producer handing the tensor over (``time.perf_counter()`` taken in
the producer right before ``return``) to the consumer having touched every page
(``perf_counter()`` there); perf_counter is CLOCK_MONOTONIC on Linux, one clock for every
process. "call" is the whole ``rt.run`` as the caller sees it (front -> producer -> front ->
consumer -> front). GB/s = 1e9 bytes of payload per second.

The worker pools default to 256 MiB; this script sets ``OMNIFLOW_POOL_BYTES`` (inherited by
the workers the front spawns) to twice the largest size so 512 MiB fits. Workers import this
file by path to rebuild the roles, so everything below ``main`` is module level and cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import omniflow as of

MB = 1 << 20
PAGE_ELEMS = 4096 // 4  # float32 elements per 4 KiB page
EDGE = ("bsrc.run", "bdst.run")


class BenchSrc(of.Role):
    """Hands over a float32 tensor of ``nbytes`` (made once per size, pages touched)."""

    def __init__(self) -> None:
        self._made: dict[int, Any] = {}

    async def setup(self) -> None:
        import torch

        torch.set_num_threads(1)

    @of.interface(inputs_or=[["nbytes"]], outputs=["t", "t0"])
    async def run(self, nbytes: int) -> dict[str, Any]:
        import torch

        t = self._made.get(nbytes)
        if t is None:
            self._made.clear()
            t = self._made[nbytes] = torch.ones(nbytes // 4, dtype=torch.float32)
        return {"t": t, "t0": time.perf_counter()}


class BenchDst(of.Role):
    """Sums one element per page of what it received; reports when it was done."""

    async def setup(self) -> None:
        import torch

        torch.set_num_threads(1)

    @of.interface(inputs_or=[["t"]], outputs=["t1", "pages"])
    async def run(self, t: Any) -> dict[str, Any]:
        pages = float(t[::PAGE_ELEMS].sum())
        return {"t1": time.perf_counter(), "pages": pages}


graph = of.Graph(
    "bench_dp",
    roles={"bsrc": BenchSrc(), "bdst": BenchDst()},
    inputs=[of.Placeholder("nbytes")],
    outputs=["t0", "t1", "pages"],
)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- (a)-(c) through the runtime --------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and every process below it (the workers)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


async def bench_runtime(
    sizes: list[int], repeats: list[int], **kw: Any
) -> dict[int, tuple[float, float, int, float]]:
    """size -> (median transfer s, median call s, producer's offloaded values, CPU s per call
    summed over the front and the workers)."""
    out = {}
    (g,) = of.load_graphs(__file__)  # by path: run as __main__, workers must find it again
    async with of.Runtime(g, placement="process", **kw) as rt:
        before = 0
        for size, rounds in zip(sizes, repeats, strict=True):
            nbytes = size * MB
            transfers, calls = [], []
            for i in range(rounds + 1):
                if i == 1:
                    cpu0 = cpu_seconds()
                t = time.perf_counter()
                r = await rt.run("bench_dp", {"nbytes": nbytes})
                calls.append(time.perf_counter() - t)
                transfers.append(r["t1"][0] - r["t0"][0])
                assert r["pages"] == [nbytes / 4 / PAGE_ELEMS], r["pages"]
            cpu = (cpu_seconds() - cpu0) / rounds
            stats = await rt.pool_stats()
            offloaded = sum(s["offloaded"] for s in stats.values()) - before
            before += offloaded
            out[size] = (statistics.median(transfers[1:]), statistics.median(calls[1:]),
                         offloaded, cpu)  # fmt: skip
        assert rt.stats()["data_plane_bytes"] == 0
    return out


# -- (d) torch.multiprocessing Queue ----------------------------------------------------------


def torch_consumer(conn: Connection, queue: Any) -> None:
    import torch

    torch.set_num_threads(1)
    conn.send("ready")
    while conn.recv() is not None:
        tensor = queue.get()
        pages = float(tensor[::PAGE_ELEMS].sum())
        t1 = time.perf_counter()
        del tensor
        conn.send((t1, pages))


def bench_torch(sizes: list[int], repeats: list[int]) -> dict[int, float]:
    import torch
    import torch.multiprocessing as tmp

    torch.set_num_threads(1)
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=torch_consumer, args=(there, queue), daemon=True)
    proc.start()
    out = {}
    try:
        assert here.recv() == "ready"
        for size, rounds in zip(sizes, repeats, strict=True):
            nbytes = size * MB
            times = []
            for _ in range(rounds + 1):
                tensor = torch.ones(nbytes // 4, dtype=torch.float32)  # fresh, untimed
                here.send("go")
                t0 = time.perf_counter()
                queue.put(tensor)
                t1, pages = here.recv()
                assert pages == nbytes / 4 / PAGE_ELEMS
                times.append(t1 - t0)
                del tensor
            out[size] = statistics.median(times[1:])
    finally:
        here.send(None)
        proc.join(30)
        queue.close()
    return out


# -- (e) memcpy -------------------------------------------------------------------------------


def bench_memcpy(sizes: list[int], repeats: list[int]) -> dict[int, float]:
    out = {}
    for size, rounds in zip(sizes, repeats, strict=True):
        src = np.ones(size * MB // 4, dtype=np.float32)
        dst = np.zeros_like(src)  # zeros_like writes: pages are faulted in before timing
        dst.fill(0)
        times = []
        for _ in range(rounds + 1):
            t = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t)
        out[size] = statistics.median(times[1:])
        del src, dst
    return out


# -- report -----------------------------------------------------------------------------------


def table(sizes: list[int], r: dict[str, Any]) -> str:
    lines = [
        "| size | omniflow shm | omniflow zmq pull | omniflow inline (pickle over ZMQ) "
        "| torch.mp Queue | memcpy | shm / inline | shm / memcpy | shm / torch.mp "
        "| call ms: shm / zmq / inline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        nbytes = size * MB
        shm, zmq, inline = (r[k][size][0] for k in ("shm", "zmq", "inline"))
        bw = {
            k: gbps(nbytes, v)
            for k, v in (("shm", shm), ("zmq", zmq), ("inline", inline),
                         ("torch", r["torch"][size]), ("memcpy", r["memcpy"][size]))
        }  # fmt: skip
        calls = " / ".join(f"{r[k][size][1] * 1e3:.1f}" for k in ("shm", "zmq", "inline"))
        lines.append(
            f"| {size} MiB | {bw['shm']:.2f} | {bw['zmq']:.2f} | {bw['inline']:.2f} "
            f"| {bw['torch']:.2f} | {bw['memcpy']:.2f} | {bw['shm'] / bw['inline']:.1f}x "
            f"| {bw['shm'] / bw['memcpy']:.0%} | {bw['shm'] / bw['torch']:.1f}x | {calls} |"
        )
    lines.append("")
    lines.append("Transfer GB/s (1e9 bytes/s), median of repeats; call = whole rt.run, median.")
    return "\n".join(lines)


def calls_table(sizes: list[int], r: dict[str, Any]) -> str:
    """Whole-call wall time and CPU time (all processes) of the runtime paths that ran."""
    modes = [k for k in ("shm", "zmq", "inline") if k in r]
    lines = [
        "| size | " + " | ".join(f"{k} call ms | {k} CPU ms" for k in modes) + " |",
        "|---:|" + "---:|---:|" * len(modes),
    ]
    for size in sizes:
        cells = " | ".join(f"{r[k][size][1] * 1e3:.1f} | {r[k][size][3] * 1e3:.1f}" for k in modes)
        lines.append(f"| {size} MiB | {cells} |")
    lines.append("")
    lines.append("call = whole rt.run, median; CPU = user + system of the front and its workers "
                 "per call, mean over the repeats.")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="1,64,512", help="tensor sizes in MiB")
    parser.add_argument("--repeats", default="30,8,3", help="timed repeats per size (+1 warm-up)")
    parser.add_argument(
        "--only", action="append", choices=PATHS, help="these paths only (repeatable)"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    repeats = [int(n) for n in args.repeats.split(",")]
    only = args.only or list(PATHS)
    os.environ["OMNIFLOW_POOL_BYTES"] = str(max(256, 2 * max(sizes)) * MB)
    results: dict[str, Any] = {}
    t = time.perf_counter()
    if "memcpy" in only:
        results["memcpy"] = bench_memcpy(sizes, repeats)
    if "shm" in only:
        results["shm"] = asyncio.run(bench_runtime(sizes, repeats))
    if "zmq" in only:
        results["zmq"] = asyncio.run(bench_runtime(sizes, repeats, connectors={EDGE: "zmq"}))
    if "inline" in only:
        results["inline"] = asyncio.run(bench_runtime(sizes, repeats, data_threshold=2**62))
    if "torch" in only:
        results["torch"] = bench_torch(sizes, repeats)
    for i, size in enumerate(sizes):  # the data plane carried the tensor in shm and zmq only
        for k in ("shm", "zmq"):
            assert k not in results or results[k][size][2] == repeats[i] + 1
        assert "inline" not in results or results["inline"][size][2] == 0
    print(f"python {sys.version.split()[0]}, nproc {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.1f}, {time.perf_counter() - t:.0f} s\n")  # fmt: skip
    if args.only is None:
        print(table(sizes, results))
        print()
    print(calls_table(sizes, results))


PATHS = ("memcpy", "shm", "zmq", "inline", "torch")


if __name__ == "__main__":
    main()
