"""Continuous batching: which sequences compute how many tokens, and what the pool must do first.

>>> sched = Scheduler(max_batch=2, max_step_tokens=8, page_tokens=4, budget=6)
>>> sched.add(Sequence("a", [1] * 20, max_new_tokens=4))
>>> plan = sched.schedule()
>>> [(s.request_id, n) for s, n in plan.items], [(io.op.value, io.pages) for io in plan.io]
([('a', 8)], [('alloc', 2)])

``schedule()`` is a pure function of the scheduler's state: it admits waiting sequences while
there is room (``max_batch``), gives every decoding sequence its one token, and shares the rest
of the step's token budget among prefilling sequences in arrival order, in chunks, so a long
prompt never stalls the streams already decoding. A sequence whose input is still open
(segmented emission: more segments are on their way) prefills what it has except its last
token, and samples nothing until the input is closed.

The scheduler also owns the engine's page budget. It keeps a ledger of the pool pages its
sequences pin (a prefix page that several sequences matched counts once) until the shell
reports them released, and walks the plan in order: a sequence whose new pages fit the budget
gets an ``ALLOC``; one that does not preempts the newest sequences running after it when
their pages make room (``PREEMPT``: pages released, the sequence waits at the head of the
queue, its tokens kept, its KV recomputed later), and is preempted itself otherwise; when
nothing else runs and no finished sequence is about to give pages back it fails (``FAIL``), as
does one whose own pages pass the budget. So the oldest running sequence advances and no two
sequences take turns preempting each other. The pool has the last word: when it refuses an
``ALLOC`` the budget allowed (its pages are shared with other users), the shell reports
``refused``; the scheduler decides the same way and replans the rest of the step. The shell
carries the ``io`` out in order (pool calls, page views) and reports back: ``allocated``,
``preempted``, ``released``.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from omniflow.compute._pages import PageIO, PageLedger, PageOp
from omniflow.compute._queues import RunQueues
from omniflow.compute._sequence import SeqStatus, Sequence

__all__ = ["PageIO", "PageOp", "Scheduler", "StepPlan"]


@dataclass(slots=True)
class StepPlan:
    """What one forward pass computes, and the pool I/O that must precede it."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)  #: (sequence, new tokens)
    #: pool I/O to carry out first, in order (the shell pops from the left)
    io: deque[PageIO[Sequence]] = field(default_factory=deque)
    #: every item scheduled, before the budget dropped the preempted and failed ones
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)

    def samples(self, seq: Sequence, n: int) -> bool:
        """Whether this chunk reaches the end of a complete input (so a token is sampled)."""
        return not seq.input_open and seq.num_computed + n == len(seq.tokens)


class Scheduler(RunQueues[Sequence]):
    """Waiting and running sequences of one engine replica, and the pages they hold."""

    def __init__(
        self,
        *,
        max_batch: int,
        max_step_tokens: int,
        page_tokens: int = 16,
        budget: int | None = None,
    ) -> None:
        if max_batch < 1 or max_step_tokens < max_batch:
            raise ValueError("need max_batch >= 1 and max_step_tokens >= max_batch")
        if page_tokens < 1 or (budget is not None and budget < 0):
            raise ValueError("need page_tokens >= 1 and budget None or >= 0")
        super().__init__(max_batch=max_batch)
        self.max_step_tokens = max_step_tokens  #: tokens per forward pass (chunked prefill)
        self.page_tokens = page_tokens  #: tokens per KV page
        #: most pool pages this engine's sequences hold at once (None: only the pool's
        #: refusals bound them, for a pool shared with other users)
        self.budget = budget
        #: the pages its sequences pin: queued, or removed and not yet ``released``
        self.ledger: PageLedger[Sequence] = PageLedger()

    # ---- the ledger ------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Distinct pool pages the engine's sequences pin now."""
        return self.ledger.held

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; the pages it already holds (a matched prefix) join the ledger."""
        super().add(seq)
        self.ledger.pin(seq)

    def allocated(self, seq: Sequence, slots: list[int]) -> None:
        """The pool gave ``seq`` the ``slots`` of its ``ALLOC``."""
        self.ledger.grow(seq, slots)

    def preempted(self, seq: Sequence) -> None:
        """The shell released a ``PREEMPT``ed sequence's pages: it waits to be recomputed
        (unless it was aborted meanwhile: then it only leaves the ledger's count)."""
        self.ledger.unpin(seq.slots)
        seq.slots, seq.num_computed = [], 0
        if seq.status is not SeqStatus.FINISHED:
            self.requeue(seq)

    def released(self, request_id: str) -> None:
        """A finished or aborted sequence's pages are back in the pool (its ``slots`` stay, for
        the publication that came before)."""
        self.ledger.release(request_id)

    # ---- planning --------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether ``schedule()`` has something to do: admit a sequence, or compute a token of a
        running one (an open one may be waiting for its next segment). False means the loop
        may sleep until a request arrives or a segment is fed."""
        if self.waiting and len(self.running) < self.max_batch:
            return True
        return any(s.decoding or s.ready_prefill > 0 for s in self.running)

    def schedule(self) -> StepPlan:
        """The next step's plan and its pool I/O; no items when there is nothing to do."""
        self.admit()
        plan = StepPlan()
        budget = self.max_step_tokens
        decoding = [s for s in self.running if s.decoding]
        for seq in decoding:
            plan.scheduled.append((seq, 1))
        budget -= len(decoding)
        for seq in self.running:
            need = seq.ready_prefill
            if need > 0 and not seq.decoding and budget > 0:
                n = min(need, budget)
                plan.scheduled.append((seq, n))
                budget -= n
        plan.items, io = self._place(plan.scheduled, Counter(), set())
        plan.io.extend(io)
        return plan

    def refused(self, plan: StepPlan, seq: Sequence, why: str) -> None:
        """The pool refused ``seq``'s ``ALLOC`` (the shell popped it): the newest sequence
        running after it is preempted and ``seq`` asks again; with none, ``seq`` itself is
        preempted or fails. The rest of the step is replanned with the pages given back."""
        k = next(i for i, (s, _) in enumerate(plan.items) if s is seq)
        at = next(i for i, (s, _) in enumerate(plan.scheduled) if s is seq)
        gone: Counter[int] = Counter()
        victim = self._victim(seq, set())
        if victim is None:
            first = self._evict(seq, gone, set(), why)
            out, tail = {seq.request_id}, plan.scheduled[at + 1 :]
        else:
            first = self._preempt(victim, gone, why)
            out, tail = {victim.request_id}, plan.scheduled[at:]
        kept, io = self._place(tail, gone, out)
        plan.items[k:] = kept
        plan.items[:k] = [item for item in plan.items[:k] if item[0] is not victim]
        plan.io.clear()
        plan.io.extend([first, *io])

    def _place(
        self, items: list[tuple[Sequence, int]], gone: Counter[int], out: set[str]
    ) -> tuple[list[tuple[Sequence, int]], list[PageIO[Sequence]]]:
        """Walk ``items`` in order against the budget: the items kept and the I/O. ``gone``:
        pins the I/O so far gives back; ``out``: sequences it preempts or fails. A sequence
        whose pages do not fit preempts the newest sequences running after it, so the oldest
        always advances (no two sequences preempt each other forever)."""
        kept: list[tuple[Sequence, int]] = []
        io: list[PageIO[Sequence]] = []
        budget = self.budget
        free = None if budget is None else budget - self.held
        for seq, n in items:
            if seq.request_id in out or seq.status is SeqStatus.WAITING:
                continue  # preempted earlier in this step
            need = seq.pages_needed(n, self.page_tokens)
            if need == 0:
                kept.append((seq, n))
                continue
            if free is not None and budget is not None:
                free += self.ledger.freed(gone)
                if len(set(seq.slots)) + need > budget:  # could never fit
                    why = f"needs {len(set(seq.slots)) + need} pages, the budget is {budget}"
                    io.append(PageIO(PageOp.FAIL, seq, len(set(seq.slots)), why))
                    out.add(seq.request_id)
                    continue
                short = need > free and need <= free + self._could_free(seq, gone, out, io)
                while short and need > free and (victim := self._victim(seq, out)) is not None:
                    why = f"{seq.request_id!r} needs {need} pages, {max(free, 0)} are free"
                    io.append(self._preempt(victim, gone, why))
                    out.add(victim.request_id)
                    kept = [item for item in kept if item[0] is not victim]
                    planned = [x for x in io if x.op is PageOp.ALLOC and x.seq is victim]
                    for x in planned:  # earlier in this step: it allocates nothing now
                        io.remove(x)
                        free += x.pages
                    free += self.ledger.freed(gone)
            if free is None or need <= free:
                io.append(PageIO(PageOp.ALLOC, seq, need))
                kept.append((seq, n))
                if free is not None:
                    free -= need
                continue
            why = f"needs {need} pages, {max(free, 0)} of the budget's {self.budget} are free"
            coming = any(x.op is PageOp.FAIL and x.pages for x in io)
            io.append(self._evict(seq, gone, out, why, coming=coming))
            out.add(seq.request_id)
        return kept, io

    def _newer(self, seq: Sequence, out: set[str]) -> list[Sequence]:
        """Running sequences admitted after ``seq`` and not yet out, newest first (none when
        ``seq`` no longer runs: aborted meanwhile, it takes no one's pages)."""
        if seq not in self.running:
            return []
        newer = []
        for s in reversed(self.running):
            if s is seq:
                break
            if s.request_id not in out:
                newer.append(s)
        return newer

    def _victim(self, seq: Sequence, out: set[str]) -> Sequence | None:
        """The newest running sequence admitted after ``seq`` and not yet out, if any."""
        newer = self._newer(seq, out)
        return newer[0] if newer else None

    def _could_free(
        self, seq: Sequence, gone: Counter[int], out: set[str], io: list[PageIO[Sequence]]
    ) -> int:
        """Pages preempting every sequence newer than ``seq`` would give it (their planned
        allocations and the pages only they pin): they are preempted only when that suffices,
        otherwise ``seq`` itself waits."""
        newer = {s.request_id for s in self._newer(seq, out)}
        trial = Counter(gone)
        for s in self.running:
            if s.request_id in newer:
                trial.update(set(s.slots))
        planned = sum(x.pages for x in io if x.op is PageOp.ALLOC and x.seq.request_id in newer)
        return planned + sum(1 for p, n in trial.items() if n and self.ledger.refs[p] <= n)

    def _preempt(self, seq: Sequence, gone: Counter[int], why: str) -> PageIO[Sequence]:
        gone.update(set(seq.slots))
        return PageIO(PageOp.PREEMPT, seq, len(set(seq.slots)), why)

    def _evict(
        self, seq: Sequence, gone: Counter[int], out: set[str], why: str, *, coming: bool = False
    ) -> PageIO[Sequence]:
        """``seq`` cannot have its pages: preempt it while others run or a finished (or failing:
        ``coming``) sequence is about to give pages back; otherwise it cannot fit even alone and
        fails."""
        others = any(s is not seq and s.request_id not in out for s in self.running)
        finishing = coming or any(
            s.status is SeqStatus.FINISHED and s.slots for s in self.ledger.holders.values()
        )
        if not others and not finishing:
            return PageIO(PageOp.FAIL, seq, 0, why)
        return self._preempt(seq, gone, why)

    # ---- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the invariants (tests call this after every transition)."""
        self.validate_queues("sequence")
        for s in self.running:
            assert 0 <= s.num_computed < len(s.tokens), f"{s}: computed out of range"
        self.ledger.validate([*self.running, *self.waiting])
