"""The co-located KV pool: one pool, min of the proposals, decided only after every role loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.compute import (
    DenoiseRequest,
    DiTEngine,
    EngineError,
    GenerateRequest,
    ModelLoadError,
    RequestError,
    SamplingParams,
    TorchEngine,
)
from omniflow.compute._colocate import (
    KvPoolBarrier,
    _Decision,
    _mem_available,
    pages_that_fit,
    propose_pages,
)
from omniflow.compute._config import ModelConfig
from omniflow.compute._dit import make_tiny_dit
from omniflow.compute._nodebarrier import NodeBarrier, decide, died_during_barrier
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
        three = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        opened = asyncio.ensure_future(llm.open(GenerateRequest(input_ids=ids[:9], sampling=three)))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not prefill.done() and llm.kv_pool is None  # waiting, not failed
        assert not opened.done()  # segmented input waits for the pool the same way
        with pytest.raises(RequestError, match="no open input"):
            llm.feed("nope", [1])
        await dit.start()
        prefix = await prefill
        rid = await opened
        llm.feed(rid, [7, 8], last=True)
        assert [o.index async for o in llm.outputs(rid)] == [0, 1, 2]
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


# -- across processes of one node -------------------------------------------------------------


def test_the_node_rule_is_the_minimum_once_all_proposed_and_names_a_dead_member() -> None:
    members = frozenset({"a", "b"})
    assert decide(members, {"a": 300}, {}, set()) == (None, None)
    assert decide(members, {"a": 300, "b": 200}, {}, set()) == (200, None)
    assert decide(members, {"a": 300, "b": 200}, {}, {"b"}) == (200, None)  # b proposed
    size, why = decide(members, {"a": 300}, {}, {"b"})
    assert size is None and why is not None and "'b' died during the barrier" in why
    size, why = decide(members, {"a": 300}, {"b": "ModelLoadError: no weights"}, set())
    assert size is None and why == "role 'b' failed: ModelLoadError: no weights"


def test_a_proposal_is_measured_from_a_budget_or_available_memory(tmp_path: Path) -> None:
    assert propose_pages(1000, "cpu", budget=10_000, margin=0.1) == 9
    assert propose_pages(1000, "cpu", budget=10_000, margin=0.1, max_pages=4) == 4
    with pytest.raises(EngineError, match="no room for one KV page"):
        propose_pages(1000, "cpu", budget=1000, margin=0.1)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert _mem_available(str(meminfo)) == 2048 * 1024
    assert propose_pages(1024, "cpu", margin=0.0) >= 1  # this machine's MemAvailable


def _spawn(group: str, specs: list[tuple[str, int, bool]]) -> tuple[Any, dict[str, Any], Any]:
    import multiprocessing as mp

    from tests.compute._colocate_workers import member

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    events = {name: ctx.Event() for name, _, _ in specs}
    procs = []
    for name, pages, die in specs:
        p = ctx.Process(target=member, args=(group, name, pages, events[name], out, die))
        p.start()
        procs.append(p)
    return procs, events, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", ["a", "b"])
def test_colocated_processes_proposing_300_and_200_get_one_pool_of_200(first: str) -> None:
    import uuid

    from tests.compute._colocate_workers import LAYOUT as WLAYOUT

    group = f"test-{uuid.uuid4().hex}"
    procs, events, out = _spawn(group, [("a", 300, False), ("b", 200, False)])
    nb = NodeBarrier(group, "kv", ("a", "b"))
    second = "b" if first == "a" else "a"
    events[first].set()  # `first` finished loading first and proposed ...
    import time

    deadline = time.monotonic() + 60
    while first in nb.snapshot()[2] and time.monotonic() < deadline:
        time.sleep(0.01)  # ... before the other one did
    events[second].set()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [("a", 200, 100, True), ("b", 200, 100, True)]  # 200 pages on the node
    assert WLAYOUT.page_bytes > 0 and not nb.path.exists()  # the last to leave cleaned up


@pytest.mark.timeout(120)
def test_a_member_that_dies_during_the_barrier_fails_its_partner_naming_it() -> None:
    import uuid

    group = f"test-{uuid.uuid4().hex}"
    procs, events, out = _spawn(group, [("a", 300, False), ("b", 200, True)])
    procs[1].join(60)
    assert procs[1].exitcode == 3
    events["a"].set()
    name, kind, why = out.get(timeout=60)  # well within the barrier's 120 s
    procs[0].join(30)
    assert (name, kind) == ("a", "error")
    assert "kv_pool_barrier 'kv': role 'b' died during the barrier" in why
    nb = NodeBarrier(group, "kv", ("a", "b"))  # (recreates the directory: remove it again)
    nb.leave("a")
    assert not nb.path.exists()  # nobody alive is left: the last leave removed it


def _in_a_worker(name: str, group: str, pool: Any, said: list[str | None] | None = None) -> None:
    """What a worker's ``setup()`` sees: the graph's pool, and partners in other processes."""
    from omniflow.dsl._context import Colocation, _colocation, _setup_pools

    _setup_pools.set({pool.name: pool})
    _colocation.set(
        Colocation(frozenset({name}), group, last_words=None if said is None else said.append)
    )


def test_a_seat_leaves_last_words_until_it_proposed() -> None:
    """Across processes, a role that takes its seat tells its front (the worker's start-error
    file) that dying now is dying in the barrier of this pool; proposing takes that back."""
    import uuid

    from omniflow.data.kv import ParamsPool

    async def go() -> None:
        said: list[str | None] = []
        _in_a_worker("a", f"test-{uuid.uuid4().hex}", ParamsPool("kv", LAYOUT, {"l1": 1}), said)
        barrier = KvPoolBarrier("kv", None, members=("a", "b"))
        barrier.arrive("a")
        assert said == ["kv_pool_barrier 'kv': " + died_during_barrier("a")]
        barrier.propose("a", 300)
        assert said[-1] is None
        await barrier.leave("a")

    asyncio.run(go())


def test_a_pool_on_cuda_across_processes_is_refused_by_name() -> None:
    """Sharing a pool's L1 across processes on a GPU needs CUDA IPC, which is not implemented:
    the seat is refused before any weight loads, naming the pool, the partners and what to do.
    (The condition is the pool's device; no GPU is needed to check the refusal.)"""
    import uuid

    from omniflow.data.kv import ParamsPool

    async def go() -> None:
        pool = ParamsPool("kv", LAYOUT, {"l1": 1}, device="cuda")
        _in_a_worker("a", f"test-{uuid.uuid4().hex}", pool)
        barrier = KvPoolBarrier("kv", None, members=("a", "b"))
        refused = r"'kv': roles \['b'\] run in other processes .* on cuda through CUDA IPC"
        with pytest.raises(EngineError, match=refused + ".*one Deploy process group"):
            barrier.arrive("a")
        assert not pool.opened  # nothing was allocated

    asyncio.run(go())
