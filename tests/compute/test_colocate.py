"""The co-located KV pool: one pool, min of the proposals, decided only after every role loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.compute import (
    DenoiseRequest,
    DiTEngine,
    EngineError,
    GenerateRequest,
    ModelLoadError,
    TorchEngine,
)
from omniflow.compute._colocate import KvPoolBarrier, _Decision, pages_that_fit
from omniflow.compute._config import ModelConfig
from omniflow.compute._dit import make_tiny_dit
from omniflow.compute._pool import layout_for
from omniflow.compute._tiny import make_tiny_model
from omniflow.data.kv import PageLayout

LAYOUT = PageLayout(
    sub_names=("l0",), slices={"k": (2, 4), "v": (2, 4)}, page_tokens=4, dtype="float32"
)


def test_early_role_cannot_over_allocate() -> None:
    """The LLM loads long before the DiT and proposes 300; the DiT proposes 200 later: both get
    one pool of 200, and the LLM had no pool at all before the DiT joined."""

    async def go() -> None:
        barrier = KvPoolBarrier("kv", LAYOUT, members=("llm", "dit"))
        llm_joined = asyncio.Event()
        dit_loaded = asyncio.Event()

        async def llm() -> object:
            join = asyncio.ensure_future(barrier.join("llm", 300))
            await asyncio.sleep(0)
            llm_joined.set()
            return await join

        async def dit() -> object:
            await dit_loaded.wait()  # "loading weights" takes until the test says so
            return await barrier.join("dit", 200)

        tasks = [asyncio.ensure_future(llm()), asyncio.ensure_future(dit())]
        await llm_joined.wait()
        assert barrier.pool is None  # the early role holds nothing it could allocate from
        assert not tasks[0].done()
        dit_loaded.set()
        pools = await asyncio.gather(*tasks)
        assert pools[0] is pools[1] is barrier.pool
        assert barrier.pool is not None and barrier.pool.capacity["l1"] == 200

    asyncio.run(go())


def test_failed_member_fails_waiters_and_bad_joins_are_typed() -> None:
    async def go() -> None:
        barrier = KvPoolBarrier("kv", LAYOUT, members=("llm", "dit"))
        waiter = asyncio.ensure_future(barrier.join("llm", 10))
        await asyncio.sleep(0)
        barrier.abort("dit", RuntimeError("weights missing"))
        with pytest.raises(EngineError, match="'dit' failed: weights missing"):
            await waiter
        other = KvPoolBarrier("kv", LAYOUT, members=("llm",))
        with pytest.raises(EngineError, match="not co-located"):
            await other.join("vae", 3)
        with pytest.raises(EngineError, match="positive int"):
            await other.join("llm", 0)
        timed = KvPoolBarrier("kv", LAYOUT, members=("a", "b"))
        with pytest.raises(EngineError, match=r"\['b'\]"):
            await timed.join("a", 5, timeout=0)

    asyncio.run(go())


def test_pages_that_fit() -> None:
    assert pages_that_fit(LAYOUT, 100 * LAYOUT.page_bytes, 0.5) == 50
    assert pages_that_fit(LAYOUT, 10) == 0
    with pytest.raises(EngineError):
        pages_that_fit(LAYOUT, 10, 0.0)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 10_000), min_size=1), st.randoms())
def test_decision_is_min_after_all_and_none_before(proposals: dict[str, int], rnd: object) -> None:
    order = list(proposals)
    rnd.shuffle(order)  # type: ignore[attr-defined]
    d = _Decision(proposals)
    for i, member in enumerate(order):
        assert d.size is None
        d.propose(member, proposals[member])
        d.validate()
        assert d.missing == sorted(order[i + 1 :])
        with pytest.raises(EngineError):
            d.propose(member, 1)  # twice
    assert d.size == min(proposals.values())


def test_propose_in_setup_then_wait_at_first_use() -> None:
    """Roles set up one after another (the in-process runtime) propose without waiting."""

    async def go() -> None:
        barrier = KvPoolBarrier("kv", LAYOUT, members=("llm", "dit"))
        barrier.propose("llm", 300)  # llm.setup
        assert barrier.pool is None
        barrier.propose("dit", 200)  # dit.setup
        a, b = await barrier.wait("llm"), await barrier.wait("dit")
        assert a is b and a.capacity["l1"] == 200

    asyncio.run(go())


@pytest.mark.slow
def test_engines_take_seats_at_the_barrier(tmp_path: Path) -> None:
    """TorchEngine loads first and proposes 300 pages, DiTEngine proposes 200 later: requests
    to the LLM wait for the pool instead of failing, and both engines get one pool of 200."""
    llm_dir = make_tiny_model(tmp_path / "llm", hidden_size=64, layers=2, heads=4, kv_heads=2)
    dit_dir = make_tiny_dit(tmp_path / "dit", heads=4, kv_heads=2, head_dim=16, layers=2)
    layout = layout_for(ModelConfig.from_dir(llm_dir))

    async def go() -> None:
        barrier = KvPoolBarrier("kv", layout, members=("llm", "dit"))
        llm = TorchEngine(llm_dir, pool=barrier.member("llm", 300), device="cpu")
        dit = DiTEngine(dit_dir, pool=barrier.member("dit", 200), device="cpu")
        await llm.start()  # weights loaded, proposal made, no pool yet
        assert barrier.proposals == {"llm": 300} and barrier.pool is None
        ids = list(range(5, 45))
        prefill = asyncio.ensure_future(llm.prefill(GenerateRequest(input_ids=ids, session="s")))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not prefill.done() and llm.kv_pool is None  # waiting, not failed
        await dit.start()
        prefix = await prefill
        assert llm.kv_pool is barrier.pool and dit.kv_pool is barrier.pool
        assert barrier.pool is not None and barrier.pool.capacity["l1"] == 200
        outs = [o async for o in dit.generate(DenoiseRequest(context=prefix, steps=2))]
        assert outs[-1].context_tokens == 32
        await dit.stop()
        assert barrier.pool.stats()["pinned"] == 0
        assert not barrier.pool.closed  # the LLM still uses it
        await llm.stop()
        assert barrier.pool.closed  # the last co-located engine to stop closed it

    asyncio.run(go())


def test_an_engine_that_fails_to_load_fails_its_partners(tmp_path: Path) -> None:
    llm_dir = make_tiny_model(tmp_path / "llm", hidden_size=64, layers=2, heads=4, kv_heads=2)
    layout = layout_for(ModelConfig.from_dir(llm_dir))

    async def go() -> None:
        barrier = KvPoolBarrier("kv", layout, members=("llm", "dit"))
        llm = TorchEngine(llm_dir, pool=barrier.member("llm", 300), device="cpu")
        await llm.start()
        waiting = asyncio.ensure_future(llm.prefill(GenerateRequest(input_ids=[5], session="s")))
        with pytest.raises(ModelLoadError, match="run it with TorchEngine"):
            await DiTEngine(llm_dir, pool=barrier.member("dit", 200)).start()  # wrong checkpoint
        with pytest.raises(EngineError, match="role 'dit' failed"):
            await waiting
        with pytest.raises(EngineError, match="not co-located"):
            barrier.member("vae", 1)
        await llm.stop()
        # stopped while still waiting for its partner: the waiter hears so
        lonely = KvPoolBarrier("kv", layout, members=("llm", "dit"))
        llm = TorchEngine(llm_dir, pool=lonely.member("llm", 300), device="cpu")
        await llm.start()
        waiting = asyncio.ensure_future(llm.prefill(GenerateRequest(input_ids=[5], session="s")))
        await asyncio.sleep(0)
        await llm.stop()
        with pytest.raises(EngineError, match="stopped"):
            await waiting

    asyncio.run(go())
