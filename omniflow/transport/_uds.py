"""``uds:///abs/path.sock``: ROUTER/DEALER endpoints over plain Unix-domain stream sockets.

>>> async def main(key):                    # ``_zmq``'s example, with the keyed handshake
...     async with bind("uds:///tmp/of-doc/w.sock", key=key) as worker:
...         async with connect(worker.url, identity=b"front-1", key=key) as front:
...             await front.send([b"ping"])                      # no seal needed on it
...             return front.authenticated, (await worker.recv()).peer
>>> asyncio.run(main(generate_key()))                            # doctest: +SKIP
(True, b'front-1')

The same-node fast path of the control plane. libzmq moves every message through its I/O
thread (four thread wake-ups per message, application to I/O thread to socket and back); here
the event loop's own ``add_reader``/``add_writer`` drive the socket, one wake-up per burst.
The semantics are those of ``_zmq``'s ROUTER/DEALER, which the fleet and the worker rely on:

- **Bound side** (ROUTER): a listening socket, file mode 0600 (bound under a temporary name,
  chmod-ed, then renamed into place, so it is never reachable with a wider mode), in a directory
  the caller made private. Each accepted connection first sends a handshake frame
  (``b"OFU\\x01" + identity``); from then on its messages are tagged with that identity. A
  connection from another user id (``SO_PEERCRED``) is refused. A new connection with an
  identity already connected takes the route over (``ROUTER_HANDOVER``). ``send(peer=...)`` to
  an identity with no connection raises TransportError (``ROUTER_MANDATORY``). A live socket at
  the path is refused, a stale file replaced, and the file is removed on close (if it is still
  ours).
- **With a key** (``bind``/``connect`` ``key=``: the cluster key on both sides), the first
  message is instead the keyed handshake (``_udshandshake.Handshake``: hello, challenge, proof;
  each side proves the key for this connection's two nonces). The connected side writes
  nothing else until the bound side's proof held; the bound side delivers nothing of a
  connection, and routes nothing to it, until the connected side's did. A wrong or missing
  proof drops the connection (logged; the connected side retries as after any loss). Such an
  endpoint is ``authenticated``: its messages need no per-message seal.
- **Connected side** (DEALER): a fixed identity. It may send before the bound side exists or
  while it restarts: messages queue and the connection is retried every 10 ms, backing off to
  50 ms (a timer on the loop, non-blocking ``connect``; no thread, no polling in between) until
  it succeeds or the endpoint closes. A peer that goes away (EOF, ECONNRESET, EPIPE) is
  reconnected the same way; it never raises (supervision lives in the fleet, as with ZMQ).
  A message cut by a broken connection is lost (its rest is never sent on the next one), as
  with ZMQ.

Received messages wait for ``recv``/``recv_batch``, or, once ``set_receiver(fn)`` was called,
go to ``fn`` from the readable event itself (at most 256 a call, the rest on the next loop
turns: no future and no task wake-up per burst). A message sent with nothing queued before it
goes out in one ``sendmsg`` and is never queued.

Where it lives: ``_udsendpoint`` (what both sides share: the loop, the inbox and the
reader/writer plumbing), ``_udsrouter`` (the bound side), ``_udsdealer`` (the connected
side), ``_udshandshake`` (the first messages of a connection, the peer's uid) and
``_udswire`` (the byte stream of one connection: framing, the outbox, reading and parsing);
this module is the transport (``bind``, ``connect``, the socket path).

``close()`` wakes a pending ``recv`` with RuntimeClosedError, fails sends still waiting for
room, makes one last non-blocking attempt to write what is queued, removes readers and
writers, closes the sockets and unlinks the socket file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket as _socket
import uuid

from omniflow._exceptions import TransportError
from omniflow.transport._base import Endpoint, Transport, register_transport, socket_file_in_use
from omniflow.transport._udsdealer import UdsDealer
from omniflow.transport._udsendpoint import MAX_IDENTITY, SOCK_FLAGS
from omniflow.transport._udsrouter import UdsRouter

__all__ = ["UdsTransport"]


# ROUTER/DEALER again beside _zmq by design: one Endpoint contract (_base, tests/transport/
# test_endpoints.py over every scheme); this one drives the socket from the loop, same node only.
class UdsTransport(Transport):
    """Serves ``uds:///abs/path.sock``.

    ``hwm``: messages that may wait to be written per connection before ``send`` waits too
    (ZMQ's high-water mark).
    """

    schemes = ("uds",)

    def __init__(self, *, hwm: int = 1000) -> None:
        #: Messages per connection before ``send`` waits.
        self.hwm = hwm

    def bind(self, url: str, *, key: bytes | None = None) -> Endpoint:
        path = _path(url)
        if socket_file_in_use(path):
            raise TransportError(f"{url}: address already in use by a live socket", url=url)
        listener = _socket.socket(_socket.AF_UNIX, SOCK_FLAGS)
        try:
            listener.setblocking(False)
            _bind_private(listener, path)
            listener.listen(_socket.SOMAXCONN)
            inode = os.stat(path).st_ino
        except OSError as exc:
            listener.close()
            raise TransportError(f"{url}: cannot bind: {exc}", url=url) from exc
        return UdsRouter(url, listener, path, inode, hwm=self.hwm, key=key)

    def connect(
        self, url: str, *, identity: bytes | None = None, key: bytes | None = None
    ) -> Endpoint:
        path = _path(url)
        identity = identity if identity is not None else uuid.uuid4().bytes
        if not 0 < len(identity) <= MAX_IDENTITY:
            raise TransportError(
                f"{url}: an identity is 1 to {MAX_IDENTITY} bytes, got {len(identity)}", url=url
            )
        return UdsDealer(url, path, identity, hwm=self.hwm, key=key)


def _path(url: str) -> str:
    path = url.removeprefix("uds://")
    if path == url or not path.startswith("/"):
        raise TransportError(
            f"{url!r} is not a uds URL: expected uds:// and an absolute path, e.g. "
            "uds:///run/omniflow/w0.sock",
            url=url,
        )
    if len(os.fsencode(path)) > 107:
        raise TransportError(
            f"{url}: the socket path is {len(os.fsencode(path))} bytes, over the 107 a Unix "
            "socket address holds; use a shorter directory",
            url=url,
        )
    return path


def _bind_private(listener: _socket.socket, path: str) -> None:
    """Bind ``path`` with mode 0600 from the first moment it is reachable: bind a temporary
    name beside it, chmod, rename over ``path`` (which also replaces a stale file)."""
    tmp = os.path.join(os.path.dirname(path), f".of{secrets.token_hex(4)}")
    if len(os.fsencode(tmp)) > 107:  # no room for the temporary name: rely on the directory
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale (socket_file_in_use said nothing listens)
        listener.bind(path)
        os.chmod(path, 0o600)
        return
    listener.bind(tmp)
    try:
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


register_transport(UdsTransport())
