"""A request's state inside the engine: its tokens, how many have KV, and its pages.

>>> s = Sequence("r1", [5, 6, 7], max_new_tokens=4)
>>> (s.prompt_len, s.remaining_prefill, s.status)
(3, 3, <SeqStatus.WAITING: 'waiting'>)
"""

from __future__ import annotations

import enum

import torch

__all__ = ["EMBED", "SeqStatus", "Sequence"]

#: The token id stored at positions whose input is an embedding row rather than a token.
EMBED = -1


class SeqStatus(enum.Enum):
    WAITING = "waiting"  #: admitted by the engine, not yet scheduled
    RUNNING = "running"  #: holds pages, computes every step
    FINISHED = "finished"  #: done (stop, length or abort); pages to publish/release


class Sequence:
    """The engine's record of one request (the pure scheduler's unit of work)."""

    __slots__ = (
        "cached_tokens",
        "embeds",
        "finish_reason",
        "input_open",
        "max_new_tokens",
        "num_computed",
        "prompt_len",
        "request_id",
        "slots",
        "status",
        "stop_ids",
        "tokens",
    )

    def __init__(
        self,
        request_id: str,
        tokens: list[int],
        *,
        max_new_tokens: int,
        stop_ids: frozenset[int] = frozenset(),
        embeds: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.request_id = request_id  #: owner of the pages in the pool
        self.tokens = tokens  #: prompt then generated ids (EMBED where an embedding row goes)
        self.embeds = embeds or {}  #: start position -> (n, hidden) rows on host (Layer 1)
        self.prompt_len = len(tokens)  #: tokens before generation started
        self.max_new_tokens = max_new_tokens  #: generation budget
        self.stop_ids = stop_ids  #: ids that finish the sequence
        self.num_computed = 0  #: leading tokens whose KV is in ``slots``
        self.cached_tokens = 0  #: of those, how many came from the pool (prefix hit)
        self.slots: list[int] = []  #: pool pages in chain order
        self.status = SeqStatus.WAITING  #: lifecycle
        self.finish_reason: str | None = None  #: "stop" | "length" | "abort" once finished
        #: more input segments are coming (segmented emission): what is there is prefilled,
        #: but the last token waits, so nothing is sampled until the input is closed
        self.input_open = False

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before the next token can be sampled (1 when decoding)."""
        return len(self.tokens) - self.num_computed

    @property
    def ready_prefill(self) -> int:
        """Tokens the next step may compute: all that remain, less the last one while the
        input is open (it is computed with the sampling step once the input is complete)."""
        return len(self.tokens) - self.num_computed - (1 if self.input_open else 0)

    @property
    def decoding(self) -> bool:
        """One token to compute and a token to sample from it."""
        return not self.input_open and len(self.tokens) - self.num_computed == 1

    def extend(self, tokens: list[int], embeds: dict[int, torch.Tensor]) -> None:
        """Append an input segment (ids, EMBED placeholders and their rows) to the prompt."""
        self.tokens.extend(tokens)
        self.embeds.update(embeds)
        self.prompt_len = len(self.tokens)

    def pages_needed(self, n_tokens: int, page_tokens: int) -> int:
        """Extra pages to hold the KV of ``n_tokens`` more tokens."""
        total = -(-(self.num_computed + n_tokens) // page_tokens)
        return max(0, total - len(self.slots))

    def append(self, token_id: int) -> str | None:
        """Record a sampled token; returns the finish reason if it ends the sequence."""
        self.tokens.append(token_id)
        if token_id in self.stop_ids:
            return "stop"
        if self.num_generated >= self.max_new_tokens:
            return "length"
        return None

    def embed_rows(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from ``start``, rows) for every embedding segment overlapping [start, end)."""
        out = []
        for seg_start, rows in self.embeds.items():
            lo, hi = max(start, seg_start), min(end, seg_start + rows.shape[0])
            if lo < hi:
                out.append((lo - start, rows[lo - seg_start : hi - seg_start]))
        return out

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self.tokens)}, "
            f"computed={self.num_computed}, pages={len(self.slots)})"
        )
