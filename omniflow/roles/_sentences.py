"""Sentence splitting for streamed text: feed deltas, take whole sentences as they complete.

>>> s = Sentences()
>>> s.feed("Hello there. How a"), s.feed("re you? Fine"), s.flush()
(['Hello there.'], ['How are you?'], ['Fine'])
>>> Sentences(max_chars=12).feed("one two three four five")
['one two', 'three four']
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
    A run-on sentence is cut once ``max_chars`` are pending (at the last space, if one is in
    its second half), so no text waits for a sentence end that never comes.
    """

    __slots__ = ("_pending", "max_chars")

    def __init__(self, max_chars: int = 160) -> None:
        #: Pending text this long is spoken without waiting for its sentence's end.
        self.max_chars = max_chars
        #: Text received after the last sentence end.
        self._pending = ""

    def feed(self, delta: str) -> list[str]:
        self._pending += delta
        *done, self._pending = _END.split(self._pending)
        out = [s.strip() for s in done if s.strip()]
        while len(self._pending) >= self.max_chars:
            head = self._pending[: self.max_chars]
            cut = head.rfind(" ")
            if cut < self.max_chars // 2:
                cut = self.max_chars
            piece, self._pending = self._pending[:cut].strip(), self._pending[cut:].lstrip()
            if piece:
                out.append(piece)
        return out

    def flush(self) -> list[str]:
        rest, self._pending = self._pending.strip(), ""
        return [rest] if rest else []
