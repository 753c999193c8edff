"""Batching across calls (``batch=of.Batch(max_size, max_wait_ms)``, docs/contract.md §1).

The pure queue (``_batching.BatchQueue``) is tested with explicit times and a hypothesis
state machine with ``validate()`` as its invariant; the shell (``_batcher.Batcher``) with a
fake clock; the runtime with module-level graphs (batch_graphs.py) in every placement; and a
hypothesis property: random graphs with batched nodes give each call the frames the sequential
reference evaluator gives the unbatched graph.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import omniflow as of
from omniflow.runtime._batcher import BatchEntry, Batcher, EntryState
from omniflow.runtime._batching import BatchQueue

from . import batch_graphs as bg
from .random_graph_module import Model
from .test_placement import eventually, placement, runtime  # noqa: F401 (fixtures)
from .test_random_graphs import check_model, models

# ------------------------------------------------------------------ the pure queue


def test_full_batch_is_taken_at_once_in_arrival_order() -> None:
    q = BatchQueue("n", max_size=3, max_wait=1.0)
    for i, call in enumerate(["a", "b", "a"]):
        q.add(f"k{i}", call, now=0.0)
        q.validate()
    assert q.take(now=0.0) == ["k0", "k1", "k2"]
    assert len(q) == 0 and q.deadline() is None and q.take(now=99.0) is None
    q.validate()


def test_wait_bound_with_a_fake_clock() -> None:
    """The batch is not due a moment before ``max_wait`` after its first activation, and is
    due exactly then, however many joined meanwhile (short of full)."""
    q = BatchQueue("n", max_size=8, max_wait=0.005)
    q.add("first", "a", now=10.0)
    q.add("second", "b", now=10.004)
    assert q.deadline() == pytest.approx(10.005)
    assert q.take(now=10.0049) is None
    assert q.take(now=10.005) == ["first", "second"]
    st_ = q.statistics()
    assert st_["batches"] == 1 and st_["max_wait_s"] == pytest.approx(0.005)
    # What stays after a full batch is due by its own first arrival's deadline.
    q = BatchQueue("n", max_size=2, max_wait=1.0)
    for i in range(3):
        q.add(i, "a", now=float(i))
    assert q.take(now=2.0) == [0, 1]
    assert q.deadline() == 3.0 and q.take(now=2.9) is None and q.take(now=3.0) == [2]


def test_remove_leaves_the_batch_and_moves_the_deadline() -> None:
    q = BatchQueue("n", max_size=4, max_wait=1.0)
    q.add("a1", "a", now=0.0)
    q.add("b1", "b", now=0.5)
    assert q.remove("a1") and not q.remove("a1")
    q.validate()
    assert q.deadline() == 1.5
    assert q.take(now=1.5) == ["b1"]
    assert q.statistics()["removed"] == 1


def test_one_calls_burst_does_not_starve_another_call() -> None:
    """Measured: call A queues 64 activations, then call B one. Round-robin across calls puts
    B's activation in the very next batch (arrival order alone would run it fifth)."""
    q = BatchQueue("n", max_size=16, max_wait=1.0)
    for i in range(64):
        q.add(("a", i), "A", now=0.0)
    q.add(("b", 0), "B", now=0.001)
    batches = []
    while (b := q.take(now=5.0)) is not None:
        batches.append(b)
        q.validate()
    assert [len(b) for b in batches] == [16, 16, 16, 16, 1]
    b_batch = next(i for i, b in enumerate(batches) if ("b", 0) in b)
    assert b_batch == 0
    # Within the batch: arrival order (the method's lists follow it).
    assert batches[0] == [*[("a", i) for i in range(15)], ("b", 0)]
    # The oldest waiting activation is always in the batch taken (the wait bound).
    assert all(b[0] == min(b) or b[0][0] == "a" for b in batches)


def test_adding_a_key_twice_is_an_error() -> None:
    q = BatchQueue("vit.encode", max_size=2, max_wait=1.0)
    q.add("k", "a", now=0.0)
    with pytest.raises(ValueError, match=r"vit\.encode"):
        q.add("k", "b", now=0.0)


class QueueMachine(RuleBasedStateMachine):
    """Random adds, removes and takes against a model: every key is taken once or removed,
    no batch exceeds max_size, the oldest waiting key is in every batch taken, a take happens
    exactly when full or past the oldest's deadline, and ``validate()`` holds at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.q = BatchQueue("m", max_size=3, max_wait=2.0)
        self.now = 0.0
        self.waiting: dict[int, tuple[str, float]] = {}
        self.next = 0

    @rule(call=st.sampled_from("abc"))
    def add(self, call: str) -> None:
        self.q.add(self.next, call, self.now)
        self.waiting[self.next] = (call, self.now)
        self.next += 1

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.waiting)))
        assert self.q.remove(key)
        del self.waiting[key]

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def take(self) -> None:
        oldest = min(self.waiting, default=None)
        due = len(self.waiting) >= 3 or (
            oldest is not None and self.now >= self.waiting[oldest][1] + 2.0
        )
        got = self.q.take(self.now)
        assert (got is not None) == due
        if got is not None:
            assert 1 <= len(got) <= 3 and got == sorted(got) and oldest in got
            calls = {self.waiting[k][0] for k in got}
            # Round-robin: a call with waiting keys is left out only of a batch that is full.
            left = {self.waiting[k][0] for k in self.waiting if k not in got}
            assert len(got) == 3 or not (left - calls)
            for k in got:
                del self.waiting[k]

    @invariant()
    def valid(self) -> None:
        self.q.validate()
        assert len(self.q) == len(self.waiting)
        assert self.q.deadline() == (
            min(t for _c, t in self.waiting.values()) + 2.0 if self.waiting else None
        )


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------ the shell


async def test_batcher_arms_its_timer_for_the_deadline_and_runs_one_batch() -> None:
    now = [100.0]
    seen: list[tuple[list[int], int]] = []
    got: dict[int, Any] = {}

    async def method(x: list[int]) -> list[Any]:
        seen.append((x, len(of.batch_contexts())))
        return [{"y": v} if v else ValueError("zero") for v in x]

    b = Batcher("n.m", method, of.Batch(4, 5), clock=lambda: now[0])
    entries = []
    for i in range(3):
        put = functools.partial(got.__setitem__, i)
        e = BatchEntry(b, {"x": i}, _Ctx(i), f"c{i}", put, put)
        entries.append(e)
        b.add(e)
        b.validate()
    assert b._timer is not None and b._timer_at == pytest.approx(100.005)
    assert not seen  # not due: nothing ran
    now[0] = 100.0035  # within the loop's timer resolution of the deadline: not yet due
    b.poll()
    assert not seen and b._timer_at == pytest.approx(100.005)
    now[0] = 100.0042  # the timer, armed SLACK (1 ms) early, fires: it takes what is due by then
    b._fire()
    # Started eagerly from the timer: the method (which never suspends) already ran.
    assert all(e.state is EntryState.OVER for e in entries) and b._timer is None
    assert seen == [([0, 1, 2], 3)]
    assert isinstance(got[0], ValueError) and got[1] == {"y": 1} and got[2] == {"y": 2}
    assert b.statistics()["batches"] == 1 and b.statistics()["running"] == 0
    b.validate()
    b.close()


async def test_a_full_batch_starts_at_once_with_its_clock_standing_still() -> None:
    """The ``add`` that fills a batch takes it: no timer, no wait (the fake clock never moves);
    its task runs on the next loop turn. An activation past it waits for a batch of its own."""
    seen: list[list[int]] = []

    async def method(x: list[int]) -> list[Any]:
        seen.append(x)
        return [{"y": v} for v in x]

    got: dict[int, Any] = {}
    b = Batcher("n.m", method, of.Batch(4, 600_000), clock=lambda: 7.0)
    for i in range(5):
        put = functools.partial(got.__setitem__, i)
        b.add(BatchEntry(b, {"x": i}, _Ctx(i), f"c{i}", put, put))
        b.validate()
        if i == 3:  # full: taken by this add, nothing left to time
            assert len(b.running) == 1 and len(b.queue) == 0 and b._timer is None
    assert len(b.queue) == 1 and b._timer_at == pytest.approx(7.0 + 600.0)
    await asyncio.sleep(0)
    assert seen == [[0, 1, 2, 3]] and got == {i: {"y": i} for i in range(4)}
    assert b.statistics()["full"] == 1 and b.statistics()["max_wait_s"] == 0.0
    b.close()


async def test_batcher_cancel_before_and_during_a_batch() -> None:
    release = asyncio.Event()
    started = asyncio.Event()
    cancelled = []

    async def method(x: list[str]) -> list[Any]:
        started.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(x)
            raise
        return [{"y": v} for v in x]

    ends: dict[str, Any] = {}

    def entry(b: Batcher, name: str) -> BatchEntry:
        def done(v: Any) -> None:
            ends[name] = v

        return BatchEntry(b, {"x": name}, _Ctx(0), name, done, done)

    b = Batcher("n.m", method, of.Batch(2, 60_000))
    a = entry(b, "a")
    b.add(a)
    a.cancel()  # waiting: it leaves the queue; its end comes next turn, as a cancel
    assert len(b.queue) == 0 and b._timer is None
    await asyncio.sleep(0)
    assert isinstance(ends.pop("a"), asyncio.CancelledError)
    x, y = entry(b, "x"), entry(b, "y")
    b.add(x)
    b.add(y)
    await started.wait()
    x.cancel()  # running: it ends now as cancelled, its result will be dropped
    await asyncio.sleep(0)
    assert isinstance(ends.pop("x"), asyncio.CancelledError)
    release.set()
    while "y" not in ends:
        await asyncio.sleep(0)
    assert ends == {"y": {"y": "y"}} and not cancelled
    # Every activation of a running batch cancelled: the batch's task is cancelled.
    release.clear()
    started.clear()
    p, r = entry(b, "p"), entry(b, "r")
    b.add(p)
    b.add(r)
    await started.wait()
    p.cancel()
    r.cancel()
    while len(cancelled) < 1 or b.running:
        await asyncio.sleep(0)
    assert cancelled == [["p", "r"]]
    b.validate()


class _Ctx:
    def __init__(self, i: int) -> None:
        self.i = i

    def activation_context(self) -> Any:
        return self.i


# ------------------------------------------------------------------ declaring


def test_a_batched_generator_is_a_graph_error() -> None:
    class Gen(of.Role):
        @of.interface(inputs_or=[["x"]], outputs=["y"], batch=of.Batch(4, 5))
        async def g(self, x: list[int]) -> AsyncIterator[dict[str, Any]]:
            yield {"y": x}

    graph = of.Graph("bt_gen", roles={"gen": Gen()}, inputs=[of.Placeholder("x")], outputs=["y"])
    with pytest.raises(of.GraphError, match=r"node 'gen\.g': a batched method .* async generator"):
        of.parse(graph)


@pytest.mark.parametrize(
    ("size", "wait"), [(0, 5), (1.5, 5), (True, 5), (4, -1), (4, "5"), (4, float("nan"))]
)
def test_batch_arguments_are_checked(size: Any, wait: Any) -> None:
    with pytest.raises(of.GraphError, match="Batch"):
        of.Batch(size, wait)


def test_batch_must_be_a_batch() -> None:
    with pytest.raises(of.GraphError, match=r"batch must be omniflow\.Batch"):
        of.interface(inputs_or=[["x"]], outputs=["y"], batch=(4, 5))(lambda x: x)  # type: ignore[arg-type]


def test_batch_contexts_outside_a_batch_is_the_activation() -> None:
    with pytest.raises(of.OmniflowError, match="outside a running interface method"):
        of.batch_contexts()


# ------------------------------------------------------------------ in every placement


@pytest.fixture
def rt_of(runtime: Any) -> Any:  # noqa: F811 (test_placement.py's: every placement, leftovers checked)
    return runtime


async def test_lists_in_and_out_and_errors_per_activation(rt_of: Any) -> None:
    rt = await rt_of(bg.lists)
    calls = [rt.call("bt_lists", {"x": x}) for x in (1, "none", "bad", 4)]
    outs = [await c.collect() for c in calls]
    ids = [c.call_id for c in calls]
    assert [c.status for c in calls] == ["ok", "ok", "error", "ok"]
    y1, y4 = outs[0]["y"][0], outs[3]["y"][0]
    # One batch of the four calls (full), each activation's frame to its own call.
    assert (y1["v"], y1["size"], y1["call"]) == (1, 4, ids[0])
    assert (y4["v"], y4["size"], y4["call"]) == (4, 4, ids[3])
    assert sorted(y1["calls"]) == sorted(ids)
    assert outs[1] == {} and outs[2] == {}  # None: a zero-yield; an exception: that call fails
    (err,) = calls[2].errors
    assert err.node == "bt_enc.enc" and f"bad input in {ids[2]}" in str(err)
    assert not calls[0].errors and not calls[3].errors
    if placement_of(rt) == "inproc":
        stats = rt.batch_stats()["bt_enc.enc"]
        assert stats["batches"] == 1 and stats["mean_size"] == 4 and stats["queued"] == 0


async def test_a_raised_exception_fails_every_activation_of_the_batch(rt_of: Any) -> None:
    rt = await rt_of(bg.lists)
    calls = [rt.call("bt_lists", {"x": x}) for x in (1, 2, "boom", 3)]
    for c in calls:
        await c.wait()
    assert [c.status for c in calls] == ["error"] * 4
    for c in calls:
        (err,) = c.errors
        assert err.node == "bt_enc.enc" and "the whole batch fails" in str(err)


async def test_a_lone_activation_runs_after_max_wait(rt_of: Any) -> None:
    rt = await rt_of(bg.lone)
    assert await rt.run("bt_lone", {"x": 1}) == {"y": [2]}


async def test_cancel_before_a_batch_leaves_it(rt_of: Any, tmp_path: Path) -> None:
    (tmp_path / "release").touch()
    rt = await rt_of(bg.hold)
    a = rt.call("bt_hold", {"x": "a", "dir": str(tmp_path)})
    if placement_of(rt) == "inproc":
        await eventually(lambda: rt.batch_stats()["bt_hold.hold"]["queued"] == 1, "a queued")
    else:
        await asyncio.sleep(0.05)  # (a at the worker or not: either way it must not run)
    await a.cancel()
    assert a.status == "cancelled" and rt.stats()["active_calls"] == 0
    b = rt.call("bt_hold", {"x": "b", "dir": str(tmp_path)})
    c = rt.call("bt_hold", {"x": "c", "dir": str(tmp_path)})
    assert (await b.collect())["y"] == [{"v": "b", "batch": ["b", "c"]}]
    assert (await c.collect())["y"] == [{"v": "c", "batch": ["b", "c"]}]


async def test_cancel_during_a_batch_drops_its_result(rt_of: Any, tmp_path: Path) -> None:
    rt = await rt_of(bg.hold)
    a = rt.call("bt_hold", {"x": "a", "dir": str(tmp_path)})
    b = rt.call("bt_hold", {"x": "b", "dir": str(tmp_path)})
    await eventually((tmp_path / "started").exists, "the batch started")
    await a.cancel()  # does not wait for the batch: its activation ends now
    assert a.status == "cancelled" and not (tmp_path / "release").exists()
    (tmp_path / "release").touch()
    assert (await b.collect())["y"] == [{"v": "b", "batch": ["a", "b"]}]
    assert b.status == "ok" and not (tmp_path / "cancelled").exists()


async def test_cancelling_every_activation_cancels_the_batch(rt_of: Any, tmp_path: Path) -> None:
    rt = await rt_of(bg.hold)
    calls = [rt.call("bt_hold", {"x": x, "dir": str(tmp_path)}) for x in "ab"]
    await eventually((tmp_path / "started").exists, "the batch started")
    for c in calls:
        await c.cancel()
    await eventually((tmp_path / "cancelled").exists, "the batch's task cancelled")
    assert (tmp_path / "cancelled").read_text() == "a,b\n"


async def test_seq_and_session_order_through_batched_nodes(rt_of: Any) -> None:
    rt = await rt_of(bg.session)
    calls = [rt.call("bt_session", {"n": 10}, session=f"s{i % 2}") for i in range(4)]
    for c in calls:
        frames = [f async for f in c]
        assert c.status == "ok", c.errors
        assert [f.value for f in frames if f.field == "u"] == list(range(10))
        # The session node ran its activations one at a time, in SeqId order.
        assert [f.value for f in frames if f.field == "w"] == [[i, i] for i in range(10)]


async def test_a_batched_join_in_a_diamond(rt_of: Any) -> None:
    rt = await rt_of(bg.diamond)
    calls = [rt.call("bt_diamond", {"x": i}) for i in range(8)]
    assert [(await c.collect())["d"] for c in calls] == [[5 * i] for i in range(8)]


async def test_a_batched_node_on_a_loop(rt_of: Any) -> None:
    rt = await rt_of(bg.loop)
    calls = [rt.call("bt_loop", {"n": n}) for n in (0, 3, 5)]
    outs = [(await c.collect())["out"] for c in calls]
    assert outs == [["done"], [3, 2, 1, "done"], [5, 4, 3, 2, 1, "done"]]


def placement_of(rt: of.Runtime) -> str:
    return "inproc" if rt.remote is None else "remote"


# ------------------------------------------------------------------ metrics


async def test_batch_statistics_in_metrics() -> None:
    from omniflow.serve._metrics import HttpMetrics, render

    async with of.Runtime(bg.lists, metrics=True) as rt:
        calls = [rt.call("bt_lists", {"x": i}) for i in range(4)]
        for c in calls:
            await c.wait()
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    front = 'node="bt_enc.enc",replica="<front>"'
    assert f"omniflow_batches_total{{{front}}} 1.0" in text
    assert f"omniflow_batch_activations_total{{{front}}} 4.0" in text
    assert f"omniflow_batch_mean_size{{{front}}} 4.0" in text
    assert "omniflow_batch_wait_seconds_max" in text


@pytest.mark.slow
async def test_a_workers_batchers_reach_the_fronts_metrics_with_its_heartbeat() -> None:
    from omniflow.serve._metrics import HttpMetrics, render

    async with of.Runtime(bg.lists, placement="process", heartbeat_interval=0.05) as rt:
        calls = [rt.call("bt_lists", {"x": i}) for i in range(4)]
        for c in calls:
            await c.wait()

        def said() -> bool:
            per = rt.replica_batch_stats()
            return any(
                n == "bt_enc.enc" and st["activations"] == 4
                for r, nodes in per.items()
                if r != "<front>"
                for n, st in nodes.items()
            )

        await eventually(said, "a heartbeat with the worker's batch statistics")
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    assert 'omniflow_batch_activations_total{node="bt_enc.enc",replica="' in text


# ------------------------------------------------------------------ the property


@st.composite
def batched_models(draw: st.DrawFn) -> Model:
    model = draw(models())
    coros = [m for m in model.nodes if not m.gen]
    for m in coros:
        if draw(st.integers(0, 2)) > 0:
            m.batch = draw(st.sampled_from([1, 2, 4, 16]))
    return model


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
@given(model=batched_models(), seed=st.integers(0, 2**32 - 1))
def test_batched_graphs_give_the_unbatched_frames(model: Model, seed: int) -> None:
    """Each call's frames equal the sequential reference's (what the unbatched graph gives,
    test_random_graphs.py), every rule the methods check holds, and session calls stay FIFO."""
    check_model(model, seed)
