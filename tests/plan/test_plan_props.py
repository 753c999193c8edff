"""Property tests: random graphs against a reference model computed here, independently.

A ``Model`` is a plain description of a graph; ``build`` turns it into real Role classes
(async methods taking ``**fields``) and an ``of.Graph``. Valid models are generated so that
every node can fire (OR group 0 of node i draws only from Placeholders and outputs of nodes
before i); other OR groups may draw from any output, which makes cycles and self-loops.

The reference side recomputes producers, edges, buckets, slots and critical slots from the
model, and checks diamond roots by plain reachability (``d`` dominates ``x`` iff ``x`` is
unreachable from ``<input>`` once ``d`` is removed), never through the plan's dominator code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omniflow as of
from omniflow._cli_plan import render_dot, render_json, render_table
from omniflow.dsl import LB_POLICIES

IN = "<input>"
FIELDS = ("a", "b", "c", "d", "e")
PLACEHOLDERS = ("p0", "p1", "p2")
RoleFactory = Callable[..., of.Role]

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass
class NodeModel:
    role: str
    method: str
    groups: list[list[str]]
    outputs: list[str]
    lb: str = "round_robin"
    collect: list[str] = field(default_factory=list)
    count: dict[str, Any] | None = None
    kind: str = "coro"  # "coro" | "gen" | "sync"
    params: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.role}.{self.method}"

    def decl(self) -> dict[str, Any]:
        return {
            "inputs_or": self.groups,
            "outputs": self.outputs,
            "lb": self.lb,
            "collect": self.collect,
            "activate_by_count": self.count,
            "kind": self.kind,
            "params": self.params,
        }


@dataclass
class Model:
    placeholders: list[str]
    nodes: list[NodeModel]
    outputs: list[str]
    max_iterations: int = 8

    def copy(self) -> Model:
        return Model(
            list(self.placeholders),
            [
                replace(
                    n,
                    groups=[list(g) for g in n.groups],
                    outputs=list(n.outputs),
                    collect=list(n.collect),
                    count=None if n.count is None else dict(n.count),
                )
                for n in self.nodes
            ],
            list(self.outputs),
            self.max_iterations,
        )


def build(model: Model, make_role: RoleFactory, name: str = "rand") -> of.Graph:
    by_role: dict[str, dict[str, Any]] = {}
    for n in model.nodes:
        by_role.setdefault(n.role, {})[n.method] = n.decl()
    roles = {r: make_role(methods, name=f"Role_{r}") for r, methods in by_role.items()}
    return of.Graph(
        name,
        roles=roles,
        inputs=[of.Placeholder(p) for p in model.placeholders],
        outputs=model.outputs,
        max_iterations=model.max_iterations,
    )


# -- generation ---------------------------------------------------------------------------------


@st.composite
def models(draw: st.DrawFn, cyclic: bool | None = None) -> Model:
    if cyclic is None:
        cyclic = draw(st.booleans())
    placeholders = draw(
        st.lists(st.sampled_from(PLACEHOLDERS), min_size=1, max_size=2, unique=True)
    )
    n = draw(st.integers(1, 6))
    # With cycles allowed, a node may also output a Placeholder's name: that field then has
    # <input> among its sources (and every consumer of it becomes a possible loop).
    universe = FIELDS + PLACEHOLDERS[:1] if cyclic else FIELDS
    outputs = [draw(st.lists(st.sampled_from(universe), max_size=3, unique=True)) for _ in range(n)]
    produced_all = sorted(set(placeholders).union(*map(set, outputs)))
    nodes = []
    for i in range(n):
        if cyclic:  # a field some earlier node produces: node i can fire
            early = sorted(set(placeholders).union(*map(set, outputs[:i])))
        else:  # a field only earlier nodes produce: no edge points backwards
            later = set().union(*map(set, outputs[i:]))
            early = sorted(set(placeholders).union(*map(set, outputs[:i])) - later)
        pool = produced_all if cyclic else early
        # Mostly feed later nodes from node outputs, not Placeholders, so that paths fork and
        # meet below the entry (diamond roots other than <input>).
        inner = [f for f in early if f not in placeholders]
        if inner and draw(st.integers(0, 7)):
            early = inner
        inner = [f for f in pool if f not in placeholders]
        if inner and draw(st.integers(0, 7)):
            pool = inner
        groups = [draw(st.lists(st.sampled_from(early), min_size=1, max_size=3, unique=True))]
        for _ in range(draw(st.integers(0, 2))):
            groups.append(
                draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
            )
        inputs = sorted({f for g in groups for f in g})
        collect = (
            draw(st.lists(st.sampled_from(inputs), max_size=2, unique=True))
            if draw(st.booleans())
            else []
        )
        count = None
        if len(groups) == 1 and draw(st.integers(0, 5)) == 0:
            candidates = [f for f in groups[0] if f not in collect]
            if candidates:
                fields = draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True))
                count = {f: draw(st.sampled_from([1, 2, of.ALL])) for f in fields}
        nodes.append(
            NodeModel(
                role=f"r{draw(st.integers(0, i))}",
                method=f"m{i}",
                groups=groups,
                outputs=outputs[i],
                lb=draw(st.sampled_from(LB_POLICIES)),
                collect=collect,
                count=count,
                kind=draw(st.sampled_from(["coro", "gen"])),
            )
        )
    node_outputs = sorted(set().union(*map(set, outputs)))
    graph_outputs = (
        draw(st.lists(st.sampled_from(node_outputs), unique=True)) if node_outputs else []
    )
    return Model(placeholders, nodes, graph_outputs, draw(st.integers(1, 64)))


# -- the reference ------------------------------------------------------------------------------


class Reference:
    """What the plan must say, computed straight from the model."""

    def __init__(self, m: Model) -> None:
        self.m = m
        self.nodes = {n.name: n for n in m.nodes}
        self.producers: dict[str, list[str]] = {}
        for p in m.placeholders:
            self.producers.setdefault(p, []).append(IN)
        for n in m.nodes:
            for f in n.outputs:
                self.producers.setdefault(f, []).append(n.name)
        self.edges = {
            (src, f, n.name, gi)
            for n in m.nodes
            for gi, grp in enumerate(n.groups)
            for f in grp
            for src in self.producers[f]
        }
        self.succ: dict[str, set[str]] = {IN: set(), **{n: set() for n in self.nodes}}
        for src, _f, dst, _g in self.edges:
            self.succ[src].add(dst)
        self.buckets = {
            (n.name, gi)
            for n in m.nodes
            for gi, grp in enumerate(n.groups)
            if sum(len(self.producers[f]) for f in grp) >= 2
            or any(f in n.collect for f in grp)
            or n.count
        }
        self.critical = {
            (n.name, gi, f)
            for n in m.nodes
            for gi, grp in enumerate(n.groups)
            for f in grp
            if len(self.producers[f]) == 1
        }

    @property
    def depth(self) -> dict[str, int]:
        """Hops from <input> on a shortest path."""
        depth, frontier = {IN: 0}, [IN]
        while frontier:
            nxt = []
            for n in frontier:
                for m in self.succ[n]:
                    if m not in depth:
                        depth[m] = depth[n] + 1
                        nxt.append(m)
            frontier = nxt
        return depth

    def reach(self, start: str, removed: str | None = None) -> set[str]:
        if start == removed:
            return set()
        seen, todo = {start}, [start]
        while todo:
            for nxt in self.succ[todo.pop()]:
                if nxt not in seen and nxt != removed:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def dominates(self, d: str, x: str) -> bool:
        if d in (x, IN):
            return True
        return x != IN and x not in self.reach(IN, removed=d)

    def on_cycle(self, n: str) -> bool:
        return any(n in self.reach(s) for s in self.succ[n])

    def sources(self, bucket: tuple[str, int]) -> set[str]:
        node, gi = bucket
        return {src for f in self.nodes[node].groups[gi] for src in self.producers[f]}


def check_plan(plan: of.StaticPlan, m: Model) -> None:
    ref = Reference(m)
    everything = [IN, *ref.nodes]
    assert set(plan.nodes) == set(ref.nodes) and len(plan.nodes) == len(ref.nodes)
    assert plan.inputs == tuple(m.placeholders)
    assert plan.outputs == tuple(m.outputs)
    assert plan.producers == {f: tuple(sorted(s)) for f, s in ref.producers.items()}
    assert plan.edges == ref.edges
    flat = [(src, *e) for src, lst in plan.ctrl_edges.items() for e in lst]
    assert len(flat) == len(ref.edges)
    assert {(s, f, d, g) for s, d, g, f in flat} == ref.edges
    assert all(
        lst == sorted(lst, key=lambda e: (e[2], e[0], e[1])) for lst in plan.ctrl_edges.values()
    )

    # A bucket iff >= 2 upstream paths, collect or activate_by_count.
    assert plan.buckets == ref.buckets
    assert set(plan.diamond_roots) == ref.buckets
    assert set(plan.slots) == ref.buckets
    for node, gi in ref.buckets:
        grp = ref.nodes[node].groups[gi]
        assert plan.slots[(node, gi)] == tuple(
            sorted((f, src) for f in grp for src in ref.producers[f])
        )
    # A slot is critical iff its field has exactly one producer.
    assert plan.critical_slots == ref.critical
    assert plan.edge_rule == {e: ("C" if (e[2], e[3]) in ref.buckets else "A") for e in ref.edges}

    # Diamond roots, checked by reachability alone.
    for bucket, root in plan.diamond_roots.items():
        sources = ref.sources(bucket)
        for s in sources:
            assert ref.dominates(root, s), (bucket, root, s)
        if ref.nodes[bucket[0]].count or IN in sources:
            assert root == IN
        elif len(sources) == 1 and not any(
            f in ref.nodes[bucket[0]].collect for f in ref.nodes[bucket[0]].groups[bucket[1]]
        ):
            # Plain fields of one producer pair up frame by frame: the producer is the root.
            assert root == next(iter(sources))
        elif len(sources) == 1:
            (only,) = sources
            assert root != only
            strict = [d for d in everything if d != only and ref.dominates(d, only)]
            assert root in strict
            assert all(ref.dominates(d, root) for d in strict), "not the immediate dominator"
        else:
            common = [d for d in everything if all(ref.dominates(d, s) for s in sources)]
            assert root in common
            assert all(ref.dominates(d, root) for d in common), "not the nearest one"
    assert plan.root_nodes == set(plan.diamond_roots.values()) - {IN}

    assert plan.seq_producers == {n.name for n in m.nodes if n.kind == "gen" or n.lb == "session"}
    assert plan.cycle_nodes == {n for n in ref.nodes if ref.on_cycle(n)}
    assert plan.reach == {n: ref.reach(n) for n in everything}
    # Plan order is a BFS from the entry: depths never decrease along it.
    depths = [ref.depth[n] for n in plan.nodes]
    assert depths == sorted(depths)
    assert plan.output_producers == {
        f: tuple(sorted(s for s in ref.producers[f] if s != IN)) for f in m.outputs
    }
    assert plan.max_iterations == m.max_iterations
    assert {n: (s.groups, s.outputs, s.lb, s.collect) for n, s in plan.specs.items()} == {
        n.name: (
            tuple(map(tuple, n.groups)),
            tuple(n.outputs),
            n.lb,
            frozenset(n.collect),
        )
        for n in m.nodes
    }


@pytest.mark.slow
@SETTINGS
@given(model=models())
def test_random_graphs_match_the_reference(make_role: RoleFactory, model: Model) -> None:
    graph = build(model, make_role)
    plan = of.parse(graph)
    check_plan(plan, model)
    # Parsing twice, or parsing an equal graph built afresh, gives an equal plan.
    assert of.parse(graph) == plan
    assert of.parse(build(model, make_role)) == plan
    # Every renderer of `omniflow plan` handles every valid plan.
    plans = {plan.graph: plan}
    assert json.loads(render_json(plans))[plan.graph]["graph"] == plan.graph
    assert render_table(plans).startswith(f"graph '{plan.graph}'")
    assert render_dot(plans).rstrip().endswith("}")


@pytest.mark.slow
@SETTINGS
@given(model=models(cyclic=False))
def test_dags_have_no_cycle_nodes(make_role: RoleFactory, model: Model) -> None:
    plan = of.parse(build(model, make_role))
    assert plan.cycle_nodes == frozenset()
    check_plan(plan, model)


# -- invalid mutations --------------------------------------------------------------------------

#: name -> (applies to model?, mutate(model, node index, draw) -> (expected node, field) or None)
Mutation = Callable[[Model, int, st.DrawFn], tuple[str | None, str | None]]


def _consumed_non_placeholders(m: Model) -> list[str]:
    used = {f for n in m.nodes for g in n.groups for f in g}
    return sorted(used - set(m.placeholders))


def drop_producer(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    f = draw(st.sampled_from(_consumed_non_placeholders(m)))
    for n in m.nodes:
        if f in n.outputs:
            n.outputs.remove(f)
    return None, f


def make_sync(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes[i].kind = "sync"
    return m.nodes[i].name, None


def empty_group(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes[i].groups.insert(draw(st.integers(0, len(m.nodes[i].groups))), [])
    m.nodes[i].count = None
    return m.nodes[i].name, None


def no_groups(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    n = m.nodes[i]
    n.groups, n.collect, n.count = [], [], None
    return n.name, None


def bad_lb(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes[i].lb = draw(st.sampled_from(["fastest", "", "Session", "round-robin"]))
    return m.nodes[i].name, None


def collect_non_input(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes[i].collect.append("zz_nowhere")
    return m.nodes[i].name, "zz_nowhere"


def count_non_input(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    n = m.nodes[i]
    n.groups = n.groups[:1]
    n.collect = [f for f in n.collect if f in n.groups[0]]
    n.count = {**(n.count or {}), "zz_nowhere": draw(st.sampled_from([1, of.ALL]))}
    return n.name, "zz_nowhere"


def count_two_groups(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    n = m.nodes[i]
    f = n.groups[0][0]
    n.collect = [c for c in n.collect if c != f]
    n.count = {f: of.ALL}
    n.groups.append(list(n.groups[0]))
    return n.name, None


def count_and_collect(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    n = m.nodes[i]
    n.groups = n.groups[:1]
    f = n.groups[0][0]
    n.collect = [f]
    n.count = {f: 1}
    return n.name, f


def bad_count_value(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    n = m.nodes[i]
    n.count = {n.groups[0][0]: draw(st.sampled_from([0, -1, True, "all", 1.5, None]))}
    return None, None  # rejected by @interface, before any node name exists


def bad_signature(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes[i].params = draw(st.sampled_from([("zz_required",), ("zz_opt=None",), ("x", "/")]))
    return m.nodes[i].name, None


def duplicate_in_group(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    g = m.nodes[i].groups[0]
    g.append(g[0])
    return m.nodes[i].name, None


def duplicate_output(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes[i].outputs += ["zz_twice", "zz_twice"]
    return m.nodes[i].name, None


def non_field_name(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    bad = draw(st.sampled_from(["", 3, None]))
    where = draw(st.sampled_from(["outputs", "group", "collect"]))
    n = m.nodes[i]
    if where == "outputs":
        n.outputs.append(bad)  # type: ignore[arg-type]
    elif where == "group":
        n.groups[0].append(bad)  # type: ignore[arg-type]
    else:
        n.collect.append(bad)  # type: ignore[arg-type]
    return None, None


def ghost_output(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.outputs.append("zz_ghost")
    return None, "zz_ghost"


def placeholder_only_output(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.placeholders.append("zz_in")
    m.outputs.append("zz_in")
    return None, "zz_in"


def duplicate_placeholder(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.placeholders.append(m.placeholders[0])
    return None, m.placeholders[0]


def closed_cycle(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes.append(NodeModel("zz_a", "run", [["zz_ping"]], ["zz_pong"]))
    m.nodes.append(NodeModel("zz_b", "run", [["zz_pong"]], ["zz_ping"]))
    return None, None


def needs_own_output(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.nodes[i].groups = [[*g, "zz_self"] for g in m.nodes[i].groups]
    m.nodes[i].outputs.append("zz_self")
    return None, None  # the error may name a node downstream that starves with it


def bad_max_iterations(m: Model, i: int, draw: st.DrawFn) -> tuple[str | None, str | None]:
    m.max_iterations = draw(st.sampled_from([0, -3, True, 2.5]))
    return None, None


MUTATIONS: dict[str, Mutation] = {
    f.__name__: f
    for f in (
        drop_producer,
        make_sync,
        empty_group,
        no_groups,
        bad_lb,
        collect_non_input,
        count_non_input,
        count_two_groups,
        count_and_collect,
        bad_count_value,
        bad_signature,
        duplicate_in_group,
        duplicate_output,
        non_field_name,
        ghost_output,
        placeholder_only_output,
        duplicate_placeholder,
        closed_cycle,
        needs_own_output,
        bad_max_iterations,
    )
}


def _applicable(m: Model) -> Iterable[str]:
    for name in MUTATIONS:
        if name == "drop_producer" and not _consumed_non_placeholders(m):
            continue
        yield name


@pytest.mark.slow
@SETTINGS
@given(model=models(), data=st.data())
def test_invalid_mutations_raise_graph_error(
    make_role: RoleFactory, model: Model, data: st.DataObject
) -> None:
    bad = model.copy()
    name = data.draw(st.sampled_from(sorted(_applicable(bad))), label="mutation")
    i = data.draw(st.integers(0, len(bad.nodes) - 1), label="node")
    node, fld = MUTATIONS[name](bad, i, data.draw)
    with pytest.raises(of.GraphError) as info:
        of.parse(build(bad, make_role))
    err = info.value
    msg = str(err)
    if node is not None:
        assert err.node == node, (name, msg)
        assert f"'{node}'" in msg, (name, msg)
    if fld is not None:
        assert err.field == fld, (name, msg)
        assert f"'{fld}'" in msg, (name, msg)
    if err.node is not None:
        assert "graph 'rand'" in msg, (name, msg)
    # The valid original still parses: the mutation, not the generator, made the error.
    check_plan(of.parse(build(model, make_role)), model)


def _plan_order(m: Model) -> list[str]:
    """CONTRACT §2 plan order, recomputed from the model: breadth-first from the graph inputs,
    the successors of each node (any node consuming one of its outputs, or a Placeholder)
    visited by name, then the nodes no input reaches, by name."""
    producers: dict[str, set[str]] = {p: {IN} for p in m.placeholders}
    for n in m.nodes:
        for f in n.outputs:
            producers.setdefault(f, set()).add(n.name)
    succ: dict[str, set[str]] = {IN: set()}
    for n in m.nodes:
        for grp in n.groups:
            for f in grp:
                for src in producers.get(f, ()):
                    succ.setdefault(src, set()).add(n.name)
    order: list[str] = []
    seen = {IN}
    frontier = [IN]
    while frontier:
        nxt: list[str] = []
        for n in frontier:
            for s in sorted(succ.get(n, ())):
                if s not in seen:
                    seen.add(s)
                    order.append(s)
                    nxt.append(s)
        frontier = nxt
    return order + sorted({n.name for n in m.nodes} - set(order))


@pytest.mark.slow
@SETTINGS
@given(model=models())
def test_plan_nodes_are_in_plan_order(make_role: RoleFactory, model: Model) -> None:
    plan = of.parse(build(model, make_role))
    assert list(plan.nodes) == _plan_order(model)
    assert sorted(plan.nodes) == sorted(n.name for n in model.nodes)
