"""The three connectors a consumer resolves a ``DataRef`` through (``_plane``), and the node
identity that decides which one works.

>>> ref = DataRef(handle, HOST, os.getpid(), "", ("a", "c1", "b", "0:0"))  # doctest: +SKIP
>>> choose_connector(ref)                                                # doctest: +SKIP
'inproc'

    inproc  same process: the producer's own object, zero-copy
    shm     same host: the producer's slab mapped copy-on-write, a zero-copy writable view
    zmq     another host: pulled from the producer on demand (``PullFn``, ``_pull.PullClient``)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from omniflow._exceptions import DataError, DataTimeoutError
from omniflow._media import Audio, Image
from omniflow.data._attach import PoolAttachment
from omniflow.data._handle import BlockHandle
from omniflow.data._pool import SharedBufferPool
from omniflow.data._ref import DataRef

__all__ = [
    "HOST",
    "Connector",
    "InprocConnector",
    "PullFn",
    "ShmConnector",
    "ZmqConnector",
    "as_media",
    "choose_connector",
    "decode_block",
    "set_node_id",
]

#: This process's node identity: refs it produces carry it, and a ref from another node is
#: pulled (zmq) rather than mapped (shm). The host name, unless a cluster manager names nodes
#: (``set_node_id``: a Ray actor takes its Ray node id, so simulated nodes on one machine
#: behave like separate hosts).
HOST = socket.gethostname()


def set_node_id(node_id: str) -> None:
    """Name the node this process runs on (call before its data plane produces refs)."""
    global HOST
    HOST = node_id


def choose_connector(ref: DataRef, wanted: str = "auto") -> str:
    """The connector a consumer here uses for ``ref``; raises if ``wanted`` cannot work."""
    same_proc = ref.pid == os.getpid() and ref.host == HOST
    same_host = ref.host == HOST
    if wanted == "auto":
        return "inproc" if same_proc else "shm" if same_host else "zmq"
    if wanted == "inproc" and not same_proc:
        raise DataError(f"connector 'inproc' cannot reach {ref.key}: producer is another process")
    if wanted == "shm" and not same_host:
        raise DataError(f"connector 'shm' cannot reach {ref.key}: producer is on {ref.host}")
    return wanted


class Connector(ABC):
    """The RFC's connector API; keys are (from_node, to_node, request_id, payload_key)."""

    name: ClassVar[str]

    @abstractmethod
    def put(
        self, from_node: str, to_node: str, request_id: str, payload_key: str, value: Any
    ) -> DataRef: ...

    @abstractmethod
    async def get(self, ref: DataRef, *, timeout: float | None = None) -> Any: ...

    @abstractmethod
    def cleanup(self, request_id: str) -> int: ...

    @abstractmethod
    def health(self) -> dict[str, Any]: ...


class ShmConnector(Connector):
    """Producer side: a pool owned by this process. Consumer side: attach by name."""

    name = "shm"

    def __init__(self, pool_factory: Callable[[], SharedBufferPool], source: str = "") -> None:
        self._pool_factory = pool_factory
        self._pool: SharedBufferPool | None = None
        self._attached: dict[str, PoolAttachment] = {}
        self.source = source
        #: Node identity of the refs put here (None: this process's ``HOST``); a front placed
        #: by Ray names the Ray node it runs on, so same-node actors map its blocks.
        self.host: str | None = None

    @property
    def pool(self) -> SharedBufferPool:
        if self._pool is None:
            self._pool = self._pool_factory()
        return self._pool

    def put(
        self, from_node: str, to_node: str, request_id: str, payload_key: str, value: Any
    ) -> DataRef:
        pool = self.pool
        media: tuple[Any, ...] = ()
        if type(value) is Audio:
            media, value = ("audio", value.sample_rate), value.samples
        elif type(value) is Image:
            media, value = ("image",), value.pixels
        if isinstance(value, bytes | bytearray | memoryview):
            view = memoryview(value).cast("B")
            handle = pool.alloc(view.nbytes, owner=request_id)
            pool.view(handle)[:] = view
        elif hasattr(value, "data_ptr"):
            handle = pool.put_tensor(value, owner=request_id)
        else:
            handle = pool.put_array(value, owner=request_id)
        return DataRef(handle, self.host or HOST, os.getpid(), self.source,
                       (from_node, request_id, to_node, payload_key), media)  # fmt: skip

    def read(self, ref: DataRef, *, copy: bool) -> Any:
        value = self._read(ref, copy=copy)
        return as_media(ref, value) if ref.media else value

    def _read(self, ref: DataRef, *, copy: bool) -> Any:
        h = ref.handle
        if self._pool is not None and h.pool == self._pool.name:
            io: Any = self._pool
        else:
            # Another process's slab, mapped copy-on-write: what a consumer gets is writable
            # like the producer's value, without a copy until it writes (then only the pages
            # it writes become its own; the producer's block never changes).
            io = self._attached.get(h.pool)
            if io is None:
                io = self._attached[h.pool] = PoolAttachment(h.pool, private=True)
            if h.kind == "numpy":
                return io.get_array(h, copy=copy, writable=True)
            if h.kind == "torch":
                return io.get_tensor(h, copy=copy)
            return bytes(io.view(h))  # the type a producer's bytes have
        if h.kind == "numpy":
            return io.get_array(h, copy=copy)
        if h.kind == "torch":
            return io.get_tensor(h, copy=copy)
        view = io.view(h)
        return bytes(view) if copy else view.toreadonly()

    async def get(self, ref: DataRef, *, timeout: float | None = None) -> Any:
        return self.read(ref, copy=False)

    def release(self, ref: DataRef) -> None:
        if self._pool is not None:
            with contextlib.suppress(DataError):
                self._pool.release(ref.handle, owner=ref.key[1])

    def cleanup(self, request_id: str) -> int:
        if self._pool is None:
            return 0
        return self._pool.release_owner(request_id)

    def health(self) -> dict[str, Any]:
        stats = self._pool.statistics() if self._pool is not None else {}
        return {"ok": True, "pool": self._pool.name if self._pool else None, **stats}

    def close(self) -> None:
        for att in self._attached.values():
            att.close()
        self._attached.clear()
        if self._pool is not None:
            self._pool.close()


class InprocConnector(Connector):
    """Zero-copy hand-off of the producer's own object within one process."""

    name = "inproc"

    def __init__(self) -> None:
        self._objects: dict[tuple[str, str, str, str], Any] = {}

    def keep(self, ref: DataRef, value: Any) -> None:
        self._objects[ref.key] = value

    def put(
        self, from_node: str, to_node: str, request_id: str, payload_key: str, value: Any
    ) -> DataRef:
        raise DataError("InprocConnector.put needs a block: use DataPlane.put")

    def lookup(self, ref: DataRef) -> Any:
        try:
            return self._objects[ref.key]
        except KeyError:
            raise DataError(f"no in-process object for {ref.key}") from None

    async def get(self, ref: DataRef, *, timeout: float | None = None) -> Any:
        return self.lookup(ref)

    def forget(self, ref: DataRef) -> None:
        self._objects.pop(ref.key, None)

    def cleanup(self, request_id: str) -> int:
        keys = [k for k in self._objects if k[1] == request_id]
        for k in keys:
            del self._objects[k]
        return len(keys)

    def health(self) -> dict[str, Any]:
        return {"ok": True, "objects": len(self._objects)}


#: Sends ``(address, ref)`` to the producer and returns its reply frames (the block's bytes).
PullFn = Callable[[str, DataRef], Awaitable[bytes | memoryview]]


class ZmqConnector(Connector):
    """Consumer side of a cross-host edge: pull the block's bytes from the producer."""

    name = "zmq"

    def __init__(self, shm: ShmConnector, pull: PullFn) -> None:
        self._shm = shm
        self._pull = pull

    def put(
        self, from_node: str, to_node: str, request_id: str, payload_key: str, value: Any
    ) -> DataRef:
        return self._shm.put(from_node, to_node, request_id, payload_key, value)

    async def get(self, ref: DataRef, *, timeout: float | None = None) -> Any:
        if not ref.source:
            raise DataError(f"cannot pull {ref.key}: its producer serves no pulls")
        try:
            data = await asyncio.wait_for(self._pull(ref.source, ref), timeout)
        except TimeoutError:
            raise DataTimeoutError(
                f"pulling {ref.key} ({ref.nbytes:,} bytes) from {ref.source} took longer than "
                f"{timeout} s"
            ) from None
        value = decode_block(ref.handle, data)
        return as_media(ref, value) if ref.media else value

    def cleanup(self, request_id: str) -> int:
        return self._shm.cleanup(request_id)

    def health(self) -> dict[str, Any]:
        return {"ok": True}


def as_media(ref: DataRef, array: Any) -> Any:
    """The media value a block's array was the payload of (``ref.media``)."""
    match ref.media:
        case ("audio", int(rate)):
            return Audio(array, sample_rate=rate)
        case ("image",):
            return Image(array)
    raise DataError(f"{ref.key}: unknown media tag {ref.media!r}")


def decode_block(handle: BlockHandle, data: bytes | memoryview) -> Any:
    """Rebuild a pulled block's value (a private copy) from its bytes."""
    from omniflow.data import _handle

    view = memoryview(bytearray(data))
    if handle.kind == "numpy":
        return _handle.read_array(view, handle, copy=False, writable=True)
    if handle.kind == "torch":
        return _handle.read_tensor(view, handle, copy=False)
    return bytes(view)
