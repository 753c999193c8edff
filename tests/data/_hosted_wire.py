"""A worker's client of front-hosted metadata, wired through the real protocol in one process
(every call a sealed ``MetaCall``, every answer a sealed ``MetaReply``, served as the front's
``RemoteRoles`` serves them)."""

from __future__ import annotations

import asyncio
from typing import Any

from omniflow._exceptions import DataError
from omniflow.data.kv._hosted import HostedMetadata, serve
from omniflow.data.kv._meta import MemoryMetadata
from omniflow.transport._auth import Opener, Sealer
from omniflow.transport._protocol import MetaCall, MetaNotify, MetaReply, decode_msg, encode_msg


def _wire(msg: Any, sealer: Sealer, opener: Opener) -> Any:
    """``msg`` as the other end of an authenticated connection reads it."""
    inner = opener.open(sealer.seal(encode_msg(msg)))
    assert inner is not None
    return decode_msg(inner)


def hosted_client(front: MemoryMetadata) -> HostedMetadata:
    """A worker's client of ``front``: every call a sealed MetaCall, every answer a sealed
    MetaReply, served as the front's RemoteRoles serves them."""
    key = b"k" * 32
    client = HostedMetadata(timeout=10)
    tasks: set[asyncio.Task[None]] = set()

    async def front_side(r: int, op: str, args: list[Any]) -> None:
        call = _wire(MetaCall(r, op, args), Sealer(key), Opener(key))
        assert type(call) is MetaCall
        try:
            reply = MetaReply(call.request, await serve(front, call.op, call.args))
        except DataError as exc:
            reply = MetaReply(call.request, None, str(exc))
        if call.op == "register" and reply.error is None:  # as RemoteRoles._meta_call does
            front.listen(call.args[0], call.args[1], notify)
        back = _wire(reply, Sealer(key), Opener(key))
        client.reply(back.request, back.value, back.error)

    def notify(pool: str, session: str | None, keys: list[str]) -> None:
        msg = _wire(MetaNotify(pool, session, keys), Sealer(key), Opener(key))
        client.notify(msg.pool, msg.session, msg.keys)

    def send(r: int, op: str, args: list[Any]) -> None:
        task = asyncio.get_running_loop().create_task(front_side(r, op, args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    client.attach(send)
    return client
