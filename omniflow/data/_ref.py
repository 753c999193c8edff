"""What a control message carries instead of a big value: a :class:`DataRef` to a block in its
producer's pool. No sockets, no pools: the call core and placement planning import this
module, not the data plane (``_plane``) that moves the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniflow.data._handle import BlockHandle

__all__ = ["CONNECTORS", "DataRef", "refs_in"]

#: Connector names an edge may ask for.
CONNECTORS = ("auto", "inproc", "shm", "zmq")


@dataclass(frozen=True, slots=True)
class DataRef:
    """What a control message carries instead of a big value."""

    #: The block in the producer's pool (dtype and shape included).
    handle: BlockHandle
    #: Host and process of the producer (connector choice: inproc / shm / zmq).
    host: str
    pid: int
    #: Where the producer answers pulls (its worker address); "" for the front.
    source: str
    #: (from node, call id, field, payload key): the RFC's key, minus the consumer (one block
    #: serves every consumer edge; each edge holds a reference).
    key: tuple[str, str, str, str]
    #: What the block's array is the payload of: ``()`` (the array itself), ``("audio",
    #: sample_rate)`` for an ``of.Audio``'s samples, ``("image",)`` for an ``of.Image``'s pixels.
    media: tuple[Any, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes


def refs_in(value: Any) -> list[DataRef]:
    """DataRefs in a kwargs value (the value itself, or the items of a collected list)."""
    if type(value) is DataRef:
        return [value]
    if type(value) is list or type(value) is tuple:
        return [v for v in value if type(v) is DataRef]
    return []
