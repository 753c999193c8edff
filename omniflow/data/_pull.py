"""Pulling blocks from producers on other hosts: the consumer side of the ``zmq`` connector.

>>> client = PullClient(cluster_key)                        # doctest: +SKIP
>>> data = await client.pull("tcp://10.0.0.2:5555", ref)    # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from typing import Any

from omniflow._exceptions import DataError
from omniflow.data._ref import DataRef
from omniflow.transport._auth import Opener, PlainOpener, WireStats
from omniflow.transport._dealers import Dealers
from omniflow.transport._protocol import (
    Batch,
    ProtocolError,
    Pull,
    Pulled,
    PullFailed,
    decode_inner,
    decode_msg,
    encode_msg,
)

__all__ = ["PullClient"]


def _lost_error(address: str, ref: DataRef) -> DataError:
    return DataError(
        f"cannot pull {ref.key} ({ref.nbytes:,} bytes): its producer at {address} (pid "
        f"{ref.pid}) was lost, and its pool with it"
    )


# Not data/kv/_pull.PullClient (both sit on transport/_dealers.Dealers): blocks ride the worker
# protocol (counted ids, a lost producer fails its pulls); pages cross pools (nonces, deadlines).
class PullClient:
    """Pulls blocks from producers on other hosts over the control transport (DEALER side).

    One connection per producer address; requests carry an id and the producer answers
    ``pulled {r, data}`` with the block's bytes as an out-of-band frame. A producer that dies
    never answers (ZMQ just reconnects), so the front reports lost producers (``lost``): their
    pulls in flight fail at once, and so does any later pull of a block they made.
    """

    def __init__(self, key: bytes, stats: WireStats | None = None) -> None:
        #: Replies are authenticated with the cluster key before anything is decoded.
        self._opener = Opener(key, stats)
        #: What comes over a connection that proved the key (a uds:// producer) is not sealed.
        self._plain = PlainOpener(self._opener.stats)
        #: One connection, sealer and reader per producer address (authenticated where the
        #: producer's transport can: it is a worker's endpoint, bound with the key).
        self._dealers = Dealers(key, self._read, authenticate=True)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        #: Request id -> (address, pid) of the producer it waits on.
        self._asked: dict[int, tuple[str, int]] = {}
        #: Producers known to be gone, as (address, pid): a restarted one has a new pid.
        self._lost: set[tuple[str, int]] = set()
        self._ids = iter(range(1, 1 << 62))

    async def pull(self, address: str, ref: DataRef) -> bytes | memoryview:
        if (address, ref.pid) in self._lost:
            raise _lost_error(address, ref)
        ep, sealer = self._dealers.get(address)
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self._asked[rid] = (address, ref.pid)
        try:
            await ep.send(sealer.seal(encode_msg(Pull(rid, ref.handle))))
            data: bytes | memoryview = await fut
            return data
        except DataError as exc:
            if (address, ref.pid) in self._lost:
                raise _lost_error(address, ref) from exc
            raise
        finally:
            self._waiting.pop(rid, None)
            self._asked.pop(rid, None)

    def lost(self, address: str, pid: int) -> None:
        """The producer at ``address`` (process ``pid``) is gone: fail its pulls, now and later."""
        self._lost.add((address, pid))
        for rid, where in list(self._asked.items()):
            fut = self._waiting.get(rid)
            if where == (address, pid) and fut is not None and not fut.done():
                fut.set_exception(DataError(f"producer {address} (pid {pid}) was lost"))

    async def _read(self, _address: str, ep: Any) -> None:
        from omniflow._exceptions import RuntimeClosedError

        opener = self._plain if ep.authenticated else self._opener
        while True:
            try:
                _peer, frames = await ep.recv()
            except (RuntimeClosedError, asyncio.CancelledError):
                return
            inner = opener.open(frames)
            if inner is None:
                continue  # counted by the opener
            try:
                # The block's bytes stay a view of the received frame: decode_block makes the
                # one private copy (an owned decode here would copy 64 MiB twice).
                msg = decode_msg(inner, owned=False)
            except ProtocolError as exc:
                self._opener.stats.drop(exc.reason)
                continue
            if type(msg) is Batch:  # small answers the producer had ready together
                for m in msg.messages:
                    try:
                        self._answer(decode_inner(m))
                    except ProtocolError as exc:
                        self._opener.stats.drop(exc.reason)
            else:
                self._answer(msg)

    def _answer(self, msg: Any) -> None:
        """A producer's answer to one pull."""
        match msg:
            case Pulled(request=r, data=data) if isinstance(data, bytes | memoryview):
                fut = self._waiting.get(r)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            case PullFailed(request=r, error=error):
                fut = self._waiting.get(r)
                if fut is not None and not fut.done():
                    fut.set_exception(DataError(f"pull failed: {error}"))
            case _:
                self._opener.stats.drop("unknown_kind")

    def close(self) -> None:
        self._dealers.close()
