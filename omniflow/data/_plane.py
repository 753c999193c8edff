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

import os
from collections.abc import Mapping
from typing import Any

from omniflow._exceptions import DataError, PoolExhaustedError
from omniflow._media import Audio, Image
from omniflow.data._connectors import (
    Connector,
    InprocConnector,
    PullFn,
    ShmConnector,
    ZmqConnector,
    choose_connector,
    set_node_id,
)
from omniflow.data._handle import BlockHandle
from omniflow.data._pool import SharedBufferPool
from omniflow.data._pull import PullClient
from omniflow.data._ref import CONNECTORS, DataRef

__all__ = [
    "CONNECTORS",
    "DEFAULT_THRESHOLD",
    "STATISTICS_KEYS",
    "Connector",
    "DataPlane",
    "DataRef",
    "InprocConnector",
    "PullClient",
    "ShmConnector",
    "ZmqConnector",
    "choose_connector",
    "set_node_id",
]

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

    def resolve_now(self, value: Any, connectors: Mapping[str, str] | None = None) -> Any:
        """An input value (a ref, or a collected list or tuple holding refs) with each ref
        read (``read_now``) through the connector ``connectors`` names for its producing node
        ("auto" for one it does not name); any other value as it is. The front's shell and
        the workers resolve inputs with this and ``resolve``."""
        if type(value) is DataRef:
            return self.read_now(value, _connector(value, connectors))
        if type(value) is list or type(value) is tuple:
            items = [
                self.read_now(v, _connector(v, connectors)) if type(v) is DataRef else v
                for v in value
            ]
            return items if type(value) is list else tuple(items)
        return value

    async def resolve(self, value: Any, connectors: Mapping[str, str] | None = None) -> Any:
        """``resolve_now`` that also pulls refs from other hosts (``get``)."""
        if type(value) is DataRef:
            return await self.get(value, _connector(value, connectors))
        if type(value) is list or type(value) is tuple:
            items = [await self.resolve(v, connectors) for v in value]
            return items if type(value) is list else tuple(items)
        return value

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


def _connector(ref: DataRef, connectors: Mapping[str, str] | None) -> str:
    """The connector an edge asked for its producer's refs (``Runtime(connectors=...)``)."""
    return "auto" if connectors is None else connectors.get(ref.key[0], "auto")


async def _no_pull(address: str, ref: DataRef) -> bytes:
    raise DataError(f"this process cannot pull {ref.key} from {address}: no transport")
