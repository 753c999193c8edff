"""Issue 33, from CONTRACT §7/§8's recipes: ``pool="name"`` resolves in ``setup()`` and inside a
method, and a call's pages are unpinned by the time its end is visible to the caller."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import omniflow as of
from omniflow.compute import GenerateRequest, SamplingParams, TorchEngine
from tests.runtime.conftest import ray_local  # noqa: F401  (the "ray" placement's Ray)

from . import pool_graphs as pg


def _placement(placement: str, request: pytest.FixtureRequest) -> Any:
    """The Runtime's ``placement=`` for a test parameter ("ray": of.Ray() on a local Ray)."""
    if placement != "ray":
        return placement
    request.getfixturevalue("ray_local")
    return of.Ray()


async def _reference(prompt: str) -> list[int]:
    """The same greedy generation by an engine with its own private pool."""
    engine = TorchEngine(pg.MODEL_DIR)
    await engine.start()
    try:
        req = GenerateRequest(
            prompt=prompt,
            sampling=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
        )
        return [out.token_id async for out in engine.generate(req)]
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    "placement",
    ["inproc", "process", "ray"],  # (conftest marks "process" and "ray" slow)
)
async def test_contract_engine_recipe_starts_in_setup(
    placement: str, request: pytest.FixtureRequest
) -> None:
    want = await _reference("hello world")
    async with of.Runtime(pg.llm, placement=_placement(placement, request)) as rt:
        for session in ("s1", "s1", "s2"):  # turn 2 of s1 reuses its cached prefix
            out = await rt.run("llm", {"prompt": "hello world"}, session=session)
            assert out["token"] == want


async def test_engine_started_inside_a_method_resolves_the_name() -> None:
    class Lazy(of.Role):
        def __init__(self) -> None:
            self.engine = of.TorchEngine(pg.MODEL_DIR, pool="kv", max_batch=4)

        @of.interface(inputs_or=[["prompt"]], outputs=["token"])
        async def generate(self, prompt: str) -> Any:
            await self.engine.start()  # idempotent: the first call starts it, here
            pool = of.context().pools["kv"]
            assert self.engine.kv_pool is pool
            req = of.GenerateRequest(
                prompt=prompt,
                sampling=of.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
            )
            async for out in self.engine.generate(req):
                yield {"token": out.token_id}

    role = Lazy()
    pool = of.TorchEngine.pool(pg.MODEL_DIR, "kv", capacity={"l1": 64, "l2": 0, "l3": 0})
    graph = of.Graph(
        "lazy", roles={"lazy": role}, inputs=[of.Placeholder("prompt")], outputs=["token"],
        pools=[pool],
    )  # fmt: skip
    want = await _reference("hello world")
    try:
        async with of.Runtime(graph) as rt:
            assert (await rt.run("lazy", {"prompt": "hello world"}))["token"] == want
            assert pool.stats()["pinned"] == 0
    finally:
        await role.engine.stop()


async def test_unknown_pool_name_fails_at_start_naming_the_pools() -> None:
    graph = of.Graph(
        "wrong",
        roles={"llm": pg.Llm(pg.MODEL_DIR, pool="kvv")},
        inputs=[of.Placeholder("prompt")],
        outputs=["token"],
        pools=[of.TorchEngine.pool(pg.MODEL_DIR, "kv", capacity={"l1": 16, "l2": 0, "l3": 0})],
    )
    with pytest.raises(of.OmniflowError, match=r"no pool named 'kvv'.*have \['kv'\]"):
        async with of.Runtime(graph):
            pass


async def test_engine_with_a_name_outside_any_role_says_where_to_start_it() -> None:
    engine = of.TorchEngine(pg.MODEL_DIR, pool="kv")
    with pytest.raises(of.EngineError, match="setup"):
        await engine.start()
    await engine.stop()


@pytest.mark.parametrize(
    "placement",
    ["inproc", "process", "ray"],
)
async def test_call_owned_pages_are_released_by_the_end(
    placement: str, request: pytest.FixtureRequest
) -> None:
    async with of.Runtime(pg.owned, placement=_placement(placement, request)) as rt:
        local = placement == "inproc"

        async def pinned() -> int:
            # in-process the test's pool is the role's; in a worker only a call can ask
            if local:
                return int(pg.OWNED.stats()["pinned"])
            return int((await rt.run("owned", {"mode": "probe"}))["held"][0])

        # ok: rt.run returns
        assert (await rt.run("owned", {"mode": "ok"}))["held"] == [3]
        assert await pinned() == 0
        # ok: the async for ends
        frames = [f.value async for f in rt.call("owned", {"mode": "ok"})]
        assert frames == [3]
        assert await pinned() == 0
        # error: rt.run raises
        with pytest.raises(of.NodeError, match="boom"):
            await rt.run("owned", {"mode": "error"})
        assert await pinned() == 0
        # error: the call's wait returns
        call = rt.call("owned", {"mode": "error"})
        assert await call.wait() == "error"
        assert await pinned() == 0
        # cancelled: cancel() returns
        call = rt.call("owned", {"mode": "hang"})
        while (await pinned()) == 0 if local else False:
            await asyncio.sleep(0.01)
        if not local:
            await asyncio.sleep(0.3)  # the method has pinned its pages in the worker
        await call.cancel()
        assert call.status == "cancelled"
        assert await pinned() == 0
        # cancelled: a timeout ends rt.run
        with pytest.raises(of.NodeError):
            await rt.run("owned", {"mode": "hang"}, timeout=0.3)
        assert await pinned() == 0
