"""The client side of a sealed request/answer protocol: one DEALER per peer address.

A client that asks peers and matches their answers (the data plane's block pulls, the KV
pools' page pulls) keeps, per peer address, one connected endpoint, one ``Sealer`` (each
connection's sends are in seal order) and one reader task that gets the answers; ``Dealers``
holds the three and closes them together.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Coroutine
from typing import Any

from omniflow.transport._auth import PlainSealer, Sealer, sealer_for
from omniflow.transport._base import Endpoint, connect

__all__ = ["Dealers"]

#: ``read(address, endpoint)``: the reader task of one connection (returns when it closes).
Reader = Callable[[str, Endpoint], Coroutine[Any, Any, None]]


class Dealers:
    """Per peer address: a connected endpoint, a sealer under the current key, a reader task.

    ``random_identity``: connect with 8 random bytes as the DEALER identity (else the
    transport's own). ``authenticate``: connect with the key (``connect(key=)``), for peers
    bound with it; a connection that is then authenticated sends unsealed (``PlainSealer``).
    """

    def __init__(
        self,
        key: bytes,
        read: Reader,
        *,
        random_identity: bool = False,
        authenticate: bool = False,
    ) -> None:
        self._key = key
        self._authenticate = authenticate
        self._read = read
        self._random_identity = random_identity
        self._conns: dict[str, Endpoint] = {}
        self._sealers: dict[str, Sealer | PlainSealer] = {}
        self._readers: list[asyncio.Task[None]] = []

    def get(self, address: str) -> tuple[Endpoint, Sealer | PlainSealer]:
        """The endpoint and sealer for ``address``, connecting (and starting its reader) on
        first use; call from the event loop."""
        ep = self._conns.get(address)
        if ep is None:
            identity = secrets.token_bytes(8) if self._random_identity else None
            key = self._key if self._authenticate else None
            ep = self._conns[address] = connect(address, identity=identity, key=key)
            self._readers.append(asyncio.get_running_loop().create_task(self._read(address, ep)))
        sealer = self._sealers.get(address)
        if sealer is None:
            sealer = self._sealers[address] = sealer_for(ep, self._key)
        return ep, sealer

    def rekey(self, key: bytes) -> None:
        """Seal under ``key`` from now on (new sealers; the connections stay)."""
        self._key = key
        self._sealers.clear()

    def close(self) -> None:
        """Cancel the readers and close every connection."""
        for task in self._readers:
            task.cancel()
        for ep in self._conns.values():
            ep.close()
        self._conns.clear()
