"""The per-process data plane (omniflow/data/_plane.py) with no runtime: offload, the three
connectors, connector choice, deadlines, release and cleanup, pool exhaustion.

"Another process" is either a spawned child that owns its own DataPlane (_plane_workers.py),
or, where only the connector choice matters, a second pool in this process with a DataRef that
names another pid (the consumer then has to attach the pool by name, as another process would).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# A sibling module (not this one), so the spawned child imports just numpy, omniflow and it.
import _plane_workers as workers
import numpy as np
import pytest

import omniflow as of
from omniflow.data import SharedBufferPool
from omniflow.data._connectors import (
    HOST,
    ShmConnector,
    ZmqConnector,
    choose_connector,
    decode_block,
)
from omniflow.data._plane import POOL_BYTES_ENV, DataPlane, DataRef
from omniflow.data._pull import PullClient
from omniflow.transport._protocol import Frame, decode_msg, encode_msg

torch = pytest.importorskip("torch")

KB = 1024


@pytest.fixture
def plane() -> Iterator[DataPlane]:
    """A plane with a 1 MiB pool and a 1 KiB threshold; validated, emptied and closed after."""
    p = DataPlane(threshold=KB, capacity=2**20)
    yield p
    if p.shm._pool is not None:
        p.shm.pool.validate()
    p.close()


def elsewhere(ref: DataRef, **changes: Any) -> DataRef:
    """``ref`` as a consumer in another process (``pid``) or on another host sees it."""
    return dataclasses.replace(ref, **({"pid": ref.pid + 1} | changes))


# ---------------------------------------------------------------- offload


def test_offload_replaces_only_big_values_of_the_listed_fields(plane: DataPlane) -> None:
    big_np = np.arange(512, dtype=np.float32)  # 2 KiB
    big_t = torch.arange(300, dtype=torch.int64)  # 2400 bytes
    big_b = b"x" * KB
    frame = {
        "a": big_np, "t": big_t, "b": big_b,
        "small": np.zeros(8), "small_t": torch.zeros(4), "small_b": b"tiny",
        "text": "y" * 4 * KB, "items": list(range(1000)), "none": None,
        "unlisted": np.ones(4 * KB),
    }  # fmt: skip
    out = plane.offload("n.run", "c1", 7, 0, frame, [k for k in frame if k != "unlisted"])
    assert out is not frame and frame["a"] is big_np  # the producer's dict is untouched
    assert {k for k, v in out.items() if type(v) is DataRef} == {"a", "t", "b"}
    assert all(out[k] is frame[k] for k in frame if k not in ("a", "t", "b"))
    ref = out["a"]
    assert ref.key == ("n.run", "c1", "a", "7:0")
    assert (ref.host, ref.pid, ref.nbytes) == (HOST, os.getpid(), big_np.nbytes)
    assert (ref.handle.kind, ref.handle.dtype, ref.handle.shape) == ("numpy", "<f4", (512,))
    assert out["t"].handle[4:] == ("torch", "int64", (300,))
    assert out["b"].handle.kind == "bytes"
    stats = plane.statistics()
    assert (stats["offloaded"], stats["pool_live_blocks"]) == (3, 3)
    assert stats["offloaded_bytes"] == big_np.nbytes + 2400 + KB
    # Nothing big enough: the very same dict comes back.
    small = {"a": np.zeros(3)}
    assert plane.offload("n.run", "c1", 8, 0, small, ["a"]) is small
    # A per-call threshold overrides the plane's (the front's setting, sent to workers).
    assert type(plane.offload("n.run", "c1", 9, 0, small, ["a"], 8)["a"]) is DataRef
    assert plane.offload("n.run", "c1", 9, 1, {"a": big_np}, ["a"], 2**40)["a"] is big_np
    plane.cleanup("c1")


def test_refs_survive_the_worker_protocol(plane: DataPlane) -> None:
    out = plane.offload("n.run", "c1", 1, 0, {"a": np.ones(KB)}, ["a"])
    msg = decode_msg(encode_msg(Frame("c1", 1, out)))
    assert isinstance(msg, Frame) and msg.frame["a"] == out["a"]
    plane.cleanup("c1")


# ---------------------------------------------------------------- reading


def test_read_now_in_process_is_the_producers_own_object(plane: DataPlane) -> None:
    t = torch.randn(64, 64)
    ref = plane.offload("n.run", "c1", 1, 0, {"t": t}, ["t"])["t"]
    assert choose_connector(ref) == "inproc"
    assert plane.read_now(ref) is t
    # Asked for shm, the same process reads its own pool: a view equal to the value.
    view = plane.read_now(ref, "shm")
    assert view is not t and torch.equal(view, t)
    assert plane.statistics()["reads_inproc"] == plane.statistics()["reads_shm"] == 1
    plane.cleanup("c1")


def test_shm_read_of_another_pool_is_a_zero_copy_view(plane: DataPlane) -> None:
    producer = SharedBufferPool(2**20)  # stands in for another process's pool
    try:
        arr = np.arange(1000, dtype=np.int32)
        t = torch.arange(1000, dtype=torch.float16).reshape(10, 100)[:, ::2]
        refs = []
        for value in (arr, t):
            put = producer.put_array if isinstance(value, np.ndarray) else producer.put_tensor
            handle = put(value, owner="c1")  # type: ignore[operator]
            refs.append(DataRef(handle, HOST, os.getpid() + 1, "", ("p.run", "c1", "x", "0:0")))
        assert [choose_connector(r) for r in refs] == ["shm", "shm"]
        got_arr, got_t = (plane.read_now(r) for r in refs)
        assert got_arr.tobytes() == arr.tobytes() and got_arr.flags.writeable
        assert torch.equal(got_t, t) and got_t.is_contiguous()
        producer.view(refs[0].handle)[:4] = b"\x07\x00\x00\x00"  # the owner writes ...
        assert got_arr[0] == 7  # ... and the reader sees it: a view, not a copy
        got_arr[1] = -5  # the reader writes: its own page (copy-on-write) ...
        assert got_arr[1] == -5
        assert producer.get_array(refs[0].handle)[1] == 1  # ... the owner's block is untouched
        copied = plane.read_now(refs[0], copy=True)
        producer.view(refs[0].handle)[:4] = b"\x08\x00\x00\x00"
        assert copied[0] == 7 and copied.flags.writeable
        del got_arr, got_t
    finally:
        plane.shm.close()  # detach before the owner unlinks
        producer.close()


def test_shm_read_from_a_producer_process(plane: DataPlane) -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=workers.producer, args=(child,))
    proc.start()
    try:
        assert parent.poll(30), "the producer process did not start"
        sent = parent.recv()
        assert sent["stats"]["pool_live_blocks"] == 2
        x_ref, b_ref = sent["x"], sent["b"]
        assert x_ref.pid == proc.pid and choose_connector(x_ref) == "shm"
        expected = workers.produced()
        x = plane.read_now(x_ref)
        b = plane.read_now(b_ref)
        assert x.dtype == np.float64 and x.shape == expected["x"].shape
        assert x.tobytes() == expected["x"].tobytes() and x.flags.writeable
        assert type(b) is bytes and b == expected["b"]
        parent.send(("poke", "x"))
        parent.recv()
        assert np.isnan(x[0, 0])  # 0xff * 8: the producer's write shows through the view
        parent.send(("release", "x"))
        assert parent.recv()["pool_live_blocks"] == 1
        parent.send(("cleanup", "c1"))
        dropped, stats = parent.recv()
        assert (dropped, stats["pool_live_blocks"], stats["pool_used_bytes"]) == (1, 0, 0)
        del x, b
    finally:
        parent.send(("close", None))
        assert parent.poll(10) and parent.recv() == "closed"
        proc.join(10)
        plane.shm.close()
    assert proc.exitcode == 0
    assert not Path(f"/dev/shm/{x_ref.handle.pool}").exists()


# ---------------------------------------------------------------- choosing a connector


def test_choose_connector(plane: DataPlane) -> None:
    ref = plane.offload("n.run", "c1", 1, 0, {"a": np.ones(KB)}, ["a"])["a"]
    other_proc = elsewhere(ref)
    other_host = elsewhere(ref, host="elsewhere.example", source="tcp://10.0.0.2:5555")
    assert [choose_connector(r) for r in (ref, other_proc, other_host)] == ["inproc", "shm", "zmq"]
    for wanted in ("inproc", "shm", "zmq"):
        assert choose_connector(ref, wanted) == wanted
    assert choose_connector(other_proc, "shm") == "shm"
    assert choose_connector(other_proc, "zmq") == "zmq"
    assert choose_connector(other_host, "zmq") == "zmq"
    with pytest.raises(of.DataError, match=r"'inproc' cannot reach .* another process"):
        choose_connector(other_proc, "inproc")
    with pytest.raises(of.DataError, match="'inproc' cannot reach"):
        choose_connector(other_host, "inproc")
    with pytest.raises(of.DataError, match=r"'shm' cannot reach .* elsewhere\.example"):
        choose_connector(other_host, "shm")
    assert plane.needs_pull(other_host) and not plane.needs_pull(other_proc)
    assert plane.needs_pull(other_proc, "zmq")
    with pytest.raises(of.DataError, match="needs an async pull"):
        plane.read_now(other_host)
    plane.cleanup("c1")


async def test_resolve_reads_refs_in_values_and_collected_lists_by_each_edges_connector(
    plane: DataPlane,
) -> None:
    """``resolve_now`` / ``resolve``: what the front's shell and the workers use on inputs."""
    t = torch.randn(32, 32)
    a = np.arange(KB, dtype=np.float32)
    refs = plane.offload("n.run", "c1", 1, 0, {"t": t, "a": a}, ["t", "a"])
    other_host = elsewhere(refs["a"], host="elsewhere.example", source="tcp://10.0.0.2:5555")
    assert plane.resolve_now(refs["t"]) is t  # auto: in process, the producer's own object
    # The connector named for the producing node ("n.run") holds for every ref it made.
    via_shm = plane.resolve_now(refs["t"], {"n.run": "shm"})
    assert via_shm is not t and torch.equal(via_shm, t)
    assert plane.resolve_now(refs["t"], {"other": "shm"}) is t
    listed = plane.resolve_now([refs["t"], 7, refs["a"]])
    assert type(listed) is list and listed[0] is t and listed[1] == 7 and listed[2] is a
    assert plane.resolve_now((7, refs["a"])) == (7, a)
    assert plane.resolve_now({"k": refs["a"]}) == {"k": refs["a"]}  # (only values and lists)
    with pytest.raises(of.DataError, match="needs an async pull"):
        plane.resolve_now([other_host])

    async def pull(address: str, r: DataRef) -> memoryview:
        return plane.serve_pull(r.handle)

    consumer = DataPlane(pull=pull)
    got = await consumer.resolve((other_host, "x"))
    assert type(got) is tuple and got[1] == "x" and np.array_equal(got[0], a)
    assert (await consumer.resolve([[other_host]]))[0][0].tolist() == a.tolist()
    assert await consumer.resolve(3) == 3
    assert consumer.statistics()["pulls"] == 2
    plane.cleanup("c1")
    consumer.close()


# ---------------------------------------------------------------- zmq: pulls and deadlines


async def test_zmq_get_pulls_a_private_copy(plane: DataPlane) -> None:
    value = torch.randn(40, 40).to(torch.bfloat16)
    ref = plane.offload("n.run", "c1", 1, 0, {"t": value}, ["t"])["t"]
    remote = elsewhere(ref, host="elsewhere.example", source="tcp://10.0.0.2:5555")
    asked: list[str] = []

    async def pull(address: str, r: DataRef) -> memoryview:
        asked.append(address)
        return plane.serve_pull(r.handle)

    consumer = DataPlane(pull=pull)
    got = await consumer.get(remote, timeout=5)
    assert asked == ["tcp://10.0.0.2:5555"] and torch.equal(got, value)
    got.zero_()  # a private copy: writable, and the producer's block is untouched
    assert torch.equal(plane.read_now(ref, "shm"), value)
    assert consumer.statistics()["pulls"] == 1
    assert consumer.statistics()["pulled_bytes"] == value.numel() * 2
    assert plane.statistics()["pulls_served"] == 1
    assert decode_block(ref.handle, bytes(plane.serve_pull(ref.handle))).dtype == torch.bfloat16
    plane.cleanup("c1")
    consumer.close()


async def test_zmq_get_past_its_deadline_raises_data_timeout(plane: DataPlane) -> None:
    ref = plane.offload("n.run", "c1", 1, 0, {"a": np.ones(KB)}, ["a"])["a"]
    remote = elsewhere(ref, host="elsewhere.example", source="tcp://10.0.0.2:5555")
    never = asyncio.Event()

    async def silent(address: str, r: DataRef) -> bytes:
        await never.wait()  # a producer that never answers
        raise AssertionError("unreachable")

    conn = ZmqConnector(ShmConnector(lambda: SharedBufferPool(KB)), silent)
    with pytest.raises(of.DataTimeoutError, match=r"longer than 0\.05 s") as info:
        await conn.get(remote, timeout=0.05)
    assert isinstance(info.value, TimeoutError)  # catchable as a plain timeout too
    consumer = DataPlane(pull=silent)
    with pytest.raises(of.DataTimeoutError):
        await consumer.get(remote, "zmq", timeout=0.05)
    with pytest.raises(of.DataError, match="serves no pulls"):
        await consumer.get(dataclasses.replace(remote, source=""), timeout=0.05)
    consumer.close()
    plane.cleanup("c1")


async def test_pulls_from_a_lost_producer_fail_now_and_later(
    plane: DataPlane, tmp_path: Path
) -> None:
    ref = plane.offload("n.run", "c1", 1, 0, {"a": np.ones(KB)}, ["a"])["a"]
    address = f"ipc://{tmp_path}/nobody.sock"  # nobody answers there
    remote = elsewhere(ref, host="elsewhere.example", source=address)
    client = PullClient(b"test-cluster-key-0123456789")
    try:
        pending = asyncio.ensure_future(client.pull(address, remote))
        await asyncio.sleep(0.05)
        assert not pending.done()
        client.lost(address, remote.pid)
        with pytest.raises(of.DataError, match="was lost"):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(of.DataError, match="was lost"):
            await client.pull(address, remote)
        # Another process at the same address (a restarted producer) is not lost.
        later = asyncio.ensure_future(client.pull(address, elsewhere(remote)))
        await asyncio.sleep(0.05)
        assert not later.done()
        later.cancel()
        with pytest.raises(asyncio.CancelledError):
            await later
    finally:
        client.close()
        plane.cleanup("c1")


# ---------------------------------------------------------------- release, cleanup, exhaustion


def test_release_and_cleanup_leave_the_pool_empty(plane: DataPlane) -> None:
    values = {"a": np.ones(KB), "b": b"z" * 2 * KB, "t": torch.ones(KB)}
    c1 = plane.offload("n.run", "c1", 1, 0, values, list(values))
    c2 = plane.offload("n.run", "c2", 1, 0, values, ["a"])
    pool = plane.shm.pool
    assert pool.statistics()["live_blocks"] == 4
    plane.release(c1["a"])  # its last consumer edge finished
    assert pool.statistics()["live_blocks"] == 3
    with pytest.raises(of.DataError, match="no in-process object"):
        plane.read_now(c1["a"])
    assert plane.cleanup("c1") == 2  # the call ended holding "b" and "t"
    with pytest.raises(of.DataError):
        plane.read_now(c1["t"])
    plane.release(c1["t"])  # a late release after cleanup is harmless
    assert pool.statistics()["live_blocks"] == 1
    assert plane.read_now(c2["a"]) is values["a"]
    assert plane.cleanup("c2") == 1
    assert pool.statistics()["live_blocks"] == 0
    assert plane.statistics()["pool_used_bytes"] == 0
    assert plane.cleanup("c3") == 0


def test_an_exhausted_pool_falls_back_to_inline(plane: DataPlane) -> None:
    fits = np.ones(2**20 // 8 - KB)  # almost the whole 1 MiB pool
    too_big = np.ones(2**20 // 4)  # 2 MiB: never fits
    out = plane.offload("n.run", "c1", 1, 0, {"a": fits, "b": too_big}, ["a", "b"])
    assert type(out["a"]) is DataRef and out["b"] is too_big
    again = plane.offload("n.run", "c1", 2, 0, {"a": fits}, ["a"])  # the pool is full now
    assert again["a"] is fits
    stats = plane.statistics()
    assert (stats["pool_fallbacks"], stats["offloaded"], stats["pool_live_blocks"]) == (2, 1, 1)
    plane.cleanup("c1")
    assert plane.statistics()["pool_live_blocks"] == 0


def test_pool_capacity_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POOL_BYTES_ENV, str(8 * 2**20))
    assert DataPlane().capacity == 8 * 2**20
    assert DataPlane(capacity=2**20).capacity == 2**20
    monkeypatch.setenv(POOL_BYTES_ENV, "lots")
    with pytest.raises(of.DataError, match="OMNIFLOW_POOL_BYTES='lots'"):
        DataPlane()
    monkeypatch.delenv(POOL_BYTES_ENV)
    assert DataPlane().capacity == 256 * 2**20


# ---------------------------------------------------------------- media values (contract §9)


async def test_media_values_take_the_data_plane_whatever_their_size(plane: DataPlane) -> None:
    """An of.Audio or of.Image is offloaded even below the threshold; every connector hands
    back the same kind of value (inproc: the object itself; shm and zmq: equal and writable)."""
    clip = of.Audio(np.arange(8, dtype=np.int16), sample_rate=8000)  # 16 bytes < 1 KiB
    pic = of.Image(np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3))
    frame = {"clip": clip, "pic": pic, "small": np.arange(8)}
    out = plane.offload("n.run", "c1", 1, 0, frame, ["clip", "pic", "small"])
    assert out["small"] is frame["small"]  # a plain small array stays inline
    cref, pref = out["clip"], out["pic"]
    assert (cref.media, pref.media) == (("audio", 8000), ("image",))
    assert plane.read_now(cref) is clip and plane.read_now(pref) is pic
    for ref, value in ((cref, clip), (pref, pic)):
        via_shm = plane.read_now(ref, "shm", copy=True)
        assert type(via_shm) is type(value) and via_shm == value

        async def pull(address: str, r: DataRef) -> memoryview:
            return plane.serve_pull(r.handle)

        consumer = DataPlane(pull=pull)
        remote = elsewhere(ref, host="elsewhere.example", source="tcp://10.0.0.2:5555")
        got = await consumer.get(remote, timeout=5)
        array = got.samples if isinstance(got, of.Audio) else got.pixels
        assert type(got) is type(value) and got == value and array.flags.writeable
        consumer.close()
    assert plane.statistics()["offloaded"] == 2
    assert not plane.is_big(of.Audio(np.zeros(0, np.int16)))  # nothing to place
    plane.cleanup("c1")


def test_media_refs_survive_the_worker_protocol(plane: DataPlane) -> None:
    clip = of.Audio(np.arange(8, dtype=np.float32) / 8, sample_rate=16000)
    ref = plane.offload("n.run", "c1", 1, 0, {"a": clip}, ["a"])["a"]
    msg = decode_msg(encode_msg(Frame("c1", 1, {"a": ref})))
    assert (
        isinstance(msg, Frame)
        and msg.frame["a"] == ref
        and msg.frame["a"].media == ("audio", 16000)
    )
    plane.cleanup("c1")


def test_an_unknown_media_tag_is_a_data_error(plane: DataPlane) -> None:
    ref = plane.offload("n.run", "c1", 1, 0, {"a": np.ones(KB)}, ["a"])["a"]
    with pytest.raises(of.DataError, match="unknown media tag"):
        plane.read_now(dataclasses.replace(ref, media=("video",)), "shm")
    plane.cleanup("c1")
