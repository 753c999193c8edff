"""The slot engine: where every page of a Params Pool lives, who pins it, what moves next.

Pure bookkeeping over tier indices (no tensors, no I/O, no metadata), so every rule is tested
by a hypothesis state machine (``tests/data/test_kv_slots.py``); ``ParamsPool`` is the shell.

A *slot* is a page's stable id; it sits at one index of one tier (L1, L2, L3). Each slot keeps
four sets of task ids instead of counters -- ``active`` (owners: requests that pin it),
``writes`` (bytes being written into it), ``evicts`` (a planned move down) and ``readbacks``
(bytes being read out of it) -- and may be moved or dropped only while ``active``, ``writes``
and ``readbacks`` are empty. Sets are idempotent: adding twice or removing what is absent
cannot drive a count negative or leak one.

Room is made by a *plan*: ``plan_room`` picks victims in the coldest of four frequency levels
(cold, warm1, warm2, hot; the level is derived from a TinyLFU count-min sketch), moves each one
tier down, cascading, and drops a page only when no lower tier can take it; at the last tier a
demoted page is admitted only if the sketch says it is hotter than the page it would push out.
The shell copies the bytes of the plan's moves in order, then ``commit`` s it (or ``abort`` s it,
and nothing changed).

>>> core = SlotCore({"l1": 2, "l2": 2, "l3": 0})
>>> plan = core.plan_room(0, 2)
>>> _ = core.commit(plan); a, b = core.new_slots("call-1", plan)
>>> core.publish(a, "h0", fill=16); core.publish(b, "h1", fill=16)
True
True
>>> core.release("call-1")          # published pages stay, unpinned
[]
>>> plan = core.plan_room(0, 1)      # a third page: the colder one moves to L2
>>> [(m.src_tier, m.dst_tier) for m in plan.moves]
[(0, 1)]
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from omniflow._exceptions import PoolExhaustedError
from omniflow.data._chunks import _check
from omniflow.data.kv._sketch import CountMinSketch

__all__ = ["L1", "L2", "L3", "LEVELS", "TIERS", "Move", "Plan", "Slot", "SlotCore", "unindex"]

L1, L2, L3 = 0, 1, 2
TIERS = ("l1", "l2", "l3")
LEVELS = ("cold", "warm1", "warm2", "hot")


def unindex(index: dict[str, set[int]], owner: str, slot: int) -> None:
    """Drop ``slot`` from ``owner``'s set in an owner -> slots index (and the owner with its
    last slot)."""
    held = index.get(owner)
    if held is not None:
        held.discard(slot)
        if not held:
            del index[owner]


def level_of(freq: int) -> int:
    """Sketch frequency -> LRU level: 0-1 cold, 2-3 warm1, 4-7 warm2, 8+ hot."""
    return min(3, max(0, freq.bit_length() - 1))


class Slot:
    """One page: its place, its chain hash once published, and its four task sets."""

    __slots__ = ("active", "evicts", "fill", "index", "key", "level", "readbacks", "slot",
                 "tier", "writes")  # fmt: skip

    def __init__(self, slot: int, tier: int, index: int) -> None:
        self.slot = slot
        self.tier = tier
        self.index = index
        #: Chain hash once published (or pulled); ``None``: private to its owners.
        self.key: str | None = None
        #: Tokens written (a partially filled page is kept whole with its fill level).
        self.fill = 0
        #: LRU level, 0 (cold) .. 3 (hot).
        self.level = 0
        self.active: set[str] = set()
        self.writes: set[str] = set()
        self.evicts: set[str] = set()
        self.readbacks: set[str] = set()

    @property
    def movable(self) -> bool:
        return not (self.active or self.writes or self.readbacks or self.evicts)

    def __repr__(self) -> str:
        return f"<Slot {self.slot} {TIERS[self.tier]}[{self.index}] key={self.key}>"


class Move:
    """Copy ``slot`` from (src_tier, src_index) to (dst_tier, dst_index); dst None: drop it."""

    __slots__ = ("dst_index", "dst_tier", "frees_src", "key", "slot", "src_index", "src_tier")

    def __init__(
        self, slot: Slot, dst_tier: int | None, dst_index: int | None, *, frees_src: bool = False
    ) -> None:
        self.slot = slot.slot
        self.key = slot.key
        self.src_tier = slot.tier
        self.src_index = slot.index
        self.dst_tier = dst_tier
        self.dst_index = dst_index
        #: The source index goes back to the free list (else another move or the caller takes it).
        self.frees_src = frees_src

    def __repr__(self) -> str:
        dst = "drop" if self.dst_tier is None else f"{TIERS[self.dst_tier]}[{self.dst_index}]"
        return f"<Move {self.slot} {TIERS[self.src_tier]}[{self.src_index}] -> {dst}>"


class Plan:
    """Moves to copy in order, and the indices granted to the caller once committed."""

    __slots__ = ("granted", "moves", "popped", "task")

    def __init__(self, task: str) -> None:
        self.task = task
        self.moves: list[Move] = []
        #: (tier, index) the caller may use after ``commit``.
        self.granted: list[tuple[int, int]] = []
        #: Indices taken from a free list (given back on ``abort``).
        self.popped: list[tuple[int, int]] = []

    @property
    def drops(self) -> list[Move]:
        return [m for m in self.moves if m.dst_tier is None]


class SlotCore:
    """Slots over three tiers of ``capacity[tier]`` pages each."""

    def __init__(self, capacity: Mapping[str, int], *, name: str = "kv") -> None:
        #: Pool name, for error messages.
        self.name = name
        #: Pages per tier.
        self.capacity = tuple(int(capacity.get(t, 0)) for t in TIERS)
        if self.capacity[L1] < 1 or min(self.capacity) < 0:
            raise ValueError(f"pool '{name}': need capacity l1 >= 1 and l2, l3 >= 0")
        self._free: list[list[int]] = [list(range(c - 1, -1, -1)) for c in self.capacity]
        self._at: list[dict[int, int]] = [{} for _ in TIERS]
        self._lru: list[list[OrderedDict[int, None]]] = [
            [OrderedDict() for _ in LEVELS] for _ in TIERS
        ]
        self._slots: dict[int, Slot] = {}
        self._by_key: dict[str, int] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._ids = itertools.count(1)
        self._tasks = itertools.count(1)
        #: TinyLFU frequency estimate by page key.
        self.sketch = CountMinSketch(4 * sum(self.capacity))
        #: Pages dropped from the last tier that could take them.
        self.evictions = 0
        #: Pages moved between tiers, by (src, dst).
        self.moved = 0

    # -- slots --------------------------------------------------------------------------------

    def slot(self, slot: int) -> Slot:
        found = self._slots.get(slot)
        if found is None:
            raise KeyError(slot)
        return found

    def has(self, slot: int) -> bool:
        return slot in self._slots

    def lookup(self, key: str) -> Slot | None:
        sid = self._by_key.get(key)
        return None if sid is None else self._slots[sid]

    def slots(self) -> list[Slot]:
        return list(self._slots.values())

    def owned(self, owner: str) -> set[int]:
        return set(self._by_owner.get(owner, ()))

    def new_slots(self, owner: str, plan: Plan) -> list[int]:
        """Slots at the L1 indices ``plan`` granted (after ``commit``), pinned for ``owner``."""
        out = []
        for tier, index in plan.granted:
            _check(tier == L1 and index not in self._at[L1], f"granted {TIERS[tier]}[{index}]")
            slot = Slot(next(self._ids), L1, index)
            self._slots[slot.slot] = slot
            self._at[L1][index] = slot.slot
            self._lru[L1][0][slot.slot] = None
            self.pin(slot.slot, owner)
            out.append(slot.slot)
        plan.granted = []
        return out

    def pin(self, slot: int, owner: str) -> None:
        self.slot(slot).active.add(owner)
        self._by_owner.setdefault(owner, set()).add(slot)

    def unpin(self, slot: int, owner: str) -> bool:
        """Drop ``owner``'s pin; an unpublished page nobody pins is freed (returns True)."""
        s = self.slot(slot)
        s.active.discard(owner)
        unindex(self._by_owner, owner, slot)
        if s.key is None and not (s.active or s.writes or s.readbacks or s.evicts):
            self._remove(s)
            return True
        return False

    def release(self, owner: str) -> list[int]:
        """Unpin every page ``owner`` holds; returns the unpublished slots freed."""
        return [sid for sid in sorted(self._by_owner.get(owner, ())) if self.unpin(sid, owner)]

    def publish(self, slot: int, key: str, fill: int) -> bool:
        """Index ``slot`` under chain hash ``key``; False if another local page already is."""
        s = self.slot(slot)
        s.fill = fill
        other = self._by_key.get(key)
        if other is not None and other != slot:
            return False
        if s.key is not None and s.key != key:
            del self._by_key[s.key]
        s.key = key
        self._by_key[key] = slot
        self.touch(slot)
        return True

    def mark(self, slot: int, kind: str, task: str) -> None:
        """Add ``task`` to the slot's ``writes``, ``readbacks`` or ``evicts`` set."""
        getattr(self.slot(slot), kind).add(task)

    def unmark(self, slot: int, kind: str, task: str) -> None:
        s = self._slots.get(slot)
        if s is not None:
            getattr(s, kind).discard(task)
            if s.key is None and not (s.active or s.writes or s.readbacks or s.evicts):
                self._remove(s)

    def forget(self, slot: int) -> None:
        """Drop an unpinned slot whose bytes never arrived (a failed pull)."""
        s = self.slot(slot)
        if s.key is not None and self._by_key.get(s.key) == slot:
            del self._by_key[s.key]
        s.key = None
        if not (s.active or s.writes or s.readbacks or s.evicts):
            self._remove(s)

    def new_task(self, prefix: str) -> str:
        return f"{prefix}{next(self._tasks)}"

    # -- frequency ----------------------------------------------------------------------------

    def touch(self, slot: int) -> None:
        """One access: count it in the sketch, set the level, move to the level's MRU end."""
        s = self.slot(slot)
        freq = self.sketch.add(s.key if s.key is not None else f"#{slot}")
        self._relevel(s, level_of(freq))
        self._age(s.tier)

    def take(self, slots: Iterable[int], owner: str) -> None:
        """``pin`` and ``touch`` a match's pages in one step (the LRU heads aged once per tier,
        not once per page)."""
        tiers = set()
        held = self._by_owner.setdefault(owner, set())
        for sid in slots:
            s = self.slot(sid)
            s.active.add(owner)
            held.add(sid)
            self._relevel(s, level_of(self.sketch.add(s.key if s.key is not None else f"#{sid}")))
            tiers.add(s.tier)
        if not held:
            del self._by_owner[owner]
        for tier in sorted(tiers):
            self._age(tier)

    def _relevel(self, s: Slot, level: int) -> None:
        del self._lru[s.tier][s.level][s.slot]
        s.level = level
        self._lru[s.tier][level][s.slot] = None

    def _age(self, tier: int) -> None:
        """Re-level the LRU head of every warm/hot level from the (decaying) sketch."""
        for level in (1, 2, 3):
            lru = self._lru[tier][level]
            if lru:
                head = self._slots[next(iter(lru))]
                now = level_of(self.sketch.estimate(head.key or f"#{head.slot}"))
                if now < level:
                    self._relevel(head, now)

    # -- plans --------------------------------------------------------------------------------

    def free_count(self, tier: int) -> int:
        return len(self._free[tier])

    def plan_room(
        self, tier: int, n: int, *, exclude: Iterable[int] = (), nodrop: Iterable[int] = ()
    ) -> Plan:
        """Grant ``n`` indices of ``tier``, moving unpinned pages down (and dropping the coldest
        only when no lower tier has room). Raises ``PoolExhaustedError`` and changes nothing when
        that needs a page with an owner or a task (or one in ``exclude``) to move, or one in
        ``nodrop`` to be dropped."""
        plan = Plan(self.new_task("plan"))
        ex, nd = set(exclude), set(nodrop)
        for _ in range(n):
            index = self._obtain(plan, tier, None, ex, nd)
            if index is None or index < 0:
                self.abort(plan)
                pinned = sum(1 for s in self._slots.values() if s.tier == tier and not s.movable)
                raise PoolExhaustedError(
                    f"pool '{self.name}': cannot have {n} {TIERS[tier]} pages without evicting "
                    f"pages that have an owner or a task ({pinned} of {self.capacity[tier]} "
                    f"{TIERS[tier]} pages are pinned); release owners (pool.release(owner)) or "
                    f"create the pool with a larger capacity",
                    pool=self.name,
                    requested=n,
                    free=self.free_count(tier),
                    capacity=self.capacity[tier],
                )
            plan.granted.append((tier, index))
        return plan

    def plan_readback(
        self, slots: int | Iterable[int], *, exclude: Iterable[int] = (), nodrop: Iterable[int] = ()
    ) -> Plan:
        """Room in L1 plus the moves of ``slots`` up into it, one batch (marks them
        ``readbacks``)."""
        wanted = [slots] if isinstance(slots, int) else list(slots)
        # Sources in (tier, index) order meet the granted indices in ascending order, so a
        # run of pages that lies contiguous below lands contiguous in L1: one slice copy per
        # run and (sub, slice) instead of a gather of scattered pages.
        pages = sorted((self.slot(s) for s in wanted), key=lambda p: (p.tier, p.index))
        ex = set(exclude) | set(wanted)
        plan = self.plan_room(L1, len(pages), exclude=ex, nodrop=nodrop)
        for page, (tier, index) in zip(pages, sorted(plan.granted), strict=True):
            plan.moves.append(Move(page, tier, index, frees_src=True))
            page.readbacks.add(plan.task)
        plan.granted = []
        return plan

    def _victims(self, tier: int, exclude: set[int]) -> Iterator[Slot]:
        for lru in self._lru[tier]:
            for sid in lru:
                s = self._slots[sid]
                if s.movable and sid not in exclude:
                    yield s

    def _obtain(
        self, plan: Plan, tier: int, incoming: Slot | None, exclude: set[int], nodrop: set[int]
    ) -> int | None:
        """One index of ``tier`` for ``plan``; -1: ``incoming`` is not admitted (drop it)."""
        if self._free[tier]:
            index = self._free[tier].pop()
            plan.popped.append((tier, index))
            return index
        if self.capacity[tier] == 0:
            return None
        victim = next(self._victims(tier, exclude), None)
        if victim is None:
            return None
        lower = next((t for t in range(tier + 1, len(TIERS)) if self.capacity[t]), None)
        below: int | None = None
        if lower is not None:  # the next tier that has any capacity (l2 may be 0)
            below = self._obtain(plan, lower, victim, exclude, nodrop)
        if lower is not None and below is not None and below >= 0:
            plan.moves.append(Move(victim, lower, below))
            victim.evicts.add(plan.task)
            return victim.index
        if below == -1 and victim.slot not in nodrop:  # the tier below did not admit it
            plan.moves.append(Move(victim, None, None))
            victim.evicts.add(plan.task)
            return victim.index
        # No lower tier takes it: drop the coldest droppable page, unless TinyLFU says the
        # page arriving from above is colder than it (then that one is not admitted).
        dropped = next((v for v in self._victims(tier, exclude) if v.slot not in nodrop), None)
        if dropped is None:
            return None
        if incoming is not None and incoming.slot not in nodrop:
            hot = self.sketch.estimate(dropped.key or f"#{dropped.slot}")
            if self.sketch.estimate(incoming.key or f"#{incoming.slot}") < hot:
                return -1
        plan.moves.append(Move(dropped, None, None))
        dropped.evicts.add(plan.task)
        return dropped.index

    def commit(self, plan: Plan) -> list[str]:
        """Apply a plan whose bytes were copied; returns the keys of the pages dropped."""
        dropped: list[str] = []
        for m in plan.moves:
            s = self._slots[m.slot]
            del self._at[m.src_tier][m.src_index]
            del self._lru[m.src_tier][s.level][s.slot]
            s.evicts.discard(plan.task)
            s.readbacks.discard(plan.task)
            if m.frees_src:
                self._free[m.src_tier].append(m.src_index)
        for m in plan.moves:
            s = self._slots[m.slot]
            if m.dst_tier is None or m.dst_index is None:
                if s.key is not None:
                    self._by_key.pop(s.key, None)
                    dropped.append(s.key)
                del self._slots[s.slot]
                self.evictions += 1
                continue
            s.tier, s.index = m.dst_tier, m.dst_index
            self._at[s.tier][s.index] = s.slot
            self._lru[s.tier][s.level][s.slot] = None
            self.moved += 1
        plan.moves = []
        plan.popped = []
        return dropped

    def abort(self, plan: Plan) -> None:
        """Forget a plan that was not copied: every index and mark goes back."""
        for m in plan.moves:
            s = self._slots.get(m.slot)
            if s is not None:
                s.evicts.discard(plan.task)
                s.readbacks.discard(plan.task)
        for tier, index in reversed(plan.popped):
            self._free[tier].append(index)
        plan.moves, plan.popped, plan.granted = [], [], []

    # -- internals ----------------------------------------------------------------------------

    def _remove(self, s: Slot) -> None:
        del self._slots[s.slot]
        del self._at[s.tier][s.index]
        del self._lru[s.tier][s.level][s.slot]
        self._free[s.tier].append(s.index)
        if s.key is not None and self._by_key.get(s.key) == s.slot:
            del self._by_key[s.key]

    # -- checks -------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant; raise ``AssertionError`` naming the first one broken."""
        for tier, cap in enumerate(self.capacity):
            free = self._free[tier]
            used = set(self._at[tier])
            _check(len(set(free)) == len(free), f"{TIERS[tier]}: free list has duplicates")
            _check(not (set(free) & used), f"{TIERS[tier]}: an index is both free and used")
            _check(len(free) + len(used) == cap, f"{TIERS[tier]}: indices leaked")
            listed = [sid for lru in self._lru[tier] for sid in lru]
            _check(sorted(listed) == sorted(self._at[tier].values()), f"{TIERS[tier]}: LRU")
        for sid, s in self._slots.items():
            _check(self._at[s.tier].get(s.index) == sid, f"slot {sid}: not at its index")
            _check(sid in self._lru[s.tier][s.level], f"slot {sid}: not in its level")
            _check(s.key is not None or bool(s.active or s.writes or s.readbacks or s.evicts),
                   f"slot {sid}: unpublished and unpinned (leaked)")  # fmt: skip
            for owner in s.active:
                _check(sid in self._by_owner.get(owner, ()), f"slot {sid}: owner not indexed")
        for key, sid in self._by_key.items():
            _check(sid in self._slots and self._slots[sid].key == key, f"key {key}: stale")
        for owner, sids in self._by_owner.items():
            _check(bool(sids), f"owner {owner}: indexed with nothing")
            for sid in sids:
                _check(owner in self._slots[sid].active, f"owner {owner}: slot {sid} not pinned")

    def counts(self) -> dict[str, int]:
        """Pages per tier, pinned pages, tasks in flight."""
        out = {t: len(self._at[i]) for i, t in enumerate(TIERS)}
        out["pinned"] = sum(1 for s in self._slots.values() if s.active)
        out["tasks"] = sum(
            len(s.writes) + len(s.readbacks) + len(s.evicts) for s in self._slots.values()
        )
        out["owners"] = len(self._by_owner)
        return out
