"""Denoising requests as sequences, and the pure scheduler that batches their steps.

>>> import torch
>>> sched = DenoiseScheduler(max_batch=2)
>>> for rid in ("a", "b", "c"):
...     sched.add(DitSeq(rid, torch.zeros(4, 2), steps=2))
>>> [s.request_id for s in sched.schedule()]
['a', 'b']

A picture being denoised is a ``DitSeq``: its context pages (the LLM's prompt, matched in the
pool), then pages of its own for its image tokens, its latents and how many of its ``steps`` are
done. ``schedule()`` is a pure function of the scheduler's state: it admits waiting pictures
while there is room (``max_batch``) in arrival order and runs one step of every running picture
in the same forward pass, so pictures that arrive while others are denoising join the batch at
the next step (continuous batching, like the LLM's decode). The async shell (``DiTEngine``)
allocates pages, runs the step and reports back with ``DitSeq.advance``.
"""

from __future__ import annotations

import enum

import torch

from omniflow.compute._queues import RunQueues
from omniflow.compute._sequence import SeqStatus

__all__ = ["DenoiseScheduler", "DitSeq", "StepKind"]


class StepKind(enum.Enum):
    """What a finished step means for its picture."""

    STEP = "step"  #: nothing to deliver yet
    PREVIEW = "preview"  #: every ``preview_every`` steps: the latents so far
    FINAL = "final"  #: the last step: the picture is done


class DitSeq:
    """The engine's record of one picture (the pure scheduler's unit of work)."""

    __slots__ = (
        "context_len",
        "done",
        "finish_reason",
        "latents",
        "own_pages",
        "preview_every",
        "request_id",
        "slots",
        "status",
        "steps",
    )

    def __init__(
        self, request_id: str, latents: torch.Tensor, *, steps: int, preview_every: int = 0
    ) -> None:
        self.request_id = request_id  #: owner of the pages in the pool
        self.latents = latents  #: (num_tokens, latent_dim), x at the current timestep
        self.steps = steps  #: Euler steps from t=1 (noise) to t=0
        self.preview_every = preview_every  #: 0: no previews
        self.done = 0  #: steps taken
        self.context_len = 0  #: context positions in the first pages (the LLM's prompt)
        self.slots: list[int] = []  #: context pages, then the image tokens' own pages
        self.own_pages = False  #: the image tokens' pages are allocated
        self.status = SeqStatus.WAITING  #: lifecycle
        self.finish_reason: str | None = None  #: "length" when done, "abort" when cancelled

    @property
    def num_tokens(self) -> int:
        return int(self.latents.shape[0])

    def timesteps(self) -> tuple[float, float]:
        """(t, t_next) of the next step."""
        return 1.0 - self.done / self.steps, 1.0 - (self.done + 1) / self.steps

    def advance(self, latents: torch.Tensor) -> StepKind:
        """Record a step's result; what it means for the caller."""
        if self.done >= self.steps:
            raise ValueError(f"{self!r}: a step past the last one")
        self.latents = latents
        self.done += 1
        if self.done == self.steps:
            self.finish_reason = "length"
            return StepKind.FINAL
        if self.preview_every and self.done % self.preview_every == 0:
            return StepKind.PREVIEW
        return StepKind.STEP

    def __repr__(self) -> str:
        return (
            f"DitSeq({self.request_id!r}, {self.status.value}, step={self.done}/{self.steps}, "
            f"context={self.context_len}, pages={len(self.slots)})"
        )


class DenoiseScheduler(RunQueues[DitSeq]):
    """Waiting and running pictures of one DiT engine replica (``max_batch``: pictures denoised
    together)."""

    def has_work(self) -> bool:
        return self.holds()

    def schedule(self) -> list[DitSeq]:
        """The pictures whose next step runs in the next forward pass (all running ones)."""
        return list(self.admit())

    def validate(self) -> None:
        """Check the invariants (tests call this after every transition)."""
        self.validate_queues("picture")
        for s in self.running:
            assert 0 <= s.done < s.steps, f"{s}: step out of range"
        for s in self.waiting:
            assert s.done < s.steps, f"{s}: finished but waiting"
