"""The front's claim of forwarded runs whose forwarder was lost (unit level): the frame that
reported a forward may reach the front before the forward leaves the worker's queues, so a
run the front bound may die with its forwarder. The front asks each replica that should hold
such runs which ones it does not; those fail, the rest run on (docs/fast-path.md,
*Losing a forwarder*)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.cluster._fleet import Replica
from omniflow.cluster._forward import Hop
from omniflow.cluster._remote import RemoteRoles
from omniflow.cluster._remote_pending import Pending, Plan
from omniflow.cluster._replica import ReplicaEvent
from omniflow.cluster.fastpath._events import Handled, Made, Reported
from omniflow.transport._protocol import Claim, Claimed, decode_msg


def _front() -> tuple[RemoteRoles, list[tuple[str, BaseException | None]]]:
    ended: list[tuple[str, BaseException | None]] = []
    rr = RemoteRoles(
        [],
        registry=None,
        on_frame=lambda *a: None,
        on_done=lambda call, core, act, err: ended.append((act.wid, err)),
        on_return=lambda *a: None,
        spin=0.0,
    )
    return rr, ended


def _bind(rr: RemoteRoles, c: str, wid: str, target: Replica, via: Replica) -> None:
    """A forwarded run ``wid`` (``"<n>.0.0"``) of call ``c``, bound to ``target``, forwarded
    by ``via``: its parent's frame reported it, the core made it, the router bound it."""
    act = SimpleNamespace(node="m.run", wid=wid)
    core = SimpleNamespace(c=SimpleNamespace(specs={"m.run": SimpleNamespace(role="m")}))
    call = SimpleNamespace(call_id=c, graph="g")
    fast = rr._fast.core
    plan = Plan(Hop("x", "m.run", 0, "m", False), target, ())
    parent = int(wid.split(".")[0])
    fast.handle(Reported(via, c, parent, 0, [[0, wid]], (plan,), 0))
    [bind] = fast.handle(Made(c, "m.run", 0, 0, {"x": 1}))
    assert fast.handle(Handled(c)) == []
    key = (c, wid)
    rr._pending[key] = Pending(rr, key, call, core, act, [target], (), bind.via)  # type: ignore[arg-type]
    target.held.add(key)


def _ready(n: int) -> list[Replica]:
    reps = [Replica(f"r{i}", ["m"], f"uds:///r{i}") for i in range(n)]
    for rep in reps:
        rep.life.apply(ReplicaEvent.READY)
    return reps


def _claims(rep: Replica) -> list[Claim]:
    out = []
    while not rep.out.empty():
        msg = decode_msg(rep.out.get_nowait())
        assert type(msg) is Claim
        out.append(msg)
    return out


#: Bound runs: (call, forwarder index, target index); replica 0 is the one lost.
_RUNS = st.lists(
    st.tuples(st.sampled_from(["c", "d"]), st.integers(0, 2), st.integers(0, 3)),
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(runs=_RUNS, dead=st.sets(st.integers(1, 3)), missing=st.data())
def test_a_lost_forwarders_runs_are_claimed_and_only_the_missing_ones_fail(
    runs: list[tuple[str, int, int]], dead: set[int], missing: st.DataObject
) -> None:
    """Replica 0 is lost: each live replica (but 0) gets one claim per call, naming exactly
    the runs it holds that 0 forwarded; of those, the ones its answer lists fail once, with
    "replica lost" naming both replicas; the others, and every run another replica
    forwarded, stay bound; an answer not asked for, or naming a run not asked about, is
    dropped and counted; no claim is left."""

    async def main() -> None:
        rr, ended = _front()
        reps = _ready(4)
        bound: dict[tuple[str, str], tuple[int, int]] = {}
        for n, (c, via, target) in enumerate(runs):
            wid = f"{n}.0.0"
            _bind(rr, c, wid, reps[target], reps[via])
            bound[(c, wid)] = (via, target)
        for i in dead:
            reps[i].life.apply(ReplicaEvent.LOST)
        reps[0].life.apply(ReplicaEvent.LOST)
        rr._on_lost(reps[0], "killed")
        ended_by_loss = {wid for wid, _ in ended}  # (runs replica 0 itself held)
        assert ended_by_loss == {w for (c, w), (_, t) in bound.items() if t == 0}
        expect = {
            (t, c): sorted(
                w for (cc, w), (v, tt) in bound.items() if cc == c and tt == t and v == 0
            )
            for (c, _), (v, t) in bound.items()
            if v == 0 and t != 0 and t not in dead
        }
        asked = {}
        for t in range(1, 4):
            for claim in _claims(reps[t]):
                assert (t, claim.call_id) not in asked
                asked[(t, claim.call_id)] = (claim.request, sorted(claim.wire_ids))
        assert {k: ws for k, (_, ws) in asked.items()} == expect
        failed = set()
        for (t, c), (r, ws) in asked.items():
            lost = missing.draw(st.sets(st.sampled_from(ws)) if ws else st.just(set()))
            rr._on_message(reps[t], Claimed(r, c, [*sorted(lost), "9.9.9"]))  # (one not asked)
            rr._on_message(reps[t], Claimed(r, c, []))  # (answered already: foreign)
            failed |= {(c, w) for w in lost}
        assert rr._fast.core.claims == {}
        rr._fast.core.validate()
        now_ended = {w: e for w, e in ended if w not in ended_by_loss}
        assert set(now_ended) == {w for _, w in failed}
        assert len(now_ended) == len([w for w, _ in ended if w not in ended_by_loss])
        for c, w in failed:
            err = now_ended[w]
            t = bound[(c, w)][1]
            assert "replica lost" in str(err) and "'r0'" in str(err) and f"'r{t}'" in str(err)
            assert (c, w) not in rr._pending and (c, w) not in reps[t].held
            assert rr._fast.core.orphans[c][w] is reps[t]  # (what it may still send is dropped)
        for key, (_v, t) in bound.items():
            if t != 0 and key not in failed:
                assert key in rr._pending and key in reps[t].held
        stats = rr.wire_statistics()
        assert stats["dropped_malformed"] == len(asked)
        assert stats["dropped_foreign"] == len(asked)

    asyncio.run(main())


def test_a_claim_for_a_replica_that_is_then_lost_is_forgotten() -> None:
    async def main() -> None:
        rr, ended = _front()
        r0, r1 = _ready(2)
        _bind(rr, "c", "1.0.0", r1, r0)
        r0.life.apply(ReplicaEvent.LOST)
        rr._on_lost(r0, "killed")
        [claim] = _claims(r1)
        assert list(rr._fast.core.claims) == [claim.request]
        r1.life.apply(ReplicaEvent.LOST)
        rr._on_lost(r1, "killed")
        assert rr._fast.core.claims == {}
        rr._fast.core.validate()
        assert [(m["on"], m["from"], m["to"]) for m in rr.fast_path_story("c")] == [
            ("reported", "gone", "expected"), ("made", "expected", "bound"),
            ("ended", "bound", "gone"),
        ]  # fmt: skip
        [(wid, err)] = ended
        assert wid == "1.0.0" and "'r1'" in str(err)  # (lost with the replica that held it)

    asyncio.run(main())
