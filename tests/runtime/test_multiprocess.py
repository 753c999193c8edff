"""Acceptance tests of the multi-process runtime (CONTRACT §5): Deploy, the Redis registry,
scaling by hand, session affinity across fronts, replica loss, Redis restarts, bad input.

Roles run in worker processes (``python -m omniflow worker tests/runtime/mp_graphs.py ...``),
spawned by a Runtime or started here by hand; a test sees them only through what crosses a
process boundary: frames (roles report ``os.getpid()``), ``call.errors``, ``rt.stats()``,
``rt.remote.statistics()``, a marker file, and the registry read by a client of its own.

Timings: the registry heartbeat is 0.2 s (ttl 0.6 s) in every test that uses one, so loss by
heartbeat expiry shows within about a second. Each test starts as few processes as it can, and
every process started here is killed at teardown whatever happened (``procs`` fixture; spawned
workers are stopped by ``Runtime.close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omniflow as of
from omniflow.registry import RedisRegistry
from omniflow.testing import RedisServer
from omniflow.transport import VERSION, connect, encode
from omniflow.transport._auth import sealer_for

from . import mp_graphs as mp

GRAPH_FILE = str(Path(mp.__file__).resolve())
ZERO = {"open_buckets": 0, "inflight": 0, "active_calls": 0, "data_plane_bytes": 0}
#: Every test here starts worker processes.
pytestmark = pytest.mark.slow
#: Registry heartbeat of every process in these tests; the registry ttl is 3 of them.
HEARTBEAT = 0.2


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
async def observer(redis: RedisServer) -> AsyncIterator[RedisRegistry]:
    """A registry client of the test's own: what any other process would read."""
    async with RedisRegistry(redis.url, heartbeat_interval=HEARTBEAT) as registry:
        yield registry


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """One cluster key for the test's fronts and the workers it starts by hand."""
    key = "test-cluster-key-0123456789abcdef"
    monkeypatch.setenv("OMNIFLOW_CLUSTER_KEY", key)
    return key


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Worker processes started by hand; every one still running at teardown is killed."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def hand_worker(
    procs: list[subprocess.Popen[bytes]], role: str, *args: str
) -> subprocess.Popen[bytes]:
    """``omniflow worker mp_graphs.py --role ROLE ARGS...``, as an operator would start one."""
    cmd = [sys.executable, "-m", "omniflow", "worker", GRAPH_FILE, "--role", role, *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    procs.append(proc)
    return proc


def front(graph: of.Graph, placement: Any, registry: str | None = None) -> of.Runtime:
    """A Runtime whose registry client and spawned workers heartbeat every HEARTBEAT s."""
    rt = of.Runtime(graph, placement=placement, registry=registry, validate=True)
    assert rt.remote is not None
    # Runtime has no knob for this (yet): RemoteRoles reads it at start().
    rt.remote.heartbeat_interval = HEARTBEAT  # same as Runtime(heartbeat_interval=...)
    return rt


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float) -> float:
    """Poll ``check`` until it holds; return the seconds it took, fail after ``within``."""
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > within:
            pytest.fail(f"not within {within:.2f}s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def registered_pids(registry: RedisRegistry, role: str) -> set[int]:
    return {r.meta["pid"] for r in await registry.replicas(role)}


def alive(pid: int) -> bool:
    """Running (a zombie no one reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def idle(rt: of.Runtime) -> bool:
    """Nothing of any call is left (CONTRACT §3's three counters; others may be added)."""
    stats = rt.stats()
    return {k: stats[k] for k in ZERO} == ZERO


def spawned_pid(rt: of.Runtime) -> int:
    """The pid of the one worker ``rt`` spawned."""
    assert rt.remote is not None
    [pid] = [r.process.pid for r in rt.remote.fleet.replicas.values() if r.process is not None]
    return pid


def replicas(rt: of.Runtime) -> int:
    assert rt.remote is not None
    return rt.remote.statistics()["replicas"]


# ---------------------------------------------------------------- 1. Deploy


async def test_deploy_groups_replicates_and_keeps_unnamed_roles_in_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "lifecycle"
    monkeypatch.setenv(mp.MARKER_ENV, str(marker))
    placement = of.Deploy({"a": {"replicas": 2, "process": "grp"}, "b": {"process": "grp"}})
    async with front(mp.deploy, placement) as rt:
        outs = await asyncio.gather(*(rt.run("mp_deploy", {"x": i}) for i in range(8)))
        assert sorted(o["z"][0] for o in outs) == [(i + 1) * 10 for i in range(8)]
        a_pids = {o["a_pid"][0] for o in outs}
        b_pids = {o["b_pid"][0][0] for o in outs}
        # Two processes for the group, each hosting a and b; c stays here.
        assert len(a_pids) == 2 and os.getpid() not in a_pids
        assert b_pids == a_pids
        assert {o["c_pid"][0] for o in outs} == {os.getpid()}
        # b's setup() ran in the worker that serves it.
        assert all(pid == setup_pid for o in outs for pid, setup_pid in o["b_pid"])
        assert replicas(rt) == 2
        assert idle(rt)
    lines = marker.read_text().splitlines()
    assert sorted(lines) == sorted(
        [f"setup b {pid}" for pid in a_pids] + [f"teardown b {pid}" for pid in a_pids]
    )
    assert not any(alive(pid) for pid in a_pids), "Runtime.close left a worker running"


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (lambda: of.Deploy({"nope": {}}), r"Deploy names role 'nope'.*roles: \['a', 'b', 'c'\]"),
        (lambda: of.Deploy({"a": {"replicas": 0}}), r"role 'a' replicas must be an int >= 1"),
        (lambda: of.Deploy({"a": {"replicas": True}}), r"role 'a' replicas must be an int >= 1"),
        (lambda: of.Deploy({"a": {"replicas": "2"}}), r"role 'a' replicas must be an int >= 1"),
        (
            lambda: of.Deploy({"a": {"replica": 2}}),
            r"role 'a' has unknown option\(s\) \['replica'\]",
        ),
        (lambda: of.Deploy({"a": 2}), r"options of role 'a' must be a dict"),
        (lambda: of.Deploy(["a"]), r"Deploy takes a dict"),  # type: ignore[arg-type]
        (
            lambda: of.Deploy(
                {"a": {"replicas": 2, "process": "g"}, "b": {"replicas": 3, "process": "g"}}
            ),
            r"roles of process 'g' disagree on replicas \(2 vs 3: roles 'a' and 'b'\)",
        ),
        (lambda: "threads", r"placement='threads' is not understood"),
    ],
)
def test_bad_deploy_specs_are_clear_errors(placement: Callable[[], Any], message: str) -> None:
    with pytest.raises(of.OmniflowError, match=message):
        of.Runtime(mp.deploy, placement=placement())


def test_a_group_takes_the_replicas_of_whichever_role_states_them() -> None:
    """A role that does not say how many replicas joins its group's count, in either order."""
    for roles in (
        {"a": {"replicas": 2, "process": "g"}, "b": {"process": "g"}},
        {"b": {"process": "g"}, "a": {"replicas": 2, "process": "g"}},
    ):
        rt = of.Runtime(mp.deploy, placement=of.Deploy(roles))
        assert rt.remote is not None
        [spec] = rt.remote.processes
        assert (sorted(spec.roles), spec.replicas) == (["a", "b"], 2), roles


def test_registry_needs_a_multi_process_placement() -> None:
    with pytest.raises(of.OmniflowError, match="needs a multi-process placement"):
        of.Runtime(mp.scale, registry="redis://127.0.0.1:1/0")


def test_a_graph_built_in_main_cannot_be_placed_in_a_worker() -> None:
    source = (
        "import omniflow as of\n"
        "class R(of.Role):\n"
        "    @of.interface(inputs_or=[['x']], outputs=['y'])\n"
        "    async def run(self, x):\n"
        "        return {'y': x}\n"
        "g = of.Graph('main_g', roles={'r': R()}, inputs=[of.Placeholder('x')], outputs=['y'])\n"
    )
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, "<main>", "exec"), namespace)
    with pytest.raises(of.OmniflowError, match=r"role 'r' must run in a worker.*__main__"):
        of.Runtime(namespace["g"], placement="process")
    of.Runtime(namespace["g"], placement=of.Deploy({}))  # nothing placed: fine


async def test_a_broadcast_activation_takes_every_replicas_return() -> None:
    """lb="broadcast" runs the node on every replica. Each replica's done carries its
    returned frame; the activation ends with the last done, failed if a replica failed (the
    other replica's frame still reaches the caller)."""
    async with front(mp.broadcast, of.Deploy({"everywhere": {"replicas": 2}})) as rt:
        assert rt.remote is not None
        pids = sorted(r.pid for r in rt.remote.fleet.replicas.values() if r.pid is not None)
        assert len(pids) == 2
        for _ in range(3):
            out = await rt.run("mp_broadcast", {"fail": 0})
            assert sorted(out["where"]) == pids
            for failing, other in (pids, pids[::-1]):
                call = rt.call("mp_broadcast", {"fail": failing})
                assert await call.collect() == {"where": [other]}
                assert call.status == "error"
                [err] = call.errors
                assert err.node == "everywhere.run" and err.exc_type == "ValueError"
                assert f"replica {failing} fails" in err.message
        assert idle(rt)


# ---------------------------------------------------------------- 2. scaling by hand


async def test_scale_up_and_down_by_hand_under_traffic(
    redis: RedisServer, observer: RedisRegistry, procs: list[subprocess.Popen[bytes]]
) -> None:
    async with front(mp.scale, of.Deploy({"r": {}}), registry=redis.url) as rt:
        [spawned] = await registered_pids(observer, "r")
        served: list[tuple[float, int]] = []
        failed: list[Any] = []
        stop = asyncio.Event()

        async def traffic() -> None:
            i = 0
            while not stop.is_set():
                calls = [rt.call("mp_scale", {"x": i + k}) for k in range(4)]
                for k, call in enumerate(calls):
                    out = await call.collect()
                    if call.status != "ok" or out.get("y") != [i + k]:
                        failed.append((call.status, call.errors, out))
                    else:
                        served.append((time.monotonic(), out["pid"][0]))
                i += 4

        load = asyncio.create_task(traffic())
        try:
            # Scale up: a replica started by hand registers and gets traffic; nothing restarts.
            extra = hand_worker(procs, "r", "--registry", redis.url, "--heartbeat", str(HEARTBEAT))

            async def registered() -> bool:
                return await registered_pids(observer, "r") == {spawned, extra.pid}

            async def reached() -> bool:
                return any(pid == extra.pid for _, pid in served)

            await eventually(registered, "the hand-started worker registers", 30)
            await eventually(reached, "traffic reaches the new replica", 30)
            assert replicas(rt) == 2
            # Scale down: SIGTERM; the worker deregisters, finishes what it holds, and leaves.
            extra.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(extra.wait, 10) == 0
            assert await registered_pids(observer, "r") == {spawned}  # deregistered, not expired

            async def drained() -> bool:
                return replicas(rt) == 1

            await eventually(drained, "the front drops the replica that left", 30)
            n = len(served)

            async def more() -> bool:
                return len(served) >= n + 20

            await eventually(more, "calls keep succeeding on the survivor", 30)
        finally:
            stop.set()
            await load
        assert failed == []
        assert {pid for t, pid in served} == {spawned, extra.pid}
        # Once the front dropped it, nothing more went to the replica that left (an order, not a
        # time: how soon after SIGTERM that happens is load-dependent).
        assert all(pid == spawned for t, pid in served[n:]), "routed to a replica that left"
        assert alive(spawned) and idle(rt)


# ---------------------------------------------------------------- 3. session affinity


async def test_two_fronts_route_each_session_to_the_same_replica(
    redis: RedisServer, observer: RedisRegistry
) -> None:
    """Two fronts (two Runtimes: separate registry clients, separate replica tables, nothing
    shared but Redis) each spawn workers of the session role and adopt the other's through the
    registry. Whichever front sees a session first, both must route it to one replica: the
    replica's own memory then counts every call of that session exactly once, 1, 2, 3, ..."""
    fa = front(mp.session, of.Deploy({"sess": {"replicas": 2}}), registry=redis.url)
    fb = front(mp.session, of.Deploy({"sess": {}}), registry=redis.url)
    async with fa, fb:

        async def all_adopted() -> bool:
            return replicas(fa) == 3 and replicas(fb) == 3

        await eventually(all_adopted, "both fronts see all three replicas", 30)
        assert len(await registered_pids(observer, "sess")) == 3
        sessions = [f"s{i}" for i in range(12)]
        where: dict[str, list[list[int]]] = {s: [] for s in sessions}

        async def one(rt: of.Runtime, s: str) -> None:
            out = await rt.run("mp_session", {"x": 0}, session=s)
            where[s].extend(out["where"])

        # Round 1: both fronts meet every new session at the same moment.
        await asyncio.gather(*(one(rt, s) for s in sessions for rt in (fa, fb)))
        # Rounds 2-3: one front after the other.
        for rt in (fb, fa, fb, fa):
            await asyncio.gather(*(one(rt, s) for s in sessions))
        for s in sessions:
            pids = {pid for pid, _ in where[s]}
            counts = sorted(count for _, count in where[s])
            assert len(pids) == 1 and counts == [1, 2, 3, 4, 5, 6], (s, where[s])
            assert await observer.get_affinity(s, "sess") is not None
        assert len({where[s][0][0] for s in sessions}) > 1, "every session on one replica"
        assert idle(fa) and idle(fb)


# ---------------------------------------------------------------- 4. replica loss


@pytest.mark.parametrize("n_replicas", [2, 1])
async def test_sigkill_of_a_spawned_worker_mid_stream(n_replicas: int) -> None:
    async with front(mp.stream, of.Deploy({"s": {"replicas": n_replicas}})) as rt:
        call = rt.call("mp_stream", {"n": 500, "every": 0.02})
        got: list[list[int]] = []
        killed_at = 0.0
        async for frame in call:
            got.append(frame.value)
            if len(got) == 3:
                victim = frame.value[1]
                os.kill(victim, signal.SIGKILL)
                killed_at = time.monotonic()
        took = time.monotonic() - killed_at
        assert call.status == "error"
        [err] = call.errors
        assert (err.node, err.kind) == ("s.gen", "error")
        assert "replica lost" in err.message and "role 's'" in err.message
        # A spawned worker's loss is seen through its process exit, typically well within the
        # 3 heartbeats (0.6 s) a heartbeat miss would take; reported, not asserted: a loaded
        # machine can delay either path.
        print(f"loss detected {took:.2f}s after SIGKILL")
        assert [i for i, _ in got] == list(range(len(got))) and len(got) >= 3
        assert idle(rt)
        assert rt.remote is not None
        stats = rt.remote.statistics()
        assert (stats["replicas"], stats["remote_inflight"], stats["forward_waiting"]) == (
            n_replicas - 1,
            0,
            0,
        )
        if n_replicas == 2:
            outs = await asyncio.gather(
                *(rt.run("mp_stream", {"n": 3, "every": 0.0}) for _ in range(4))
            )
            pids = {pid for o in outs for _, pid in o["tok"]}
            assert len(pids) == 1 and victim not in pids
        else:
            # It fails, it does not wait for a replica (bounded generously: no timing claim).
            call = rt.call("mp_stream", {"n": 3, "every": 0.0})
            assert await asyncio.wait_for(call.collect(), 30) == {}
            [err] = call.errors
            assert err.node == "s.gen" and "no live replica of role 's'" in err.message
            with pytest.raises(of.NodeError, match="no live replica"):
                await rt.run("mp_stream", {"n": 3, "every": 0.0})
        assert idle(rt)


async def test_sigkill_of_a_registry_found_worker_mid_stream(
    redis: RedisServer, observer: RedisRegistry, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A worker the front did not spawn is lost by heartbeat expiry: within two ttls and one
    watch interval of the kill."""
    async with front(mp.stream, of.Deploy({"s": {}}), registry=redis.url) as rt:
        extra = hand_worker(procs, "s", "--registry", redis.url, "--heartbeat", str(HEARTBEAT))

        async def adopted() -> bool:
            return replicas(rt) == 2

        await eventually(adopted, "the front adopts the hand-started worker", 30)
        # 3 s streams: the doomed one cannot finish before the kill, however loaded the machine.
        calls = [rt.call("mp_stream", {"n": 60, "every": 0.05}) for _ in range(2)]
        streams = [aiter(c) for c in calls]  # keep them: a dropped iterator cancels its call
        pids = [(await anext(s)).value[1] for s in streams]
        assert sorted(pids) == sorted([spawned_pid(rt), extra.pid])  # round robin: one each
        doomed, survivor = (0, 1) if pids[0] == extra.pid else (1, 0)
        extra.kill()
        killed_at = time.monotonic()
        await calls[doomed].wait()
        took = time.monotonic() - killed_at
        assert calls[doomed].status == "error"
        [err] = calls[doomed].errors
        assert err.node == "s.gen" and "replica lost" in err.message
        # Expected within two ttls and a watch interval; reported, not asserted (load-dependent).
        bound = 2 * observer.ttl + observer.watch_interval
        print(f"loss detected {took:.2f}s after SIGKILL (nominal bound {bound:.2f}s)")
        rest = [f.value async for f in streams[survivor]]
        assert calls[survivor].status == "ok"
        assert rest == [[i, pids[survivor]] for i in range(1, 60)]
        assert [f async for f in streams[doomed]] == []
        assert idle(rt)
        outs = await asyncio.gather(
            *(rt.run("mp_stream", {"n": 2, "every": 0.0}) for _ in range(4))
        )
        assert {pid for o in outs for _, pid in o["tok"]} == {pids[survivor]}
        assert replicas(rt) == 1
        assert await registered_pids(observer, "s") == {pids[survivor]}


# ---------------------------------------------------------------- 5. Redis restart


async def test_redis_restart_disturbs_no_call_and_workers_reregister(
    redis: RedisServer, observer: RedisRegistry
) -> None:
    async with front(mp.stream, of.Deploy({"s": {}}), registry=redis.url) as rt:
        [pid] = await registered_pids(observer, "s")
        # A 5 s stream: still running when the restart (a thread, slow under load) is done.
        call = rt.call("mp_stream", {"n": 50, "every": 0.1})
        got: list[list[int]] = []
        running_after_restart = False
        async for frame in call:
            got.append(frame.value)
            if len(got) == 5:
                await asyncio.to_thread(redis.restart)
                running_after_restart = call.status == "running"
        assert call.status == "ok", call.errors
        assert got == [[i, pid] for i in range(50)]
        assert running_after_restart  # the call spanned the restart

        async def back() -> bool:
            try:
                return await registered_pids(observer, "s") == {pid}
            except of.RegistryError:
                return False

        # Back at the next heartbeat; the deadline is about hangs, not speed.
        await eventually(back, "the worker re-registers after the restart", 30)
        assert replicas(rt) == 1 and idle(rt)
        assert (await rt.run("mp_stream", {"n": 2, "every": 0.0}))["tok"] == [[0, pid], [1, pid]]


async def test_redis_restart_reregisters_within_an_interval(
    redis: RedisServer, observer: RedisRegistry
) -> None:
    """Re-registration after a restart, timed from the moment the new server answers.

    The next heartbeat re-registers (one interval, two when one fell in the restart); the time is
    printed, not asserted, since a loaded machine can delay any heartbeat.
    """
    async with front(mp.scale, of.Deploy({"r": {}}), registry=redis.url) as rt:
        [pid] = await registered_pids(observer, "r")
        await asyncio.to_thread(redis.restart)

        async def back() -> bool:
            try:
                return await registered_pids(observer, "r") == {pid}
            except of.RegistryError:
                return False

        took = await eventually(back, "re-registration", 30)
        print(f"re-registered {took:.2f}s after the restart (nominal: <= {2 * HEARTBEAT:.1f}s)")
        assert (await rt.run("mp_scale", {"x": 7}))["y"] == [7]


# ---------------------------------------------------------------- 6. malformed input


def _envelope(kind: str, body: Any) -> list[bytes]:
    """A codec envelope (not sealed: the fuzzer seals it with the right key, so it gets past
    authentication and exercises the decoder and the protocol's type checks)."""
    if isinstance(body, dict) and kind in ("run", "cancel"):
        order = ["c", "a", "n", "k", "s", "g", "q", "gr"] if kind == "run" else ["c", "a"]
        body = [body[k] for k in order if k in body]  # the wire's positional fields
    return [bytes(f) for f in encode(body, kind=kind, pickle=True)]


_KINDS = ["run", "cancel", "hello", "end_call", "close_session", "frame", "done", "ready", "bye"]
_INTS = st.integers(-(2**63), 2**64 - 1)
_JSONISH = st.recursive(
    st.none() | st.booleans() | _INTS | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
_RUN_KEYS = {
    "c": st.text(max_size=4) | _JSONISH,
    "a": _INTS | _JSONISH,
    "n": st.sampled_from(["r.run", "s.gen", "nope.x", ""]) | _JSONISH,
    "k": st.fixed_dictionaries({"x": _INTS}) | st.just({"n": 2, "every": 0.0}) | _JSONISH,
    "s": st.none() | st.text(max_size=4),
    "g": st.integers(-1, 3) | _JSONISH,
    "q": st.integers(-1, 3) | _JSONISH,
    "gr": st.text(max_size=4) | _JSONISH,
}
_VALID_RUN = _envelope(
    "run", {"c": "x", "a": 1, "n": "r.run", "k": {"x": 1}, "s": None, "g": 0, "q": 0, "gr": "g"}
)
_MESSAGES = st.one_of(
    # Random frames.
    st.lists(st.binary(max_size=64), min_size=1, max_size=4),
    # A valid message cut short, or with a byte flipped.
    st.integers(0, len(_VALID_RUN[0]) - 1).map(lambda i: [_VALID_RUN[0][:i]]),
    st.tuples(st.integers(0, len(_VALID_RUN[0]) - 1), st.integers(0, 255)).map(
        lambda t: [_VALID_RUN[0][: t[0]] + bytes([t[1]]) + _VALID_RUN[0][t[0] + 1 :]]
    ),
    # A wrong wire version, or the magic bytes followed by garbage.
    st.integers(0, 255)
    .filter(lambda v: v != VERSION)
    .map(lambda v: [b"OF" + bytes([v]) + _VALID_RUN[0][3:]]),
    st.binary(max_size=32).map(lambda b: [b"OF" + bytes([VERSION]) + b]),
    # Well-formed envelopes with bodies the protocol does not expect ("stop" is left out: it
    # is the front's legitimate way to stop a worker).
    st.tuples(st.sampled_from(_KINDS) | st.text(max_size=6), _JSONISH).map(
        lambda t: _envelope(t[0] if t[0] != "stop" else "stopp", t[1])
    ),
    st.fixed_dictionaries({}, optional=_RUN_KEYS).map(lambda body: _envelope("run", body)),
    st.fixed_dictionaries({"c": st.text(max_size=2), "a": _JSONISH}).map(
        lambda body: _envelope("cancel", body)
    ),
)


async def test_fuzzed_messages_never_kill_a_worker() -> None:
    async with front(mp.scale, of.Deploy({"r": {}})) as rt:
        assert rt.remote is not None
        [rep] = rt.remote.fleet.replicas.values()
        address, pid = rep.address, (await rt.run("mp_scale", {"x": 0}))["pid"][0]
        seen: list[int] = []

        def fuzz() -> None:
            # A client of the worker's own transport (uds:// with the fast path on, ipc://
            # off), on an event loop of this thread's.
            loop = asyncio.new_event_loop()
            key = os.environ["OMNIFLOW_CLUSTER_KEY"].encode()
            sock = connect(address, key=key)  # (uds://: the connection proves the key)
            sealer = sealer_for(sock, key)

            async def send_one(frames: list[bytes]) -> None:
                await sock.send(sealer.seal(frames))
                with contextlib.suppress(TimeoutError):
                    while True:  # replies to valid runs; keep our inbox empty
                        await asyncio.wait_for(sock.recv_batch(), 0.002)

            @settings(
                max_examples=100,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            )
            @given(_MESSAGES)
            def send(frames: list[bytes]) -> None:
                loop.run_until_complete(send_one(frames))
                seen.append(len(frames))

            try:
                send()
            finally:
                sock.close()
                loop.close()

        # Real calls keep running while the garbage arrives.
        fuzzing = asyncio.create_task(asyncio.to_thread(fuzz))
        results = []
        while not fuzzing.done():
            results.append(await rt.run("mp_scale", {"x": len(results)}))
        await fuzzing
        assert len(seen) >= 100
        assert all(r["y"] == [i] for i, r in enumerate(results))
        assert alive(pid) and replicas(rt) == 1
        assert (await rt.run("mp_scale", {"x": 42})) == {"y": [42], "pid": [pid]}
        assert idle(rt)


# ---------------------------------------------------------------- 7. the worker command

FRONT = """
import asyncio, sys
import omniflow as of
[graph] = [g for g in of.load_graphs(sys.argv[1]) if g.name == "mp_scale"]
async def main():
    async with of.Runtime(graph, placement="process") as rt:
        print((await rt.run("mp_scale", {"x": 1}))["pid"][0], flush=True)
        await asyncio.sleep(60)
asyncio.run(main())
"""


async def test_workers_leave_when_their_front_is_killed(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Workers run in a session of their own (Ctrl-C in the front's terminal must not reach
    them); a front that dies without stopping them must not leave them running, nor the fork
    server that forked them (``cluster/_forkserver.py``)."""
    front_proc = subprocess.Popen(
        [sys.executable, "-c", FRONT, GRAPH_FILE],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the orphan must not hold the test's pipes either
    )
    procs.append(front_proc)
    worker = 0
    try:
        assert front_proc.stdout is not None
        worker = int(await asyncio.wait_for(asyncio.to_thread(front_proc.stdout.readline), 30))
        assert alive(worker)
        with open(f"/proc/{worker}/stat") as f:
            server = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent
        assert server != front_proc.pid and alive(server)  # forked by the fork server
        front_proc.kill()
        front_proc.wait(10)

        async def gone() -> bool:
            return not alive(worker) and not alive(server)

        await eventually(gone, "the orphaned worker and fork server exit", 30)
    finally:
        if worker and alive(worker):
            os.kill(worker, signal.SIGKILL)
        if front_proc.stdout is not None:
            front_proc.stdout.close()


def test_worker_without_registry_or_bind_exits_1_with_a_clear_message() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omniflow", "worker", GRAPH_FILE, "--role", "r"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "needs --registry" in done.stderr and "--bind" in done.stderr
    assert "Traceback" not in done.stderr


def test_worker_for_an_unknown_role_exits_1_naming_it(tmp_path: Path) -> None:
    bind = f"ipc://{tmp_path}/w.sock"
    done = subprocess.run(
        [sys.executable, "-m", "omniflow", "worker", GRAPH_FILE, "--role", "nope", "--bind", bind],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "declares role(s) ['nope']" in done.stderr and "Traceback" not in done.stderr


def test_worker_without_a_cluster_key_exits_1_saying_how_to_give_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMNIFLOW_CLUSTER_KEY")
    bind = f"ipc://{tmp_path}/w.sock"
    cmd = [sys.executable, "-m", "omniflow", "worker", GRAPH_FILE, "--role", "r", "--bind", bind]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "OMNIFLOW_CLUSTER_KEY" in done.stderr and "--cluster-key-file" in done.stderr
    short = tmp_path / "key"
    short.write_text("too-short\n")
    done = subprocess.run(
        [*cmd, "--cluster-key-file", str(short)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1 and "at least 16" in done.stderr
