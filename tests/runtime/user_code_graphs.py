"""Module-level graphs whose role methods are everyday asyncio code (test_user_code.py).

Every method, and each role's ``setup()``/``teardown()``, runs :func:`exercise`: the
libraries users call from role methods, each of which needs one task for the method's whole
life (``asyncio.timeout``, ``TaskGroup``, anyio cancel scopes, and so httpx and
redis.asyncio). What each saw comes back in the frames, so the same assertions hold in every
placement (a worker imports this file by path).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
from typing import Any

import anyio
import httpx
import redis.asyncio as aioredis

import omniflow as of

#: Set by each method to its call's ``x``: no other call's method may see it.
MARK: contextvars.ContextVar[int | None] = contextvars.ContextVar("mark", default=None)


async def exercise(x: int | None, url: str | None, redis_url: str | None) -> list[str]:
    """Run the everyday libraries; return what went wrong (empty: all worked)."""
    bad: list[str] = []
    me = asyncio.current_task()
    if me is None:
        return ["no current task"]
    seen = MARK.get()
    if seen is not None and seen != x:
        bad.append(f"saw another call's contextvar {seen} (own {x})")
    MARK.set(x)
    try:
        async with asyncio.timeout(5):
            await asyncio.sleep(0)
        async with asyncio.TaskGroup() as tg:
            sub = [tg.create_task(asyncio.sleep(0, i)) for i in range(3)]
        if [t.result() for t in sub] != [0, 1, 2]:
            bad.append("TaskGroup results")
        with anyio.fail_after(5):
            await anyio.sleep(0)
        if await asyncio.wait_for(asyncio.sleep(0, "w"), 5) != "w":
            bad.append("wait_for")
        if url is not None:
            async with httpx.AsyncClient(timeout=5) as client:
                reply = await client.get(f"{url}/x{x}")
            if reply.text != f"hello x{x}":
                bad.append(f"httpx got {reply.text!r}")
        if redis_url is not None:
            client = aioredis.from_url(redis_url, socket_timeout=5)
            try:
                key = f"uc:{os.getpid()}:{x}:{id(me)}"
                await client.set(key, str(x))
                if await client.get(key) != str(x).encode():
                    bad.append("redis get")
                await client.delete(key)
            finally:
                await client.aclose()
    except Exception as exc:
        bad.append(f"{type(exc).__name__}: {exc}")
    if asyncio.current_task() is not me:
        bad.append("a different task after the awaits")
    if MARK.get() != x:
        bad.append(f"own contextvar lost: {MARK.get()} (own {x})")
    return bad


class Checked(of.Role):
    """setup() and teardown() run the libraries too; the methods report setup()'s result."""

    def __init__(self) -> None:
        self.setup_bad: list[str] = ["setup() never ran"]

    async def setup(self) -> None:
        self.setup_bad = await exercise(None, None, None)

    async def teardown(self) -> None:
        where = os.environ.get("OMNIFLOW_UC_TEARDOWN")
        bad = await exercise(None, None, None)
        if where:
            with open(os.path.join(where, f"{type(self).__name__}-{os.getpid()}.json"), "w") as f:
                json.dump(bad, f)


class First(Checked):
    @of.interface(inputs_or=[["x", "url", "redis_url"]], outputs=["a"])
    async def run(self, x: int, url: str | None, redis_url: str | None) -> dict[str, Any]:
        bad = await exercise(x, url, redis_url)
        return {"a": {"x": x, "url": url, "redis": redis_url, "bad": self.setup_bad + bad}}


class Second(Checked):
    """Downstream of ``First`` (the fast path across workers)."""

    @of.interface(inputs_or=[["a"]], outputs=["b"])
    async def run(self, a: dict[str, Any]) -> dict[str, Any]:
        bad = await exercise(a["x"], a["url"], a["redis"])
        return {"b": {**a, "bad": a["bad"] + self.setup_bad + bad}}


class Streamer(Checked):
    """A generator: the libraries between its yields, one task throughout."""

    @of.interface(inputs_or=[["b"]], outputs=["s"])
    async def run(self, b: dict[str, Any]) -> Any:
        me = asyncio.current_task()
        for i in range(3):
            bad = await exercise(b["x"], b["url"], b["redis"])
            async with asyncio.timeout(5):  # a scope across a yield: one task needed
                yield {"s": {**b, "i": i, "bad": b["bad"] + self.setup_bad + bad}}
            if asyncio.current_task() is not me:
                yield {"s": {**b, "i": -1, "bad": ["a different task between yields"]}}


class Last(Checked):
    """Downstream of every frame of the generator."""

    @of.interface(inputs_or=[["s"]], outputs=["out"])
    async def run(self, s: dict[str, Any]) -> dict[str, Any]:
        bad = await exercise(s["x"], s["url"], s["redis"])
        return {"out": {"x": s["x"], "i": s["i"], "bad": s["bad"] + self.setup_bad + bad}}


everyday = of.Graph(
    "everyday",
    roles={"first": First(), "second": Second(), "streamer": Streamer(), "last": Last()},
    inputs=[of.Placeholder("x"), of.Placeholder("url"), of.Placeholder("redis_url")],
    outputs=["out"],
)


#: The Params Pool with Redis metadata (its URL from the environment the test sets before
#: the runtime starts its workers; without it, memory metadata).
PAGED = of.ParamsPool(
    "uckv",
    of.PageLayout(("l0",), {"k": (2, 4)}, page_tokens=4, dtype="float32"),
    capacity={"l1": 16, "l2": 16},
    metadata=os.environ.get("OMNIFLOW_UC_REDIS") or None,
)


class Pager(of.Role):
    """Allocates, publishes, matches and releases pages from a method."""

    @of.interface(inputs_or=[["n"]], outputs=["pages"])
    async def run(self, n: int) -> dict[str, Any]:
        ctx = of.context()
        pool = ctx.pools["uckv"]
        owner = f"{ctx.call_id}:own"
        async with asyncio.timeout(10):
            slots = await pool.alloc(owner, n)
            hashes = of.chain_hashes([f"{ctx.call_id}:{i}".encode() for i in range(n)])
            await pool.publish(None, hashes, slots)
            await pool.release(owner)
            m = await pool.match(None, hashes, ctx.call_id)
            await pool.release(ctx.call_id)
        return {
            "pages": {"alloc": len(slots), "matched": m.pages, "pinned": pool.stats()["pinned"]}
        }


paged = of.Graph(
    "paged",
    roles={"pager": Pager()},
    inputs=[of.Placeholder("n")],
    outputs=["pages"],
    pools=[PAGED],
)
