"""The slot engine's pure core: a hypothesis state machine, TinyLFU, and the Zipf hit rate."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omniflow import PoolExhaustedError
from omniflow.data.kv._sketch import CountMinSketch
from omniflow.data.kv._slots import L1, L2, L3, SlotCore, level_of

OWNERS = ("a", "b", "c")
KEYS = tuple(f"h{i}" for i in range(12))


class SlotMachine(RuleBasedStateMachine):
    """Legal transitions only through the core's API; validate() after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.core = SlotCore({"l1": 4, "l2": 3, "l3": 2})
        self.owned: dict[str, set[int]] = {}
        self.tasks: dict[int, set[tuple[str, str]]] = {}

    def pinned_l1(self) -> int:
        return sum(1 for s in self.core.slots() if s.tier == L1 and not s.movable)

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 3))
    def alloc(self, owner: str, n: int) -> None:
        before = self.core.counts()
        blocked = self.pinned_l1()
        try:
            plan = self.core.plan_room(L1, n)
        except PoolExhaustedError:
            assert blocked + n > 4, "refused although enough pages could move"
            assert self.core.counts() == before, "a refused plan changed something"
            return
        self.core.commit(plan)
        self.owned.setdefault(owner, set()).update(self.core.new_slots(owner, plan))

    @precondition(lambda self: any(self.owned.values()))
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def publish(self, data: st.DataObject, key: str) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, s in self.owned.items() if s)))
        slot = data.draw(st.sampled_from(sorted(self.owned[owner])))
        s = self.core.slot(slot)
        if s.key is None:
            ok = self.core.publish(slot, key, fill=3)
            assert ok == (self.core.lookup(key) is s)

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner: str) -> None:
        freed = self.core.release(owner)
        for slot in freed:
            assert not self.core.has(slot)
        self.owned.pop(owner, None)

    @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS))
    def match(self, key: str, owner: str) -> None:
        """A published page, pinned and read back to L1 (if L1 can take it)."""
        s = self.core.lookup(key)
        if s is None:
            return
        self.core.pin(s.slot, owner)
        self.core.touch(s.slot)
        self.owned.setdefault(owner, set()).add(s.slot)
        if s.tier != L1:
            try:
                plan = self.core.plan_readback(s.slot)
            except PoolExhaustedError:
                assert self.pinned_l1() >= 4
                return
            assert s.readbacks, "a readback marks its page"
            self.core.commit(plan)
            assert s.tier == L1 and not s.readbacks

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True),
          owner=st.sampled_from(OWNERS))  # fmt: skip
    def match_run(self, keys: list[str], owner: str) -> None:
        """A run of published pages taken in one step and read back in one batched plan:
        contiguous sources land contiguous (sorted pairing), every byte has one place."""
        run = [s.slot for k in keys if (s := self.core.lookup(k)) is not None]
        if not run:
            return
        self.core.take(run, owner)
        self.owned.setdefault(owner, set()).update(run)
        for sid in run:
            assert owner in self.core.slot(sid).active
        down = [sid for sid in run if self.core.slot(sid).tier != L1]
        if not down:
            return
        try:
            plan = self.core.plan_readback(down)
        except PoolExhaustedError:
            assert self.pinned_l1() + len(down) > 4
            return
        srcs = sorted((m.src_tier, m.src_index) for m in plan.moves if m.slot in down)
        ups = sorted(((m.src_tier, m.src_index), m.dst_index) for m in plan.moves
                     if m.slot in down)  # fmt: skip
        assert [s for s, _ in ups] == srcs
        assert [d for _, d in ups] == sorted(d for _, d in ups), "pairing is not monotone"
        self.core.commit(plan)
        for sid in down:
            assert self.core.slot(sid).tier == L1

    @precondition(lambda self: bool(self.core.slots()))
    @rule(data=st.data(), kind=st.sampled_from(("writes", "readbacks")))
    def start_task(self, data: st.DataObject, kind: str) -> None:
        slot = data.draw(st.sampled_from(sorted(s.slot for s in self.core.slots())))
        task = self.core.new_task("t")
        self.core.mark(slot, kind, task)
        self.core.mark(slot, kind, task)  # idempotent
        self.tasks.setdefault(slot, set()).add((kind, task))

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def end_task(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.tasks)))
        kind, task = sorted(self.tasks[slot])[0]
        self.core.unmark(slot, kind, task)
        self.core.unmark(slot, kind, task)  # idempotent: no negative count
        self.tasks[slot].discard((kind, task))
        if not self.tasks[slot]:
            del self.tasks[slot]

    @rule(n=st.integers(1, 4))
    def plan_then_abort(self, n: int) -> None:
        before = (self.core.counts(), {s.slot: (s.tier, s.index) for s in self.core.slots()})
        try:
            plan = self.core.plan_room(L1, n)
        except PoolExhaustedError:
            return
        self.core.abort(plan)
        after = (self.core.counts(), {s.slot: (s.tier, s.index) for s in self.core.slots()})
        assert before == after

    @invariant()
    def valid(self) -> None:
        self.core.validate()
        for owner, slots in self.owned.items():
            for slot in slots:
                assert self.core.has(slot), f"pinned slot {slot} was dropped"
                assert owner in self.core.slot(slot).active
        for slot in self.tasks:
            assert self.core.has(slot), f"slot {slot} with a task in flight was dropped"

    def teardown(self) -> None:
        for slot, tasks in self.tasks.items():
            for kind, task in tasks:
                self.core.unmark(slot, kind, task)
        for owner in OWNERS:
            self.core.release(owner)
        self.core.validate()
        counts = self.core.counts()
        assert counts["pinned"] == 0 and counts["tasks"] == 0 and counts["owners"] == 0
        assert all(s.key is not None for s in self.core.slots()), "unpublished page leaked"


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_sketch_counts_saturates_and_halves() -> None:
    s = CountMinSketch(16, sample=1000)
    for _ in range(40):
        s.add("hot")
    assert s.estimate("hot") == 15  # 4-bit counters saturate
    s2 = CountMinSketch(16, sample=20)
    for _ in range(19):
        s2.add("a")
    assert s2.estimate("a") == 15
    s2.add("a")  # the 20th add halves every counter
    assert s2.estimate("a") == 7
    assert [level_of(f) for f in (0, 1, 2, 3, 4, 8, 15)] == [0, 0, 1, 1, 2, 3, 3]


def test_demotion_cascades_and_drops_only_from_the_last_tier() -> None:
    core = SlotCore({"l1": 1, "l2": 1, "l3": 1})
    for i in range(3):
        plan = core.plan_room(L1, 1)
        core.commit(plan)
        (slot,) = core.new_slots("o", plan)
        core.publish(slot, f"k{i}", 4)
        core.release("o")
    assert [core.lookup(f"k{i}").tier for i in range(3)] == [L3, L2, L1]  # type: ignore[union-attr]
    assert core.evictions == 0
    plan = core.plan_room(L1, 1)
    assert [(m.src_tier, m.dst_tier) for m in plan.moves] == [(L3, None), (L2, L3), (L1, L2)]
    core.commit(plan)
    assert core.lookup("k0") is None and core.evictions == 1


def test_tinylfu_does_not_admit_a_colder_page_into_the_last_tier() -> None:
    core = SlotCore({"l1": 1, "l2": 0, "l3": 1})
    for key in ("hot", "cold"):
        plan = core.plan_room(L1, 1)
        core.commit(plan)
        (slot,) = core.new_slots("o", plan)
        core.publish(slot, key, 4)
        core.release("o")
        if key == "hot":
            for _ in range(6):
                core.touch(slot)
    hot = core.lookup("hot")
    assert hot is not None and hot.tier == L3
    plan = core.plan_room(L1, 1)  # "cold" leaves L1; L3 keeps "hot"
    core.commit(plan)
    assert core.lookup("cold") is None and core.lookup("hot") is hot


def test_exhausted_at_once_and_unchanged_when_pages_are_owned() -> None:
    core = SlotCore({"l1": 2, "l2": 2})
    plan = core.plan_room(L1, 2)
    core.commit(plan)
    core.new_slots("a", plan)
    with pytest.raises(PoolExhaustedError, match="pinned"):
        core.plan_room(L1, 1)
    core.validate()
    assert core.free_count(L2) == 2


def zipf_keys(n_keys: int, n: int, s: float = 1.1, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    cum = list(itertools.accumulate(1 / (i + 1) ** s for i in range(n_keys)))
    return [f"k{i}" for i in rng.choices(range(n_keys), cum_weights=cum, k=n)]


@pytest.mark.parametrize("capacity", [64, 256])
def test_zipf_hit_rate_beats_plain_lru_under_4x_oversubscription(capacity: int) -> None:
    """Deterministic (seeded) simulation: 4x more distinct pages than L1 holds."""
    seq = zipf_keys(4 * capacity, 20_000)
    core = SlotCore({"l1": capacity})
    hits = 0
    for key in seq:
        s = core.lookup(key)
        if s is not None:
            hits += 1
            core.touch(s.slot)
            continue
        plan = core.plan_room(L1, 1)
        core.commit(plan)
        (slot,) = core.new_slots("engine", plan)
        core.publish(slot, key, 1)
        core.release("engine")
    lru: OrderedDict[str, None] = OrderedDict()
    lru_hits = 0
    for key in seq:
        if key in lru:
            lru_hits += 1
            lru.move_to_end(key)
        else:
            lru[key] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
    core.validate()
    assert hits >= lru_hits, (hits / len(seq), lru_hits / len(seq))
    assert hits / len(seq) > 0.75  # 0.81 / 0.84 measured for 64 / 256; LRU 0.75 / 0.81
