"""A request's outbox: how an engine's step loop hands outputs to the request's ``generate``.

>>> async def demo() -> list[object]:
...     box = Outbox("seq-1")
...     box.push("a")
...     return [await box.next()]
>>> asyncio.run(demo())
['a']

``EngineBase`` (``_base``) needs only ``StreamLike``; ``Outbox`` is the plainest one (the
DiT's), and ``_stream.Stream`` the LLM's (it also detokenizes).
"""

from __future__ import annotations

import asyncio
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Outbox", "StreamLike"]

SeqT = TypeVar("SeqT")


class StreamLike(Protocol):
    """A request's outbox, as the base loop sees it (``_stream.Stream`` for the LLM)."""

    seq: Any  #: the engine's record (``request_id``, ``finish_reason``)
    closed: bool  #: no more outputs will be computed
    final: Any  #: the last output, delivered after the pages are released/published
    released: asyncio.Event  #: set once the pool slots are released

    def push(self, out: Any) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    async def next(self) -> Any: ...


class Outbox(Generic[SeqT]):
    """The plainest ``StreamLike``: outputs queued as the loop pushes them (the DiT's)."""

    __slots__ = ("_queue", "closed", "final", "released", "seq")

    def __init__(self, seq: SeqT) -> None:
        self.seq = seq  #: the engine's record
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False  #: no more outputs will be computed
        self.final: Any = None  #: the last output, delivered after the pins are released
        self.released = asyncio.Event()  #: set once the pool slots are released

    def push(self, out: Any) -> None:
        self._queue.put_nowait(out)

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    async def next(self) -> Any:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item
