"""Params Pool: match+pin of a 2,048-token prefix, L2->L1 readback vs memcpy, Redis round trips.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kvpool.py [--repeats 20] [--layers 4]

Layout: ``--layers`` sub_names x {k, v}, 8 heads x 128 dims, float16, 16 tokens per page, so
one page of one (layer, slice) is 32 KiB and a page of 4 layers is 256 KiB; the prefix is 128
pages (2,048 tokens, 32 MiB for 4 layers). Medians over ``--repeats`` after one warm-up:

(a) local: ``match`` + ``release`` of the 128-page prefix held in L1, in-memory metadata.
(b) redis: the same with metadata in a private Redis; reports Redis requests per match (every
    match is one MATCH script, which also takes the session's run lock on an owner's first
    match of it -- each repeat here is a new owner).
(c) shared L2, other process: process A holds the chain in its L2; B's match maps it in place.
(d) pulled, other process: A on another "node" (``host=``): B locks, pulls (one request over
    ZMQ), writes into L1, unlocks and registers as a provider; B drops its copy between repeats.
(e) readback: 128 pages L2 -> L1 with the batched tier copy (one torch thread everywhere), and
    end to end through ``match`` (take + one plan + in-memory metadata + copy; the chain's
    hashes are computed once, outside the timing), as GB/s and as a fraction of a plain
    ``copy_`` of the same bytes between two preallocated contiguous tensors (memcpy).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

import omniflow as of
from omniflow.data.kv._slots import L1, L2, Move
from omniflow.testing import redis_server
from omniflow.transport._auth import KEY_ENV, generate_key

PAGES = 128
SPAWN = mp.get_context("spawn")


def layout(layers: int) -> of.PageLayout:
    subs = tuple(f"layer{i}" for i in range(layers))
    return of.PageLayout(subs, {"k": (8, 128), "v": (8, 128)}, page_tokens=16, dtype="float16")


def chain() -> list[str]:
    return of.chain_hashes([list(range(i * 16, i * 16 + 16)) for i in range(PAGES)])


async def publish(pool: of.ParamsPool, session: str | None = "bench") -> None:
    slots = await pool.alloc("writer", PAGES)
    for slot in slots:
        for sub, sl in pool.layout.coords():
            pool.view(slot, sub, sl).fill_(float(slot % 7))
    await pool.publish(session, chain(), slots)
    await pool.release("writer")


async def time_matches(pool: of.ParamsPool, repeats: int) -> tuple[float, float]:
    keys = chain()
    times, trips = [], []
    meta = pool._meta
    assert meta is not None
    for i in range(repeats + 1):
        before = meta.round_trips
        t0 = time.perf_counter()
        m = await pool.match("bench", keys, f"reader-{i}")
        t1 = time.perf_counter()
        assert m.pages == PAGES, m.pages
        trips.append(meta.round_trips - before)
        await pool.release(f"reader-{i}")
        if i:
            times.append(t1 - t0)
    return statistics.median(times) * 1e3, statistics.median(trips)


def provider(layers: int, url: str, host: str | None, ready: Any, done: Any) -> None:
    async def main() -> None:
        pool = of.ParamsPool("kv", layout(layers), {"l1": PAGES, "l2": 2 * PAGES},
                             metadata=url, host=host)  # fmt: skip
        await publish(pool)
        if host is None:  # same node: move the chain to L2 where B maps it
            await pool.alloc("burst", PAGES)
            await pool.release("burst")
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 300)
        await pool.aclose()

    asyncio.run(main())


async def across_processes(layers: int, url: str, host: str | None, repeats: int) -> float:
    ready, done = SPAWN.Event(), SPAWN.Event()
    proc = SPAWN.Process(target=provider, args=(layers, url, host, ready, done))
    proc.start()
    try:
        assert ready.wait(120)
        times = []
        pool = of.ParamsPool("kv", layout(layers), {"l1": PAGES, "l2": 0}, metadata=url)
        await pool.open()
        keys = chain()
        for i in range(repeats + 1):
            before = pool.stats()
            t0 = time.perf_counter()
            m = await pool.match("bench", keys, "reader")
            t1 = time.perf_counter()
            assert m.pages == PAGES, m.pages
            after = pool.stats()
            if host is None:
                assert after["shared"] - before["shared"] == PAGES
                assert after["bytes_moved"] == 0
            else:
                assert after["pulled"] - before["pulled"] == PAGES
            await pool.release("reader")
            if host is not None:  # drop the pulled copies (A still has them): pull again
                await pool.alloc("burst", PAGES)
                await pool.release("burst")
                assert pool.stats()["pages"]["l1"] == 0
            if i:
                times.append(t1 - t0)
        await pool.aclose()
        return statistics.median(times) * 1e3
    finally:
        done.set()
        proc.join(60)


async def readback(layers: int, repeats: int) -> dict[str, float]:
    pool = of.ParamsPool("rb", layout(layers), {"l1": 2 * PAGES, "l2": 2 * PAGES})
    await pool.open()
    store = pool._store
    assert store is not None
    nbytes = PAGES * pool.layout.page_bytes
    src = torch.empty(nbytes // 2, dtype=torch.float16).fill_(1.0)
    dst = torch.empty_like(src)
    memcpy, tier_copy, through_match = [], [], []

    class _Slot:  # a Move needs only these
        def __init__(self, i: int) -> None:
            self.slot, self.key, self.tier, self.index = i, None, L2, i

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for sub, sl in pool.layout.coords():  # fault every page of both tiers in first
        store.store(L2, sub, sl).fill_(1.0)
        store.store(L1, sub, sl).fill_(0.0)
    moves = [Move(_Slot(i), L1, i) for i in range(PAGES)]  # type: ignore[arg-type]
    for _ in range(repeats + 1):  # interleaved, so load on the machine hits both alike
        memcpy.append(timed(lambda: dst.copy_(src)))
        tier_copy.append(timed(lambda: store.copy(moves)))
    await publish(pool)
    keys = chain()  # the caller's hashing is not part of the match
    for i in range(repeats + 1):
        await pool.alloc("burst", 2 * PAGES)  # the chain goes to L2
        await pool.release("burst")
        assert pool.stats()["pages"]["l2"] == PAGES
        memcpy.append(timed(lambda: dst.copy_(src)))
        t0 = time.perf_counter()
        m = await pool.match("bench", keys, f"r{i}")
        through_match.append(time.perf_counter() - t0)
        assert m.pages == PAGES
        await pool.release(f"r{i}")
    await pool.aclose()
    med = {k: statistics.median(v[1:]) for k, v in
           {"memcpy": memcpy, "tier": tier_copy, "match": through_match}.items()}  # fmt: skip
    return {
        "mib": nbytes / 2**20,
        "memcpy_gbs": nbytes / med["memcpy"] / 1e9,
        "tier_gbs": nbytes / med["tier"] / 1e9,
        "match_gbs": nbytes / med["match"] / 1e9,
        "tier_frac": med["memcpy"] / med["tier"],
        "match_frac": med["memcpy"] / med["match"],
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core for every copy: the 2-core box is shared
    # One cluster key for both processes (spawned children inherit it), as in a deployment:
    # node records and pulls are sealed with it.
    os.environ.setdefault(KEY_ENV, generate_key().hex())
    lay = layout(args.layers)
    print(f"layout: {args.layers} layers x k,v (8x128 fp16), 16 tokens/page, "
          f"{lay.page_bytes // 1024} KiB/page, prefix {PAGES} pages = "
          f"{PAGES * lay.page_bytes / 2**20:.0f} MiB; torch {torch.__version__}, "
          f"L1 on {'cuda' if torch.cuda.is_available() else 'cpu'}")  # fmt: skip
    rb = await readback(args.layers, args.repeats)  # first: before other processes exist
    local = of.ParamsPool("kv", lay, {"l1": 2 * PAGES, "l2": 0})
    await publish(local)
    ms, trips = await time_matches(local, args.repeats)
    print(f"(a) local match+pin 128 pages:          {ms:8.3f} ms  ({trips:.0f} metadata calls)")
    await local.aclose()
    with redis_server() as server:
        pool = of.ParamsPool("kv", lay, {"l1": 2 * PAGES, "l2": 0}, metadata=server.url)
        await publish(pool)
        ms, trips = await time_matches(pool, args.repeats)
        print(f"(b) redis match+pin 128 pages:          {ms:8.3f} ms  ({trips:.0f} Redis "
              "requests per match, an owner's first)")  # fmt: skip
        await pool.aclose()
        ms = await across_processes(args.layers, server.url, None, args.repeats)
        print(f"(c) other process, shared L2 in place:  {ms:8.3f} ms  (0 bytes copied)")
        ms = await across_processes(args.layers, server.url, "node-a", max(3, args.repeats // 4))
        mib = PAGES * lay.page_bytes / 2**20
        print(
            f"(d) other node, pulled over ZMQ:        {ms:8.3f} ms  "
            f"({mib / ms * 1e3 / 1024:.2f} GiB/s of page data)"
        )
    print(
        f"(e) readback L2->L1 {rb['mib']:.0f} MiB: memcpy {rb['memcpy_gbs']:.2f} GB/s, "
        f"tier copy {rb['tier_gbs']:.2f} GB/s ({rb['tier_frac']:.0%} of memcpy), "
        f"through match {rb['match_gbs']:.2f} GB/s ({rb['match_frac']:.0%})"
    )


if __name__ == "__main__":
    asyncio.run(main())
