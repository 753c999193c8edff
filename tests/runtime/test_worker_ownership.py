"""A worker acts on control messages only for what the sending front owns (unit level)."""

from __future__ import annotations

import asyncio

from omniflow.cluster._worker import Worker
from omniflow.data._connectors import HOST
from omniflow.data._handle import BlockHandle
from omniflow.data._ref import DataRef
from omniflow.runtime._params import SessionParams
from omniflow.transport._protocol import EndCall, Hello, Release, Stop

KEY = b"test-cluster-key-0123456789abcdef"
A, B = b"front-a", b"front-b"


def worker(owner: str | None = "token-a") -> Worker:
    w = Worker([], ["r"], "ipc:///nowhere", cluster_key=KEY, owner=owner)
    w._handle(A, Hello("token-a", 1.0))
    w._handle(B, Hello("token-b", 1.0))
    return w


async def test_end_call_and_release_from_another_front_are_dropped_as_foreign() -> None:
    w = worker()
    w._call_owner["c1"] = A
    w._call_params["c1"] = SessionParams({})
    released: list[DataRef] = []
    w.plane.release = released.append  # type: ignore[method-assign]
    handle = BlockHandle("pool", 1, 0, 8)
    ref = DataRef(handle, HOST, 1, "", ("n.run", "c1", "y", "0:0"))
    w._handle(B, Release([ref]))
    w._handle(B, EndCall("c1"))
    assert released == [] and "c1" in w._call_params
    assert w.wire.dropped["foreign"] == 2
    w._handle(A, Release([ref]))
    w._handle(A, EndCall("c1"))
    assert released == [ref] and "c1" not in w._call_params and "c1" not in w._call_owner
    w._handle(B, EndCall("c-unknown"))  # a call with no state here: nothing to do, not foreign
    assert w.wire.dropped["foreign"] == 2
    w.plane.close()


async def test_only_the_spawning_front_may_stop_a_worker() -> None:
    w = worker()
    w._handle(B, Stop())
    assert not w._stop.is_set() and w.wire.dropped["foreign"] == 1
    w._handle(A, Stop())
    assert w._stop.is_set()
    hand = worker(owner=None)  # started by hand: stopped by SIGTERM, not by any front
    hand._handle(A, Stop())
    assert not hand._stop.is_set() and hand.wire.dropped["foreign"] == 1
    await asyncio.sleep(0)
    w.plane.close()
    hand.plane.close()


async def test_only_the_spawning_front_hosts_the_pools_metadata() -> None:
    from omniflow.transport._protocol import MetaCall, MetaNotify, MetaReply, decode_msg

    w = worker()
    assert w._hosted is not None and w._hosted.attached
    seen: list[tuple[str, str | None, list[str]]] = []
    w._hosted.listen("kv", "node", lambda p, s, k: seen.append((p, s, k)))
    call = asyncio.ensure_future(w._hosted.match("kv", "chat", ["a"]))
    r = -1
    await asyncio.sleep(0)
    while not w._out.empty():  # skip the two readies; the call goes to the owning front
        peer, frames = w._out.get_nowait()
        msg = decode_msg(frames)
        if isinstance(msg, MetaCall):
            assert peer == A and msg.op == "match" and msg.args == ["kv", "chat", ["a"]]
            r = msg.request
    w._handle(B, MetaReply(r, [{"x": "1:0:4"}]))  # another front cannot answer for it
    w._handle(B, MetaNotify("kv", "chat", ["a"]))  # nor notify
    assert not call.done() and seen == [] and w.wire.dropped["foreign"] == 2
    w._handle(A, MetaNotify("kv", "chat", ["a", 1]))  # type: ignore[list-item]
    assert seen == [] and w.wire.dropped["malformed"] == 1
    w._handle(A, MetaNotify("kv", "chat", ["a"]))
    w._handle(A, MetaReply(r, [{"n": "1:0:4"}]))
    assert await call == [{"n": "1:0:4"}] and seen == [("kv", "chat", ["a"])]
    hand = worker(owner=None)
    assert hand._hosted is None  # started by hand: no front hosts its pools
    w.plane.close()
    hand.plane.close()
