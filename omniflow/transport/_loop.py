"""Messages over endpoints: encode-and-send, receive-and-decode, and a receive loop.

>>> import asyncio
>>> from omniflow.transport import bind, connect
>>> async def main():
...     async def on_message(peer, message):
...         await worker.send(encode({"echo": message.body}), peer=peer)
...     async with bind("inproc://echo") as worker, connect("inproc://echo") as front:
...         async with asyncio.TaskGroup() as tg:
...             tg.create_task(ReceiveLoop(worker, on_message).run())
...             await send_message(front, {"op": "ping"})
...             _, reply = await recv_message(front)
...             worker.close()                         # ends the loop
...     return reply.body
>>> asyncio.run(main())
{'echo': {'op': 'ping'}}
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from omniflow._exceptions import CodecError, RuntimeClosedError
from omniflow.transport._base import Endpoint
from omniflow.transport._codec import OOB_THRESHOLD, Message, decode_message, encode

__all__ = ["Handler", "ReceiveLoop", "recv_message", "send_message"]

logger = logging.getLogger("omniflow.transport")

#: Called once per well-formed message with the sending peer (None on a connected endpoint).
Handler = Callable[[bytes | None, Message], Awaitable[None]]

#: Log every malformed message up to this many, then one line per this many.
_LOG_FIRST = 10


async def send_message(
    endpoint: Endpoint,
    body: Any,
    *,
    kind: str = "msg",
    peer: bytes | None = None,
    threshold: int = OOB_THRESHOLD,
) -> None:
    """Encode ``body`` and send it (to ``peer`` on a bound endpoint)."""
    await endpoint.send(encode(body, kind=kind, threshold=threshold), peer=peer)


async def recv_message(endpoint: Endpoint) -> tuple[bytes | None, Message]:
    """Receive and decode one message; a malformed one raises CodecError."""
    peer, frames = await endpoint.recv()
    return peer, decode_message(frames)


class ReceiveLoop:
    """Receives from ``endpoint``, decodes, and awaits ``handler`` for each message in order.

    A malformed message is logged (one line; after the first 10, one line per 10), counted in
    ``statistics()["malformed"]`` and skipped: a peer sending garbage cannot stop the loop.
    An exception from ``handler`` is a bug of the caller and ends ``run()`` with it.
    ``run()`` returns when the endpoint is closed.
    """

    def __init__(self, endpoint: Endpoint, handler: Handler) -> None:
        #: Where messages come from.
        self.endpoint = endpoint
        #: Where decoded messages go.
        self.handler = handler
        self._received = 0
        self._handled = 0
        self._malformed = 0

    async def run(self) -> None:
        endpoint = self.endpoint
        while True:
            try:
                peer, frames = await endpoint.recv()
            except RuntimeClosedError:
                return
            self._received += 1
            try:
                message = decode_message(frames)
            except CodecError as exc:
                self._malformed += 1
                if self._malformed <= _LOG_FIRST or self._malformed % _LOG_FIRST == 0:
                    logger.warning(
                        "%s: dropped malformed message #%d from peer %s: %s",
                        endpoint.url,
                        self._malformed,
                        peer.hex() if peer is not None else "-",
                        exc,
                    )
                continue
            await self.handler(peer, message)
            self._handled += 1

    def statistics(self) -> dict[str, int]:
        """Messages received, handed to the handler, and dropped as malformed."""
        return {
            "received": self._received,
            "handled": self._handled,
            "malformed": self._malformed,
        }
