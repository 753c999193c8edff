"""The one exception tree of omniflow.

    OmniflowError
    ├── GraphError          a graph declaration or plan is invalid (raised before serving)
    ├── InputError          a call names an unknown graph or misses a Placeholder (ValueError)
    │   └── MediaError          an of.Audio / of.Image value or its bytes are malformed
    ├── NodeError           a node failed, was cancelled, or broke a runtime rule during a call
    ├── RuntimeClosedError  a Runtime (or pool, server) was used outside its lifetime
    ├── StartError          a Runtime could not start: a role's setup() failed or its process died
    ├── TransportError      a message could not be encoded, sent or received
    │   ├── CodecError          a message is malformed, truncated or of another wire version
    │   └── ProtocolError       a decoded message breaks the protocol (transport/_protocol.py)
    ├── RegistryError       the service registry is unreachable or inconsistent
    ├── DataError           the data plane could not place, find or deliver a buffer
    │   ├── DataTimeoutError    a connector ``get`` passed its deadline
    │   ├── PoolExhaustedError  a buffer pool cannot fit a block, even after evicting idle cache
    │   └── InvalidBlockError   a handle or offset names no live block, or a release goes below 0
    ├── EngineError         an engine cannot start or serve a request (compute/_errors.py)
    │   ├── ModelLoadError      a checkpoint cannot be loaded as written (a tensor, a field)
    │   ├── RequestError        a GenerateRequest the engine cannot honour
    │   └── EngineProcessError  an engine's own process failed
    ├── ForkServerError     the fork server refused or lost a worker (cluster/_forkserver.py)
    ├── ReplicaStateError   a replica moved between states it cannot (cluster/_replica.py)
    ├── ValueEncodingError  a value cannot be written as JSON for the HTTP edge (serve/_codec.py)
    ├── ValueDecodingError  a JSON value of a request cannot be read back (serve/_codec.py)
    └── _Unsendable         a worker's frame cannot be sent; it fails the activation (_worker_held)

Every exception carries structured fields and survives pickling, so an error raised in a worker
process reaches the caller intact.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CodecError",
    "DataError",
    "DataTimeoutError",
    "GraphError",
    "InputError",
    "InvalidBlockError",
    "MediaError",
    "NodeError",
    "OmniflowError",
    "PoolExhaustedError",
    "RegistryError",
    "RuntimeClosedError",
    "StartError",
    "TransportError",
]


class OmniflowError(Exception):
    """Root of every error omniflow raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[OmniflowError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls)
    Exception.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class GraphError(OmniflowError):
    """A graph declaration or its static plan is invalid.

    >>> raise GraphError("node 'vit.encode': input 'image' has no producer", graph="t2i")
    """

    def __init__(
        self,
        message: str,
        *,
        graph: str | None = None,
        node: str | None = None,
        field: str | None = None,
    ) -> None:
        # Name the graph unless the message already does ("graph output 'x'" does not).
        prefix = (
            f"graph '{graph}': " if graph and not message.startswith(f"graph '{graph}'") else ""
        )
        super().__init__(prefix + message)
        self.graph = graph
        self.node = node
        self.field = field


class InputError(OmniflowError, ValueError):
    """A call was made with an unknown graph or without a required Placeholder."""

    def __init__(self, message: str, *, graph: str | None = None, field: str | None = None):
        super().__init__(message)
        self.graph = graph
        self.field = field


class MediaError(InputError):
    """An ``of.Audio`` or ``of.Image`` was given samples, pixels or bytes it cannot hold.

    ``field`` names the part (``"samples"``, ``"pixels"``, ``"audio"``, ``"image"``, or the
    request part the server decoded), so a server answers 400 naming it.

    >>> err = MediaError("of.Image: pixels must be uint8, got float32", field="pixels")
    >>> err.field
    'pixels'
    """


class NodeError(OmniflowError):
    """A node of a running call failed (``kind="error"``) or was cancelled (``kind="cancel"``).

    >>> err = NodeError("vit.encode", "boom", kind="error")
    >>> err.node, err.kind
    ('vit.encode', 'error')
    """

    def __init__(
        self,
        node: str,
        message: str,
        *,
        kind: str = "error",
        field: str | None = None,
        call_id: str | None = None,
        graph: str | None = None,
        exc_type: str | None = None,
        traceback: str | None = None,
    ) -> None:
        super().__init__(f"node '{node}': {message}")
        self.node = node
        self.kind = kind
        self.message = message
        self.field = field
        self.call_id = call_id
        self.graph = graph
        self.exc_type = exc_type
        #: The formatted traceback of the exception the node raised (for server logs; never
        #: sent to HTTP clients). None for cancels and for errors omniflow itself detected.
        self.traceback: str | None = traceback

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form, used by the server and the worker protocol."""
        return {
            "node": self.node,
            "kind": self.kind,
            "message": self.message,
            "field": self.field,
            "exc_type": self.exc_type,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeError:
        return cls(
            data["node"],
            data["message"],
            kind=data.get("kind", "error"),
            field=data.get("field"),
            exc_type=data.get("exc_type"),
        )


class RuntimeClosedError(OmniflowError):
    """A lifecycle object (Runtime, server, pool) was used before start or after close."""


class StartError(OmniflowError):
    """A Runtime could not start: a role's ``setup()`` failed, its process died before it was
    ready, or a partner it is co-located with did (``rt.start()`` raises it and closes).

    >>> err = StartError("role 'dit' died during the barrier", roles=["llm"], replica="llm-0")
    >>> err.roles
    ['llm']
    """

    def __init__(
        self, message: str, *, roles: list[str] | None = None, replica: str | None = None
    ) -> None:
        super().__init__(message)
        #: The roles whose start failed (the replica's roles across processes).
        self.roles = list(roles or [])
        #: The replica that did not start, across processes (None in this process).
        self.replica = replica


class TransportError(OmniflowError):
    """A control or data message could not be encoded, sent or received.

    >>> err = TransportError("tcp://10.0.0.5:7000: connection refused", url="tcp://10.0.0.5:7000")
    >>> err.url
    'tcp://10.0.0.5:7000'
    """

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        #: The endpoint involved, when there is one.
        self.url = url


class CodecError(TransportError):
    """A received message is malformed, truncated, or was written by another wire version.

    Decoding raises only this, whatever the bytes, so a receive loop can count and skip it.
    """


class RegistryError(OmniflowError):
    """The service registry could not be reached or holds no replica for a role.

    >>> err = RegistryError("role 'llm' has no live replica", role="llm")
    >>> err.role
    'llm'
    """

    def __init__(self, message: str, *, role: str | None = None, url: str | None = None) -> None:
        super().__init__(message)
        #: The role concerned, when there is one.
        self.role = role
        #: The registry URL (``redis://...``) for backend errors.
        self.url = url


class DataError(OmniflowError):
    """The data plane could not allocate, find or deliver a buffer."""


class DataTimeoutError(DataError, TimeoutError):
    """A connector ``get`` did not see its payload before the deadline."""


class PoolExhaustedError(DataError):
    """A buffer pool could not fit ``requested`` bytes, even after evicting every idle cached block.

    >>> err = PoolExhaustedError("pool 'p': cannot allocate", pool="p", requested=4096)
    >>> err.requested
    4096
    """

    def __init__(
        self,
        message: str,
        *,
        pool: str | None = None,
        requested: int = 0,
        free: int = 0,
        largest_free: int = 0,
        capacity: int = 0,
    ) -> None:
        super().__init__(message)
        self.pool = pool
        self.requested = requested
        self.free = free
        self.largest_free = largest_free
        self.capacity = capacity


class InvalidBlockError(DataError):
    """A handle or byte offset names no live block of a pool, or a release would go below zero.

    >>> err = InvalidBlockError("pool 'p': block #3 was freed", pool="p", block_id=3)
    >>> err.block_id
    3
    """

    def __init__(
        self,
        message: str,
        *,
        pool: str | None = None,
        block_id: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.pool = pool
        self.block_id = block_id
        self.offset = offset
