"""Connectors and the per-process data plane: big values leave the control messages.

A frame value at or above ``threshold`` bytes (a numpy array, a torch tensor, bytes) is put
into the producing process's ``SharedBufferPool`` under the call as owner, and a small
``DataRef`` rides in the control message instead. A consumer resolves the ref through one of
three connectors (the RFC's put / get / cleanup / health):

    inproc  same process: the producer's own object, zero-copy
    shm     same host: the producer's slab mapped copy-on-write, a zero-copy writable view
    zmq     another host: pulled from the producer over ZMQ on demand (the producer never pushes)

The choice is per edge (``Runtime(connectors={...})``, default ``"auto"``: the cheapest one that
works). References: every consumer edge that receives a ref holds it (counted by the front's
call core); when the last holder finishes, the owner releases the block; when the call ends,
the owner drops whatever the call still holds (``cleanup``), so nothing of a finished call stays
in any pool, whether it ended ok, with an error, or cancelled.

Media values (``of.Audio``, ``of.Image``) always take the data plane, whatever their size
(contract §9: never inside a control message): their array goes into the block, the ref says
what it was (``DataRef.media``), and every connector hands the consumer the same kind of value
back (inproc: the producer's own object).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from omniflow._exceptions import DataError, DataTimeoutError, PoolExhaustedError
from omniflow._media import Audio, Image
from omniflow.data._attach import PoolAttachment
from omniflow.data._handle import BlockHandle
from omniflow.data._pool import SharedBufferPool
from omniflow.data._ref import CONNECTORS, DataRef
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

__all__ = [
    "CONNECTORS",
    "Connector",
    "DataPlane",
    "DataRef",
    "InprocConnector",
    "ShmConnector",
    "ZmqConnector",
    "choose_connector",
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


#: Values of at least this many bytes go through the data plane (256 KiB).
DEFAULT_THRESHOLD = 256 * 1024
#: Default capacity of a process's pool (fixed; a value that does not fit rides inline).
DEFAULT_CAPACITY = 256 * 2**20
#: Environment variable that overrides DEFAULT_CAPACITY (bytes) for every DataPlane created
#: without an explicit capacity; worker processes inherit it from the front that spawns them.
POOL_BYTES_ENV = "OMNIFLOW_POOL_BYTES"


def default_capacity() -> int:
    """Pool capacity from ``$OMNIFLOW_POOL_BYTES``, else DEFAULT_CAPACITY (256 MiB)."""
    raw = os.environ.get(POOL_BYTES_ENV)
    if not raw:
        return DEFAULT_CAPACITY
    try:
        value = int(raw)
    except ValueError:
        raise DataError(f"{POOL_BYTES_ENV}={raw!r} is not a number of bytes") from None
    if value <= 0:
        raise DataError(f"{POOL_BYTES_ENV}={raw!r} must be a positive number of bytes")
    return value


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


class DataPlane:
    """One process's data plane: offload big outputs, resolve refs, release and clean up."""

    def __init__(
        self,
        *,
        threshold: int = DEFAULT_THRESHOLD,
        capacity: int | None = None,
        source: str = "",
        pull: PullFn | None = None,
    ) -> None:
        #: Values of at least this many bytes are offloaded (unless ``offload`` says otherwise).
        self.threshold = threshold
        #: Bytes of the pool, created on first offload (``$OMNIFLOW_POOL_BYTES`` or 256 MiB).
        self.capacity = default_capacity() if capacity is None else capacity
        self.shm = ShmConnector(lambda: SharedBufferPool(self.capacity), source)
        self.inproc = InprocConnector()
        self.zmq = ZmqConnector(self.shm, pull or _no_pull)
        #: Values that did not fit the pool and rode the control message instead.
        self.fallbacks = 0
        #: Counters: values offloaded (and their bytes), reads per connector, pulls served.
        self.counts = dict.fromkeys(_COUNTS, 0)

    def is_big(self, value: Any, threshold: int | None = None) -> bool:
        """An ndarray, torch tensor or bytes of at least ``threshold`` bytes (and at least 1),
        or a non-empty media value (``of.Audio``, ``of.Image``: any size)."""
        limit = max(1, self.threshold if threshold is None else threshold)
        t = type(value)
        if t is bytes or t is bytearray:
            return len(value) >= limit
        if t is Audio:
            return len(value) > 0
        if t is Image:
            return True  # never empty
        mod = t.__module__
        if mod != "numpy" and not mod.startswith("torch"):
            return False  # (the common case, small plain values: decided without a lookup)
        nbytes = getattr(value, "nbytes", None)
        if nbytes is None and hasattr(value, "data_ptr"):
            nbytes = value.numel() * value.element_size()
        return isinstance(nbytes, int) and nbytes >= limit

    def offload(
        self, node: str, call_id: str, aid: int | str, yidx: int, frame: dict[str, Any],
        fields: frozenset[str] | set[str] | list[str], threshold: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """``frame`` with each big value of ``fields`` replaced by a DataRef in our pool.

        ``threshold`` overrides ``self.threshold`` for this frame (the front's setting, sent
        with each run message, so ``Runtime(data_threshold=...)`` holds in its workers too).
        """
        out = None
        is_big = self.is_big
        for f in fields:
            v = frame.get(f)
            if v is None or not is_big(v, threshold):
                continue
            try:
                ref = self.shm.put(node, f, call_id, f"{aid}:{yidx}", v)
            except PoolExhaustedError:
                self.fallbacks += 1  # too big for the pool now: it rides the control message
                continue
            self.inproc.keep(ref, v)
            self.counts["offloaded"] += 1
            self.counts["offloaded_bytes"] += ref.nbytes
            if out is None:
                out = dict(frame)
            out[f] = ref
        return frame if out is None else out

    def read_now(self, ref: DataRef, connector: str = "auto", *, copy: bool = False) -> Any:
        """Resolve without waiting (inproc / shm); raises for a ref that needs a pull."""
        kind = choose_connector(ref, connector)
        if kind == "inproc":
            self.counts["reads_inproc"] += 1
            return self.inproc.lookup(ref)
        if kind == "shm":
            self.counts["reads_shm"] += 1
            return self.shm.read(ref, copy=copy)
        raise DataError(f"{ref.key} lives on {ref.host}: it needs an async pull")

    def needs_pull(self, ref: DataRef, connector: str = "auto") -> bool:
        return choose_connector(ref, connector) == "zmq"

    async def get(
        self, ref: DataRef, connector: str = "auto", *, timeout: float | None = None
    ) -> Any:
        kind = choose_connector(ref, connector)
        if kind == "zmq":
            value = await self.zmq.get(ref, timeout=timeout)
            self.counts["pulls"] += 1
            self.counts["pulled_bytes"] += ref.nbytes
            return value
        return self.read_now(ref, kind)

    def serve_pull(self, handle: BlockHandle) -> memoryview:
        """The bytes of one of our blocks, for a consumer on another host."""
        view = self.shm.pool.view(handle)
        self.counts["pulls_served"] += 1
        return view

    def release(self, ref: DataRef) -> None:
        """The last consumer edge finished: free the block (we own it)."""
        self.inproc.forget(ref)
        self.shm.release(ref)

    def cleanup(self, call_id: str) -> int:
        """The call ended: drop every block and object it still holds here."""
        self.inproc.cleanup(call_id)
        if self.shm._pool is None:
            return 0
        return self.shm.cleanup(call_id)

    def statistics(self) -> dict[str, int]:
        """The pool (zeros until its first offload) and the counters (``_COUNTS``)."""
        pool = self.shm._pool
        stats = pool.statistics() if pool is not None else {}
        return {
            "pool_capacity_bytes": stats.get("capacity", 0),
            "pool_used_bytes": stats.get("used_bytes", 0),
            "pool_live_blocks": stats.get("live_blocks", 0),
            "pool_fallbacks": self.fallbacks,
            **self.counts,
        }

    def close(self) -> None:
        self.shm.close()


#: Counters of ``DataPlane.statistics()`` beside the pool's gauges: values this process put in
#: its pool (and their bytes); reads it resolved in process (inproc), by mapping a producer's
#: slab (shm) or by pulling (zmq, with the bytes pulled); pulls it answered as a producer.
_COUNTS = ("offloaded", "offloaded_bytes", "reads_inproc", "reads_shm", "pulls", "pulled_bytes",
           "pulls_served")  # fmt: skip
#: Every key of ``DataPlane.statistics()``.
STATISTICS_KEYS = ("pool_capacity_bytes", "pool_used_bytes", "pool_live_blocks", "pool_fallbacks",
                   *_COUNTS)  # fmt: skip


async def _no_pull(address: str, ref: DataRef) -> bytes:
    raise DataError(f"this process cannot pull {ref.key} from {address}: no transport")


def _lost_error(address: str, ref: DataRef) -> DataError:
    return DataError(
        f"cannot pull {ref.key} ({ref.nbytes:,} bytes): its producer at {address} (pid "
        f"{ref.pid}) was lost, and its pool with it"
    )


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
                for m in msg.ms:
                    try:
                        self._answer(decode_inner(m))
                    except ProtocolError as exc:
                        self._opener.stats.drop(exc.reason)
            else:
                self._answer(msg)

    def _answer(self, msg: Any) -> None:
        """A producer's answer to one pull."""
        match msg:
            case Pulled(r=r, data=data) if isinstance(data, bytes | memoryview):
                fut = self._waiting.get(r)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            case PullFailed(r=r, error=error):
                fut = self._waiting.get(r)
                if fut is not None and not fut.done():
                    fut.set_exception(DataError(f"pull failed: {error}"))
            case _:
                self._opener.stats.drop("unknown_kind")

    def close(self) -> None:
        self._dealers.close()
