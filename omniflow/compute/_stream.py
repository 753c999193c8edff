"""Delivery of one request's outputs: text deltas, stop strings, the queue its caller reads.

>>> # stream.on_token(token_id, finish_reason) -> StepOutput
"""

from __future__ import annotations

from omniflow.compute._outbox import Outbox
from omniflow.compute._request import StepOutput
from omniflow.compute._sampling import StopWatch
from omniflow.compute._sequence import Sequence
from omniflow.compute._tokenizer import Detokenizer, Tokenizer

__all__ = ["Stream"]


class Stream(Outbox[Sequence]):
    """A request's outputs on their way to the ``generate`` iterator (an ``Outbox`` that also
    turns sampled tokens into text; ``final`` is delivered after publication)."""

    __slots__ = ("_detok", "_watch", "session")

    def __init__(
        self, seq: Sequence, session: str | None, tok: Tokenizer | None, stops: tuple[str, ...]
    ) -> None:
        super().__init__(seq)
        self.session = session  #: where finished pages are published (None: not published)
        self._detok = Detokenizer(tok) if tok is not None else None
        self._watch = StopWatch(stops)

    def on_token(self, token: int, reason: str | None) -> StepOutput:
        """The output for a newly sampled token (``reason``: finish reason from the ids)."""
        seq = self.seq
        stop_id = reason == "stop"
        delta = "" if stop_id or self._detok is None else self._detok.push(token)
        text, hit = self._watch.feed(delta)
        if hit:
            reason = "stop"
        elif reason is not None:
            tail = self._detok.flush() if self._detok is not None and not stop_id else ""
            more, hit = self._watch.feed(tail)
            text += more + ("" if hit else self._watch.flush())
        return StepOutput(
            token_id=token,
            text=text,
            finished=reason is not None,
            cached_tokens=seq.cached_tokens,
            prompt_tokens=seq.prompt_len,
            index=seq.num_generated - 1,
            finish_reason=reason,
        )

    async def next(self) -> StepOutput:
        out: StepOutput = await super().next()
        return out
