"""Buffer-pool data path vs. memcpy, pickle over ZMQ and torch.multiprocessing, between processes.

    .venv/bin/python benchmarks/bench_pool.py [--sizes-mb 1,64,512] [--repeats 30,8,3]

For each payload size it times, median over repeats after one warm-up:

(a) memcpy: ``np.copyto`` of the payload into a preallocated array, one core, one process.
(b) pool: the owner process ``put_array``s the payload into a block (write), sends the handle
    over a pipe, and a second process copies the block out into a preallocated array (read).
    End-to-end runs from the start of the write to the end of the read.
(c) pickle+ZMQ: ``pickle.dumps`` (protocol 5, in band) sent over a pyzmq PUSH/PULL ``ipc://``
    socket, ``pickle.loads`` in the second process.
(d) torch.mp Queue: a fresh CPU tensor put on a ``torch.multiprocessing`` queue (which moves it
    to shared memory) and copied out in the second process; skipped without torch.

End-to-end times span two processes and use ``time.perf_counter`` (CLOCK_MONOTONIC on Linux,
the same clock in every process). GB/s means 1e9 bytes per second of payload. At most about
three copies of the largest payload are alive at once (1.5 GB for 512 MB).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from omniflow.data import PoolAttachment, SharedBufferPool

MB = 1 << 20
CHUNK = 1 << 20
SPAWN = mp.get_context("spawn")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def payload(nbytes: int, fill: int = 7) -> np.ndarray:
    array = np.empty(nbytes, dtype=np.uint8)
    array.fill(fill)  # touch every page: an untouched array reads as the shared zero page
    return array


def with_consumer(
    target: Callable[..., None], args: tuple[Any, ...], step: Callable[[Connection, int], float]
) -> Callable[[int], list[float]]:
    """Run ``target(conn, *args)`` in a spawned process; ``step(conn, i)`` times one transfer."""

    def run(rounds: int) -> list[float]:
        here, there = SPAWN.Pipe()
        proc = SPAWN.Process(target=target, args=(there, *args), daemon=True)
        proc.start()
        try:
            assert here.recv() == "ready"
            return [step(here, i) for i in range(rounds)]
        finally:
            here.send(None)
            proc.join(30)

    return run


# -- (a) memcpy -------------------------------------------------------------------------------


def bench_memcpy(nbytes: int, rounds: int) -> dict[str, float]:
    src, dst = payload(nbytes), payload(nbytes, 0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return {"memcpy": gbps(nbytes, statistics.median(times[1:]))}


# -- (b) pool ---------------------------------------------------------------------------------


def pool_consumer(conn: Connection, name: str, nbytes: int) -> None:
    dst = payload(nbytes, 0)
    with PoolAttachment(name) as slab:
        conn.send("ready")
        while (handle := conn.recv()) is not None:
            t0 = time.perf_counter()
            np.copyto(dst, slab.get_array(handle))
            conn.send((t0, time.perf_counter()))
    assert dst[0] == dst[-1] == 7


def bench_pool(nbytes: int, rounds: int) -> dict[str, float]:
    src = payload(nbytes)
    writes, reads = [], []
    with SharedBufferPool(nbytes, chunk_size=CHUNK) as pool:

        def step(conn: Connection, _: int) -> float:
            t0 = time.perf_counter()
            handle = pool.put_array(src, owner="bench")
            writes.append(time.perf_counter() - t0)
            conn.send(handle)  # the control message: a ~60-byte tuple
            read_start, read_end = conn.recv()
            reads.append(read_end - read_start)
            pool.release(handle, owner="bench")
            return float(read_end) - t0

        ends = with_consumer(pool_consumer, (pool.name, nbytes), step)(rounds)
        pool.validate()
    return {
        "pool_write": gbps(nbytes, statistics.median(writes[1:])),
        "pool_read": gbps(nbytes, statistics.median(reads[1:])),
        "pool": gbps(nbytes, statistics.median(ends[1:])),
    }


# -- (c) pickle over ZMQ ----------------------------------------------------------------------


def zmq_consumer(conn: Connection, address: str) -> None:
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as sock:
        sock.connect(address)
        conn.send("ready")
        while conn.recv() is not None:
            frame = sock.recv(copy=False)
            array = pickle.loads(frame.buffer)
            del frame, array
            conn.send(time.perf_counter())


def bench_zmq(nbytes: int, rounds: int) -> dict[str, float]:
    import zmq

    src = payload(nbytes)
    with tempfile.TemporaryDirectory() as tmp, zmq.Context() as ctx:
        address = f"ipc://{tmp}/bench.sock"
        with ctx.socket(zmq.PUSH) as sock:
            sock.bind(address)

            def step(conn: Connection, _: int) -> float:
                conn.send("go")  # the consumer waits in recv before the clock starts
                t0 = time.perf_counter()
                sock.send(pickle.dumps(src, protocol=5), copy=False)
                return float(conn.recv()) - t0

            times = with_consumer(zmq_consumer, (address,), step)(rounds)
    return {"zmq": gbps(nbytes, statistics.median(times[1:]))}


# -- (d) torch.multiprocessing Queue ----------------------------------------------------------


def torch_consumer(conn: Connection, queue: Any, nbytes: int) -> None:
    import torch

    torch.set_num_threads(1)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    conn.send("ready")
    while conn.recv() is not None:
        tensor = queue.get()
        dst.copy_(tensor)
        del tensor
        conn.send(time.perf_counter())


def bench_torch(nbytes: int, rounds: int) -> dict[str, float]:
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        return {}
    torch.set_num_threads(1)
    queue = tmp.get_context("spawn").Queue()
    held: list[Any] = []

    def step(conn: Connection, i: int) -> float:
        held.clear()  # the consumer is done with the previous tensor
        tensor = torch.empty(nbytes, dtype=torch.uint8).fill_(i & 0xFF)  # fresh, untimed
        held.append(tensor)
        conn.send("go")
        t0 = time.perf_counter()
        queue.put(tensor)
        return float(conn.recv()) - t0

    times = with_consumer(torch_consumer, (queue, nbytes), step)(rounds)
    held.clear()
    return {"torch": gbps(nbytes, statistics.median(times[1:]))}


# -- report -----------------------------------------------------------------------------------


def table(results: dict[int, dict[str, float]]) -> str:
    head = (
        "| size | memcpy | pool write | pool read | pool end-to-end | pickle+ZMQ | torch.mp Queue "
        "| pool / pickle+ZMQ | pool / memcpy |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for size, r in results.items():
        torch = f"{r['torch']:.2f}" if "torch" in r else "n/a"
        rows.append(
            f"| {size} MB | {r['memcpy']:.2f} | {r['pool_write']:.2f} | {r['pool_read']:.2f} "
            f"| {r['pool']:.2f} | {r['zmq']:.2f} | {torch} | {r['pool'] / r['zmq']:.1f}x "
            f"| {r['pool'] / r['memcpy']:.2f}x |"
        )
    return head + "\n".join(rows) + "\n\nAll figures GB/s (1e9 bytes/s), median of repeats.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="1,64,512")
    parser.add_argument("--repeats", default="30,8,3", help="timed repeats per size (+1 warm-up)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    repeats = [int(r) for r in args.repeats.split(",")]
    results: dict[int, dict[str, float]] = {}
    for size, rounds in zip(sizes, repeats, strict=True):
        nbytes, row = size * MB, {}
        for bench in (bench_memcpy, bench_pool, bench_zmq, bench_torch):
            part = bench(nbytes, rounds + 1)
            row.update(part)
            print(
                f"{size} MB {bench.__name__}: " + ", ".join(f"{k} {v:.2f}" for k, v in part.items())
            )
        results[size] = row
    print()
    print(table(results))


if __name__ == "__main__":
    main()
