"""uds:// endpoints opened with the cluster key: each connection proves the key once, both ways,
before a message crosses (``_udshandshake.Handshake``); then its messages need no per-message
seal.
What must hold: key holders talk (queued messages included, in order, over reconnects);
anything else is dropped at the handshake, and nothing it sent is ever delivered."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniflow.transport import bind, connect
from omniflow.transport._udshandshake import (
    AUTH_CHALLENGE,
    AUTH_HELLO,
    AUTH_PROOF,
    NONCE_BYTES,
    Handshake,
)
from tests.transport.test_uds import RawPeer, eventually, raw_message, validate

KEY = b"k" * 32
OTHER = b"o" * 32


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="of-", dir="/tmp") as tmp:
        yield Path(tmp)


async def test_key_holders_talk_and_say_so(sock_dir: Path) -> None:
    url = f"uds://{sock_dir}/w.sock"
    async with connect(url, identity=b"f", key=KEY) as front:
        for i in range(3):  # before the bound side exists: queued until the proof held
            await front.send([f"m{i}".encode()])
        async with bind(url, key=KEY) as worker:
            assert worker.authenticated and front.authenticated
            got = [await worker.recv() for _ in range(3)]
            assert [(p.peer, p.frames) for p in got] == [
                (b"f", [b"m0"]), (b"f", [b"m1"]), (b"f", [b"m2"])
            ]  # fmt: skip
            assert worker.try_send([b"back"], peer=b"f")
            assert (await front.recv()).frames == [b"back"]
            validate(front, worker)
    async with bind(f"uds://{sock_dir}/plain.sock") as plain:
        assert not plain.authenticated


async def test_a_restarted_bound_side_is_proved_again(sock_dir: Path) -> None:
    url = f"uds://{sock_dir}/w.sock"
    first = bind(url, key=KEY)
    async with connect(url, identity=b"f", key=KEY) as front:
        await front.send([b"one"])
        assert (await first.recv()).frames == [b"one"]
        first.close()
        async with bind(url, key=KEY) as second:
            await front.send([b"two"])
            assert (await second.recv()).frames == [b"two"]
            await second.send([b"back"], peer=b"f")
            assert (await front.recv()).frames == [b"back"]


@pytest.mark.parametrize(
    ("bound_key", "connected_key"),
    [(KEY, OTHER), (KEY, None), (None, KEY)],
    ids=["other-key", "connected-without", "bound-without"],
)
async def test_mismatched_keys_never_deliver(
    sock_dir: Path,
    bound_key: bytes | None,
    connected_key: bytes | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"uds://{sock_dir}/w.sock"
    caplog.set_level(logging.WARNING, "omniflow.transport")
    async with bind(url, key=bound_key) as worker:
        front = connect(url, identity=b"f", key=connected_key)
        try:
            await front.send([b"must not arrive"])
            # It keeps trying (each try is dropped at the handshake) and never gets through.
            await eventually(lambda: front.statistics()["connects"] >= 3, "three tries")
            await asyncio.sleep(0.05)
            assert worker.statistics()["received"] == 0
            assert worker.statistics()["peers"] == 0
            if connected_key is not None:  # kept for a bound side that proves the key
                assert front.statistics()["queued"] == 1
            with pytest.raises(Exception, match="not connected"):
                await worker.send([b"x"], peer=b"f")
        finally:
            front.close()
    assert "cluster key" in caplog.text


async def handshake_by_hand(url: str, key: bytes, identity: bytes) -> tuple[RawPeer, bytes, bytes]:
    """Connect a raw socket and run the connected side's half of the handshake by hand:
    the peer, our nonce and the bound side's."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(url.removeprefix("uds://"))
    peer = RawPeer(sock)
    mine = b"n" * NONCE_BYTES
    sock.sendall(raw_message(AUTH_HELLO + mine + identity))
    [challenge] = await peer.message()
    assert challenge.startswith(AUTH_CHALLENGE)
    theirs = challenge[len(AUTH_CHALLENGE) : len(AUTH_CHALLENGE) + NONCE_BYTES]
    return peer, mine, theirs


async def test_the_proof_binds_both_nonces_and_the_identity(sock_dir: Path) -> None:
    """A proof made for another identity or nonce (a replay from another connection) is refused,
    and data sent in place of the proof is never delivered."""
    url = f"uds://{sock_dir}/w.sock"
    hs = Handshake(KEY)
    async with bind(url, key=KEY) as worker:
        # Right key, proof for another identity: dropped.
        peer, mine, theirs = await handshake_by_hand(url, KEY, b"me")
        peer.conn.sendall(raw_message(hs.answer(mine, theirs, b"someone-else")))
        peer.conn.sendall(raw_message(b"smuggled"))
        assert await peer.eof()
        peer.conn.close()
        # Data instead of a proof: dropped, not delivered.
        peer, mine, theirs = await handshake_by_hand(url, KEY, b"me")
        peer.conn.sendall(raw_message(b"no proof, just data"))
        assert await peer.eof()
        peer.conn.close()
        # The bound side's own proof sent back (a reflection): dropped.
        peer, mine, theirs = await handshake_by_hand(url, KEY, b"me")
        reflected = AUTH_PROOF + hs.proof(b"bound", mine, theirs, b"me")
        peer.conn.sendall(raw_message(reflected))
        assert await peer.eof()
        peer.conn.close()
        # The real thing works, and what follows it in the same write is delivered.
        peer, mine, theirs = await handshake_by_hand(url, KEY, b"me")
        peer.conn.sendall(raw_message(hs.answer(mine, theirs, b"me")) + raw_message(b"hi"))
        packet = await asyncio.wait_for(worker.recv(), 30)
        assert (packet.peer, packet.frames) == (b"me", [b"hi"])
        assert worker.statistics()["received"] == 1
        peer.conn.close()


async def test_a_bound_side_that_cannot_prove_the_key_gets_nothing(sock_dir: Path) -> None:
    """The connected side sends nothing but its hello until the bound side's proof held: a
    listener without the key (another program at the path) never sees a message."""
    path = sock_dir / "w.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    srv.setblocking(False)
    loop = asyncio.get_running_loop()
    front = connect(f"uds://{path}", identity=b"f", key=KEY)
    try:
        await front.send([b"secret"])
        conn, _ = await asyncio.wait_for(loop.sock_accept(srv), 30)
        peer = RawPeer(conn)
        [hello] = await peer.message()
        assert hello.startswith(AUTH_HELLO) and hello.endswith(b"f")
        bogus = hmac.new(b"guess", b"x", hashlib.sha256).digest()
        conn.sendall(raw_message(AUTH_CHALLENGE + b"b" * NONCE_BYTES + bogus))
        assert await peer.eof()  # dropped, and "secret" never written
        assert b"secret" not in bytes(peer.pending)
        assert front.statistics()["queued"] == 1
        conn.close()
    finally:
        front.close()
        srv.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=80), min_size=1, max_size=4))
def test_garbage_handshakes_are_dropped(garbage: list[bytes]) -> None:
    """Whatever a peer without the key sends as its handshake, the bound side delivers
    nothing and keeps serving key holders."""

    async def main() -> None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="of-", dir="/tmp") as tmp:
            url = f"uds://{tmp}/w.sock"
            async with bind(url, key=KEY) as worker:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(url.removeprefix("uds://"))
                sock.sendall(b"".join(raw_message(g) for g in garbage))
                async with connect(url, identity=b"good", key=KEY) as front:
                    await front.send([b"ok"])
                    packet = await asyncio.wait_for(worker.recv(), 30)
                    assert (packet.peer, packet.frames) == (b"good", [b"ok"])
                assert worker.statistics()["received"] == 1
                sock.close()

    asyncio.run(main())
