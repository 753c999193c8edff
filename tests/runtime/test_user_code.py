"""Role methods are ordinary asyncio code, in every placement (CONTRACT §1, docs/contract.md).

Each method of ``user_code_graphs.everyday`` (a first node, a downstream node reached on the
fast path, a generator, and the node after each of its frames) and each role's
``setup()``/``teardown()`` runs ``asyncio.timeout``, ``TaskGroup``, ``anyio.fail_after``,
``asyncio.wait_for``, an ``httpx.AsyncClient`` against a local HTTP server and
``redis.asyncio`` against the test's Redis, checks that ``asyncio.current_task()`` is one task
throughout, and that no other call's contextvar reaches it; sequentially (warm calls
included) and 32 calls at once, in-process, in worker processes and on Ray.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import omniflow as of
from omniflow.testing import RedisServer

from . import user_code_graphs as ucg


@pytest.fixture(params=["inproc", "process", "ray"])
def placement(request: pytest.FixtureRequest) -> Any:
    if request.param == "ray":
        request.getfixturevalue("ray_local")
        return of.Ray()
    return request.param


@pytest.fixture
async def http_url() -> AsyncIterator[str]:
    """A local HTTP server answering ``GET /NAME`` with ``hello NAME``."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        while (await reader.readline()).strip():
            pass  # (the headers)
        body = f"hello {line.split()[1].decode().lstrip('/')}".encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


def check(out: dict[str, list[Any]], xs: list[int]) -> None:
    frames = out["out"]
    assert sorted((f["x"], f["i"]) for f in frames) == [(x, i) for x in xs for i in range(3)]
    problems = [(f["x"], f["i"], f["bad"]) for f in frames if f["bad"]]
    assert problems == []


async def test_role_methods_run_everyday_asyncio_code(
    placement: Any,
    http_url: str,
    redis: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNIFLOW_UC_TEARDOWN", str(tmp_path))
    inputs = {"url": http_url, "redis_url": redis.url}
    rt = of.Runtime(ucg.everyday, placement=placement, validate=True)
    async with rt:
        for x in range(3):  # sequential; the later ones warm
            check(await rt.run("everyday", {"x": x, **inputs}), [x])
        xs = list(range(100, 132))
        outs = await asyncio.gather(*(rt.run("everyday", {"x": x, **inputs}) for x in xs))
        for x, out in zip(xs, outs, strict=True):
            check(out, [x])
        assert rt.stats()["active_calls"] == 0
    if placement in ("inproc", "process"):  # (Ray's actors do not see this test's env)
        reports = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
        assert len(reports) >= 4 and all(r == [] for r in reports)


async def test_a_contextvar_set_by_one_call_is_not_seen_by_another(placement: Any) -> None:
    """Calls A and B interleave at every await; each sees only its own value."""
    async with of.Runtime(ucg.everyday, placement=placement) as rt:
        xs = list(range(200, 216))
        outs = await asyncio.gather(
            *(rt.run("everyday", {"x": x, "url": None, "redis_url": None}) for x in xs)
        )
        for x, out in zip(xs, outs, strict=True):
            check(out, [x])


async def test_the_callers_contextvars_reach_the_methods_and_come_back_untouched() -> None:
    """Methods run in copies of the caller's context at ``rt.call``: what the caller set is
    there; what a method sets stays with the call."""
    outer: contextvars.ContextVar[str] = contextvars.ContextVar("outer", default="-")

    class Peek(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> dict[str, Any]:
            seen = outer.get()
            outer.set("method")
            await asyncio.sleep(0)
            return {"y": (seen, outer.get())}

    g = of.Graph("peek", roles={"p": Peek()}, inputs=[of.Placeholder("x")], outputs=["y"])
    async with of.Runtime(g) as rt:
        outer.set("caller")
        assert await rt.run("peek", {"x": 1}) == {"y": [("caller", "method")]}
        assert outer.get() == "caller"


async def test_cancel_raises_at_the_methods_await_and_runs_its_finally() -> None:
    events: list[str] = []
    started = asyncio.Event()

    class Slow(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"])
        async def run(self, x: int) -> dict[str, Any]:
            me = asyncio.current_task()
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(asyncio.sleep(3600))
                    started.set()
            except asyncio.CancelledError:
                events.append("cancelled" if asyncio.current_task() is me else "wrong task")
                raise
            finally:
                events.append("finally")
            return {"y": x}

    g = of.Graph("slow", roles={"s": Slow()}, inputs=[of.Placeholder("x")], outputs=["y"])
    async with of.Runtime(g) as rt:
        call = rt.call("slow", {"x": 1})
        reader = asyncio.ensure_future(call.collect())
        await started.wait()
        await call.cancel()
        await reader
        assert call.status == "cancelled" and events == ["cancelled", "finally"]
        assert rt.stats()["active_calls"] == 0


@pytest.mark.slow
async def test_params_pool_with_redis_metadata_works_from_worker_methods(
    redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages allocated, published, matched and released from a method in a worker process,
    the pool's metadata in Redis (redis.asyncio inside the method's task)."""
    monkeypatch.setenv("OMNIFLOW_UC_REDIS", redis.url)
    async with of.Runtime(ucg.paged, placement="process") as rt:
        outs = await asyncio.gather(*(rt.run("paged", {"n": n}) for n in (1, 2, 3, 4)))
    assert [o["pages"][0] for o in outs] == [
        {"alloc": n, "matched": n, "pinned": 0} for n in (1, 2, 3, 4)
    ]


def test_on_uvloop_as_omniflow_serve_runs_the_front() -> None:
    """The front of ``omniflow serve`` runs on uvloop: eager tasks there too."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        async with of.Runtime(ucg.everyday) as rt:
            xs = list(range(300, 308))
            outs = await asyncio.gather(
                *(rt.run("everyday", {"x": x, "url": None, "redis_url": None}) for x in xs)
            )
            for x, out in zip(xs, outs, strict=True):
                check(out, [x])

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def test_a_loop_that_cannot_start_tasks_eagerly_still_runs_methods_in_tasks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a loop has no instance attributes, a walker starts on the next loop turn: slower,
    the same semantics."""
    from omniflow.runtime import _drive

    monkeypatch.setattr(_drive, "_own", lambda loop: None)
    async with of.Runtime(ucg.everyday, validate=True) as rt:
        xs = list(range(400, 408))
        outs = await asyncio.gather(
            *(rt.run("everyday", {"x": x, "url": None, "redis_url": None}) for x in xs)
        )
        for x, out in zip(xs, outs, strict=True):
            check(out, [x])
        assert rt.stats()["active_calls"] == 0
