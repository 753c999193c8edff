"""GraphParser: Graph declarations -> StaticPlan. Compiles only: it imports no file and never
changes the Graph objects it is given (loading graph files is ``omniflow._loader``).

>>> plans = parse_graphs([graph_a, graph_b])                # doctest: +SKIP
>>> plans["fig3"].diamond_roots[("llm.generate", 1)]       # doctest: +SKIP
'parse.run'

Every mistake in a declaration is a GraphError naming the graph, the node and the field, raised
here, before any request arrives.
"""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Iterable
from typing import Any

from omniflow._exceptions import GraphError
from omniflow._types import INPUT
from omniflow.dsl._graph import GlobalParameters, GlobalParametersRef, Graph, RoleRef
from omniflow.dsl._role import LB_POLICIES, InterfaceSpec, interfaces_of
from omniflow.plan._graphalgo import (
    bfs_order,
    cycle_nodes,
    dominators,
    nearest_common_dominator,
    reachable,
)
from omniflow.plan._plan import NodeSpec, Slot, StaticPlan

__all__ = ["parse_graphs"]


def parse_graphs(graphs: Iterable[Graph]) -> dict[str, StaticPlan]:
    """Plans for several graphs that share roles and params through RoleRef/GlobalParametersRef.

    Checks cross-graph consistency: unique graph names, every ref resolves, one role name is
    bound to one instance, one params name has one factory.
    """
    graphs = list(graphs)
    by_name: dict[str, Graph] = {}
    for g in graphs:
        if not isinstance(g, Graph):
            raise GraphError(f"expected omniflow.Graph objects, got {g!r}")
        if g.name in by_name and by_name[g.name] is not g:
            raise GraphError(
                f"two different graphs are named '{g.name}'; graph names must be unique"
            )
        by_name[g.name] = g
    graphs = list(by_name.values())

    # Roles are scoped to the module that declares their graph: two modules may each call a
    # role "vae". Within one module a name means one instance; RoleRef shares across graphs.
    roles: dict[tuple[str | None, str], object] = {}
    for g in graphs:
        for rname, role in g.roles.items():
            if isinstance(role, RoleRef):
                continue
            key = (g.module, rname)
            if key in roles and roles[key] is not role:
                raise GraphError(
                    f"role name '{rname}' is bound to two different instances in module "
                    f"{g.module or '__main__'} (graphs sharing a role must declare it once and "
                    "use omniflow.RoleRef elsewhere; different roles need different names)",
                    graph=g.name,
                )
            roles[key] = role
    params: dict[str, GlobalParameters] = {}
    for g in graphs:
        for p in g.params:
            if isinstance(p, GlobalParameters):
                old = params.get(p.name)
                if old is not None and old.factory is not p.factory:
                    raise GraphError(
                        f"GlobalParameters '{p.name}' is declared with two different factories "
                        f"({old.factory!r} and {p.factory!r}); declare it once and use "
                        "omniflow.GlobalParametersRef elsewhere",
                        graph=g.name,
                    )
                params[p.name] = p
    return {g.name: _build(g, roles, params) for g in graphs}


def _resolve_roles(g: Graph, roles: dict[tuple[str | None, str], object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for rname, role in g.roles.items():
        if not isinstance(rname, str) or not rname.isidentifier() or keyword.iskeyword(rname):
            raise GraphError(
                f"role name {rname!r} is not a Python identifier; node names are "
                "'<role>.<method>', so role names must be identifiers",
                graph=g.name,
            )
        if isinstance(role, RoleRef):
            role = _resolve_ref(g, rname, role.name, roles)
        if isinstance(role, type):
            raise GraphError(
                f"role '{rname}' is the class {role.__name__}, not an instance; write "
                f"{role.__name__}() in Graph(roles=...)",
                graph=g.name,
            )
        out[rname] = role
    return out


def _resolve_ref(
    g: Graph, rname: str, name: str, roles: dict[tuple[str | None, str], object]
) -> object:
    """The role a ``RoleRef(name)`` of graph ``g`` means: the one of ``g``'s own module, else
    the only role of that name among the graphs parsed together."""
    own = roles.get((g.module, name))
    if own is not None:
        return own
    found = {m: r for (m, n), r in roles.items() if n == name}
    if not found:
        raise GraphError(
            f"RoleRef('{name}') (role '{rname}') resolves nowhere; declare role "
            f"'{name}' in a graph passed to the same parse/Runtime",
            graph=g.name,
        )
    if len({id(r) for r in found.values()}) > 1:
        raise GraphError(
            f"RoleRef('{name}') (role '{rname}') is ambiguous: modules "
            f"{sorted(str(m) for m in found)} each declare a role '{name}'; rename one of them "
            "or declare the shared role in this graph's own module",
            graph=g.name,
        )
    return next(iter(found.values()))


def _resolve_params(g: Graph, params: dict[str, GlobalParameters]) -> dict[str, GlobalParameters]:
    out: dict[str, GlobalParameters] = {}
    for p in g.params:
        if isinstance(p, GlobalParametersRef):
            target = params.get(p.name)
            if target is None:
                raise GraphError(
                    f"GlobalParametersRef('{p.name}') resolves nowhere; declare "
                    f"GlobalParameters('{p.name}', factory=...) in a graph of the same runtime",
                    graph=g.name,
                )
            out[p.name] = target
        else:
            if p.name in out:
                raise GraphError(f"GlobalParameters '{p.name}' is declared twice", graph=g.name)
            out[p.name] = p
    return out


def _check_signature(gname: str, node: str, fn: Any, groups: tuple[tuple[str, ...], ...]) -> None:
    if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        raise GraphError(
            f"node '{node}': the interface method is not async; declare it 'async def' "
            "(return a dict, or yield dicts to stream)",
            graph=gname,
            node=node,
        )
    sig = inspect.signature(fn)
    named = set()
    required = set()
    var_kw = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            named.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
        elif p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise GraphError(
                f"node '{node}': parameter '{p.name}' is positional-only; fields are passed "
                "by keyword",
                graph=gname,
                node=node,
            )
    for gi, group in enumerate(groups):
        for f in group:
            if f not in named and not var_kw:
                raise GraphError(
                    f"node '{node}': OR group {gi} passes field '{f}' but the method has no "
                    f"parameter '{f}' (nor **kwargs); add it to the signature",
                    graph=gname,
                    node=node,
                    field=f,
                )
        missing = sorted(required - set(group))
        if missing:
            raise GraphError(
                f"node '{node}': OR group {gi} {list(group)} does not provide required "
                f"parameter '{missing[0]}'; give it a default or add it to that OR group",
                graph=gname,
                node=node,
                field=missing[0],
            )


def _node_spec(gname: str, rname: str, role: object, mname: str, spec: InterfaceSpec) -> NodeSpec:
    node = f"{rname}.{mname}"
    if spec.lb not in LB_POLICIES:
        raise GraphError(
            f"node '{node}': unknown lb {spec.lb!r}; use one of {', '.join(LB_POLICIES)}",
            graph=gname,
            node=node,
        )
    if not spec.inputs_or:
        raise GraphError(
            f"node '{node}': inputs_or is empty; give at least one OR group of fields",
            graph=gname,
            node=node,
        )
    for gi, group in enumerate(spec.inputs_or):
        if not group:
            raise GraphError(
                f"node '{node}': OR group {gi} is empty; every OR group needs at least one field",
                graph=gname,
                node=node,
            )
        if len(set(group)) != len(group):
            raise GraphError(
                f"node '{node}': OR group {gi} names a field twice: {list(group)}",
                graph=gname,
                node=node,
            )
    all_inputs = {f for group in spec.inputs_or for f in group}
    for f in sorted(spec.collect):
        if f not in all_inputs:
            raise GraphError(
                f"node '{node}': collect names '{f}', which is not an input of this node; "
                f"inputs are {sorted(all_inputs)}",
                graph=gname,
                node=node,
                field=f,
            )
    for what, names in (("optional", spec.optional), ("latch", spec.latch)):
        for f in sorted(names):
            if f not in all_inputs:
                raise GraphError(
                    f"node '{node}': {what} names '{f}', which is not in any OR group of this "
                    f"node; inputs are {sorted(all_inputs)}",
                    graph=gname,
                    node=node,
                    field=f,
                )
    for f in sorted(spec.latch):
        if f in spec.collect or any(f == cf for cf, _n in spec.activate_by_count or ()):
            raise GraphError(
                f"node '{node}': latched field '{f}' is also in collect or activate_by_count; "
                "a latch takes one frame per call, drop it from one of them",
                graph=gname,
                node=node,
                field=f,
            )
    for gi, group in enumerate(spec.inputs_or):
        if spec.latch and set(group) <= spec.latch:
            raise GraphError(
                f"node '{node}': every field of OR group {gi} is latched; a latch is paired "
                "with activations that the group's other fields fire, so keep at least one "
                "field unlatched",
                graph=gname,
                node=node,
                field=group[0],
            )
    count = spec.activate_by_count or ()
    if count:
        if len(spec.inputs_or) != 1:
            raise GraphError(
                f"node '{node}': activate_by_count joins all inputs into one bucket per call, "
                "so the node must have exactly one OR group",
                graph=gname,
                node=node,
            )
        for f, _n in count:
            if f not in all_inputs:
                raise GraphError(
                    f"node '{node}': activate_by_count names '{f}', which is not an input of "
                    f"this node; inputs are {sorted(all_inputs)}",
                    graph=gname,
                    node=node,
                    field=f,
                )
            if f in spec.collect:
                raise GraphError(
                    f"node '{node}': field '{f}' is in both collect and activate_by_count; a "
                    "count field is already passed as a list, drop it from collect",
                    graph=gname,
                    node=node,
                    field=f,
                )
    if len(set(spec.outputs)) != len(spec.outputs):
        raise GraphError(f"node '{node}': outputs name a field twice", graph=gname, node=node)
    fn = getattr(role, mname)
    _check_signature(gname, node, fn, spec.inputs_or)
    if spec.batch is not None and not inspect.iscoroutinefunction(fn):
        raise GraphError(
            f"node '{node}': a batched method (batch=...) must be a coroutine that returns a "
            "list with one entry per activation; an async generator cannot be batched "
            "(drop batch=, or return the frames instead of yielding them)",
            graph=gname,
            node=node,
        )
    return NodeSpec(
        name=node,
        role=rname,
        method=mname,
        groups=spec.inputs_or,
        outputs=spec.outputs,
        lb=spec.lb,
        collect=spec.collect,
        count=tuple(count),
        is_generator=inspect.isasyncgenfunction(fn),
        max_concurrency=spec.max_concurrency,
        optional=spec.optional,
        latch=spec.latch,
        batch=spec.batch,
    )


def _build(
    g: Graph,
    all_roles: dict[tuple[str | None, str], object],
    all_params: dict[str, GlobalParameters],
) -> StaticPlan:
    gname = g.name
    roles = _resolve_roles(g, all_roles)
    params = _resolve_params(g, all_params)

    specs: dict[str, NodeSpec] = {}
    for rname, role in roles.items():
        ifaces = interfaces_of(role)
        if not ifaces:
            raise GraphError(
                f"role '{rname}' ({type(role).__name__}) declares no @omniflow.interface method",
                graph=gname,
            )
        for mname, spec in ifaces:
            ns = _node_spec(gname, rname, role, mname, spec)
            # Role names are identifiers (checked above) and unique keys, method names unique
            # per role: "<role>.<method>" cannot repeat.
            assert ns.name not in specs, ns.name
            specs[ns.name] = ns

    placeholders = [p.name for p in g.inputs]
    if len(set(placeholders)) != len(placeholders):
        dup = next(p for p in placeholders if placeholders.count(p) > 1)
        raise GraphError(f"Placeholder '{dup}' is declared twice", graph=gname, field=dup)
    producers_l: dict[str, list[str]] = {p: [INPUT] for p in placeholders}
    for n, ns in specs.items():
        for f in ns.outputs:
            producers_l.setdefault(f, []).append(n)
    producers = {f: tuple(sorted(srcs)) for f, srcs in producers_l.items()}

    for n, ns in specs.items():
        for f in sorted({f for grp in ns.groups for f in grp}):
            if f not in producers:
                raise GraphError(
                    f"node '{n}': input '{f}' has no producer; add a Placeholder('{f}') or a "
                    f"role output named '{f}'",
                    graph=gname,
                    node=n,
                    field=f,
                )
    if len(set(g.outputs)) != len(g.outputs):
        dup = next(f for f in g.outputs if g.outputs.count(f) > 1)
        raise GraphError(
            f"graph outputs name field '{dup}' twice; list each output once",
            graph=gname,
            field=dup,
        )
    for f in g.outputs:
        srcs = producers.get(f, ())
        if not srcs:
            raise GraphError(
                f"graph output '{f}' is produced by no node; add '{f}' to some interface's "
                "outputs or drop it from Graph(outputs=...)",
                graph=gname,
                field=f,
            )
        if all(s == INPUT for s in srcs):
            raise GraphError(
                f"graph output '{f}' is only a Placeholder; a graph output must be produced by "
                "a node (echo it through a role if you need it back)",
                graph=gname,
                field=f,
            )

    # Which nodes can ever fire: a fixpoint over producible fields.
    avail = set(placeholders)
    fireable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n, ns in specs.items():
            if n not in fireable and any(all(f in avail for f in grp) for grp in ns.groups):
                fireable.add(n)
                avail.update(ns.outputs)
                changed = True
    for n, ns in specs.items():
        if n not in fireable:
            missing = sorted({f for grp in ns.groups for f in grp if f not in avail})
            raise GraphError(
                f"node '{n}' can never fire: no OR group can be completed, because "
                f"{', '.join(repr(m) for m in missing)} can only come from nodes that never "
                "fire themselves (a cycle with no entry from the graph inputs?)",
                graph=gname,
                node=n,
                field=missing[0] if missing else None,
            )

    edges: set[tuple[str, str, str, int]] = set()
    for n, ns in specs.items():
        for gi, grp in enumerate(ns.groups):
            for f in grp:
                for src in producers[f]:
                    edges.add((src, f, n, gi))
    succ: dict[str, set[str]] = {INPUT: set()}
    for n in specs:
        succ.setdefault(n, set())
    for src, _f, dst, _g in edges:
        succ[src].add(dst)

    order = bfs_order(succ, INPUT)
    node_order = tuple(n for n in order if n != INPUT)
    # Plan order (docs/contract.md §2): breadth-first from the inputs, successors by name; nodes no
    # input reaches (none, once every node is fireable) last by name.
    node_order += tuple(sorted(set(specs) - set(node_order)))

    ctrl: dict[str, list[tuple[str, int, str]]] = {}
    for src, f, dst, gi in sorted(edges):
        ctrl.setdefault(src, []).append((dst, gi, f))

    dom = dominators(succ, INPUT)
    buckets: set[tuple[str, int]] = set()
    roots: dict[tuple[str, int], str] = {}
    slots: dict[tuple[str, int], tuple[Slot, ...]] = {}
    critical: set[tuple[str, int, str]] = set()
    for n, ns in specs.items():
        for gi, full in enumerate(ns.groups):
            # Latched fields are per-call constants paired with each activation: they never
            # make a group hold a bucket, nor take part in its slots.
            grp = tuple(f for f in full if f not in ns.latch)
            grp_slots = tuple(sorted((f, src) for f in grp for src in producers[f]))
            for f in grp:
                if len(producers[f]) == 1:
                    critical.add((n, gi, f))
            if len(grp_slots) >= 2 or any(f in ns.collect for f in grp) or ns.is_join:
                buckets.add((n, gi))
                slots[(n, gi)] = grp_slots
                sources = {src for _f, src in grp_slots}
                if ns.is_join or INPUT in sources:
                    root = INPUT
                elif len(sources) == 1:
                    (only,) = sources
                    if any(f in ns.collect for f in grp):
                        # Collect the whole stream of the one producer: bin one level up.
                        strict = dom[only] - {only}
                        root = max(strict, key=lambda d: (len(dom[d]), d))
                    else:
                        # Plain fields of one producer pair up frame by frame.
                        root = only
                else:
                    root = nearest_common_dominator(dom, sources)
                roots[(n, gi)] = root

    edge_rule = {e: ("C" if (e[2], e[3]) in buckets else "A") for e in edges}
    seq_producers = frozenset(n for n, ns in specs.items() if ns.is_generator or ns.lb == "session")
    root_nodes = frozenset(r for r in roots.values() if r != INPUT)
    reach = {n: reachable(succ, n) for n in [INPUT, *node_order]}
    cycles = cycle_nodes(succ) - {INPUT}
    output_producers = {f: tuple(s for s in producers[f] if s != INPUT) for f in g.outputs}

    return StaticPlan(
        graph=gname,
        nodes=node_order,
        inputs=tuple(placeholders),
        outputs=tuple(g.outputs),
        edges=frozenset(edges),
        ctrl_edges=ctrl,
        buckets=frozenset(buckets),
        diamond_roots=roots,
        critical_slots=frozenset(critical),
        specs=specs,
        producers=producers,
        slots=slots,
        edge_rule=edge_rule,
        seq_producers=seq_producers,
        root_nodes=root_nodes,
        reach=reach,
        cycle_nodes=cycles,
        output_producers=output_producers,
        params=params,
        max_iterations=g.max_iterations,
        roles=roles,
        module=g.module or "",
    )
