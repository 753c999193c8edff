"""The uds transport's own behaviour, beyond the endpoint suite every transport runs
(test_endpoints.py, through the ``url`` fixture): late binds, restarts, handover, big and many
frames, back-pressure, hostile headers, the socket file."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow import RuntimeClosedError, TransportError
from omniflow.transport import (
    FAST_PATH_ENV,
    Endpoint,
    UdsTransport,
    bind,
    connect,
    fast_path_enabled,
    is_local,
    local_url,
    run_loop,
)
from omniflow.transport._base import MAX_DELIVERY, Packet
from omniflow.transport._udshandshake import HANDSHAKE
from omniflow.transport._udswire import MAX_FRAME_BYTES, MAX_FRAMES


@pytest.fixture
def sock_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private directory with a short path (sun_path holds 107 bytes)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="of-", dir="/tmp") as tmp:
        yield Path(tmp)


async def eventually(check: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``deadline_s`` (a hang guard,
    not a timing assertion)."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s}s waiting for {what}")
        await asyncio.sleep(0.005)


def validate(*endpoints: Endpoint) -> None:
    for ep in endpoints:
        ep.validate()  # type: ignore[attr-defined]


class RawPeer:
    """The far end of a uds connection spoken by hand: reads the wire format byte by byte."""

    def __init__(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self.conn = conn
        self.pending = bytearray()

    async def exactly(self, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        while len(self.pending) < n:
            chunk = await asyncio.wait_for(loop.sock_recv(self.conn, 1 << 20), 30)
            if not chunk:
                raise EOFError(f"EOF after {len(self.pending)} of {n} bytes")
            self.pending += chunk
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    async def message(self) -> list[bytes]:
        (count,) = struct.unpack("<I", await self.exactly(4))
        sizes = struct.unpack(f"<{count}Q", await self.exactly(8 * count))
        return [await self.exactly(size) for size in sizes]

    async def eof(self) -> bool:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.sock_recv(self.conn, 1), 30) == b""
        except ConnectionResetError:
            return True


def raw_message(*frames: bytes) -> bytes:
    return struct.pack(f"<I{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)


def listener(path: Path) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    srv.setblocking(False)
    return srv


# ------------------------------------------------------------------------ connecting


async def test_send_before_bind_is_queued_and_delivered_once_bound(sock_dir: Path) -> None:
    url = f"uds://{sock_dir}/late.sock"
    async with connect(url, identity=b"early") as front:
        for i in range(3):
            await front.send([f"m{i}".encode()])  # nothing listens yet: queued, not raised
        assert front.statistics()["queued"] == 3
        async with bind(url) as worker:
            got = [await worker.recv() for _ in range(3)]
            assert [(p.peer, p.frames) for p in got] == [
                (b"early", [b"m0"]), (b"early", [b"m1"]), (b"early", [b"m2"])
            ]  # fmt: skip
            await worker.send([b"hello"], peer=b"early")
            assert (await front.recv()).frames == [b"hello"]
            validate(front, worker)


async def test_connected_side_reconnects_to_a_restarted_bound_side(sock_dir: Path) -> None:
    url = f"uds://{sock_dir}/w.sock"
    first = bind(url)
    async with connect(url, identity=b"f") as front:
        await front.send([b"one"])
        assert (await first.recv()).frames == [b"one"]
        first.close()  # the worker process restarts at the same address
        assert not os.path.exists(f"{sock_dir}/w.sock")
        async with bind(url) as second:
            await eventually(lambda: front.statistics()["connects"] == 2, "the reconnect")
            await front.send([b"two"])
            peer, frames = await second.recv()
            assert (peer, frames) == (b"f", [b"two"])
            await second.send([b"back"], peer=b"f")
            assert (await front.recv()).frames == [b"back"]


async def test_a_new_connection_with_the_same_identity_takes_the_route_over(
    sock_dir: Path,
) -> None:
    path = f"{sock_dir}/w.sock"
    async with bind(f"uds://{path}") as worker:
        # The old connection, spoken by hand so it does not reconnect by itself.
        old_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_sock.connect(path)
        old = RawPeer(old_sock)
        old_sock.sendall(raw_message(HANDSHAKE + b"same") + raw_message(b"from old"))
        assert await worker.recv() == (b"same", [b"from old"])
        async with connect(f"uds://{path}", identity=b"same") as new:
            await new.send([b"from new"])
            assert await worker.recv() == (b"same", [b"from new"])
            assert await old.eof()  # the old connection was closed by the handover
            await worker.send([b"to same"], peer=b"same")
            assert (await new.recv()).frames == [b"to same"]
            worker.validate()  # type: ignore[attr-defined]
        old_sock.close()


async def test_send_to_a_peer_that_left_raises(sock_dir: Path) -> None:
    async with bind(f"uds://{sock_dir}/w.sock") as worker:
        front = connect(worker.url, identity=b"gone")
        await front.send([b"hi"])
        await worker.recv()
        front.close()
        await eventually(lambda: worker.statistics()["peers"] == 0, "the peer's EOF")
        with pytest.raises(TransportError, match="not connected"):
            await worker.send([b"late"], peer=b"gone")
        assert worker.statistics()["dropped"] == 0  # a plain close is not a broken peer


# ------------------------------------------------------------------------ big and many


async def test_a_64_mib_frame_each_way(sock_dir: Path) -> None:
    blob = os.urandom(1 << 20) * 64
    digest = hashlib.sha256(blob).digest()
    async with bind(f"uds://{sock_dir}/w.sock") as worker, connect(worker.url) as front:
        await front.send([b"head", blob, b"tail"])
        peer, frames = await worker.recv()
        assert [len(f) for f in frames] == [4, len(blob), 4]
        assert frames[0] == b"head" and frames[2] == b"tail"
        assert hashlib.sha256(frames[1]).digest() == digest
        await worker.send([frames[1]], peer=peer)  # the received buffer goes straight back
        (back,) = (await front.recv()).frames
        assert hashlib.sha256(back).digest() == digest


async def test_big_frame_buffers_are_reused_only_once_released(sock_dir: Path) -> None:
    blobs = [bytes([i]) * (3 << 20) for i in range(6)]
    async with bind(f"uds://{sock_dir}/w.sock") as worker, connect(worker.url) as front:
        held = []
        for blob in blobs[:3]:  # held: their buffers must not be written again
            await front.send([blob])
            held.append((await worker.recv()).frames[0])
        for blob in blobs[3:]:  # dropped at once: their buffers may be reused
            await front.send([blob])
            (frame,) = (await worker.recv()).frames
            assert frame == blob
            del frame
        assert [bytes(f) for f in held] == blobs[:3]
        addresses = set()
        for blob in blobs:
            await front.send([blob])
            (frame,) = (await worker.recv()).frames
            assert frame == blob
            addresses.add(id(memoryview(frame).obj))
            del frame
        assert len(addresses) == 1  # one slab served them all
        assert [bytes(f) for f in held] == blobs[:3]


async def test_a_burst_of_small_messages_arrives_in_few_batches_in_order(
    sock_dir: Path,
) -> None:
    n = 1000
    async with bind(f"uds://{sock_dir}/w.sock") as worker, connect(worker.url) as front:
        for i in range(n):  # no await that suspends: the whole burst is written first
            assert front.try_send([b"msg %04d" % i, b"x" * (i % 7)])
        got: list[tuple[bytes, ...]] = []
        batches = 0
        while len(got) < n:
            batches += 1
            got += [tuple(p.frames) for p in await worker.recv_batch()]
        assert got == [(b"msg %04d" % i, b"x" * (i % 7)) for i in range(n)]
        assert batches <= 10, batches


async def test_a_receiver_gets_every_message_in_order_from_the_reader_itself(
    sock_dir: Path,
) -> None:
    """``set_receiver``: what arrived before is handed over on the next loop turn, a burst in
    calls of at most MAX_DELIVERY, in order; ``None`` gives the messages back to ``recv``."""
    calls: list[list[bytes]] = []

    def receiver(packets: list[Packet]) -> None:
        assert asyncio.current_task() is None  # the loop's reader callback, not a task
        calls.append([bytes(p.frames[0]) for p in packets])

    async with bind(f"uds://{sock_dir}/w.sock") as worker, connect(worker.url) as front:
        assert front.try_send([b"early"])
        await eventually(lambda: worker.statistics()["peers"] == 1, "the handshake")
        await asyncio.sleep(0.05)  # "early" waits in the inbox (nobody receives yet)
        assert worker.set_receiver(receiver)
        n = 1000
        for i in range(n):  # one burst, written before the reader runs
            assert front.try_send([b"%04d" % i])
        await eventually(lambda: sum(map(len, calls)) == n + 1, "every message")
        assert [m for c in calls for m in c] == [b"early", *(b"%04d" % i for i in range(n))]
        assert max(map(len, calls)) <= MAX_DELIVERY and len(calls) >= 1 + n // MAX_DELIVERY
        assert worker.statistics()["received"] == n + 1
        assert worker.set_receiver(None)
        assert front.try_send([b"later"])
        assert (await asyncio.wait_for(worker.recv(), 30)).frames == [b"later"]
    with pytest.raises(RuntimeClosedError):
        worker.set_receiver(receiver)  # closed
    async with bind("inproc://no-receiver") as other:
        assert not other.set_receiver(receiver)  # a transport without the path: recv_batch


async def test_drain_hands_the_receiver_all_its_peers_wrote_before_it(sock_dir: Path) -> None:
    """``drain``: what arrived but waits in the inbox, then everything peers wrote before the
    call (small messages and big ones, on every connection), reaches the receiver before it
    returns, no loop turn needed, in order per connection; nothing happens without a
    receiver, and a transport that cannot tell says so."""
    got: list[bytes] = []

    def receiver(packets: list[Packet]) -> None:
        got.extend(bytes(p.frames[0][:8]) for p in packets)

    async with (
        bind(f"uds://{sock_dir}/w.sock") as worker,
        connect(worker.url) as a,
        connect(worker.url) as b,
    ):
        for peer in (a, b):
            assert peer.try_send([b"hello"])
        await eventually(lambda: worker.statistics()["peers"] == 2, "both handshakes")
        waiting = [b"w%07d" % i for i in range(MAX_DELIVERY + 3)]
        for m in waiting:
            assert a.try_send([m])
        inbox = worker._in.packets  # type: ignore[attr-defined]
        await eventually(lambda: len(inbox) == 2 + len(waiting), "the burst in the inbox")
        assert not worker.drain()  # no receiver: nothing is handed anywhere
        assert worker.set_receiver(receiver)  # (its delivery would come on the next turn)
        got.clear()
        small = [b"a%07d" % i for i in range(500)]
        big = b"A-big---" + bytes(300_000)  # (read in a stream of its own)
        for m in small:
            assert a.try_send([m])
        assert a.try_send([big])
        for i in range(300):
            assert b.try_send([b"b%07d" % i])
        assert worker.drain()
        assert [m for m in got if m[:1] != b"b"] == [b"hello", b"hello", *waiting, *small, big[:8]]
        assert [m for m in got if m[:1] == b"b"] == [b"b%07d" % i for i in range(300)]
    async with bind("inproc://no-drain") as other:
        other.set_receiver(receiver)
        assert not other.drain()


#: A send: how (``try_send``, else ``send``), how many frames, and how big the first.
_SENDS = st.lists(
    st.tuples(st.booleans(), st.integers(1, 3), st.sampled_from([0, 5, 100, 70_000])),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None)
@given(sends=_SENDS, hwm=st.integers(1, 8), receiver_from=st.integers(0, 40))
def test_sends_both_ways_arrive_in_order_and_are_counted_alike(
    sends: list[tuple[bool, int, int]], hwm: int, receiver_from: int
) -> None:
    """One-frame ``try_send``s to a ready connection go out in one step, and a reader with a
    receiver hands what it read over in one call; whatever mix of sends (one or more frames,
    ``try_send`` or ``send``, a small high-water mark) and receiving (``recv_batch`` first,
    a receiver from some point on), both sides see the same messages in order, both ways,
    and count the same messages and bytes."""

    async def main() -> None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="of-", dir="/tmp") as tmp:
            transport = UdsTransport(hwm=hwm)
            async with (
                transport.bind(f"uds://{tmp}/w.sock") as worker,
                transport.connect(f"uds://{tmp}/w.sock", identity=b"f") as front,
            ):
                msgs = [
                    [b"%03d" % i + b"x" * size, *(b"f%d" % j for j in range(1, n))]
                    for i, (_try, n, size) in enumerate(sends)
                ]
                got: list[list[bytes]] = []
                back: list[list[bytes]] = []

                def to_worker(packets: list[Packet]) -> None:
                    for peer, frames in packets:
                        got.append([bytes(f) for f in frames])
                        assert peer == b"f"
                        if not worker.try_send(frames, peer=peer):  # echo it back
                            pending.append(asyncio.ensure_future(worker.send(frames, peer=peer)))

                pending: list[asyncio.Future[None]] = []
                assert front.set_receiver(lambda ps: back.extend(
                    [bytes(f) for f in p.frames] for p in ps))  # fmt: skip

                async def send(i: int) -> None:
                    if not (sends[i][0] and front.try_send(msgs[i])):
                        await front.send(msgs[i])

                first = min(receiver_from, len(msgs))
                for i in range(first):  # these the worker reads with recv_batch
                    await send(i)
                while len(got) < first:
                    for peer, frames in await worker.recv_batch():
                        got.append([bytes(f) for f in frames])
                        await worker.send(frames, peer=peer)
                assert worker.set_receiver(to_worker)  # the rest: handed over by the reader
                for i in range(first, len(msgs)):
                    await send(i)
                await eventually(lambda: len(back) == len(msgs), "every echo")
                await asyncio.gather(*pending)
                assert got == msgs and back == msgs
                sent, received = front.statistics(), worker.statistics()
                assert sent["sent"] == received["received"] == len(msgs)
                assert sent["sent_bytes"] == received["received_bytes"]
                assert received["sent"] == sent["received"] == len(msgs)
                validate(front, worker)

    asyncio.run(main())


# ------------------------------------------------------------------------ back-pressure


async def test_outbox_under_back_pressure_keeps_order_and_loses_nothing(
    sock_dir: Path,
) -> None:
    path = sock_dir / "slow.sock"
    srv = listener(path)  # a peer that does not read until we say so
    loop = asyncio.get_running_loop()
    async with connect(f"uds://{path}", identity=b"p") as front:
        conn, _ = await asyncio.wait_for(loop.sock_accept(srv), 30)
        payload = b"y" * 32768
        n = 300  # ~10 MiB: far more than a socket buffer holds
        for i in range(n):
            await front.send([b"%d" % i, payload])
        assert front.statistics()["queued"] > 0  # the socket is full: the rest waits
        assert front.try_send([b"last"])  # below the high-water mark: queued behind, in order
        peer = RawPeer(conn)
        assert await peer.message() == [HANDSHAKE + b"p"]
        for i in range(n):
            assert await peer.message() == [b"%d" % i, payload]
        assert await peer.message() == [b"last"]
        validate(front)
    conn.close()
    srv.close()


async def test_sends_past_the_high_water_mark_wait_in_order(sock_dir: Path) -> None:
    path = sock_dir / "hwm.sock"
    front = UdsTransport(hwm=4).connect(f"uds://{path}", identity=b"h")  # nothing bound
    for i in range(4):
        assert front.try_send([b"%d" % i])
    assert not front.try_send([b"refused"])  # full: the caller queues it itself
    waiting = [asyncio.create_task(front.send([b"%d" % i])) for i in range(4, 8)]
    await asyncio.sleep(0)
    assert not any(t.done() for t in waiting)
    assert not front.try_send([b"refused"])  # never overtakes a waiting send
    async with bind(f"uds://{path}") as worker:
        got = []
        while len(got) < 8:
            got += [p.frames[0] for p in await worker.recv_batch()]
        assert got == [b"%d" % i for i in range(8)]
        await asyncio.gather(*waiting)
    front.close()


async def test_close_fails_sends_waiting_for_room(sock_dir: Path) -> None:
    front = UdsTransport(hwm=1).connect(f"uds://{sock_dir}/none.sock")
    await front.send([b"queued"])
    waiting = asyncio.create_task(front.send([b"waits"]))
    await asyncio.sleep(0)
    front.close()
    with pytest.raises(RuntimeClosedError, match="endpoint is closed"):
        await waiting


async def test_a_message_cut_by_a_broken_connection_is_dropped_whole(sock_dir: Path) -> None:
    path = sock_dir / "cut.sock"
    srv = listener(path)
    loop = asyncio.get_running_loop()
    async with connect(f"uds://{path}", identity=b"c") as front:
        first, _ = await asyncio.wait_for(loop.sock_accept(srv), 30)
        await front.send([b"big", b"z" * (8 << 20)])  # stays partly in the outbox
        await front.send([b"after"])
        assert front.statistics()["queued"] == 2
        peer = RawPeer(first)
        assert await peer.message() == [HANDSHAKE + b"c"]
        await peer.exactly(100_000)  # part of the big message, then the peer dies
        first.close()
        second, _ = await asyncio.wait_for(loop.sock_accept(srv), 30)
        peer = RawPeer(second)
        assert await peer.message() == [HANDSHAKE + b"c"]
        assert await peer.message() == [b"after"]  # whole, and nothing of the cut one
        second.close()
    srv.close()


# ------------------------------------------------------------------------ hostile peers


@pytest.mark.parametrize(
    "header",
    [
        struct.pack("<IQ", 1, MAX_FRAME_BYTES + 1),  # a frame over the limit
        struct.pack("<IQ", 1, 1 << 62),  # absurd: would be a MemoryError if allocated
        struct.pack("<I", MAX_FRAMES + 1),  # too many frames
        struct.pack("<I", 0),  # no frame at all
    ],
)
async def test_a_hostile_header_drops_only_that_connection(
    sock_dir: Path, header: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = f"{sock_dir}/w.sock"
    async with bind(f"uds://{path}") as worker, connect(worker.url, identity=b"good") as good:
        bad_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad_sock.connect(path)
        bad = RawPeer(bad_sock)
        with caplog.at_level(logging.WARNING, logger="omniflow.transport"):
            bad_sock.sendall(raw_message(HANDSHAKE + b"bad") + header + b"\0" * 64)
            assert await bad.eof()
        assert "announces" in caplog.text
        assert worker.statistics()["dropped"] == 1
        await good.send([b"still fine"])
        assert await worker.recv() == (b"good", [b"still fine"])
        bad_sock.close()


async def test_a_connection_without_a_handshake_is_dropped(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = f"{sock_dir}/w.sock"
    async with bind(f"uds://{path}") as worker:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        with caplog.at_level(logging.WARNING, logger="omniflow.transport"):
            sock.sendall(raw_message(b"GET / HTTP/1.1"))
            assert await RawPeer(sock).eof()
        assert "not a uds handshake" in caplog.text
        sock.close()
        assert worker.statistics()["dropped"] == 1


async def test_oversized_messages_are_refused_at_send(sock_dir: Path) -> None:
    front = connect(f"uds://{sock_dir}/w.sock")
    with pytest.raises(TransportError, match="more than the 1000"):
        await front.send([b"x"] * (MAX_FRAMES + 1))
    with pytest.raises(TransportError, match="an identity is 1 to 255 bytes"):
        connect(f"uds://{sock_dir}/w.sock", identity=b"")
    front.close()


# ------------------------------------------------------------------------ the socket file


async def test_socket_file_is_private_and_removed_on_close(sock_dir: Path) -> None:
    path = sock_dir / "w.sock"
    async with bind(f"uds://{path}"):
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert [p.name for p in sock_dir.iterdir()] == ["w.sock"]  # no temporary left
    assert not path.exists()


async def test_stale_socket_file_is_replaced(sock_dir: Path) -> None:
    path = sock_dir / "w.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # what a killed worker leaves behind: a file nobody listens on
    dead.close()
    assert path.exists()
    async with bind(f"uds://{path}") as worker, connect(worker.url) as front:
        await front.send([b"hi"])
        assert (await worker.recv()).frames == [b"hi"]


async def test_closing_keeps_a_file_that_another_endpoint_owns_now(sock_dir: Path) -> None:
    path = sock_dir / "w.sock"
    old = bind(f"uds://{path}")
    os.unlink(path)  # someone cleaned up under the live endpoint...
    async with bind(f"uds://{path}"):  # ... and a new one bound the path
        old.close()
        assert path.exists()


def test_bad_uds_urls() -> None:
    with pytest.raises(TransportError, match="absolute path"):
        bind("uds://relative/w.sock")
    with pytest.raises(TransportError, match="107"):
        connect("uds:///" + "d" * 120 + "/w.sock")
    with pytest.raises(TransportError, match="cannot bind"):
        bind("uds:///nonexistent-dir-of/w.sock")


# ------------------------------------------------------------------------ the switch


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("1", True), ("true", True), ("ON", True), ("0", False), ("off", False),
     (" False ", False), ("no", False)],
)  # fmt: skip
def test_fast_path_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_PATH_ENV, value)
    assert fast_path_enabled() is on
    assert local_url("/run/of/w.sock") == ("uds" if on else "ipc") + ":///run/of/w.sock"


def test_fast_path_switch_refuses_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAST_PATH_ENV, "maybe")
    with pytest.raises(TransportError, match="OMNIFLOW_FAST_PATH='maybe' is not a switch"):
        fast_path_enabled()


async def _loop_module(result: int) -> tuple[str, int]:
    """The top module of the running loop's class (``uvloop`` or ``asyncio``), and ``result``."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0], result


@pytest.mark.parametrize(("value", "module"), [(None, "uvloop"), ("1", "uvloop"), ("0", "asyncio")])
def test_run_loop_runs_on_uvloop_only_with_the_fast_path_on(
    monkeypatch: pytest.MonkeyPatch, value: str | None, module: str
) -> None:
    pytest.importorskip("uvloop")
    if value is None:
        monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_PATH_ENV, value)
    assert run_loop(_loop_module(7)) == (module, 7)


def test_run_loop_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # (import uvloop raises ImportError)
    assert run_loop(_loop_module(1)) == ("asyncio", 1)


def test_run_loop_raises_what_main_raises_and_refuses_a_bad_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def fails() -> None:
        raise KeyError("from main")

    with pytest.raises(KeyError, match="from main"):
        run_loop(fails())
    monkeypatch.setenv(FAST_PATH_ENV, "maybe")
    main = _loop_module(0)
    with pytest.raises(TransportError, match="is not a switch"):
        run_loop(main)
    assert main.cr_frame is None  # closed, not left for the collector to warn about


def test_is_local() -> None:
    assert is_local("uds:///a.sock") and is_local("ipc:///a.sock")
    assert not is_local("tcp://127.0.0.1:1") and not is_local("inproc://a")
