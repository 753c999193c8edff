"""A graph call as the caller sees it: an async stream of Frames with a final status.

>>> call = rt.call("t2i", {"request": req}, session="s1")      # doctest: +SKIP
>>> async for frame in call:                                   # doctest: +SKIP
...     print(frame.field, frame.value, frame.node, frame.seq)
>>> call.status, call.errors                                   # doctest: +SKIP
('ok', [])
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from omniflow._exceptions import NodeError

if TYPE_CHECKING:
    from omniflow.runtime._params import SessionParams
    from omniflow.runtime.callcore._core import Activation, CallCore

__all__ = ["Call", "Frame"]


class Owner(Protocol):
    """What a call needs of the runtime that runs it (``runtime._runtime.Runtime``)."""

    #: GlobalParameters factories by name (a call without a session builds its own).
    _factories: Any
    #: The runtime's Params Pools by name, read-only (``of.context().pools``).
    _pool_view: Any
    #: Undelivered frames above which a stream producer waits for the reader.
    stream_high_water: int

    def _cancel_call(self, call: Call) -> None: ...


@dataclass(frozen=True, slots=True)
class Frame:
    """One value of one output field, as it reaches the caller."""

    #: Output field name.
    field: str
    #: The value the node produced.
    value: Any
    #: Node that produced it.
    node: str
    #: Position of the frame in its originating stream (SeqId).
    seq: int


class Call:
    """A running (or finished) graph call. Iterate it for frames; ``cancel()`` to stop it."""

    def __init__(
        self,
        runtime: Owner,
        graph: str,
        call_id: str,
        inputs: dict[str, Any],
        session: str | None,
    ) -> None:
        self._rt = runtime
        #: The caller's context at ``rt.call``: each local activation runs in a copy of it.
        self._ctx = contextvars.copy_context()
        #: Graph name.
        self.graph = graph
        #: Unique id of this call within its runtime.
        self.call_id = call_id
        #: Session id, or None.
        self.session = session
        self._inputs: dict[str, Any] | None = inputs
        self._frames: deque[Frame] = deque()
        #: Takes frames in the producer's turn before they are queued (``deliver``), or None.
        self._sink: Callable[[list[Frame]], bool] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._done = asyncio.Event()
        #: The scheduling core while the call runs (None before start and after the end).
        self.core: CallCore | None = None
        #: The shell's side of the call (the core never sees these): activations handed out
        #: to run and not started yet, the task (or remote handle) of each suspended one, and
        #: start times while metrics are on.
        self._ready: deque[Activation] = deque()
        self._tasks: dict[Activation, Any] = {}
        self._t0: dict[Activation, float] = {}
        #: "pending", "running", then "ok" | "error" | "cancelled".
        self.status = "pending"
        #: Node errors of the call (kind "error" or "cancel").
        self.errors: list[NodeError] = []
        #: Activations that went DEAD although they had received frames (an input, or a
        #: latched value, never arrived): ``{"node", "field", "message"}`` each, in the order
        #: they were found. Filled when the call ends.
        self.warnings: list[dict[str, str]] = []
        #: Undelivered frames above which stream producers wait for the reader (backpressure
        #: applies only while someone iterates the call, so an unread call cannot deadlock).
        self.high_water = runtime.stream_high_water
        self._readers = 0
        self._space: asyncio.Future[None] | None = None
        #: The session's GlobalParameters (a call without a session gets its own on first use).
        self._params: SessionParams | None = None
        #: node -> coroutine method started inline by the runtime (set when the call starts).
        self._coros: dict[str, Any] = {}
        #: The deadline (``timeout=``): seconds, its timer while the call runs, and whether
        #: it fired (then the call ends "error").
        self._timeout: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False
        #: The release of the pages the call owned in the Params Pools, while it runs (set at
        #: the end, before ``_done``): the caller's view of the end waits for it.
        self._releasing: asyncio.Future[Any] | None = None

    def __repr__(self) -> str:
        return f"<Call {self.graph}#{self.call_id} session={self.session!r} {self.status}>"

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _push(self, frames: Sequence[tuple[str, Any, str, int]]) -> None:
        sink = self._sink
        if sink is not None and not self._frames:
            out = [_new_frame(f, v, n, s) for f, v, n, s in frames]
            if sink(out):
                return  # taken in the producer's turn: nothing queued, no reader to wake
            self._frames.extend(out)
        else:
            append = self._frames.append
            for f, v, n, s in frames:  # (``_new_frame``, inlined: once per frame delivered)
                fr = _alloc(Frame)
                _set_field(fr, f)
                _set_value(fr, v)
                _set_node(fr, n)
                _set_seq(fr, s)
                append(fr)
        self._wake()

    def deliver(self, sink: Callable[[list[Frame]], bool] | None) -> None:
        """Offer frames to ``sink`` as they arrive, before queueing them for the iterator.

        >>> call.deliver(lambda frames: write_now(frames))      # doctest: +SKIP

        ``sink(frames)`` runs synchronously in the producer's turn with the frames of one
        delivery; True: it took them (they never reach the iterator), False: they are queued
        and the iterator returns them as usual. It is offered frames only while nothing is
        queued, so the frames a caller gets, whichever way each goes, are in the call's order;
        a reader that takes frames from the iterator and has not finished writing them must
        make ``sink`` refuse until it has (else a later frame would overtake them). Queued
        frames count against ``high_water`` as before, so a sink that refuses while its
        consumer is slow keeps the producers' backpressure. The iterator still ends the
        stream. ``sink`` must not raise (it runs inside the runtime's delivery) and must not
        await. ``None`` removes it.
        """
        self._sink = sink

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _finish(self, status: str, errors: list[NodeError]) -> None:
        self._release_producers()
        self.status = status
        self.errors = errors
        if self.core is not None:
            self.warnings = list(self.core.warnings)
        self.core = None
        self._inputs = None
        self._sink = None
        self._done.set()
        self._wake()

    def __aiter__(self) -> _Frames:
        return _Frames(self)

    async def _settled(self) -> None:
        """Wait for the release of the call's pool pages (set by the runtime at the end), so
        that a caller who sees the end sees the pages unpinned too."""
        releasing = self._releasing
        if releasing is not None and not releasing.done():
            with contextlib.suppress(Exception):  # (the runtime logs a failed release)
                await asyncio.shield(releasing)

    def _left(self) -> None:
        """The caller left the stream before its end (break, exception, ``aclose``, task
        cancelled): cancel the call, and say so at once, before its methods have stopped."""
        self._readers -= 1
        self._release_producers()
        if not self._done.is_set():
            self._rt._cancel_call(self)
            if not self._done.is_set():
                self.status = "cancelled"

    @property
    def buffered(self) -> int:
        """Frames delivered to this call and not yet read: the next ``buffered`` frames of
        the iterator are taken without waiting (a writer may send them in one chunk)."""
        return len(self._frames)

    def _congested(self) -> bool:
        return self._readers > 0 and len(self._frames) >= self.high_water

    async def _wait_space(self) -> None:
        """A producer waits here while the reader is ``high_water`` frames behind."""
        if self._space is None:
            self._space = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._space)

    def _release_producers(self) -> None:
        space = self._space
        if space is not None:
            self._space = None
            if not space.done():
                space.set_result(None)

    async def cancel(self) -> None:
        """Cancel the call and wait until nothing of it is left."""
        self._rt._cancel_call(self)
        await self._done.wait()
        await self._settled()

    async def wait(self) -> str:
        """Wait for the end of the call (frames keep buffering); return the status."""
        await self._done.wait()
        await self._settled()
        return self.status

    async def collect(self) -> dict[str, list[Any]]:
        """All frames by field, after the call ended (does not raise on errors)."""
        out: dict[str, list[Any]] = {}
        async for frame in self:
            out.setdefault(frame.field, []).append(frame.value)
        return out


class _Frames:
    """One ``async for`` over a call. Leaving the loop early cancels the call *at once*:
    ``break`` or an exception drops the iterator, and dropping it cancels synchronously
    (an async generator would only be closed later, by the event loop's finalizer, so
    ``call.status`` would still say "running" right after the loop)."""

    __slots__ = ("_call", "_state")

    def __init__(self, call: Call) -> None:
        self._call = call
        #: _NEW until the first ``__anext__``, _READING, then _CLOSED.
        self._state = _NEW

    def __aiter__(self) -> _Frames:
        return self

    async def __anext__(self) -> Frame:
        call = self._call
        if self._state is not _READING:
            if self._state is _CLOSED:
                raise StopAsyncIteration
            self._state = _READING
            call._readers += 1
        while True:
            if call._frames:
                frame = call._frames.popleft()
                if call._space is not None and len(call._frames) <= call.high_water // 2:
                    call._release_producers()
                return frame
            if call._done.is_set():
                self._close()
                await call._settled()
                raise StopAsyncIteration
            call._waiter = asyncio.get_running_loop().create_future()
            try:
                await call._waiter
            except BaseException:
                self._close()  # the reading task was cancelled: that leaves the stream
                raise
            finally:
                call._waiter = None

    def _close(self) -> None:
        reading = self._state is _READING
        self._state = _CLOSED
        if reading:
            self._call._left()

    async def aclose(self) -> None:
        self._close()

    def __del__(self) -> None:
        if self._state is _READING:
            # Never raise from a finalizer (e.g. at interpreter exit).
            with contextlib.suppress(Exception):
                self._close()


_NEW, _READING, _CLOSED = "new", "reading", "closed"

_alloc = object.__new__
# The slot descriptors of Frame's fields (set once, on a new Frame, before anyone sees it).
_set_field, _set_value, _set_node, _set_seq = (
    vars(Frame)[name].__set__ for name in ("field", "value", "node", "seq")
)


def _new_frame(field: str, value: Any, node: str, seq: int) -> Frame:
    """``Frame(field, value, node, seq)`` without the frozen dataclass's four
    ``object.__setattr__`` calls (once per frame a caller receives)."""
    fr = _alloc(Frame)
    _set_field(fr, field)
    _set_value(fr, value)
    _set_node(fr, node)
    _set_seq(fr, seq)
    return fr
