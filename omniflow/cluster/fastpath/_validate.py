"""``FastPathCore.validate``: every invariant of the fast-path machine, checked between events.

Tests call it after every event (``test_fastpath_core``'s ``Checked``, the hypothesis machine in
``test_fastpath_machine``); production leaves it off.
"""

from __future__ import annotations

from typing import Any

from omniflow.cluster.fastpath._events import RunState
from omniflow.cluster.fastpath._waiting import Waiting, parent_of

__all__ = ["validate_fastpath"]

_EARLY, _EXPECTED, _BOUND, _ORPHAN = (
    RunState.EARLY, RunState.EXPECTED, RunState.BOUND, RunState.ORPHAN,
)  # fmt: skip


def validate_fastpath(
    runs: dict[tuple[str, str], RunState],
    expect: dict[str, tuple[str, Any, int, Any]] | None,
    rejected: list[tuple[str, Any, int, Any]],
    replaying: list[tuple[str, str]],
    early: dict[str, Waiting],
    orphans: dict[str, dict[str, Any]],
    bound: dict[tuple[str, str], tuple[Any, Any]],
    cut: dict[str, set[int | str]],
    claims: dict[int, tuple[Any, str, list[str], Any]],
) -> None:
    """Raise AssertionError naming the first breach of an invariant of the machine's tables
    (``FastPathCore``'s fields of the same names; ``replaying``: runs bound by the frame in
    the core, whose early messages replay at ``Handled``): each run's
    state matches the tables that hold it (EARLY/EXPECTED: messages kept, EXPECTED: the
    frame in the core reported it, BOUND: bound, ORPHAN: among the orphans), the parent
    index is exact, no empty table is kept, nothing is expected outside a frame."""
    expected_wids = {w for w, _p, _q, _v in rejected}
    if expect is None:
        assert not rejected and not replaying, "expectations outside a frame"
    else:
        expected_wids |= {w for w, _p, _q, _v in expect.values()}
    replay = set(replaying)
    seen: set[tuple[str, str]] = set()
    for c, waiting in early.items():
        assert waiting.early, f"call {c}: an empty Waiting kept"
        index: dict[int | str, set[str]] = {}
        for wid in waiting.early:
            index.setdefault(parent_of(wid), set()).add(wid)
            state = runs.get((c, wid))
            assert state is _EARLY or state is _EXPECTED or (c, wid) in replay, (
                f"call {c}: run {wid} has early messages but is {_name(state)}"
            )
            seen.add((c, wid))
        assert index == waiting.kids, f"call {c}: Waiting's parent index is stale"
    for c, kept in orphans.items():
        assert kept, f"call {c}: an empty orphan table kept"
        for wid in kept:
            assert runs.get((c, wid)) is _ORPHAN, f"call {c}: {wid} kept as an orphan"
    for key in bound:
        assert runs.get(key) is _BOUND, f"run {key} bound but {_name(runs.get(key))}"
    for c, cuts in cut.items():
        assert cuts, f"call {c}: an empty cut kept"
    for (c, w), state in runs.items():
        if state is _EARLY:
            assert (c, w) in seen, f"call {c}: run {w} early with nothing kept"
        elif state is _EXPECTED:
            assert w in expected_wids, f"call {c}: run {w} expected by no frame"
        elif state is _BOUND:
            assert (c, w) in bound, f"call {c}: run {w} bound to nothing"
        else:
            assert w in orphans.get(c, ()), f"call {c}: orphan {w} not kept"
    for r, (_target, c, wids, _via) in claims.items():
        assert wids and all(type(w) is str for w in wids), f"claim {r} of call {c}: {wids}"


def _name(state: RunState | None) -> str:
    return "gone" if state is None else state.value
