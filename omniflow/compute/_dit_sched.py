"""Denoising requests as sequences, and the pure scheduler that batches their steps.

>>> import torch
>>> sched = DenoiseScheduler(max_batch=2, page_tokens=4, budget=1)
>>> for rid in ("a", "b", "c"):
...     sched.add(DitSeq(rid, torch.zeros(4, 2), steps=2))
>>> plan = sched.schedule()
>>> [s.request_id for s in plan.items], [(io.op.value, io.seq.request_id) for io in plan.io]
(['a'], [('alloc', 'a')])
>>> [s.request_id for s in sched.waiting]  # b waits for a's page, c for room in the batch
['b', 'c']

A picture being denoised is a ``DitSeq``: its context pages (the LLM's prompt, matched in the
pool), then pages of its own for its image tokens, its latents and how many of its ``steps`` are
done. ``schedule()`` is a pure function of the scheduler's state: it admits waiting pictures
while there is room (``max_batch``) in arrival order and runs one step of every running picture
in the same forward pass, so pictures that arrive while others are denoising join the batch at
the next step (continuous batching, like the LLM's decode).

The scheduler also owns the engine's page budget (``_pages.PageLedger``: the context pages a
picture pinned at admission and its own pages count until the shell reports them released; a
context page several pictures share counts once). A picture allocates its own pages once, at
its first step, and keeps them to its last, so pictures never grow and nothing is preempted:
``schedule()`` walks the running pictures in order and gives one without its pages an
``ALLOC`` when they fit the budget. One that does not fit waits at the head of the queue while
another running picture holds (or is given in this plan) its own pages, which come back when
that one finishes; with none, it ``FAIL``s, as does at once one whose pages alone pass the
budget. The pool has the last word: when it refuses an ``ALLOC`` (its pages are shared with the
LLM and other users: the budget is then ``None``), the shell reports ``refused`` and the
picture waits or fails by the same rule. The shell (``DiTEngine``) carries the ``io`` out in
order, reports ``allocated``/``refused``/``released``, runs the step and reports its results
with ``DitSeq.advance``.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from omniflow.compute._pages import PageIO, PageLedger, PageOp
from omniflow.compute._queues import RunQueues
from omniflow.compute._sequence import SeqStatus

__all__ = ["DenoisePlan", "DenoiseScheduler", "DitSeq", "StepKind"]


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


@dataclass(slots=True)
class DenoisePlan:
    """The pictures one forward pass steps, and the pool I/O that must precede it."""

    items: list[DitSeq] = field(default_factory=list)  #: pictures stepped, in running order
    #: pool I/O to carry out first, in order (the shell pops from the left)
    io: deque[PageIO[DitSeq]] = field(default_factory=deque)
    #: pictures sent back to the head of the queue to wait for pages
    waited: list[DitSeq] = field(default_factory=list)


class DenoiseScheduler(RunQueues[DitSeq]):
    """Waiting and running pictures of one DiT engine replica (``max_batch``: pictures denoised
    together) and the pages they pin (``budget``: most pool pages held at once; None: only the
    pool's refusals bound them, for a pool shared with the LLM)."""

    def __init__(self, *, max_batch: int, page_tokens: int = 16, budget: int | None = None) -> None:
        if page_tokens < 1 or (budget is not None and budget < 0):
            raise ValueError("need page_tokens >= 1 and budget None or >= 0")
        super().__init__(max_batch=max_batch)
        self.page_tokens = page_tokens  #: tokens per KV page
        self.budget = budget  #: most pool pages held at once (None: the pool's refusals)
        #: the pages its pictures pin: queued, or removed and not yet ``released``
        self.ledger: PageLedger[DitSeq] = PageLedger()

    @property
    def held(self) -> int:
        """Distinct pool pages the engine's pictures pin now."""
        return self.ledger.held

    def own_pages(self, seq: DitSeq) -> int:
        """Pages the picture's image tokens take."""
        return -(-seq.num_tokens // self.page_tokens)

    def add(self, seq: DitSeq) -> None:
        """Queue ``seq``; its context pages (pinned at admission) join the ledger."""
        super().add(seq)
        self.ledger.pin(seq)

    def allocated(self, seq: DitSeq, slots: list[int]) -> None:
        """The pool gave ``seq`` the ``slots`` of its ``ALLOC``: its own pages."""
        self.ledger.grow(seq, slots)
        seq.own_pages = True

    def released(self, request_id: str) -> None:
        """A finished or aborted picture's pages are back in the pool."""
        self.ledger.release(request_id)

    def has_work(self) -> bool:
        return self.holds()

    def schedule(self) -> DenoisePlan:
        """The next forward pass: one step of every running picture that has (or now gets) its
        own pages, and the pool I/O first."""
        plan = DenoisePlan()
        budget = self.budget
        free = None if budget is None else budget - self.held
        for seq in list(self.admit()):
            if not seq.own_pages:
                need = self.own_pages(seq)
                if budget is not None and len(set(seq.slots)) + need > budget:
                    why = f"needs {len(set(seq.slots)) + need} pages, the budget is {budget}"
                    plan.io.append(PageIO(PageOp.FAIL, seq, len(set(seq.slots)), why))
                    continue
                if free is not None and need > free:
                    why = f"needs {need} pages, {max(free, 0)} of the budget's {budget} are free"
                    fail = self._short(plan, seq, why, plan.io)
                    plan.io.extend([fail] if fail else [])
                    continue
                plan.io.append(PageIO(PageOp.ALLOC, seq, need))
                if free is not None:
                    free -= need
            plan.items.append(seq)
        return plan

    def refused(self, plan: DenoisePlan, seq: DitSeq, why: str) -> None:
        """The pool refused ``seq``'s ``ALLOC`` (the shell popped it): it waits while another
        running picture holds its own pages or is still to get them in this plan (an ``ALLOC``
        after it), and fails (the next I/O) otherwise."""
        plan.items.remove(seq)
        fail = self._short(plan, seq, why, plan.io)
        plan.io.extendleft([fail] if fail else [])

    def _short(
        self, plan: DenoisePlan, seq: DitSeq, why: str, planned: Iterable[PageIO[DitSeq]]
    ) -> PageIO[DitSeq] | None:
        """``seq``'s pages cannot be had now: it waits for those of a running picture that
        holds (or by ``planned`` is about to get) its own, which come back when it finishes;
        with none, it could not fit even alone: its ``FAIL``."""
        coming = {x.seq.request_id for x in planned if x.op is PageOp.ALLOC}
        if any(s.own_pages or s.request_id in coming for s in self.running if s is not seq):
            self.requeue(seq)
            plan.waited.append(seq)
            return None
        return PageIO(PageOp.FAIL, seq, len(set(seq.slots)), why)

    def validate(self) -> None:
        """Check the invariants (tests call this after every transition)."""
        self.validate_queues("picture")
        for s in self.running:
            assert 0 <= s.done < s.steps, f"{s}: step out of range"
        for s in self.waiting:
            assert s.done < s.steps, f"{s}: finished but waiting"
            assert not s.own_pages, f"{s}: waits holding its own pages"
        self.ledger.validate([*self.running, *self.waiting])
