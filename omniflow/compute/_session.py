"""Layer 1 of prefix reuse: each session's recomputable inputs, kept on the host.

>>> h = SessionHistory(max_sessions=2)
>>> h.record("s", [1, 2, 3], {})
>>> h.base("s", 2)
([1, 2], {})

Whatever happens to the KV pages (evicted, lost with a node), a session's token ids and
embedding rows are enough to prefill it again, so a KV miss costs time, never correctness.
``step`` selects how a new turn builds on it (incremental matching, the paper's §5.1).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from omniflow.compute._errors import RequestError

__all__ = ["SessionHistory"]


class SessionHistory:
    """LRU of session -> (tokens, embedding segments) of the last finished turn."""

    def __init__(self, max_sessions: int = 1024) -> None:
        self.max_sessions = max_sessions  #: sessions kept; the least recent is forgotten
        self._data: OrderedDict[str, tuple[list[int], dict[int, torch.Tensor]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def record(self, session: str, tokens: list[int], embeds: dict[int, torch.Tensor]) -> None:
        self._data[session] = (list(tokens), dict(embeds))
        self._data.move_to_end(session)
        while len(self._data) > self.max_sessions:
            self._data.popitem(last=False)

    def base(self, session: str, step: int) -> tuple[list[int], dict[int, torch.Tensor]]:
        """The history a turn with ``step`` builds on: its first ``step`` positions, or all of
        it when ``step < 0``."""
        tokens, embeds = self._data.get(session, ([], {}))
        if step < 0:
            step = len(tokens)
        if step > len(tokens):
            raise RequestError(
                f"session {session!r}: step={step} is past the {len(tokens)} positions this "
                "engine holds for it (history lost or never recorded); resend the whole "
                "sequence with step=None",
                field="step",
            )
        kept = {pos: rows[: step - pos] for pos, rows in embeds.items() if pos < step}
        if session in self._data:
            self._data.move_to_end(session)
        return tokens[:step], kept
