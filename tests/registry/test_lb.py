"""Load-balance policies as pure logic: a dict stands in for the affinity store."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omniflow import RegistryError
from omniflow.registry import (
    Broadcast,
    Replica,
    RoundRobin,
    SessionLoadBalance,
    load_balance,
)


def replicas(*ids: str, role: str = "llm") -> list[Replica]:
    return [Replica(role, rid, f"inproc://{rid}") for rid in ids]


class DictStore:
    """An AffinityStore in a dict; ``interfere`` pins sessions behind the balancer's back."""

    def __init__(self) -> None:
        self.pins: dict[tuple[str, str], str] = {}
        self.interfere: list[str] = []

    async def get_affinity(self, session: str, role: str) -> str | None:
        return self.pins.get((session, role))

    async def pin_affinity(
        self, session: str, role: str, replica_id: str, *, replace: str | None = None
    ) -> str:
        if self.interfere:  # another front won the race with a replica we do not know
            self.pins[(session, role)] = self.interfere.pop(0)
        current = self.pins.get((session, role))
        if current is None or current == replace:
            self.pins[(session, role)] = current = replica_id
        return current


async def test_round_robin_cycles_per_role() -> None:
    rr = RoundRobin()
    llm, vae = replicas("a", "b", "c"), replicas("v0", "v1", role="vae")
    picked = [(await rr.select("llm", llm))[0].replica_id for _ in range(4)]
    assert picked == ["a", "b", "c", "a"]
    assert rr.choose("vae", vae).replica_id == "v0"  # its own turn
    assert rr.choose("llm", llm[:2]).replica_id == "a"  # scale-down: turn 4, modulo 2


@given(st.integers(1, 8), st.integers(1, 50))
def test_round_robin_is_even(n_replicas: int, rounds: int) -> None:
    rr = RoundRobin()
    pool = replicas(*(f"r{i}" for i in range(n_replicas)))
    counts = Counter(rr.choose("llm", pool).replica_id for _ in range(n_replicas * rounds))
    assert set(counts.values()) == {rounds}


async def test_broadcast_returns_every_replica() -> None:
    pool = replicas("a", "b")
    assert await Broadcast().select("llm", pool, session="s") == pool


@pytest.mark.parametrize("policy", [RoundRobin(), Broadcast(), SessionLoadBalance(DictStore())])
async def test_no_replica_is_a_registry_error(policy: object) -> None:
    with pytest.raises(RegistryError, match="no live replica of role 'llm'") as info:
        await policy.select("llm", [], session="s")  # type: ignore[attr-defined]
    assert info.value.role == "llm"


async def test_session_affinity_pins_and_keeps() -> None:
    store = DictStore()
    lb = SessionLoadBalance(store)
    pool = replicas("a", "b", "c")
    first = await lb.route("s1", "llm", pool)
    assert store.pins[("s1", "llm")] == first.replica_id
    assert first == SessionLoadBalance.pick("s1", pool)  # a stable proposal
    for _ in range(5):
        assert await lb.route("s1", "llm", list(reversed(pool))) == first
    assert lb.statistics() == {"pinned": 1, "repinned": 0}


async def test_sessions_spread_over_replicas() -> None:
    lb = SessionLoadBalance(DictStore())
    pool = replicas("a", "b", "c")
    chosen = Counter([(await lb.route(f"s{i}", "llm", pool)).replica_id for i in range(300)])
    assert set(chosen) == {"a", "b", "c"} and min(chosen.values()) > 50


async def test_dead_replica_sessions_are_repinned_to_a_live_one() -> None:
    store = DictStore()
    lb = SessionLoadBalance(store)
    store.pins[("s1", "llm")] = "dead"
    replica = await lb.route("s1", "llm", replicas("a", "b"))
    assert replica.replica_id in ("a", "b") and store.pins[("s1", "llm")] == replica.replica_id
    assert lb.statistics() == {"pinned": 0, "repinned": 1}


async def test_losing_the_pin_race_follows_the_winner() -> None:
    store = DictStore()
    store.interfere = ["b"]  # the other front pinned s1 to b first
    lb = SessionLoadBalance(store)
    assert (await lb.route("s1", "llm", replicas("a", "b"))).replica_id == "b"


async def test_a_winner_we_do_not_see_is_replaced() -> None:
    store = DictStore()
    store.interfere = ["unknown-1"]
    lb = SessionLoadBalance(store)
    assert (await lb.route("s1", "llm", replicas("a"))).replica_id == "a"


async def test_endless_disagreement_gives_up_with_a_registry_error() -> None:
    store = DictStore()
    store.interfere = [f"ghost-{i}" for i in range(10)]
    with pytest.raises(RegistryError, match="could not pin session 's1'"):
        await SessionLoadBalance(store).route("s1", "llm", replicas("a"))


async def test_no_session_falls_back_to_round_robin() -> None:
    store = DictStore()
    lb = SessionLoadBalance(store)
    pool = replicas("a", "b")
    picked = [(await lb.select("llm", pool))[0].replica_id for _ in range(3)]
    assert picked == ["a", "b", "a"] and store.pins == {}


def test_load_balance_by_name() -> None:
    assert isinstance(load_balance("round_robin"), RoundRobin)
    assert isinstance(load_balance("broadcast"), Broadcast)
    assert isinstance(load_balance("session", store=DictStore()), SessionLoadBalance)
    local = load_balance("session")  # one front: pins kept in this process
    assert isinstance(local, SessionLoadBalance) and local.store is None
    with pytest.raises(RegistryError, match="unknown load-balance policy 'random'"):
        load_balance("random")


@given(
    st.text(min_size=1, max_size=12),
    st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=8, unique=True),
    st.randoms(use_true_random=False),
)
def test_session_pick_is_a_rendezvous_hash(session: str, ids: list[str], rnd: Any) -> None:
    """Fronts that see the same replicas in any order propose the same one, and a replica
    leaving moves only the sessions it had (highest random weight)."""
    pool = replicas(*ids)
    chosen = SessionLoadBalance.pick(session, pool)
    shuffled = list(pool)
    rnd.shuffle(shuffled)
    assert SessionLoadBalance.pick(session, shuffled) == chosen
    other = next(r for r in pool if r != chosen)
    assert SessionLoadBalance.pick(session, [r for r in pool if r != other]) == chosen


async def test_without_a_store_pins_stay_in_this_process() -> None:
    lb = SessionLoadBalance()
    pool = replicas("a", "b", "c")
    [first] = lb.select_now("llm", pool, session="s1") or []
    assert lb.select_now("llm", list(reversed(pool)), session="s1") == [first]
    assert await lb.route("s1", "llm", pool) == first
    survivors = [r for r in pool if r != first]
    [moved] = lb.select_now("llm", survivors, session="s1") or []
    assert moved in survivors and lb.statistics() == {"pinned": 1, "repinned": 1}
    lb.forget("s1")
    assert lb.pinned("s1", "llm", pool) is None


async def test_with_a_store_a_new_session_needs_the_round_trip() -> None:
    store = DictStore()
    rr = RoundRobin()
    lb = SessionLoadBalance(store, fallback=rr)
    pool = replicas("a", "b")
    assert lb.select_now("llm", pool, session="s1") is None  # must ask the store
    [rep] = await lb.select("llm", pool, session="s1")
    assert lb.select_now("llm", pool, session="s1") == [rep]  # the local copy answers now
    assert lb.select_now("llm", pool) == [pool[0]] and rr.choose("llm", pool) == pool[1]


async def test_route_asks_find_about_a_pin_to_a_replica_not_seen_here() -> None:
    store = DictStore()
    store.pins[("s1", "llm")] = "elsewhere"
    pool = replicas("a")
    late = Replica("llm", "elsewhere", "inproc://elsewhere")
    asked: list[str] = []

    async def find(rid: str) -> Replica | None:
        asked.append(rid)
        pool.append(late)  # connected here meanwhile
        return late

    assert await SessionLoadBalance(store).route("s1", "llm", lambda: pool, find=find) == late
    assert asked == ["elsewhere"] and store.pins[("s1", "llm")] == "elsewhere"
