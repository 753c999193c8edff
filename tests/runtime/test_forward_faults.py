"""Fault tests of the cross-process fast path (issue 16): a stream through a forwarding chain
when a worker is killed or stopped, when Redis restarts, when the caller cancels, and when
another branch fails, with forwarded runs in flight each time.

``fw_chain`` (fwd_graphs.py) runs ``src`` -> ``m1`` -> ``m2`` (and ``src`` -> ``boom``) in three
workers; every run of m1, m2 and boom is started worker to worker (``forwarded`` counts the
runs the front bound to one). After each fault the test waits, with a generous hang guard and
no sleep, until nothing is left: no call work (``rt.stats()``), no remote activation
(``remote_inflight``), no early or orphaned forwarded run (``forward_waiting``), no pool
block in any worker; and no message was dropped by the front or a worker for being malformed,
foreign or forged. Nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

import pytest

import omniflow as of
from omniflow.testing import RedisServer

from . import fwd_graphs as fg
from .test_multiprocess import alive, eventually, front, idle, replicas

#: Every test here starts worker processes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
#: Far above any honest run, even on a loaded 2-core machine: a hang guard, not a timing.
HANG = 60.0


def deploy() -> of.Deploy:
    return of.Deploy(fg.DEPLOY)


def inputs(n: int, *, every: float = 0.01, hold: float = 0.05, fail: int = -1) -> dict[str, Any]:
    return {"n": n, "every": every, "hold": hold, "fail": fail}


def pid_of(rt: of.Runtime, role: str) -> int:
    """The pid of the one worker that serves ``role`` now."""
    assert rt.remote is not None
    [pid] = [
        r.process.pid
        for r in rt.remote.fleet.replicas.values()
        if role in r.roles and r.alive and r.process is not None
    ]
    return pid


def remote(rt: of.Runtime) -> dict[str, int]:
    assert rt.remote is not None
    return rt.remote.statistics()


async def settled(rt: of.Runtime) -> None:
    """Nothing of any call is left anywhere, and nothing was dropped on the wire."""

    async def quiet() -> bool:
        r = remote(rt)
        return idle(rt) and (r["remote_inflight"], r["forward_waiting"]) == (0, 0)

    await eventually(quiet, "no call work, remote activation or forwarded-run entry left", HANG)
    assert rt.remote is not None
    workers: dict[str, dict[str, Any]] = {}

    async def workers_idle() -> bool:
        workers.clear()
        workers.update(await rt.remote.worker_statistics())  # type: ignore[union-attr]
        return len(workers) == replicas(rt) and all(
            (w["work"]["running"], w["work"]["forwarding"], w["work"]["link_queued"]) == (0, 0, 0)
            for w in workers.values()
        )

    await eventually(workers_idle, "every worker idle, nothing queued to forward", HANG)
    for name, w in workers.items():
        assert w["plane"]["pool_live_blocks"] == 0, (name, w)
        assert dropped(w["wire"]) == {}, (name, w)
        # A link to each other worker at most: none to a lost one (it would hold what it
        # queued for good).
        assert w["work"]["links"] <= 2, (name, w)
    wire = rt.wire_stats()
    assert dropped(wire) == {} and wire["forged_records"] == 0, wire


def dropped(wire: dict[str, Any]) -> dict[str, Any]:
    """The messages a wire dropped, by reason (none is expected in any test here)."""
    return {k: v for k, v in wire.items() if k.startswith("dropped") and v}


async def chain_ok(rt: of.Runtime, n: int) -> list[dict[str, Any]]:
    """A call through the whole chain succeeds, every frame through the current workers."""
    before = remote(rt)["forwarded"]
    out = await asyncio.wait_for(rt.run("fw_chain", inputs(n, every=0.0, hold=0.0)), HANG)
    got = out["c"]
    assert sorted(v["i"] for v in got) == list(range(n))
    where = {(v["src"], v["m1"], v["m2"]) for v in got}
    assert where == {(pid_of(rt, "src"), pid_of(rt, "m1"), pid_of(rt, "m2"))}, where
    assert remote(rt)["forwarded"] >= before + 2 * n  # m1 and m2 (and boom) of every frame
    return list(got)


# ---------------------------------------------------------------- losing m1's worker


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_losing_the_middle_worker_mid_stream(sig: signal.Signals) -> None:
    """m1's worker dies (SIGKILL) or stops answering (SIGSTOP: heartbeats missed; the front
    kills it) while m1 runs forwarded by src's worker are in flight: the call ends with
    "replica lost" errors at m1 (runs it makes while m1 has no replica fail at once), never
    hangs, leaks nothing; the respawned worker serves the next call, and a SIGCONT to the
    stopped one changes nothing."""
    async with front(fg.chain, deploy()) as rt:
        await chain_ok(rt, 3)
        victim = pid_of(rt, "m1")
        # Long enough that the stream outlives the loss (SIGSTOP: 10 missed heartbeats, 2 s).
        call = rt.call("fw_chain", inputs(600))
        got: list[dict[str, Any]] = []

        async def consume() -> None:
            async for frame in call:
                got.append(frame.value)
                if len(got) == 5:
                    os.kill(victim, sig)

        await asyncio.wait_for(consume(), HANG)
        assert len(got) >= 5
        assert call.status == "error", call.status
        assert call.errors and all((e.node, e.kind) == ("m1.run", "error") for e in call.errors)
        messages = [e.message for e in call.errors]
        assert any("replica lost" in m and "role 'm1'" in m for m in messages), messages
        assert all("replica lost" in m or "no live replica of role 'm1'" in m for m in messages)
        assert remote(rt)["forwarded"] > 0
        await settled(rt)

        async def gone() -> bool:
            return not alive(victim)

        await eventually(gone, "the lost worker is gone (killed by the front if stopped)", HANG)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)

        async def respawned() -> bool:
            return replicas(rt) == 3

        await eventually(respawned, "m1's worker is respawned", HANG)
        assert pid_of(rt, "m1") != victim
        await chain_ok(rt, 20)
        await settled(rt)
        assert {r: n for r, n in rt.wire_stats()["restarts"].items() if n} == {"m1": 1}


# ---------------------------------------------------------------- losing a forwarder


async def test_runs_a_lost_worker_forwarded_but_never_delivered_fail_not_hang() -> None:
    """pm1's worker ran every pm1 run, forwarded each pm2 run to pm2's worker (stopped: its
    socket fills, the rest wait in pm1's worker) and told the front, which bound them all;
    then pm1's worker dies, idle. The front asks pm2's worker which runs it holds: the ones
    that reached it run, the ones that died with pm1's worker fail as lost with it, and the
    call ends (it used to wait for them for good); nothing is left."""
    n, size = 160, 100_000  # 16 MB: more than a socket holds (4 MiB buffer, doubled)
    rt = front(fg.padded, of.Deploy(fg.DEPLOY_PAD))
    assert rt.remote is not None
    rt.remote.fleet.heartbeat_misses = 1_000_000  # (pm2's worker is stopped, not lost)
    async with rt:
        for _ in range(2):  # (the second forwards every run: the links are made)
            before = remote(rt)["forwarded"]
            small = {"n": 2, "size": 1, "every": 0.0}
            assert (await asyncio.wait_for(rt.run("fw_pad", small), HANG))["c"]
        assert remote(rt)["forwarded"] == before + 2 * 2
        before = remote(rt)["forwarded"]
        m1, m2 = pid_of(rt, "pm1"), pid_of(rt, "pm2")
        os.kill(m2, signal.SIGSTOP)
        try:
            # (frames apart: each forward leaves pm1's worker as a message of its own)
            call = rt.call("fw_pad", {"n": n, "size": size, "every": 0.002})

            async def all_bound_m1_idle() -> bool:
                r = remote(rt)
                return r["forwarded"] == before + 2 * n and r["remote_inflight"] == n

            await eventually(all_bound_m1_idle, "every pm1 run ended, every pm2 run bound", HANG)
            os.kill(m1, signal.SIGKILL)

            async def m1_lost() -> bool:
                assert rt.remote is not None
                return not any(
                    r.alive and r.process is not None and r.process.pid == m1
                    for r in rt.remote.fleet.replicas.values()
                )

            await eventually(m1_lost, "the front lost pm1's worker", HANG)
        finally:
            os.kill(m2, signal.SIGCONT)
        got = await asyncio.wait_for(call.collect(), HANG)
        assert call.status == "error", call.status
        ran = sorted(v["i"] for v in got.get("c", []))
        assert 0 < len(ran) < n and len(call.errors) == n - len(ran), (len(ran), call.errors)
        for e in call.errors:
            assert (e.node, e.kind) == ("pm2.run", "error"), e
            assert "replica lost" in e.message and "before the run reached it" in e.message, e
        await settled(rt)


# ---------------------------------------------------------------- Redis restart


async def test_redis_restart_mid_stream_with_forwarding(redis: RedisServer) -> None:
    """With a registry, a Redis restart under a forwarding stream: the stream completes (the
    front watches the workers it spawned through their processes), nothing leaks."""
    async with front(fg.chain, deploy(), registry=redis.url) as rt:
        call = rt.call("fw_chain", inputs(300, hold=0.02))
        got: list[dict[str, Any]] = []
        running_after_restart = False

        async def consume() -> None:
            nonlocal running_after_restart
            async for frame in call:
                got.append(frame.value)
                if len(got) == 5:
                    await asyncio.to_thread(redis.restart)
                    running_after_restart = call.status == "running"

        await asyncio.wait_for(consume(), HANG)
        assert call.status == "ok", call.errors
        assert running_after_restart  # the stream spanned the restart
        assert sorted(v["i"] for v in got) == list(range(300))
        assert remote(rt)["forwarded"] >= 2 * 300
        await settled(rt)
        assert replicas(rt) == 3
        await chain_ok(rt, 5)
        await settled(rt)


# ---------------------------------------------------------------- cancel, another branch


async def test_cancel_mid_stream_with_forwarded_runs_in_flight() -> None:
    """The caller cancels while m1 runs are in flight and src keeps forwarding: the forwarded
    runs the front bound are cancelled, the ones it never bound are orphans (cancelled, their
    results dropped), and nothing is left."""
    async with front(fg.chain, deploy()) as rt:
        for k in (1, 5, 20):
            call = rt.call("fw_chain", inputs(600))
            got = 0
            async for _frame in call:
                got += 1
                if got == k:
                    await asyncio.wait_for(call.cancel(), HANG)
                    break
            await asyncio.wait_for(call.wait(), HANG)
            assert call.status == "cancelled", (call.status, call.errors)
            assert all(e.kind == "cancel" for e in call.errors), call.errors
            await settled(rt)
        assert remote(rt)["forwarded"] > 0
        await chain_ok(rt, 10)
        await settled(rt)


async def test_a_failing_branch_beside_forwarded_runs_in_flight() -> None:
    """boom fails on one frame while the m1 -> m2 runs of other frames are in flight (all of
    them forwarded): the call ends in error naming boom only, the chain's frames all arrive,
    nothing is left."""
    async with front(fg.chain, deploy()) as rt:
        call = rt.call("fw_chain", inputs(100, fail=30))
        got = await asyncio.wait_for(call.collect(), HANG)
        assert call.status == "error"
        [err] = call.errors
        assert (err.node, err.kind) == ("boom.run", "error")
        assert "ValueError: boom at frame 30" in err.message
        assert sorted(v["i"] for v in got["c"]) == list(range(100))
        assert "d" not in got
        assert remote(rt)["forwarded"] >= 3 * 100
        await settled(rt)
        await chain_ok(rt, 10)
        await settled(rt)
