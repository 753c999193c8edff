"""Placement planning (``cluster/_placement.py``): pure, so no process is started here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from omniflow import Deploy, GraphError, OmniflowError
from omniflow.cluster._placement import ProcessSpec, plan_processes, resolve_connectors

MODULES: dict[str, str | None] = {"a": "pkg.one", "b": "pkg.one", "c": "pkg.two"}


def test_inproc_places_nothing() -> None:
    assert plan_processes("inproc", MODULES) == []


def test_process_gives_every_role_its_own_process() -> None:
    assert plan_processes("process", MODULES) == [
        ProcessSpec("a", ["a"], 1, ["pkg.one"]),
        ProcessSpec("b", ["b"], 1, ["pkg.one"]),
        ProcessSpec("c", ["c"], 1, ["pkg.two"]),
    ]


@pytest.mark.parametrize(
    "roles",
    [
        {"a": {"process": "g", "replicas": 3}, "c": {"process": "g"}},
        {"c": {"process": "g"}, "a": {"process": "g", "replicas": 3}},  # any order
    ],
)
def test_a_group_takes_the_count_one_role_states(roles: dict[str, Any]) -> None:
    [spec] = plan_processes(Deploy(roles), MODULES)
    assert spec.name == "g" and spec.replicas == 3
    assert sorted(spec.roles) == ["a", "c"] and sorted(spec.modules) == ["pkg.one", "pkg.two"]


def test_roles_not_named_stay_in_the_front() -> None:
    assert plan_processes(Deploy({"b": {}}), MODULES) == [ProcessSpec("b", ["b"], 1, ["pkg.one"])]


@pytest.mark.parametrize(
    ("placement", "modules", "message"),
    [
        ("gpu", MODULES, r"placement='gpu' is not understood"),
        (Deploy({"z": {}}), MODULES, r"Deploy names role 'z'.*roles: \['a', 'b', 'c'\]"),
        ("process", {"a": None}, r"role 'a' must run in a worker process.*__main__"),
        (
            Deploy({"a": {"process": "g", "replicas": 2}, "b": {"process": "g", "replicas": 3}}),
            MODULES,
            r"roles of process 'g' disagree on replicas \(2 vs 3: roles 'a' and 'b'\)",
        ),
    ],
)
def test_bad_placements_say_what_to_do(
    placement: Any, modules: dict[str, str | None], message: str
) -> None:
    with pytest.raises(OmniflowError, match=message):
        plan_processes(placement, modules)


def _plan(*edges: tuple[str, str], roles: dict[str, str]) -> Any:
    specs = {n: SimpleNamespace(role=r) for n, r in roles.items()}
    return SimpleNamespace(specs=specs, edges=[(s, "x", d, 0) for s, d in edges])


ROLES = {"a.run": "a", "b.run": "b", "c.run": "c"}
PLANS = {"g": _plan(("<input>", "a.run"), ("a.run", "b.run"), ("b.run", "c.run"), roles=ROLES)}


def test_connectors_are_checked_per_edge() -> None:
    group = [ProcessSpec("g", ["a", "b"], 1, ["m"])]
    got = resolve_connectors(
        PLANS, {("a.run", "b.run"): "inproc", "b.run->c.run": "zmq"}, frozenset({"a", "b"}), group
    )
    assert got == {"b.run": {"a.run": "inproc"}, "c.run": {"b.run": "zmq"}}
    assert resolve_connectors(PLANS, None, frozenset(), []) == {}
    # a default applies to every edge not named; "auto" edges are left out
    assert resolve_connectors(PLANS, {"default": "shm"}, frozenset(), []) == {
        "b.run": {"a.run": "shm"},
        "c.run": {"b.run": "shm"},
    }


@pytest.mark.parametrize(
    ("config", "remote", "groups", "message"),
    [
        ({("a.run", "b.run"): "pipe"}, frozenset(), [], r"connector 'pipe' .* is unknown"),
        ({("a.run", "c.run"): "shm"}, frozenset(), [], r"no graph of this runtime has"),
        ({"a.run": "shm"}, frozenset(), [], r"is not an edge"),
        (  # replicated group: the two ends may be in different processes
            {("a.run", "b.run"): "inproc"},
            frozenset({"a", "b"}),
            [ProcessSpec("g", ["a", "b"], 2, ["m"])],
            r"edge a.run -> b.run crosses processes.*use 'shm'",
        ),
        (  # one end in the front, one in a worker
            {("b.run", "c.run"): "inproc"},
            frozenset({"b"}),
            [ProcessSpec("b", ["b"], 1, ["m"])],
            r"crosses processes",
        ),
    ],
)
def test_connectors_that_cannot_work_are_graph_errors(
    config: dict[Any, str], remote: frozenset[str], groups: list[ProcessSpec], message: str
) -> None:
    with pytest.raises(GraphError, match=message):
        resolve_connectors(PLANS, config, remote, groups)
