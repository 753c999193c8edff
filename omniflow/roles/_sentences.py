"""Sentence splitting for streamed text: feed deltas, take whole sentences as they complete.

>>> s = Sentences()
>>> s.feed("Hello there. How a"), s.feed("re you? Fine"), s.flush()
(['Hello there.'], ['How are you?'], ['Fine'])
"""

from __future__ import annotations

import re

__all__ = ["Sentences"]

#: A sentence ends at . ! ? followed by white space, or at a line break.
_END = re.compile(r"(?<=[.!?])\s+|\n+")


class Sentences:
    """Accumulates text deltas; ``feed`` returns the sentences they completed, ``flush`` the rest.

    Used inside a streaming role (one per call), so each sentence leaves for the TTS while the
    LLM still generates the next: time to first audio is one sentence, not the whole answer.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        #: Text received after the last sentence end.
        self._pending = ""

    def feed(self, delta: str) -> list[str]:
        self._pending += delta
        *done, self._pending = _END.split(self._pending)
        return [s.strip() for s in done if s.strip()]

    def flush(self) -> list[str]:
        rest, self._pending = self._pending.strip(), ""
        return [rest] if rest else []
