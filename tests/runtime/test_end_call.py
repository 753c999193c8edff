"""A call's end waits for the workers' release of its Params Pool pages (unit level): with pools,
the front asks each worker the call ran on to acknowledge its ``EndCall`` once the call's pages
there are unpinned, and the call's end becomes visible when every one has, or was lost, or
``END_CALL_TIMEOUT`` passed (docs/contract.md §7; ``test_pool_recipe.py`` runs it end to end)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omniflow.cluster import _remote_ends
from omniflow.cluster._fleet import Replica
from omniflow.cluster._remote import RemoteRoles
from omniflow.cluster._replica import ReplicaEvent
from omniflow.cluster._worker import Worker
from omniflow.transport._protocol import CallEnded, EndCall, Hello, decode_msg

KEY = b"test-cluster-key-0123456789abcdef"
A = b"front-a"


def _front(track_calls: bool = True) -> RemoteRoles:
    rr = RemoteRoles(
        [],
        registry=None,
        on_frame=lambda *a: None,
        on_done=lambda *a: None,
        on_return=lambda *a: None,
        spin=0.0,
    )
    rr.track_calls = track_calls
    return rr


def _sent(rep: Replica) -> list[Any]:
    out = []
    while not rep.out.empty():
        out.append(decode_msg(rep.out.get_nowait()))
    return out


async def test_the_end_waits_for_every_worker_asked_and_a_lost_one_counts_as_released() -> None:
    rr = _front()
    reps = [Replica(f"r{i}", ["m"], f"uds:///r{i}") for i in range(4)]
    reps[3].life.apply(ReplicaEvent.LOST)  # lost before the end: not asked, not waited for
    rr._ends.replicas["c1"] = set(reps)
    ended = rr.end_call("c1")
    assert ended is not None
    assert [_sent(r) for r in reps] == [[EndCall("c1", True)]] * 3 + [[]]
    rr._on_message(reps[0], CallEnded("c1"))
    rr._on_message(reps[0], CallEnded("c1"))  # said twice: the second is not its to say
    assert rr.fleet.wire.dropped["foreign"] == 1
    rr._on_message(reps[3], CallEnded("c1"))  # never asked
    assert rr.fleet.wire.dropped["foreign"] == 2
    await asyncio.sleep(0)
    assert not ended.done()
    reps[1].life.apply(ReplicaEvent.LOST)
    rr._on_lost(reps[1], "its process exited")  # its pages went with it
    await asyncio.sleep(0)
    assert not ended.done()
    rr._on_message(reps[2], CallEnded("c1"))
    await asyncio.wait_for(ended, 30)  # (a hang guard)
    assert rr._ends.ending == {}
    rr._on_message(reps[2], CallEnded("c1"))  # late (after the end): ignored
    assert rr.fleet.wire.dropped["foreign"] == 2


async def test_without_pools_nothing_is_acknowledged_or_waited_for() -> None:
    rr = _front(track_calls=False)
    rep = Replica("r0", ["m"], "uds:///r0")
    rr._ends.replicas["c1"] = {rep}
    assert rr.end_call("c1") is None
    assert _sent(rep) == [EndCall("c1", False)]
    assert rr.end_call("c-none") is None  # a call that ran on no worker
    assert rr._ends.ending == {}


async def test_a_worker_that_never_answers_is_let_be_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_remote_ends, "END_CALL_TIMEOUT", 0.0)
    rr = _front()
    rep = Replica("r0", ["m"], "uds:///r0")
    rr._ends.replicas["c1"] = {rep}
    ended = rr.end_call("c1")
    assert ended is not None
    await asyncio.wait_for(ended, 30)
    assert rr._ends.ending == {}
    assert "r0" in caplog.text and "did not confirm its end" in caplog.text


class _Pool:
    """A pool whose release of the call's pages waits for ``go`` (``fail``: then raises)."""

    name = "kv"

    def __init__(self, calls: set[str], fail: bool = False) -> None:
        self.calls = calls
        self.fail = fail
        self.go = asyncio.Event()

    def holds(self, call_id: str) -> bool:
        return call_id in self.calls

    async def release(self, call_id: str) -> None:
        await self.go.wait()
        self.calls.discard(call_id)
        if self.fail:
            raise RuntimeError("release failed")


def _ends(w: Worker) -> list[Any]:
    out = []
    while not w._out.empty():
        peer, frames = w._out.get_nowait()
        msg = decode_msg(frames)
        if type(msg) is CallEnded:
            assert peer == A
            out.append(msg)
    return out


async def test_a_worker_acknowledges_an_end_call_after_the_release_of_its_pages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = Worker([], ["r"], "ipc:///nowhere", cluster_key=KEY, owner="token-a")
    w._handle(A, Hello("token-a", 1.0))
    pools = w._pools["kv"], w._pools["kv2"] = _Pool({"c1"}), _Pool({"c1"}, fail=True)
    for c in ("c1", "c2"):
        w._call_owner[c] = A
    w._handle(A, EndCall("c2", True))  # no pages here: answered at once
    assert _ends(w) == [CallEnded("c2")]
    w._handle(A, EndCall("c1", True))
    for _ in range(3):
        await asyncio.sleep(0)
    assert _ends(w) == []  # still releasing
    pools[0].go.set()
    pools[1].go.set()
    await asyncio.wait_for(asyncio.gather(*w._pool_releases), 30)
    assert _ends(w) == [CallEnded("c1")]  # after both, the failed one logged
    assert pools[0].calls == pools[1].calls == set()
    assert "releasing call c1's pages" in caplog.text
    w._call_owner["c3"] = A
    w._handle(A, EndCall("c3"))  # not asked to: no answer
    assert _ends(w) == []
    w.plane.close()
