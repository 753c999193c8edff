"""The life of a call, in every placement: cancellation at every await point of a generator,
cancellation storms, the status right after the caller leaves, per-call deadlines, sessions
(close and idle TTL) and setup failures.

The graphs are module-level objects of life_graphs.py (a worker process imports that file by
path). Nothing here asserts a duration: hangs are turned into failures by ``asyncio.wait_for``
with deadlines far above any honest run, and ordering comes from what the call reports.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

import omniflow as of

from . import life_graphs as lg
from . import test_placement
from .test_placement import ZERO, build, eventually

#: Far above any honest run, even on a loaded 2-core machine.
HANG = 60.0

Factory = Callable[..., Any]


@pytest.fixture(params=["inproc", "process"])
def placement(request: pytest.FixtureRequest) -> str:
    return str(request.param)


#: The placement suite's runtime factory (leftover work checked, closed after the test), here
#: over this module's placements.
runtime = test_placement.runtime


def no_pending_tasks(rt: of.Runtime) -> None:
    """Nothing of the runtime's calls is left running in this loop."""
    assert not rt._tasks, f"tasks left behind: {rt._tasks}"
    me = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    names = [t.get_coro() for t in others]
    # The multi-process runtime keeps its own reader/writer tasks; no call task is left.
    assert not any("_drive" in repr(c) or "_Continue" in repr(c) for c in names), names


async def ended(rt: of.Runtime, call: of.Call) -> None:
    """The call ended cleanly: done, a final status, errors that fit it, nothing left."""
    assert call.done
    assert call.status in ("ok", "cancelled"), (call.status, call.errors)
    if call.status == "ok":
        assert call.errors == []
    else:
        assert all(e.kind == "cancel" for e in call.errors), call.errors
    assert rt.stats() == ZERO
    # The session's next call is not stuck behind it.
    out = await asyncio.wait_for(rt.run("lg_quick", {"n": 2}, session="s"), HANG)
    assert out == {"x": [0, 1]}


# ---------------------------------------------------------------- cancel at every await point


async def test_cancel_right_after_call_returns(runtime: Factory) -> None:
    """The issue's trigger: the generator's task is cancelled before its first step."""
    rt = await runtime(lg.life, lg.quick)
    for graph, inputs in (("lg_quick", {"n": 3}), ("lg_life", {"n": 3})):
        for _ in range(5):
            call = rt.call(graph, inputs, session="s")
            await asyncio.sleep(0)
            # Awaited directly (wait_for would start it a loop step later); a hang here is
            # caught by the test's timeout.
            await call.cancel()
            assert call.status == "cancelled", rt.story(call.call_id)
            await ended(rt, call)


async def test_cancel_after_every_number_of_loop_steps(runtime: Factory, placement: str) -> None:
    """Cancel after j event-loop steps, for every j until the call finishes on its own: in
    process this walks every await point of the generators' life (before the first step,
    between yields, after the last one, while downstream still runs)."""
    rt = await runtime(lg.life, lg.quick)
    statuses = []
    j = 0
    ok_streak = 0
    while ok_streak < 3 and j < 400:
        call = rt.call("lg_life", {"n": 3}, session="s")
        for _ in range(j):
            await asyncio.sleep(0)
        await call.cancel()
        statuses.append(call.status)
        await ended(rt, call)
        ok_streak = ok_streak + 1 if call.status == "ok" else 0
        j += 1 if placement == "inproc" else 7
    assert statuses[0] == "cancelled"
    if placement == "inproc":  # deterministic: the sweep reached the call's natural end
        assert statuses[-1] == "ok"


@pytest.mark.parametrize("how", ["break", "cancel"])
async def test_cancel_after_every_number_of_frames(runtime: Factory, how: str) -> None:
    """Leave after k frames, for every k up to the last frame (then the call is at its end:
    the generators may still be running their last await)."""
    rt = await runtime(lg.life, lg.quick)
    total = 3 + 6  # three y, six z
    for k in range(total + 1):
        call = rt.call("lg_life", {"n": 3}, session="s")
        got = 0
        if k == 0:
            if how == "break":
                async for _ in call:
                    break
            else:
                await call.cancel()
        else:
            async for _ in call:
                got += 1
                if got == k:
                    if how == "cancel":
                        await call.cancel()
                    break
        assert call.status in ("cancelled", "ok")
        await asyncio.wait_for(call.wait(), HANG)
        await ended(rt, call)


async def test_max_iterations_through_a_generator_ends_the_call(runtime: Factory) -> None:
    """Exceeding max_iterations aborts the call internally, cancelling the generator task it
    just created; that must end the call, not hang it."""
    rt = await runtime(lg.loop, lg.quick)
    for _ in range(5):
        call = rt.call("lg_loop", {"start": 0}, session="s")
        seen = [f.value async for f in call]
        await asyncio.wait_for(call.wait(), HANG)
        assert call.status == "error"
        errs = [e for e in call.errors if e.kind == "error"]
        assert len(errs) == 1 and "max_iterations=5" in str(errs[0]), call.errors
        assert errs[0].node in ("lp_gen.gen", "lp_back.run")
        assert 1 <= len(seen) <= 5 and set(seen) <= {1, 2, 3, 4, 5}
        assert rt.stats() == ZERO
    with pytest.raises(of.NodeError, match="max_iterations=5"):
        await asyncio.wait_for(rt.run("lg_loop", {"start": 0}), HANG)


# ---------------------------------------------------------------- storms


async def _storm(rt: of.Runtime, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)

    async def one(i: int) -> None:
        session = f"s{rng.randrange(8)}" if rng.random() < 0.3 else None
        graph, inputs = rng.choice(
            [("lg_life", {"n": rng.randrange(0, 4)}), ("lg_quick", {"n": rng.randrange(0, 5)})]
        )
        call = rt.call(graph, inputs, session=session)
        what = rng.randrange(4)
        steps = rng.randrange(0, 12)
        if what == 0:  # read to the end
            async for _ in call:
                pass
        elif what == 1:  # break after a few frames
            k = 0
            async for _ in call:
                k += 1
                if k > steps % 4:
                    break
        elif what == 2:  # call.cancel() after some loop steps
            for _ in range(steps):
                await asyncio.sleep(0)
            await call.cancel()
        else:  # read in a task, then cancel that task

            async def read() -> None:
                async for _ in call:
                    pass

            task = asyncio.ensure_future(read())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await call.wait()
        counts[call.status] = counts.get(call.status, 0) + 1

    counts: dict[str, int] = {}
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), HANG * 4)
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_storm_of_1000_calls_inproc() -> None:
    rt = build("inproc", lg.life, lg.quick)
    async with rt:
        for seed in (1, 2):
            counts = await _storm(rt, 1000, seed)
            assert sum(counts.values()) == 1000
            assert set(counts) <= {"ok", "cancelled"}, counts
            assert counts.get("cancelled", 0) > 100 and counts.get("ok", 0) > 100, counts
            assert rt.stats() == ZERO
            for _ in range(3):
                await asyncio.sleep(0)
            no_pending_tasks(rt)
            assert rt._sessions.queues == {}


@pytest.mark.timeout(300)
async def test_storm_of_100_calls_across_processes() -> None:
    rt = build("process", lg.life, lg.quick)
    async with rt:
        counts = await _storm(rt, 100, 7)
        assert sum(counts.values()) == 100
        assert set(counts) <= {"ok", "cancelled"}, counts
        assert rt.stats() == ZERO
        no_pending_tasks(rt)
        assert rt._sessions.queues == {}
        stats = await rt.pool_stats()
        assert all(s.get("pool_live_blocks", 0) == 0 for s in stats.values()), stats


# ---------------------------------------------------------------- status when the loop is left


async def test_status_is_cancelled_as_soon_as_the_loop_is_left(runtime: Factory) -> None:
    rt = await runtime(lg.deadline, lg.quick)

    def start() -> of.Call:
        # 1000 frames 0.1 s apart: the stream cannot end before the caller leaves the loop
        # (with no gap a worker could send all of them and its done first, and the call be "ok"),
        # and it would outlast HANG: a cancel that misses it fails the wait, not slows it.
        return rt.call("lg_deadline", {"s": 0.1})

    call = start()
    async for f in call:
        if f.field == "tick" and f.value == 2:
            break
    assert call.status == "cancelled"
    assert await asyncio.wait_for(call.wait(), HANG) == "cancelled"
    await ended(rt, call)

    call = start()
    with pytest.raises(KeyError):
        async for f in call:
            if f.field == "tick":
                raise KeyError("the caller's own error")
    assert call.status == "cancelled"
    await asyncio.wait_for(call.wait(), HANG)
    await ended(rt, call)

    call = start()
    it = aiter(call)
    await anext(it)
    await it.aclose()
    assert call.status == "cancelled"
    await asyncio.wait_for(call.wait(), HANG)
    await ended(rt, call)

    call = start()
    first = asyncio.Event()

    async def read() -> None:
        async for _ in call:
            first.set()

    task = asyncio.ensure_future(read())
    await asyncio.wait_for(first.wait(), HANG)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert call.status == "cancelled"
    await asyncio.wait_for(call.wait(), HANG)
    await ended(rt, call)


async def test_an_iterator_never_started_does_not_cancel(runtime: Factory) -> None:
    rt = await runtime(lg.quick)
    call = rt.call("lg_quick", {"n": 3})
    it = aiter(call)
    del it
    assert await asyncio.wait_for(call.wait(), HANG) == "ok"
    assert [f.value async for f in call] == [0, 1, 2]


# ---------------------------------------------------------------- deadlines


async def test_timeout_cancels_a_running_node_and_ends_error(runtime: Factory) -> None:
    rt = await runtime(lg.deadline, lg.quick)
    call = rt.call("lg_deadline", {"s": 300.0}, timeout=0.2)
    out = await asyncio.wait_for(call.collect(), HANG)
    assert out == {}
    assert call.status == "error"
    timeouts = [e for e in call.errors if e.kind == "timeout"]
    assert len(timeouts) == 1, call.errors
    assert timeouts[0].node == "dl_slow.run"
    assert "timeout of 0.2s" in str(timeouts[0])
    assert rt.stats() == ZERO
    with pytest.raises(of.NodeError) as info:
        await asyncio.wait_for(rt.run("lg_deadline", {"s": 300.0}, timeout=0.1), HANG)
    assert info.value.kind == "timeout" and info.value.node == "dl_slow.run"
    assert rt.stats() == ZERO


async def test_timeout_cuts_a_stream(runtime: Factory) -> None:
    rt = await runtime(lg.deadline)
    call = rt.call("lg_deadline", {"s": 0.01}, timeout=0.5)  # 1000 ticks, 10 s
    ticks = [f.value async for f in call if f.field == "tick"]
    assert call.status == "error"
    (err,) = [e for e in call.errors if e.kind == "timeout"]
    assert err.node == "dl_tick.gen"
    assert ticks == list(range(len(ticks))) and len(ticks) < 1000
    assert rt.stats() == ZERO


async def test_timeout_not_reached_leaves_nothing(runtime: Factory) -> None:
    rt = await runtime(lg.quick)
    call = rt.call("lg_quick", {"n": 3}, timeout=300)
    assert [f.value async for f in call] == [0, 1, 2]
    assert call.status == "ok" and call._timer is None
    assert await rt.run("lg_quick", {"n": 1}, timeout=300) == {"x": [0]}
    assert rt.stats() == ZERO


async def test_timeout_while_queued_behind_the_session(runtime: Factory) -> None:
    rt = await runtime(lg.deadline)
    first = rt.call("lg_deadline", {"s": 300.0}, session="s")
    second = rt.call("lg_deadline", {"s": 0.0}, session="s", timeout=0.1)
    assert await asyncio.wait_for(second.wait(), HANG) == "error"
    (err,) = second.errors
    assert err.kind == "timeout" and "queued" in str(err)
    assert not first.done
    await asyncio.wait_for(first.cancel(), HANG)
    assert rt.stats() == ZERO


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "1", True])
async def test_bad_timeout_is_an_input_error(bad: Any) -> None:
    async with of.Runtime(lg.quick) as rt:
        with pytest.raises(of.InputError, match="timeout"):
            rt.call("lg_quick", {"n": 1}, timeout=bad)
        assert rt.stats() == ZERO


# ---------------------------------------------------------------- sessions


async def _hist(rt: of.Runtime, job: str, session: str = "s1") -> list[str]:
    out = await asyncio.wait_for(rt.run("lg_session", {"job": job}, session=session), HANG)
    return list(out["hist"][0][0])


async def test_close_session_frees_its_params_at_once(runtime: Factory) -> None:
    rt = await runtime(lg.session)
    assert await _hist(rt, "a") == ["a"]
    assert await _hist(rt, "b") == ["a", "b"]
    assert await _hist(rt, "x", "s2") == ["x"]
    assert rt.sessions() == ["s1", "s2"]
    await asyncio.wait_for(rt.close_session("s1"), HANG)
    assert rt.sessions() == ["s2"]
    assert await _hist(rt, "c") == ["c"]  # a new session: workers dropped theirs too
    assert await _hist(rt, "y", "s2") == ["x", "y"]  # the other session is untouched
    await asyncio.wait_for(rt.close_session("never-seen"), HANG)  # no error


async def test_close_session_waits_for_its_calls(runtime: Factory) -> None:
    rt = await runtime(lg.session)
    calls = [rt.call("lg_session", {"job": f"slow{i}"}, session="s1") for i in range(3)]
    await asyncio.wait_for(rt.close_session("s1"), HANG)
    assert all(c.done and c.status == "ok" for c in calls)
    hists = [(await c.collect())["hist"][0][0] for c in calls]
    assert hists == [["slow0"], ["slow0", "slow1"], ["slow0", "slow1", "slow2"]]
    assert rt.sessions() == []


async def test_idle_sessions_close_after_their_ttl(runtime: Factory) -> None:
    rt = await runtime(lg.session, session_ttl=0.05)
    # Calls queued back to back: the session is never idle between them, so it is kept
    # although each call outlives the TTL.
    calls = [rt.call("lg_session", {"job": f"slow{i}"}, session="s1") for i in range(3)]
    for c in calls:
        await asyncio.wait_for(c.wait(), HANG)
    assert (await calls[-1].collect())["hist"][0][0] == ["slow0", "slow1", "slow2"]
    # Idle now: closed within the TTL (waited for generously), workers included.
    await eventually(lambda: rt.sessions() == [], "the idle session to close")
    assert rt._sessions.idle == {} and rt._sessions.queues == {}
    assert await _hist(rt, "again") == ["again"]
    await eventually(lambda: rt._sessions.idle == {}, "the idle timer to fire")


async def test_many_sessions_do_not_stay_in_memory() -> None:
    async with of.Runtime(lg.session, session_ttl=0.05) as rt:
        big = "s" * (1 << 20)  # 1 MiB session ids
        for i in range(50):
            await rt.run("lg_session", {"job": "j"}, session=f"{big}{i}")
        sessions = rt._sessions
        await eventually(lambda: not sessions.params and not sessions.idle, "sessions to close")
        assert rt.sessions() == [] and rt._sessions.queues == {}


async def test_session_ttl_none_keeps_sessions_and_bad_ttl_is_rejected() -> None:
    async with of.Runtime(lg.session, session_ttl=None) as rt:
        await rt.run("lg_session", {"job": "j"}, session="s1")
        assert rt.sessions() == ["s1"] and rt._sessions.idle == {}
    for bad in (0, -1, "10", True):
        with pytest.raises(of.OmniflowError, match="session_ttl"):
            of.Runtime(lg.session, session_ttl=bad)


# ---------------------------------------------------------------- setup failures


async def test_setup_failure_names_the_role(placement: str) -> None:
    rt = build(placement, lg.bad_setup)
    with pytest.raises(of.OmniflowError, match=r"role 'vae' setup\(\) failed: RuntimeError: "
                       "weights not found at /nowhere") as info:  # fmt: skip
        await asyncio.wait_for(rt.start(), HANG)
    if placement == "inproc":  # the original exception is chained
        assert isinstance(info.value.__cause__, RuntimeError)
    else:  # it happened in the worker; the front names the replica and its role
        assert "role(s) ['vae']" in str(info.value)
    assert rt.state.value == "closed"
