"""The data plane through a real multi-process Runtime: bytes, connectors, and no leaks.

Every value a consumer node receives is checked bit for bit (``dp_graphs.describe``: dtype,
shape, SHA-256 of the raw bytes) against the value its name stands for. That the bytes took
the data plane, and which connector carried them, is read from the workers' own
``DataPlane.statistics()`` (``await rt.pool_stats()``): the producer's ``offloaded`` values and
bytes, the consumer's ``reads_shm`` / ``pulls`` / ``reads_inproc``; an in-process consumer
also checks that it got the producer's very object. After every call, ok or not, every pool
of every process holds no block and ``rt.stats()`` is all zeros; after every test, no
``/dev/shm/omniflow_*`` segment is left and no worker process survives.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import omniflow as of
from omniflow.data._pool import SEGMENT_PREFIX_ENV

from . import dp_graphs as dg

ZERO = {"open_buckets": 0, "inflight": 0, "active_calls": 0, "data_plane_bytes": 0}
#: Every test here starts worker processes.
pytestmark = pytest.mark.slow
PAIR = ("dp_src.run", "dp_dst.run")
GRAPHS = {g.name: g for g in of.load_graphs(Path(dg.__file__))}
#: Small values too: every sample goes through the data plane (0-d ones included).
EVERY = {"data_threshold": 1}


def segments(prefix: str) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"{prefix}_*")}


@pytest.fixture(autouse=True)
def no_leaks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No shared-memory segment and no worker process outlives the test.

    The test's processes (this one, and the workers that inherit the environment) name their
    segments with a prefix of the test's own, so a concurrent run's segments never count.
    """
    prefix = f"omniflow_t{secrets.token_hex(4)}"
    monkeypatch.setenv(SEGMENT_PREFIX_ENV, prefix)
    yield
    # A SIGKILLed owner's resource tracker unlinks late (later on a loaded machine): poll, with
    # a bound that is about hangs, not speed.
    deadline = time.monotonic() + 30
    while segments(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not segments(prefix), f"segments left behind: {sorted(segments(prefix))}"


Factory = Callable[..., Any]


@pytest.fixture
async def runtime() -> AsyncIterator[Factory]:
    """``rt = await runtime(*graph_names, placement=..., **kw)``: started, and at teardown
    checked (nothing of any call left, every pool empty) and closed, workers reaped."""
    opened: list[of.Runtime] = []

    async def make(*names: str, **kw: Any) -> of.Runtime:
        kw.setdefault("placement", "process")
        kw.setdefault("validate", True)
        rt = of.Runtime(*(GRAPHS[n] for n in names), **kw)
        opened.append(rt)
        await rt.start()
        return rt

    yield make
    for rt in opened:
        try:
            if rt.state.value == "running":
                assert rt.stats() == ZERO
                await assert_pools_empty(rt)
        finally:
            procs = [r.process for r in rt.remote.fleet.replicas.values()] if rt.remote else []
            await rt.close()
            assert all(p is None or p.returncode is not None for p in procs)


async def assert_pools_empty(rt: of.Runtime) -> dict[str, dict[str, int]]:
    """Every process's pool holds no block (and uses no byte); returns all the statistics."""
    stats = await rt.pool_stats()
    live = {k: (s["pool_live_blocks"], s["pool_used_bytes"]) for k, s in stats.items()}
    assert all(v == (0, 0) for v in live.values()), f"blocks left in pools: {live}"
    return stats


def replica(stats: dict[str, dict[str, int]], role: str) -> dict[str, int]:
    (key,) = [k for k in stats if k.startswith(f"{role}-")]
    return stats[key]


def nbytes(value: Any) -> int:
    if isinstance(value, bytes):
        return len(value)
    return int(value.numel() * value.element_size()) if hasattr(value, "numel") else value.nbytes


# ---------------------------------------------------------------- bytes arrive bit-identical


GROUP = of.Deploy({"dp_src": {"process": "g"}, "dp_dst": {"process": "g"}})
CONNECTORS = {
    # name: (placement, Runtime kwargs, consumer counter that counts every value, producer's
    # and consumer's process in rt.pool_stats())
    "auto-shm": ("process", {}, "reads_shm", "dp_src", "dp_dst"),
    "zmq-pull": ("process", {"connectors": {PAIR: "zmq"}}, "pulls", "dp_src", "dp_dst"),
    "inproc-group": (GROUP, {"connectors": {PAIR: "inproc"}}, "reads_inproc", "g", "g"),
    "auto-front": (of.Deploy({"dp_src": {}}), {}, "reads_shm", "dp_src", "<front>"),
}


@pytest.mark.parametrize("how", list(CONNECTORS))
async def test_tensors_arrive_bit_identical_through_each_connector(
    runtime: Factory, how: str
) -> None:
    placement, kw, counter, src_proc, dst_proc = CONNECTORS[how]
    rt = await runtime("dp_pair", placement=placement, **kw, **EVERY)
    names = list(dg.SPECS)
    call = rt.call("dp_pair", {"names": names})
    frames = [f async for f in call]
    assert call.status == "ok", call.errors
    seen = [f.value for f in frames if f.field == "seen"]
    out = [f.value for f in frames if f.field == "t_out"]
    for name, s, o in zip(names, seen, out, strict=True):
        assert s["desc"] == dg.expected(name), f"{name} at the consumer ({how})"
        assert dg.describe(o) == dg.expected(name), f"{name} at the caller ({how})"
    stats = await assert_pools_empty(rt)
    src = replica(stats, src_proc)
    dst = stats["<front>"] if dst_proc == "<front>" else replica(stats, dst_proc)
    offloaded = [n for n in names if nbytes(dg.sample(n)) > 0]  # all but the empty one
    total = sum(nbytes(dg.sample(n)) for n in names)
    # Every value left the producer through its pool, and the consumer read each one through
    # the connector under test; none rode the run message to the consumer.
    assert (src["offloaded"], src["offloaded_bytes"], src["pool_fallbacks"]) == (
        len(offloaded), total, 0)  # fmt: skip
    assert dst[counter] == len(offloaded)
    others = {"reads_shm", "pulls", "reads_inproc"} - {counter}
    assert all(dst[k] == 0 for k in others), dst
    if how == "zmq-pull":
        assert dst["pulled_bytes"] == total and src["pulls_served"] == len(offloaded)
    if how == "inproc-group":  # the producer's very object
        assert [s["same_object"] for s in seen[:-1]] == [[n] for n in offloaded]
    else:
        assert all(s["same_object"] == [] for s in seen)
        assert all(s["pid"] != src["pid"] for s in seen)
    # Numpy arrays arrive writable in every placement (CONTRACT §5); shm views are mapped
    # copy-on-write, so a consumer that writes never changes the producer's block.
    assert not any(s["readonly"] for s in seen)


async def test_default_threshold_offloads_only_big_values(runtime: Factory) -> None:
    rt = await runtime("dp_pair")
    names = list(dg.SPECS)
    call = rt.call("dp_pair", {"names": names})
    seen = [f.value for f in [f async for f in call] if f.field == "seen"]
    assert call.status == "ok", call.errors
    assert [s["desc"] for s in seen] == [dg.expected(n) for n in names]
    stats = await assert_pools_empty(rt)
    big = [n for n in names if nbytes(dg.sample(n)) >= 256 * 1024]
    assert big == ["np_u8_9mib", "t_f32_8mib", "bytes_1mib"]  # the rest rides inline
    assert replica(stats, "dp_src")["offloaded"] == len(big)
    assert replica(stats, "dp_dst")["reads_shm"] == len(big)


async def test_caller_inputs_reach_a_worker_through_the_front_pool(runtime: Factory) -> None:
    rt = await runtime("dp_inbound")
    for name in ("t_f32_8mib", "np_f64_T", "bytes_1mib"):
        out = await rt.run("dp_inbound", {"blob": dg.sample(name)})
        assert out["blob_seen"] == [dg.expected(name)]
    stats = await assert_pools_empty(rt)
    # Two of three are big enough: they went front pool -> worker, mapped by name.
    assert stats["<front>"]["offloaded"] == 2
    assert replica(stats, "dp_in")["reads_shm"] == 2


async def test_threshold_huge_sends_everything_inline(runtime: Factory) -> None:
    rt = await runtime("dp_pair", data_threshold=2**62)
    names = ["t_f32_8mib", "np_u8_9mib"]
    out = await rt.run("dp_pair", {"names": names})
    assert [s["desc"] for s in out["seen"]] == [dg.expected(n) for n in names]
    stats = await assert_pools_empty(rt)
    assert all(s["offloaded"] == 0 for s in stats.values())


async def test_a_collected_list_of_refs_resolves_item_by_item(runtime: Factory) -> None:
    rt = await runtime("dp_gather")
    out = await rt.run("dp_gather", {"n": 4})
    assert out == {"sums": [[i * 2.0**19 for i in range(4)]]}
    stats = await assert_pools_empty(rt)
    assert replica(stats, "dp_stream3")["offloaded"] == 4
    assert replica(stats, "dp_gather")["reads_shm"] == 4


async def test_values_too_big_for_the_pool_ride_inline(
    runtime: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIFLOW_POOL_BYTES", str(4 * 2**20))  # workers inherit it
    rt = await runtime("dp_pair")
    names = ["np_u8_9mib", "t_f32_8mib", "bytes_1mib"]
    out = await rt.run("dp_pair", {"names": names})
    assert [s["desc"] for s in out["seen"]] == [dg.expected(n) for n in names]
    src = replica(await assert_pools_empty(rt), "dp_src")
    assert src["pool_capacity_bytes"] == 4 * 2**20
    assert (src["offloaded"], src["pool_fallbacks"]) == (1, 2)


def test_inproc_across_processes_is_a_graph_error() -> None:
    graph = GRAPHS["dp_pair"]
    with pytest.raises(of.GraphError, match="crosses processes"):
        of.Runtime(graph, placement="process", connectors={PAIR: "inproc"})
    two = of.Deploy({"dp_src": {"process": "g", "replicas": 2}, "dp_dst": {"process": "g"}})
    with pytest.raises(of.GraphError, match="crosses processes"):
        of.Runtime(graph, placement=two, connectors={"dp_src.run->dp_dst.run": "inproc"})
    with pytest.raises(of.GraphError, match="unknown"):
        of.Runtime(graph, placement="process", connectors={PAIR: "rdma"})
    with pytest.raises(of.GraphError, match="no graph of this runtime has"):
        of.Runtime(graph, placement="process", connectors={("dp_dst.run", "dp_src.run"): "shm"})


# ---------------------------------------------------------------- no leaks on any path


async def test_cancel_mid_stream_leaves_every_pool_empty(runtime: Factory) -> None:
    rt = await runtime("dp_stream")
    call = rt.call("dp_stream", {"n": -1})
    got = 0
    during: dict[str, int] = {}
    async for frame in call:
        assert frame.value == float(frame.seq) * 2**19
        got += 1
        # Every sink holds its chunk 20 ms, the stream never ends: soon several blocks are in
        # flight at once (how soon is the scheduler's business: look until they are).
        during = replica(await rt.pool_stats(), "dp_stream")
        if got >= 5 and during["pool_live_blocks"] >= 2:
            break  # leaving the loop cancels the call while chunks are in flight
        assert got < 500, f"never two blocks in flight at once: {during}"
    assert await asyncio.wait_for(call.wait(), 10) == "cancelled"
    assert rt.stats() == ZERO
    stats = await assert_pools_empty(rt)
    assert replica(stats, "dp_stream")["offloaded"] >= 5


async def test_consumer_error_leaves_every_pool_empty(
    runtime: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIFLOW_DP_FAIL_AT", "2")
    rt = await runtime("dp_stream")
    call = rt.call("dp_stream", {"n": 8})
    [f async for f in call]
    assert call.status == "error"
    assert [e.node for e in call.errors] == ["dp_sink.run"]
    assert "sink refuses chunk 2" in str(call.errors[0])
    assert rt.stats() == ZERO
    stats = await assert_pools_empty(rt)
    assert replica(stats, "dp_stream")["offloaded"] >= 3


async def test_dead_bucket_releases_its_block(runtime: Factory) -> None:
    rt = await runtime("dp_dead")
    call = rt.call("dp_dead", {"k": 3})
    assert [f async for f in call] == []
    assert call.status == "ok", call.errors
    assert [ev for ev, _ in rt.story(call.call_id) if ev == "dead"] == ["dead"]
    assert rt.stats() == ZERO
    stats = await assert_pools_empty(rt)
    assert replica(stats, "dp_big")["offloaded"] == 1


async def test_consumer_killed_mid_read_does_not_leak_the_block(
    runtime: Factory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    marker = tmp_path / "holding"
    monkeypatch.setenv(dg.MARKER_ENV, str(marker))
    rt = await runtime("dp_kill")
    before = await rt.pool_stats()
    call = rt.call("dp_kill", {"k": 2})
    while not marker.exists() or not marker.read_text():  # (a hang is pytest-timeout's)
        await asyncio.sleep(0.01)
    pid = int(marker.read_text())
    assert pid == replica(before, "dp_hold")["pid"]
    during = await rt.pool_stats()
    assert replica(during, "dp_big2")["pool_live_blocks"] == 1  # the consumer holds it now
    os.kill(pid, signal.SIGKILL)
    frames = await asyncio.wait_for(call.collect(), 10)
    assert frames == {}
    assert call.status == "error"
    (err,) = call.errors
    assert err.node == "dp_hold.run" and "replica lost" in str(err)
    assert rt.stats() == ZERO
    after = await assert_pools_empty(rt)
    assert not [k for k in after if k.startswith("dp_hold-")]  # gone, not just quiet
    assert replica(after, "dp_big2")["offloaded"] == 1


async def test_producer_lost_before_a_zmq_pull_fails_the_consumer(runtime: Factory) -> None:
    # The producer finished its activation (so it holds nothing of the call) and then died
    # before the consumer pulled: the pull must fail, not wait forever for a dead process.
    rt = await runtime("dp_kill", connectors={("dp_big2.run", "dp_hold.run"): "zmq"})
    pids = {k.split("-")[0]: s["pid"] for k, s in (await rt.pool_stats()).items() if "-" in k}
    os.kill(pids["dp_hold"], signal.SIGSTOP)  # the consumer cannot pull yet
    try:
        call = rt.call("dp_kill", {"k": 1})
        while rt.stats()["data_plane_bytes"] == 0:  # the ref reached the front (or a hang:
            await asyncio.sleep(0.01)  # pytest-timeout reports it)
        os.kill(pids["dp_big2"], signal.SIGKILL)
        await asyncio.wait_for(call.wait(), 0.5)  # not ended: it never held an activation
    except TimeoutError:
        pass
    finally:
        os.kill(pids["dp_hold"], signal.SIGCONT)
    assert await asyncio.wait_for(call.wait(), 10) == "error"
    (err,) = call.errors
    assert err.node == "dp_hold.run" and "was lost" in str(err) and "DataError" in str(err)
    assert rt.stats() == ZERO
