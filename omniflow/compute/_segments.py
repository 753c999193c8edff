"""Segmented input: a request whose prompt arrives one segment at a time (paper §5.1).

>>> # rid = await engine.open(GenerateRequest(embeds=[image_rows], session="s1"))
>>> # engine.feed(rid, more_rows); engine.feed(rid, text_ids, last=True)
>>> # async for out in engine.outputs(rid): ...

The prefix-matching role yields one frame per modal segment; the LLM role feeds each to the
engine as it arrives, so segment k is prefilled while the encoder still works on segment k+1.
Segments are validated when fed (on the caller's task) and join the sequence between steps on
the engine loop, so a step never sees a sequence change under it. While the input is open the
sequence prefills all it has but its last token; closing the input lets that token be computed
with sampling, and decoding goes on as for any request.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

import torch

from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import EngineError, RequestError
from omniflow.compute._inputs import _check_ids, _check_rows
from omniflow.compute._sequence import EMBED

if TYPE_CHECKING:
    from omniflow.compute._stream import Stream

__all__ = ["SegmentFeeds", "split_segment"]


class Engine(Protocol):
    """What the feeds need of their engine (``TorchEngine``): cancel a stream, wake its loop."""

    _wake: asyncio.Event

    def _cancel(self, stream: Stream) -> None: ...


def split_segment(segment: Any) -> list[Any]:
    """A segment as a list of parts: token-id lists and 2-D tensors."""
    if isinstance(segment, torch.Tensor):
        return [segment]
    if isinstance(segment, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in segment
    ):
        return [list(segment)] if segment else []
    if isinstance(segment, list | tuple):
        return list(segment)
    raise RequestError(
        f"a segment is token ids, a (n, hidden) tensor or a list of those; got "
        f"{type(segment).__name__}",
        field="segment",
    )


class _Open:
    __slots__ = ("closed", "length", "stream", "timeout", "timer")

    def __init__(self, stream: Stream, timeout: float) -> None:
        self.stream = stream
        self.length = len(stream.seq.tokens)  #: tokens after every segment fed so far
        self.closed = False  #: the last segment was fed
        self.timeout = timeout
        self.timer: asyncio.TimerHandle | None = None


class SegmentFeeds:
    """The engine's open requests and the segments waiting to join them."""

    def __init__(self, engine: Engine, cfg: ModelConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self._open: dict[str, _Open] = {}
        self._pending: list[tuple[Stream, list[int], dict[int, torch.Tensor], bool]] = []

    def watch(self, stream: Stream, timeout: float) -> None:
        if timeout <= 0:
            raise RequestError("idle_timeout must be > 0 seconds", field="idle_timeout")
        entry = self._open[stream.seq.request_id] = _Open(stream, timeout)
        self._arm(entry)

    def _arm(self, entry: _Open) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        loop = asyncio.get_running_loop()
        entry.timer = loop.call_later(entry.timeout, self._expire, entry)

    def _expire(self, entry: _Open) -> None:
        rid = entry.stream.seq.request_id
        self._open.pop(rid, None)
        if entry.stream.closed:
            return
        entry.stream.fail(
            EngineError(
                f"request {rid!r}: no segment fed and no reader for {entry.timeout:g} s; "
                "aborted (its producer is gone) and its pages freed"
            )
        )
        self.engine._cancel(entry.stream)
        self.engine._wake.set()

    def reading(self, request_id: str) -> None:
        """A reader took the outputs: from now on leaving its iterator aborts the request."""
        entry = self._open.get(request_id)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def feed(self, request_id: str, segment: Any, *, last: bool) -> int:
        entry = self._open.get(request_id)
        if entry is None or entry.stream.closed:
            raise RequestError(
                f"request {request_id!r} has no open input (unknown, finished, aborted or "
                "never opened with engine.open)",
                field="request_id",
            )
        if entry.closed:
            raise RequestError(
                f"request {request_id!r}: its last segment was already fed", field="segment"
            )
        tokens: list[int] = []
        embeds: dict[int, torch.Tensor] = {}
        for i, part in enumerate(split_segment(segment)):
            if isinstance(part, torch.Tensor):
                rows = _check_rows(part, self.cfg, i)
                embeds[entry.length + len(tokens)] = rows
                tokens.extend([EMBED] * rows.shape[0])
            elif isinstance(part, list | tuple):
                tokens.extend(_check_ids(list(part), self.cfg, f"segment[{i}]", allow_embed=False))
            else:
                raise RequestError(
                    f"segment[{i}] is a {type(part).__name__}; expected token ids or a tensor",
                    field="segment",
                )
        entry.length += len(tokens)
        entry.closed = last
        self._pending.append((entry.stream, tokens, embeds, last))
        if entry.timer is not None:
            self._arm(entry)
        self.engine._wake.set()
        return entry.length

    def apply(self) -> None:
        """Join the fed segments to their sequences (the loop calls this between steps)."""
        if self._pending:
            pending, self._pending = self._pending, []
            for stream, tokens, embeds, last in pending:
                if stream.closed:
                    continue  # aborted meanwhile
                stream.seq.extend(tokens, embeds)
                if last:
                    stream.seq.input_open = False
        if self._open:  # forget finished requests, and closed inputs that have their reader
            open_ = self._open.items()
            done = [r for r, e in open_ if e.stream.closed or (e.closed and e.timer is None)]
            for rid in done:
                entry = self._open.pop(rid)
                if entry.timer is not None:
                    entry.timer.cancel()
