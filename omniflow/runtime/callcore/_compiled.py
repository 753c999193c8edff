"""Per-graph lookup tables the call core uses on its hot path, derived once from a StaticPlan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniflow.dsl._role import _All
from omniflow.plan._plan import NodeSpec, StaticPlan
from omniflow.runtime.callcore._buckets import BucketSpec, bucket_specs
from omniflow.runtime.callcore._liveness import FRAME

__all__ = ["Compiled", "Fanout", "Route", "compile_plan", "once_per_call"]

#: One consumer of a (node, field): (dst node, or_group, bucket spec or None for direct fire,
#: direct: a direct fire that is admitted straight to running, with no latch to pair).
Route = tuple[str, int, BucketSpec | None, bool]
#: Everything a frame of one (node, field) goes to: (routes, the nodes that latch the field,
#: whether it goes back to the caller).
Fanout = tuple[tuple[Route, ...], tuple[str, ...], bool]


@dataclass(frozen=True, slots=True)
class Compiled:
    plan: StaticPlan
    #: Nodes that stamp a new entry on their outgoing frames (diamond roots, seq producers).
    stamping: frozenset[str]
    #: Nodes whose frames start a SeqId stream (generators, lb="session"), and "<input>".
    seq_nodes: frozenset[str]
    #: (node, latched field) -> nodes from which a producer of the field can be reached.
    latch_feeders: dict[tuple[str, str], frozenset[str]]
    #: Caller field -> nodes whose live work can still produce a frame of it that keeps the
    #: SeqId entry of that work (paths free of SeqId producers, which restamp what they make,
    #: plus everything between a bucket's root and its sources: a bucket takes its root's SeqId).
    seq_out_feeders: dict[str, frozenset[str]]
    #: Session node -> nodes whose live work can still bring it an activation with the SeqId
    #: entry of that work.
    seq_feeders: dict[str, frozenset[str]]
    #: Node specs.
    specs: dict[str, NodeSpec]
    #: Declared outputs per node, as sets.
    outputs: dict[str, frozenset[str]]
    #: Nodes on a cycle.
    cycle_nodes: frozenset[str]
    #: Plan order index of each node (used to pick buckets deterministically).
    order: dict[str, int]
    #: Bound role methods by node.
    methods: dict[str, Any]
    #: lb="session" nodes.
    session_nodes: frozenset[str]
    #: Async-generator nodes.
    generators: frozenset[str]
    #: Nodes with max_concurrency -> the limit.
    throttled: dict[str, int]
    #: Nodes admitted straight to running: not on a cycle, not lb="session", not throttled.
    unconstrained: frozenset[str] = frozenset()
    #: src ("<input>" too) -> field -> where its frames go (by source then field: one lookup
    #: per field on the hot path; a field nobody consumes has no entry).
    fanout: dict[str, dict[str, Fanout]] = field(default_factory=dict)
    #: Nodes that hold buckets.
    bucket_nodes: frozenset[str] = frozenset()
    #: Something reads the liveness counts (a bucket, a SeqId stream, a latch); otherwise the
    #: core keeps none (``Uncounted``).
    counted: bool = True
    #: (node, or_group) -> its latched fields, for groups that have any.
    latch_of: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    #: lb="session" nodes with several OR groups: one SeqId index's activations run in group
    #: order, and a later group's waits while an earlier group's bucket of that index gathers.
    group_ordered: frozenset[str] = frozenset()


def once_per_call(plan: StaticPlan) -> frozenset[str]:
    """Nodes that produce at most one frame per call, whose frames carry the call's SeqId, and
    whose ancestors are all finished once they fire.

    Such a node: lies on no cycle, is no generator and no lb="session" node, has one OR group,
    and each field of that group is either an ALL count field (a join fires once per call,
    after those streams end) or has exactly one source, itself once per call or "<input>".
    Once it has fired, no live work can reach it again: its single-source inputs come from
    activations that ended when they produced them, and by induction so did theirs.
    """
    single: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in plan.nodes:
            sp = plan.specs[n]
            if (
                n in single
                or n in plan.cycle_nodes
                or sp.is_generator
                or n in plan.seq_producers
                or len(sp.groups) != 1
            ):
                continue
            counts = dict(sp.count)
            for f in sp.groups[0]:
                if f in counts:
                    if isinstance(counts[f], _All):
                        continue
                    break
                srcs = plan.producers[f]
                if len(srcs) != 1 or (srcs[0] != "<input>" and srcs[0] not in single):
                    break
            else:
                single.add(n)
                changed = True
    return frozenset(single)


def _entry_droppers(plan: StaticPlan) -> set[str]:
    """Diamond roots whose entry some frame loses on its way to one of their buckets.

    A bucket cuts the tables of its frames at its own root's entry and a join at the call's,
    so a path from root R through such a node reaches R's bucket without R's entry, and lands
    in another bucket than the frames that kept it. Keying R's buckets by the call's entry
    would merge those, so R keeps its own entry unless every node between it and the sources
    of its buckets is direct-fire or gathers under R itself.
    """
    out: set[str] = set()
    for (node, g), root in plan.diamond_roots.items():
        if root == "<input>" or root in out:
            continue
        srcs = {s for _f, s in plan.slots[(node, g)]}
        for m in plan.reach[root]:
            if m == root or m == "<input>" or srcs.isdisjoint(plan.reach[m]):
                continue
            sp = plan.specs[m]
            if sp.is_join or any(
                plan.diamond_roots[(m, gm)] != root
                for gm in range(len(sp.groups))
                if (m, gm) in plan.buckets
            ):
                out.add(root)
                break
    return out


def compile_plan(plan: StaticPlan) -> Compiled:
    # A diamond root that fires once per call names one bucket per call, as the call's own
    # entry does: key its buckets by that entry, so the root stamps nothing and everything
    # below it carries a shorter table. Its frame's descendants are all the work under the
    # call's entry that can still reach the bucket (nothing upstream of it is live after it
    # fired), so liveness answers the same questions.
    single = once_per_call(plan) - _entry_droppers(plan)
    roots = {bg: "<input>" if r in single else r for bg, r in plan.diamond_roots.items()}
    bspecs = bucket_specs(plan, roots)
    routes: dict[tuple[str, str], list[Route]] = {}
    unconstrained = frozenset(
        n
        for n, sp in plan.specs.items()
        if n not in plan.cycle_nodes and sp.lb != "session" and sp.max_concurrency is None
    )
    latch_of = {
        (n, g): tuple(f for f in grp if f in sp.latch)
        for n, sp in plan.specs.items()
        for g, grp in enumerate(sp.groups)
        if sp.latch.intersection(grp)
    }
    latch_routes: dict[str, dict[str, set[str]]] = {}
    for src, lst in plan.ctrl_edges.items():
        for dst, g, f in lst:
            if f in plan.specs[dst].latch:
                latch_routes.setdefault(src, {}).setdefault(f, set()).add(dst)
                continue
            bspec = bspecs.get((dst, g))
            direct = bspec is None and dst in unconstrained and (dst, g) not in latch_of
            routes.setdefault((src, f), []).append((dst, g, bspec, direct))
    to_caller: dict[str, set[str]] = {}
    for f, srcs in plan.output_producers.items():
        for s in srcs:
            to_caller.setdefault(s, set()).add(f)
    fanout: dict[str, dict[str, Fanout]] = {}
    for src in ("<input>", *plan.nodes):
        fields = {f for s, f in routes if s == src}
        fields.update(latch_routes.get(src, ()), to_caller.get(src, ()))
        fanout[src] = {
            f: (
                tuple(routes.get((src, f), ())),
                tuple(sorted(latch_routes.get(src, {}).get(f, ()))),
                f in to_caller.get(src, ()),
            )
            for f in sorted(fields)
        }
    all_nodes = ["<input>", *plan.nodes]
    feeders = {
        n: frozenset(m for m in all_nodes if n in plan.reach[m]) | {FRAME} for n in all_nodes
    }
    plain = set(plan.nodes) - plan.seq_producers

    def seq_keepers(target: str) -> frozenset[str]:
        """Nodes whose live work under a SeqId entry can still bring ``target`` a frame or an
        activation carrying that entry: non-SeqId nodes on non-SeqId paths to ``target``
        (``target`` itself included when it is not a SeqId producer), and, since a bucket's
        activation takes the SeqId of its root's frame, every node between the root of a
        bucket on such a path and the bucket's sources, whatever its kind."""
        out = {target, FRAME} if target in plain else {FRAME}
        stack = [target]
        visited = {target}
        while stack:
            n = stack.pop()
            nxt: list[str] = []
            for g, fields in enumerate(plan.specs[n].groups):
                if (n, g) in plan.buckets:
                    root = roots[(n, g)]
                    if root == "<input>":
                        continue  # its activations carry the call's entry, index 0 only
                    srcs = {s for _f, s in plan.slots[(n, g)]}
                    out.update(
                        m
                        for m in plan.reach[root]
                        if m != root and not srcs.isdisjoint(plan.reach[m])
                    )
                    if root in plain:
                        nxt.append(root)
                else:
                    nxt.extend(m for f in fields for m in plan.producers[f] if m in plain)
            for m in nxt:
                if m not in visited:
                    visited.add(m)
                    out.add(m)
                    stack.append(m)
        return frozenset(out)

    seq_out_feeders = {
        f: frozenset().union(*(seq_keepers(s) for s in srcs if s in plain))
        for f, srcs in plan.output_producers.items()
    }
    seq_feeders = {n: seq_keepers(n) for n, sp in plan.specs.items() if sp.lb == "session"}
    methods = {n: getattr(plan.roles[spec.role], spec.method) for n, spec in plan.specs.items()}
    return Compiled(
        plan=plan,
        stamping=frozenset(r for r in roots.values() if r != "<input>") | plan.seq_producers,
        seq_nodes=plan.seq_producers | {"<input>"},
        latch_feeders={
            (n, f): frozenset().union(*(feeders[s] for s in plan.producers[f]))
            for n, g in latch_of
            for f in latch_of[(n, g)]
        },
        seq_out_feeders=seq_out_feeders,
        seq_feeders=seq_feeders,
        specs=plan.specs,
        outputs={n: frozenset(s.outputs) for n, s in plan.specs.items()},
        cycle_nodes=plan.cycle_nodes,
        order={n: i for i, n in enumerate(plan.nodes)},
        methods=methods,
        session_nodes=frozenset(n for n, sp in plan.specs.items() if sp.lb == "session"),
        generators=frozenset(n for n, sp in plan.specs.items() if sp.is_generator),
        throttled={
            n: sp.max_concurrency for n, sp in plan.specs.items() if sp.max_concurrency is not None
        },
        fanout=fanout,
        bucket_nodes=frozenset(n for n, _g in plan.buckets),
        latch_of=latch_of,
        unconstrained=unconstrained,
        group_ordered=frozenset(
            n for n, sp in plan.specs.items() if sp.lb == "session" and len(sp.groups) > 1
        ),
        counted=bool(plan.buckets or plan.seq_producers or latch_of),
    )
