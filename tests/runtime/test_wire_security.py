"""The authenticated wire and worker supervision, over real sockets and real processes.

- A worker's socket and a front's get 10k messages signed with a wrong key, unsigned, cut
  short and replayed, carrying a pickle whose loading would create a marker file: nothing runs
  (the file never appears), both processes live and serve, and the counters show the drops.
- A forged registry record (unsigned, or signed with another key) never receives anything.
- SIGKILL of a role's only replica: readiness names the role, then a respawned replica serves.
- SIGSTOP of a replica: its calls end with a NodeError once heartbeats are missed, and the
  replica is replaced.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import omniflow as of
from omniflow.registry import MemoryRegistry, MemoryStore, RedisRegistry, Replica
from omniflow.serve._metrics import HttpMetrics, render
from omniflow.testing import RedisServer
from omniflow.transport import bind, connect, encode
from omniflow.transport._auth import (
    BULK_BYTES,
    TAG_BYTES,
    Opener,
    Sealer,
    WireStats,
    opener_for,
    sealer_for,
)
from omniflow.transport._protocol import (
    Batch,
    Done,
    Dones,
    Forward,
    Frame,
    Heartbeat,
    Hello,
    Ready,
    Run,
    StatsReply,
    StatsRequest,
    Stop,
    decode_msg,
    encode_msg,
)

from . import mp_graphs as mp

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # every test starts workers

KEY = "test-cluster-key-0123456789abcdef"
WRONG = b"wrong-cluster-key-0123456789abcd"
HEARTBEAT = 0.2


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OMNIFLOW_CLUSTER_KEY", KEY)
    return KEY


class _Evil:
    """Unpickling this creates ``path``: the marker that code from the wire ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


def _evil_run(marker: Path) -> list[bytes]:
    body = ["c", 1, "r.run", {"x": _Evil(marker)}, None, 0, 0, "mp_scale"]
    frames = [bytes(f) for f in encode(body, kind="run", pickle=True)]
    assert b"touch" in frames[0]  # the pickle really rides in the message
    return frames


def _evil_bulk(marker: Path) -> list[bytes]:
    """The evil run padded past BULK_BYTES, so its MAC is the one-time-key GMAC."""
    body = ["c", 1, "r.run", {"x": _Evil(marker), "pad": bytes(3 * BULK_BYTES)}, None, 0, 0,
            "mp_scale"]  # fmt: skip
    frames = [bytes(f) for f in encode(body, kind="run", pickle=True)]
    assert b"touch" in frames[0] and sum(map(len, frames)) >= BULK_BYTES
    return frames


def _attack(marker: Path, replayable: list[Any]) -> Iterator[list[bytes]]:
    """10,000 hostile messages: wrong key, unsigned, cut short, tampered, replayed."""
    evil = _evil_run(marker)
    bulk = _evil_bulk(marker)
    wrong = Sealer(WRONG)
    right = Sealer(KEY.encode())
    for i in range(10_000):
        match i % 10:
            case 0 | 1 | 2 | 3 | 4:
                yield [bytes(f) for f in wrong.seal(evil)]
            case 5:  # a bulk message sealed with the right key, then one byte changed
                sealed = [bytearray(f) for f in right.seal(bulk)]
                sealed[0][(i * 7919) % len(sealed[0])] ^= 1 << (i % 8)
                yield [bytes(f) for f in sealed]
            case 6:
                yield evil  # no tag at all
            case 7:  # a correctly sealed message cut short (the MAC no longer holds)
                sealed = [bytes(f) for f in right.seal(encode_msg(Heartbeat()))]
                yield [sealed[0][:-1]]
            case 8:  # a tag from the right key over other frames
                sealed = [bytes(f) for f in right.seal(encode_msg(Heartbeat()))]
                yield [sealed[0][:TAG_BYTES] + evil[0]]
            case _:
                yield [bytes(f) for f in replayable]  # accepted once, then replays


def front(
    graph: of.Graph, placement: Any, registry: str | None = None, misses: int = 10
) -> of.Runtime:
    """Short heartbeats; the fault tests miss 3 of them, the floods get more slack (a worker
    checking 10k messages on a loaded machine must not be taken for dead)."""
    return of.Runtime(
        graph,
        placement=placement,
        registry=registry,
        heartbeat_interval=HEARTBEAT,
        heartbeat_misses=misses,
    )


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], what: str, within: float
) -> float:
    t0 = time.monotonic()
    while True:
        ok = check()
        if not isinstance(ok, bool):
            ok = await ok
        if ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > within:
            pytest.fail(f"not within {within:.1f}s: {what}")
        await asyncio.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def the_pid(rt: of.Runtime) -> int:
    assert rt.remote is not None
    replicas = rt.remote.fleet.replicas.values()
    [pid] = [r.process.pid for r in replicas if r.process is not None and r.alive]
    return pid


# ---------------------------------------------------------------- 1. a worker's socket


@pytest.mark.parametrize("fast_path", ["1", "0"], ids=["uds", "ipc"])
async def test_a_worker_drops_forged_unsigned_cut_and_replayed_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_path: str
) -> None:
    """Over ipc:// every message is sealed and checked (the flood is dropped message by
    message); over uds:// a connection proves the key when it is made, so a peer without it
    (or with another) is dropped at its handshake before any message of it is read."""
    monkeypatch.setenv("OMNIFLOW_FAST_PATH", fast_path)
    marker = tmp_path / "pwned"
    async with front(mp.scale, of.Deploy({"r": {}})) as rt:
        assert rt.remote is not None
        [rep] = rt.remote.fleet.replicas.values()
        assert rep.address.startswith("uds://" if fast_path == "1" else "ipc://")
        pid = the_pid(rt)
        assert (await rt.run("mp_scale", {"x": 1}))["y"] == [1]

        async def keyless(key: bytes | None) -> None:
            # Someone at the worker's socket without the key: each of its connections is
            # dropped at the handshake (it reconnects and is dropped again), nothing read.
            sock = connect(rep.address, key=key)
            try:
                for frames in itertools.islice(_attack(marker, [b"x"]), 20):
                    await sock.send(frames)
                await eventually(lambda: sock.statistics()["connects"] >= 3, "3 refusals", 60)
            finally:
                sock.close()

        async def hostile() -> dict[str, int]:
            # A key holder on the worker's own transport (uds:// with the fast path, ipc://
            # without), which is not the worker's front.
            sock = connect(rep.address, key=KEY.encode())
            me = sealer_for(sock, KEY.encode())
            opener = opener_for(sock, KEY.encode(), WireStats())
            try:
                replayable = me.seal(encode_msg(StatsRequest(1)))
                if sock.authenticated:
                    await sock.send(replayable)
                    await keyless(None)
                    await keyless(WRONG)
                else:
                    for frames in _attack(marker, replayable):
                        await sock.send(frames)
                # A key holder that is not the worker's front may not stop it.
                await sock.send(me.seal(encode_msg(Stop())))

                async def stats(r: int) -> dict[str, int]:
                    await sock.send(me.seal(encode_msg(StatsRequest(r))))
                    while True:
                        batch = await asyncio.wait_for(sock.recv_batch(), 30)
                        for _peer, frames in batch:
                            inner = opener.open(frames)
                            assert inner is not None
                            msg = decode_msg(inner)
                            if isinstance(msg, StatsReply) and msg.request == r:
                                return msg.wire

                before = await stats(2)
                # A batch: each bad item is dropped alone, the good ones are served.
                forward = ["c", "0.0.0", "r.run", {"x": 1}, None, 0, 0, "mp_scale"]
                items = [
                    b"garbage",
                    bytes(encode_msg(Batch([bytes(encode_msg(StatsRequest(9))[0])]))[0]),
                    bytes(encode_msg(Forward("some-front", "another-replica", *forward))[0]),
                    bytes(encode_msg(Forward("never-said-hello", rep.replica_id, *forward))[0]),
                ]
                await sock.send(me.seal(encode_msg(Batch(items))))
                after = await stats(3)
                assert after["dropped_malformed"] - before["dropped_malformed"] == 2
                assert after["dropped_foreign"] - before["dropped_foreign"] == 2
                return after
            finally:
                sock.close()

        wire = await hostile()
        assert not marker.exists()
        if fast_path == "1":  # nothing of the keyless peers was read, so nothing counted
            assert wire["dropped_bad_mac"] == wire["dropped_replay"] == 0
            assert wire["dropped_malformed"] == 2  # the two bad items of the batch below
        else:
            assert wire["dropped_bad_mac"] >= 9000
            assert wire["dropped_replay"] == 999  # the first copy was a real request
        assert wire["dropped_foreign"] >= 1  # the stop
        assert alive(pid)
        assert (await rt.run("mp_scale", {"x": 2})) == {"y": [2], "pid": [pid]}
        assert rt.readiness() == []
    assert not marker.exists()


# ---------------------------------------------------------------- 2. a front's socket


class FakeReplica:
    """A ROUTER registered (correctly signed) as a replica of role r, which the front adopts.
    It floods the front with hostile messages, then behaves: answers runs, heartbeats."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.ep = bind("tcp://127.0.0.1:0")
        self.sealer = Sealer(KEY.encode())
        self.opener = Opener(KEY.encode())
        self.runs = 0
        self.task: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        peer = None
        beat = asyncio.get_running_loop().time()
        while True:
            try:
                batch = await asyncio.wait_for(self.ep.recv_batch(), HEARTBEAT / 2)
            except TimeoutError:
                batch = []
            for who, frames in batch:
                inner = self.opener.open(frames)
                assert inner is not None, "the front sent something unauthentic"
                msg = decode_msg(inner)
                if isinstance(msg, Hello) and peer is None:
                    peer = who
                    replayable = self.sealer.seal(encode_msg(Heartbeat()))
                    for attack in _attack(self.marker, replayable):
                        await self.ep.send(attack, peer=peer)
                    # Authentic, but about activations it does not run.
                    await self.send(peer, Frame("c-nope", 7, {"y": 1}))
                    await self.send(peer, Done("c-nope", 7))
                    await self.send(peer, Dones(["c-nope"], [7, 8], [None], [None]))  # unlike
                    await self.send(peer, Ready("fake", ["r"], os.getpid()))
                elif isinstance(msg, Run):
                    self.runs += 1
                    # Its answer rides among bad records, each dropped alone: a foreign one,
                    # a malformed aid, a malformed forward note.
                    good = {"y": msg.kwargs["x"], "pid": -1}
                    c, a = msg.call_id, msg.aid
                    ends = Dones(["c-nope", c, c, c], [9, 2.5, a, a],
                                 [None, None, None, good], [None, None, 5, None])  # fmt: skip
                    await self.send(who, ends)
            now = asyncio.get_running_loop().time()
            if peer is not None and now - beat > HEARTBEAT / 2:
                beat = now
                await self.send(peer, Heartbeat())

    async def send(self, peer: bytes | None, msg: Any) -> None:
        await self.ep.send(self.sealer.seal(encode_msg(msg)), peer=peer)


async def test_a_front_drops_what_a_hostile_replica_sends(
    tmp_path: Path, redis: RedisServer
) -> None:
    marker = tmp_path / "pwned"
    fake = FakeReplica(marker)
    fake.task = asyncio.create_task(fake.serve())
    try:
        async with (
            RedisRegistry(redis.url, heartbeat_interval=0.5, key=KEY.encode()) as reg,
            front(mp.scale, of.Deploy({"r": {}}), registry=redis.url) as rt,
        ):
            await reg.register("r", "fake", fake.ep.url)
            await eventually(lambda: rt.wire_stats()["live_replicas"]["r"] == 2, "adoption", 60)
            stats = rt.wire_stats()
            assert stats["dropped_bad_mac"] >= 9000, stats
            assert stats["dropped_replay"] == 999, stats
            assert stats["dropped_foreign"] >= 2, stats
            assert not marker.exists()
            pid = the_pid(rt)
            results = [await rt.run("mp_scale", {"x": i}) for i in range(10)]
            assert [r["y"] for r in results] == [[i] for i in range(10)]
            assert {r["pid"][0] for r in results} == {pid, -1}  # both serve, in turn
            assert fake.runs == 5 and alive(pid)
            stats = rt.wire_stats()
            assert stats["dropped_malformed"] >= 1 + 2 * 5, stats
            assert stats["dropped_foreign"] >= 2 + 5, stats
    finally:
        fake.task.cancel()
        fake.ep.close()
    assert not marker.exists()


# ---------------------------------------------------------------- 3. forged registry records


async def test_forged_redis_records_never_receive_anything(redis: RedisServer) -> None:
    ctx = zmq.Context()
    traps = []
    try:
        for _ in range(2):
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            traps.append((sock, f"tcp://127.0.0.1:{port}"))
        async with (
            RedisRegistry(redis.url, heartbeat_interval=0.5) as unsigned,
            RedisRegistry(redis.url, heartbeat_interval=0.5, key=WRONG) as other_key,
            front(mp.scale, of.Deploy({"r": {}}), registry=redis.url) as rt,
        ):
            await unsigned.register("r", "forged-unsigned", traps[0][1])
            await other_key.register("r", "forged-other-key", traps[1][1])
            await eventually(lambda: rt.wire_stats()["forged_records"] >= 4, "watch polls", 30)
            for i in range(20):
                assert (await rt.run("mp_scale", {"x": i}))["y"] == [i]
            assert rt.wire_stats()["live_replicas"] == {"r": 1}
        for sock, _url in traps:
            assert not sock.poll(0), "a forged replica was contacted"
    finally:
        for sock, _url in traps:
            sock.close()
        ctx.term()


async def test_forged_memory_records_are_ignored_and_counted() -> None:
    store = MemoryStore()
    async with MemoryRegistry(store, key=KEY.encode()) as reg:
        await reg.register("r", "real", "tcp://127.0.0.1:1")
        store.put(Replica("r", "forged", "tcp://127.0.0.1:2"), 60)  # written by hand
        async with MemoryRegistry(store, key=WRONG) as other:
            await other.register("r", "other-key", "tcp://127.0.0.1:3")
            assert [r.replica_id for r in await reg.replicas("r")] == ["real"]
            assert reg.statistics()["forged_records"] == 1 + 1
        # A record whose signed fields were changed afterwards no longer verifies.
        [real] = await reg.replicas("r")
        store.put(Replica("r", "real", "tcp://evil:1", {}, real.sig), 60)
        assert await reg.replicas("r") == []


# ---------------------------------------------------------------- 4. faults


@pytest.mark.timeout(240)
async def test_sigkill_of_the_only_replica_then_a_respawned_one_serves() -> None:
    async with front(mp.scale, "process", misses=3) as rt:
        pid = the_pid(rt)
        assert (await rt.run("mp_scale", {"x": 1}))["pid"] == [pid]
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: rt.readiness() == ["r"], "readiness names the role", 30)
        took = await eventually(lambda: rt.readiness() == [], "a respawned replica", 60)
        new = the_pid(rt)
        assert new != pid
        assert (await rt.run("mp_scale", {"x": 2})) == {"y": [2], "pid": [new]}
        stats = rt.wire_stats()
        assert stats["restarts"] == {"r": 1} and stats["live_replicas"] == {"r": 1}
        scrape = render(rt, HttpMetrics(), inflight=0, draining=False)  # what /metrics shows
        assert 'omniflow_replica_restarts_total{role="r"} 1.0' in scrape
        assert 'omniflow_live_replicas{role="r"} 1.0' in scrape
        print(f"respawned and ready {took:.2f}s after readiness reported the role missing")


@pytest.mark.timeout(240)
async def test_sigstop_ends_its_calls_with_a_node_error_and_the_replica_is_replaced() -> None:
    async with front(mp.scale, "process", misses=3) as rt:
        pid = the_pid(rt)
        assert (await rt.run("mp_scale", {"x": 1}))["pid"] == [pid]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            call = rt.call("mp_scale", {"x": 2})
            await asyncio.wait_for(call.collect(), 60)
            took = time.monotonic() - t0
            assert call.status == "error"
            [err] = call.errors
            assert err.node == "r.run" and "replica lost" in err.message
            assert "missed 3 heartbeats" in err.message
            print(f"the call ended {took:.2f}s after SIGSTOP (3 intervals = {3 * HEARTBEAT}s)")
            await eventually(lambda: not alive(pid), "the stopped replica is killed", 30)
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        await eventually(lambda: rt.readiness() == [] and the_pid_or(rt) not in (None, pid),
                         "a replacement", 60)  # fmt: skip
        new = the_pid(rt)
        assert (await rt.run("mp_scale", {"x": 3})) == {"y": [3], "pid": [new]}
        assert rt.wire_stats()["restarts"] == {"r": 1}


def the_pid_or(rt: of.Runtime) -> int | None:
    try:
        return the_pid(rt)
    except ValueError:
        return None


# ---------------------------------------------------------------- 5. tracebacks cross the wire


async def test_a_worker_method_s_traceback_reaches_the_front_s_node_error() -> None:
    from . import scenario_graphs as sg

    async with of.Runtime(sg.err, placement="process") as rt:
        call = rt.call("sc_err", {"x": 7})
        await call.collect()
        (err,) = call.errors
        assert err.node == "err_bad.run" and err.exc_type == "ValueError"
        assert err.traceback is not None
        assert err.traceback.startswith("Traceback (most recent call last):")
        assert "scenario_graphs.py" in err.traceback and "cannot handle 7" in err.traceback
        assert "Traceback" not in str(err)  # the message stays the message
