"""A module-level graph with a Params Pool, for the worker-process test (test_kv_procs.py).

A worker rebuilds the role by importing this file by path: its pool is that process's own
instance (opened lazily on first use), found in ``of.context().pools`` and ``role.pools``.
"""

from __future__ import annotations

import os
from typing import Any

import omniflow as of

KV = of.ParamsPool(
    "kvw",
    of.PageLayout(("l0",), {"k": (2, 4)}, page_tokens=4, dtype="float32"),
    capacity={"l1": 8, "l2": 0},
)


class PagedEngine(of.Role):
    async def setup(self) -> None:
        self.seen = self.pools["kvw"]

    @of.interface(inputs_or=[["n"]], outputs=["held"])
    async def step(self, n: int) -> dict[str, Any]:
        ctx = of.context()
        pool = ctx.pools["kvw"]
        assert pool is self.seen
        before = pool.stats()["pinned"] if pool._store is not None else 0
        await pool.alloc(ctx.call_id, n)
        return {"held": (os.getpid(), before, pool.stats()["pinned"])}


kv_worker = of.Graph(
    "kv_worker",
    roles={"paged": PagedEngine()},
    inputs=[of.Placeholder("n")],
    outputs=["held"],
    pools=[KV],
)


KEYED = of.ParamsPool(
    "kvk",
    of.PageLayout(("l0",), {"k": (2, 4)}, page_tokens=4, dtype="float32"),
    capacity={"l1": 2, "l2": 0},
)


def key_print(pool: of.ParamsPool) -> str:
    """A fingerprint of the key the pool seals its pulls with (never the key itself)."""
    import hashlib

    return hashlib.sha256(b"kv-test" + pool._cluster_key()).hexdigest()[:16]


class KeyProbe(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["key"])
    async def probe(self, n: int) -> dict[str, Any]:
        return {"key": (os.getpid(), key_print(of.context().pools["kvk"]))}


kv_keyed = of.Graph(
    "kv_keyed",
    roles={"probe": KeyProbe()},
    inputs=[of.Placeholder("n")],
    outputs=["key"],
    pools=[KEYED],
)


# -- two roles in two worker processes, one front-hosted metadata (test_kv_procs.py) ----------

SHARE_LAYOUT = of.PageLayout(
    ("l0", "l1"), {"k": (2, 8), "v": (2, 8)}, page_tokens=16, dtype="float16"
)
SHARE_PAGES = 32
SHARED = of.ParamsPool("kvs", SHARE_LAYOUT, capacity={"l1": SHARE_PAGES, "l2": 2 * SHARE_PAGES})


def share_keys() -> list[str]:
    return of.chain_hashes([list(range(i * 16, i * 16 + 16)) for i in range(SHARE_PAGES)])


def share_bytes(key: str) -> dict[tuple[str, str], Any]:
    import torch

    gen = torch.Generator().manual_seed(int(key[:12], 16))
    return {
        (sub, sl): torch.randn((16, 2, 8), generator=gen).to(torch.float16)
        for sub, sl in SHARE_LAYOUT.coords()
    }


class ChainWriter(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["chain"])
    async def step(self, n: int) -> dict[str, Any]:
        """Publish a chain under the call's session, then push it down to L2 (shared)."""
        ctx = of.context()
        pool = ctx.pools["kvs"]
        owner = f"w-{ctx.call_id}"
        slots = await pool.alloc(owner, SHARE_PAGES)
        for key, slot in zip(share_keys(), slots, strict=True):
            for (sub, sl), t in share_bytes(key).items():
                pool.view(slot, sub, sl).copy_(t)
        await pool.publish(ctx.session, share_keys(), slots)
        await pool.release(owner)
        await pool.alloc(owner, SHARE_PAGES)  # a burst: the unpinned chain moves to L2
        await pool.release(owner)
        return {"chain": {"pid": os.getpid(), "node": pool.node, "l2": pool.stats()["pages"]}}


class ChainReader(of.Role):
    @of.interface(inputs_or=[["chain"]], outputs=["read"])
    async def step(self, chain: dict[str, Any]) -> dict[str, Any]:
        """Match the writer's chain (another process) and check its bytes, read in place."""
        import torch

        ctx = of.context()
        pool = ctx.pools["kvs"]
        m = await pool.match(ctx.session, share_keys(), ctx.call_id)
        other = await pool.match("another-session", share_keys(), f"x-{ctx.call_id}")
        equal = in_place = 0
        provider = chain["node"]
        att = pool._attached.get(provider)
        info = (await pool._meta.nodes("kvs", [provider])).get(provider, {})
        for key, slot in zip(share_keys(), m.slots, strict=False):
            want = share_bytes(key).items()
            equal += all(torch.equal(pool.view(slot, sub, sl), t) for (sub, sl), t in want)
            if att is not None:
                seg = att._segments[0]  # the writer's L2 of (l0, k), mapped by name
                lo, ptr = seg.address, pool.view(slot, "l0", "k").data_ptr()
                in_place += seg.name.startswith(info.get("shm", "?")) and lo <= ptr < lo + len(
                    seg.buf
                )
        stats = pool.stats()
        return {
            "read": {
                "pid": os.getpid(),
                "pages": m.pages,
                "other_session": other.pages,
                "equal": equal,
                "in_place": in_place,
                "shared": stats["shared"],
                "bytes_moved": stats["bytes_moved"],
                "local": stats["pages"],
                "hosted": type(pool._meta).__name__,
            }
        }


kv_share = of.Graph(
    "kv_share",
    roles={"writer": ChainWriter(), "reader": ChainReader()},
    inputs=[of.Placeholder("n")],
    outputs=["read"],
    pools=[SHARED],
)


# -- publish notifications across workers: subscribe, publish elsewhere, preload, local hit ---

NOTIFY = of.ParamsPool("kvn", SHARE_LAYOUT, capacity={"l1": 2 * SHARE_PAGES, "l2": 0})


class NotifiedReader(of.Role):
    @of.interface(inputs_or=[["n"]], outputs=["subscribed"])
    async def subscribe(self, n: int) -> dict[str, Any]:
        ctx = of.context()
        await ctx.pools["kvn"].subscribe(ctx.session, preload=True)
        return {"subscribed": os.getpid()}

    @of.interface(inputs_or=[["published"]], outputs=["read"])
    async def read(self, published: int) -> dict[str, Any]:
        """Wait for the notification (it may trail the run that brings us here), then for
        the preload, then match: every page must be a local hit."""
        import asyncio

        import torch

        ctx = of.context()
        pool = ctx.pools["kvn"]
        for _ in range(3000):  # bounded: 30 s at most
            if pool.stats()["notified"]:
                break
            await asyncio.sleep(0.01)
        await pool.preloads()
        before = dict(pool.stats())
        m = await pool.match(ctx.session, share_keys(), ctx.call_id)
        after = pool.stats()
        equal = sum(
            all(torch.equal(pool.view(slot, sub, sl), t) for (sub, sl), t in share_bytes(k).items())
            for k, slot in zip(share_keys(), m.slots, strict=False)
        )
        return {
            "read": {
                "pid": os.getpid(),
                "notices": [(s, len(keys)) for s, keys in pool.notices],
                "preloaded": before["preloaded"],
                "pages": m.pages,
                "equal": equal,
                "hits": after["hits"] - before["hits"],
                "fetched_at_match": after["misses"] - before["misses"],
                "pulled_at_match": after["pulled"] - before["pulled"],
                "shared": after["shared"],
            }
        }


class NotifyingWriter(of.Role):
    @of.interface(inputs_or=[["subscribed"]], outputs=["published"])
    async def write(self, subscribed: int) -> dict[str, Any]:
        ctx = of.context()
        pool = ctx.pools["kvn"]
        slots = await pool.alloc(ctx.call_id, SHARE_PAGES)
        for key, slot in zip(share_keys(), slots, strict=True):
            for (sub, sl), t in share_bytes(key).items():
                pool.view(slot, sub, sl).copy_(t)
        await pool.publish(ctx.session, share_keys(), slots)
        return {"published": os.getpid()}


kv_notify = of.Graph(
    "kv_notify",
    roles={"subscriber": NotifiedReader(), "publisher": NotifyingWriter()},
    inputs=[of.Placeholder("n")],
    outputs=["read"],
    pools=[NOTIFY],
)
