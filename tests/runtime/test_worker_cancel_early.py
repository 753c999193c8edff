"""A worker and the cancel of a forwarded run that overtakes the run, and the claim of runs
whose forwarder was lost (unit level).

The front's cancel and the upstream worker's forward reach a worker on different connections,
so the cancel can be read first (the more so as a lone run's end leaves before its forwards);
on the held path, a worker's own message to the front leaves behind the forwards held for the
same loop turn."""

from __future__ import annotations

import asyncio
from typing import Any

from omniflow.cluster._worker_state import CANCELLED_EARLY
from omniflow.transport._protocol import Cancel, Claim, Claimed, Done, Run

from .test_worker_dones import A, B, sent, worker


def run(a: int | str, c: str = "c") -> Run:
    return Run(c, a, "node", {"x": 1}, None, 0, 0, "g")


def test_a_forwarded_run_cancelled_before_it_came_ends_cancelled_without_running() -> None:
    w = worker()
    try:
        w._handle(A, Cancel("c", "3.0.0"))
        w._start(A, run("3.0.0"))
        (msg,) = [m for _, m in sent(w)]
        assert type(msg) is Done
        assert (msg.call_id, msg.aid, msg.error_type, msg.cancelled) == (
            "c",
            "3.0.0",
            "CancelledError",
            True,
        )
        assert w._running == {} and w._cancelled_early == {}
    finally:
        w.plane.close()


def test_the_early_cancel_is_the_senders_own_and_for_that_run_only() -> None:
    w = worker()
    try:
        w._handle(A, Cancel("c", "3.0.0"))
        w._handle(A, Cancel("c", 5))  # a front's own runs come before their cancels: not kept
        assert list(w._cancelled_early) == [(A, "c", "3.0.0")]
        w._start(B, run("3.0.0"))  # another front's run of that id is not the cancelled one
        w._start(A, run("3.0.1"))
        started: list[Any] = [m for _, m in sent(w) if type(m) is Done and m.cancelled]
        assert started == []  # (both ran: they fail on the unknown node, none is cancelled)
        assert list(w._cancelled_early) == [(A, "c", "3.0.0")]
    finally:
        w.plane.close()


def test_early_cancels_are_bounded_oldest_first() -> None:
    w = worker()
    try:
        for i in range(CANCELLED_EARLY + 5):
            w._handle(A, Cancel("c", f"1.{i}.0"))
        assert len(w._cancelled_early) == CANCELLED_EARLY
        assert (A, "c", "1.0.0") not in w._cancelled_early
        assert (A, "c", f"1.{CANCELLED_EARLY + 4}.0") in w._cancelled_early
    finally:
        w.plane.close()


def test_a_message_to_the_front_waits_behind_the_forwards_of_its_loop_turn() -> None:
    w = worker()
    try:
        w._held_links["uds:///elsewhere.sock"] = [[b"forward"]]  # its flush is due this turn
        w._done(A, "c", 1, None, {"y": 1})
        assert w._out.empty()  # held: it leaves after the forwards
        w._held_links.clear()  # (the forwards went out)
        w._flush_held()
        assert [(m.call_id, m.aid, m.frame) for _, m in sent(w)] == [("c", 1, {"y": 1})]
        w._done(A, "c", 2, None, {"y": 2})  # nothing held: at once
        assert [(m.call_id, m.aid) for _, m in sent(w)] == [("c", 2)]
    finally:
        w.plane.close()


async def test_a_claim_lists_the_runs_not_here_which_then_never_run() -> None:
    """Asked which of a lost forwarder's runs it holds, a worker first takes in what its
    connections hold (``drain``), then lists the runs it does not hold: not one running here,
    but one that never came and one another front runs; a listed run whose forward still
    comes ends cancelled without running. A wire id that is not a str is dropped."""
    w = worker()
    gate = asyncio.Event()
    ran: list[int] = []

    async def slow(x: int) -> dict[str, Any]:
        ran.append(x)
        await gate.wait()
        return {"y": x}

    drains: list[int] = []

    class Endpoint:
        def drain(self) -> bool:
            drains.append(len(w._running))
            return True

        def try_send(self, frames: list[Any], peer: bytes | None = None) -> bool:
            return False  # (to the writer's queue, where ``sent`` reads it)

    w._endpoint = Endpoint()
    w._methods["slow"] = slow
    try:
        w._start(A, Run("c", "1.0.0", "slow", {"x": 1}, None, 0, 0, "g"))
        w._start(B, Run("c", "1.2.0", "slow", {"x": 2}, None, 0, 0, "g"))
        assert set(w._running) == {(A, "c", "1.0.0"), (B, "c", "1.2.0")}
        w._handle(A, Claim(7, "c", ["1.0.0", "1.1.0", "1.2.0", 5]))
        assert sent(w) == [] and drains == []  # (answered outside the batch that asked)
        await asyncio.sleep(0)
        assert drains == [2]
        assert sent(w) == [(A, Claimed(7, "c", ["1.1.0", "1.2.0"]))]
        assert w.wire.statistics()["dropped_malformed"] == 1
        w._start(A, Run("c", "1.1.0", "slow", {"x": 3}, None, 0, 0, "g"))  # late: never runs
        ((peer, done),) = sent(w)
        assert peer == A and (done.aid, done.cancelled) == ("1.1.0", True)
        assert (A, "c", "1.1.0") not in w._running
        gate.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(ran) == [1, 2]
        assert sorted((p, m.aid) for p, m in sent(w) if type(m) is Done) == [
            (A, "1.0.0"), (B, "1.2.0"),
        ]  # fmt: skip
    finally:
        w.plane.close()
