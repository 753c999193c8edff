from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import zmq

from omniflow import RuntimeClosedError, TransportError
from omniflow.transport import (
    Endpoint,
    Packet,
    Transport,
    bind,
    connect,
    decode,
    encode,
    recv_message,
    register_transport,
    send_message,
    transport_for,
)


async def test_request_response_with_large_zero_copy_frames(url: str) -> None:
    image = np.random.default_rng(0).integers(0, 255, (1024, 1024, 3), dtype=np.uint8)  # 3 MiB
    async with bind(url) as worker, connect(worker.url, identity=b"front-0") as front:
        request = encode({"op": "call", "node": "vae.decode", "latent": image})
        assert len(request) == 2 and len(request[0]) < 200
        await front.send(request)

        peer, frames = await worker.recv()
        assert peer == b"front-0"
        assert [memoryview(f).nbytes for f in frames] == [len(request[0]), image.nbytes]
        got = decode(frames)
        assert got["op"] == "call" and np.array_equal(got["latent"], image)
        assert not got["latent"].flags.owndata  # a view over the received frame

        await worker.send(encode({"op": "result", "picture": got["latent"][::-1]}), peer=peer)
        reply_peer, reply = await front.recv()
        assert reply_peer is None
        assert np.array_equal(decode(reply)["picture"], image[::-1])
        assert front.statistics()["sent_bytes"] == worker.statistics()["received_bytes"]


async def test_bound_side_routes_replies_by_peer(url: str) -> None:
    async with (
        bind(url) as worker,
        connect(worker.url, identity=b"a") as a,
        connect(worker.url, identity=b"b") as b,
    ):
        for front in (a, b, a):
            await send_message(front, {"from": front.identity})
        for _ in range(3):
            peer, message = await recv_message(worker)
            assert message.body == {"from": peer}
            await send_message(worker, {"to": peer}, peer=peer)
        assert [(await recv_message(a))[1].body for _ in range(2)] == [{"to": b"a"}] * 2
        assert (await recv_message(b))[1].body == {"to": b"b"}
        assert worker.statistics()["received"] == 3


async def test_send_to_unknown_peer_is_a_transport_error(url: str) -> None:
    async with bind(url) as worker, connect(worker.url) as front:
        await front.send([b"hello"])
        await worker.recv()
        with pytest.raises(TransportError, match="not connected") as info:
            await worker.send([b"x"], peer=b"nobody")
        assert info.value.url == worker.url


async def test_argument_errors(url: str) -> None:
    async with bind(url) as worker, connect(worker.url) as front:
        with pytest.raises(TransportError, match="at least one frame"):
            await front.send([])
        with pytest.raises(TransportError, match="pass peer="):
            await worker.send([b"x"])
        with pytest.raises(TransportError, match="single peer"):
            await front.send([b"x"], peer=b"x")


async def test_binding_a_taken_address_fails(url: str) -> None:
    async with bind(url) as worker:
        with pytest.raises(TransportError, match=r"in use|cannot bind") as info:
            bind(worker.url)
        if url.startswith("tcp"):
            assert isinstance(info.value.__cause__, zmq.ZMQError)


async def test_close_wakes_a_pending_recv_and_later_use_fails(url: str) -> None:
    worker = bind(url)
    pending = asyncio.create_task(worker.recv())
    await asyncio.sleep(0.01)
    worker.close()
    worker.close()  # idempotent
    with pytest.raises(RuntimeClosedError, match="endpoint is closed"):
        await pending
    with pytest.raises(RuntimeClosedError):
        await worker.send([b"x"], peer=b"p")
    with pytest.raises(RuntimeClosedError):
        await worker.recv()
    assert "closed" in repr(worker)


async def test_cancelling_recv_stays_a_cancellation(url: str) -> None:
    async with bind(url) as worker:
        pending = asyncio.create_task(worker.recv())
        await asyncio.sleep(0.01)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        async with connect(worker.url) as front:  # the endpoint still works
            await front.send([b"after"])
            assert (await worker.recv()).frames == [b"after"]


async def test_ipc_socket_file_is_removed_on_close() -> None:
    path = "/tmp/of-" + os.urandom(4).hex() + ".sock"
    async with bind(f"ipc://{path}"):
        assert os.path.exists(path)
    assert not os.path.exists(path)


async def test_tcp_port_zero_picks_a_free_port() -> None:
    async with bind("tcp://127.0.0.1:0") as a, bind("tcp://127.0.0.1:0") as b:
        assert a.url != b.url and not a.url.endswith(":0")


async def test_connect_errors() -> None:
    with pytest.raises(TransportError, match="not an endpoint URL"):
        connect("localhost:7000")
    with pytest.raises(TransportError, match="no transport for scheme 'udp'"):
        connect("udp://1.2.3.4:5")
    with pytest.raises(TransportError, match="nothing is bound there"):
        connect("inproc://never-bound")
    with pytest.raises(TransportError, match="cannot connect") as info:
        connect("tcp://no-port-here")
    assert isinstance(info.value.__cause__, zmq.ZMQError)


async def test_inproc_duplicate_identity_and_closed_listener() -> None:
    worker = bind("inproc://dup")
    async with connect("inproc://dup", identity=b"x") as front:
        with pytest.raises(TransportError, match="already connected"):
            connect("inproc://dup", identity=b"x")
        worker.close()
        with pytest.raises(TransportError, match="bound endpoint has closed"):
            await front.send([b"late"])
    async with bind("inproc://dup"):  # the name is free again
        pass


async def test_register_transport_by_scheme() -> None:
    class Loopback(Transport):
        schemes = ("loop",)

        def bind(self, url: str, *, key: bytes | None = None) -> Endpoint:
            return transport_for("inproc://x").bind("inproc://" + url.removeprefix("loop://"))

        def connect(
            self, url: str, *, identity: bytes | None = None, key: bytes | None = None
        ) -> Endpoint:
            inner = "inproc://" + url.removeprefix("loop://")
            return transport_for("inproc://x").connect(inner, identity=identity)

    register_transport(Loopback())
    async with bind("loop://l") as worker, connect("loop://l") as front:
        await front.send([b"via loop"])
        assert await worker.recv() == Packet(front.identity, [b"via loop"])


async def test_ipc_stale_socket_file_is_replaced() -> None:
    path = "/tmp/of-" + os.urandom(4).hex() + ".sock"
    with open(path, "w"):
        pass  # what a killed worker leaves behind
    async with bind(f"ipc://{path}") as worker, connect(worker.url) as front:
        await front.send([b"hi"])
        assert (await worker.recv()).frames == [b"hi"]
