"""Transport: the control-plane wire format and the endpoints that carry it.

>>> import asyncio
>>> from omniflow import transport
>>> async def main():
...     async with transport.bind("inproc://w") as worker, transport.connect("inproc://w") as front:
...         await transport.send_message(front, {"op": "ping"})
...         peer, message = await transport.recv_message(worker)
...         return message.body
>>> asyncio.run(main())
{'op': 'ping'}

``_codec`` (msgpack envelope, zero-copy buffers) → ``_base`` (Endpoint, scheme registry) →
``_inproc`` / ``_zmq`` / ``_uds`` (the transports; ``uds://`` over ``_udsendpoint``,
``_udsrouter``, ``_udsdealer``, ``_udshandshake`` and ``_udswire``; ``_fastpath`` picks ``uds://``
or ``ipc://`` for same-node endpoints) → ``_loop`` (messages and the receive loop).
This layer imports nothing above it (no runtime, no registry).
"""

from __future__ import annotations

from omniflow._exceptions import CodecError, TransportError
from omniflow.transport._base import (
    Endpoint,
    EndpointState,
    Packet,
    Transport,
    bind,
    connect,
    register_transport,
    transport_for,
)
from omniflow.transport._codec import (
    OOB_THRESHOLD,
    VERSION,
    Buffer,
    Message,
    decode,
    decode_message,
    encode,
)
from omniflow.transport._fastpath import (
    FAST_PATH_ENV,
    fast_path_enabled,
    is_local,
    local_url,
    run_loop,
)
from omniflow.transport._inproc import InprocTransport
from omniflow.transport._loop import Handler, ReceiveLoop, recv_message, send_message
from omniflow.transport._uds import UdsTransport
from omniflow.transport._zmq import ZmqTransport

__all__ = [
    "FAST_PATH_ENV",
    "OOB_THRESHOLD",
    "VERSION",
    "Buffer",
    "CodecError",
    "Endpoint",
    "EndpointState",
    "Handler",
    "InprocTransport",
    "Message",
    "Packet",
    "ReceiveLoop",
    "Transport",
    "TransportError",
    "UdsTransport",
    "ZmqTransport",
    "bind",
    "connect",
    "decode",
    "decode_message",
    "encode",
    "fast_path_enabled",
    "is_local",
    "local_url",
    "recv_message",
    "register_transport",
    "run_loop",
    "send_message",
    "transport_for",
]
