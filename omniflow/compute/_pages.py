"""The pool I/O an engine's pure scheduler plans, and the ledger of the pages its sequences pin.

>>> class Seq:
...     def __init__(self, rid, slots): self.request_id, self.slots = rid, slots
>>> ledger: PageLedger[Seq] = PageLedger()
>>> a, b = Seq("a", [0, 1]), Seq("b", [1])
>>> ledger.pin(a); ledger.pin(b); ledger.grow(b, [2])
>>> ledger.held, ledger.release("a") is a, ledger.held
(3, True, 2)

Both schedulers (``Scheduler`` for the LLM, ``DenoiseScheduler`` for the DiT) own their
engine's page budget the same way: the ledger counts the distinct pool pages their sequences
pin (a prefix page several sequences matched counts once) from admission until the shell
reports them released, ``schedule()`` walks its plan against the budget and returns the pool
I/O as ``PageIO`` instructions, and the shell (``EngineBase._carry_out``) carries them out in
order and reports each outcome back. What each scheduler plans when pages are short is its own
(the LLM preempts, the DiT waits); the instructions, the ledger and its invariants are these.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["PageIO", "PageLedger", "PageOp", "Pinning"]


class Pinning(Protocol):
    """What the ledger needs of a sequence: the owner of its pins and the pages it holds."""

    request_id: str
    slots: list[int]


S = TypeVar("S", bound=Pinning)


class PageOp(enum.Enum):
    """What the shell does with the pool for one sequence before the forward pass."""

    ALLOC = "alloc"  #: allocate ``pages`` fresh pages, zero them, attach them; then ``allocated``
    PREEMPT = "preempt"  #: release the sequence's pages, forget their views; then ``preempted``
    FAIL = "fail"  #: fail the request: its pages cannot be had even with nothing else running


@dataclass(frozen=True, slots=True)
class PageIO(Generic[S]):
    """One instruction of a plan's pool I/O."""

    op: PageOp  #: what to do
    seq: S  #: for which sequence
    pages: int = 0  #: ALLOC: pages to allocate; PREEMPT, FAIL: distinct pages it held
    why: str = ""  #: PREEMPT/FAIL: the budget or the pool's refusal that decided it


class PageLedger(Generic[S]):
    """The pool pages an engine's sequences pin, each page counted once however many pin it."""

    __slots__ = ("holders", "refs")

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()  #: page -> sequences pinning it
        #: sequences whose pages are pinned: queued, or removed and not yet ``release``d
        self.holders: dict[str, S] = {}

    @property
    def held(self) -> int:
        """Distinct pool pages the sequences pin now."""
        return len(self.refs)

    def pin(self, seq: S) -> None:
        """``seq`` joins with the pages it already holds (a matched prefix or context)."""
        self.holders[seq.request_id] = seq
        self.refs.update(seq.slots)

    def grow(self, seq: S, slots: list[int]) -> None:
        """The pool gave ``seq`` the fresh ``slots``."""
        seq.slots.extend(slots)
        self.refs.update(slots)

    def unpin(self, slots: Iterable[int]) -> None:
        """A sequence that keeps its place gave ``slots`` back (preempted)."""
        self.refs.subtract(slots)
        self.refs -= Counter()  # drop the pages no one pins any more

    def release(self, request_id: str) -> S | None:
        """A finished or aborted sequence's pages are back in the pool (its ``slots`` stay, for
        the publication that came before); the sequence, if it was held."""
        seq = self.holders.pop(request_id, None)
        if seq is not None and seq.slots:
            self.unpin(seq.slots)
        return seq

    def freed(self, gone: Counter[int]) -> int:
        """Pages the releases counted in ``gone`` free (no sequence pins them any more); they
        are taken out of ``gone`` so that each is credited once."""
        freed = [p for p, n in gone.items() if n and self.refs[p] <= n]
        for p in freed:
            gone[p] = 0
        return len(freed)

    def validate(self, queued: Iterable[S]) -> None:
        """Every ``queued`` sequence is held, and the counts equal the holders' pins."""
        for s in queued:
            assert self.holders.get(s.request_id) is s, f"{s} queued but not in the ledger"
        want = Counter(p for s in self.holders.values() for p in s.slots)
        assert +self.refs == want, f"page ledger {dict(self.refs)} != pins {dict(want)}"
        assert all(n > 0 for n in self.refs.values()), "a page pinned by no one is counted"
