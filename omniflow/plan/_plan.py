"""The static plan: everything the runtime needs, precomputed so routing is a table lookup.

>>> import omniflow as of
>>> plan = of.parse(graph)                                    # doctest: +SKIP
>>> plan.buckets                                              # doctest: +SKIP
{('llm.generate', 1)}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniflow.dsl._graph import GlobalParameters
from omniflow.dsl._role import Batch, _All

__all__ = ["NodeSpec", "Slot", "StaticPlan"]

#: One static slot of a bucket: (field, source node or "<input>").
Slot = tuple[str, str]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node: a decorated method of a role, with its parsed interface."""

    #: "<role>.<method>".
    name: str
    #: Role name (the key in Graph.roles).
    role: str
    #: Method name on the role.
    method: str
    #: OR groups of AND-ed fields.
    groups: tuple[tuple[str, ...], ...]
    #: Declared outputs.
    outputs: tuple[str, ...]
    #: Load-balancing policy.
    lb: str
    #: Collected fields.
    collect: frozenset[str]
    #: activate_by_count thresholds (empty when not a join node).
    count: tuple[tuple[str, int | _All], ...]
    #: True when the method is an async generator (a stream producer).
    is_generator: bool
    #: Most concurrent activations in one process (None: unbounded).
    max_concurrency: int | None
    #: Fields that may end with no frame (the method gets None, [] for collect).
    optional: frozenset[str] = frozenset()
    #: Per-call constants: taken once per call and paired with every activation.
    latch: frozenset[str] = frozenset()
    #: Activations run together, one call of the method per batch (None: one at a time).
    batch: Batch | None = None

    @property
    def is_join(self) -> bool:
        return bool(self.count)


@dataclass(frozen=True)
class StaticPlan:
    """The compiled form of one Graph. Equal graphs give equal plans."""

    #: Graph name.
    graph: str
    #: Node names in *plan order*: breadth-first from the graph inputs ("<input>"), the
    #: successors of each node visited by name, then the nodes no input reaches, by name.
    #: Buckets that wait on each other through a cycle are settled in this order.
    nodes: tuple[str, ...]
    #: Placeholder names.
    inputs: tuple[str, ...]
    #: Fields streamed to the caller.
    outputs: tuple[str, ...]
    #: Field edges (src, field, dst, or_group); a Placeholder source is "<input>".
    edges: frozenset[tuple[str, str, str, int]]
    #: Control edges: src -> [(dst, or_group, field)], sorted.
    ctrl_edges: dict[str, list[tuple[str, int, str]]]
    #: (node, or_group) pairs that hold buckets.
    buckets: frozenset[tuple[str, int]]
    #: Fork source of each bucket ("<input>" when its paths meet only at the graph entry).
    diamond_roots: dict[tuple[str, int], str]
    #: (node, or_group, field) whose field has exactly one upstream path.
    critical_slots: frozenset[tuple[str, int, str]]
    #: Node specs by name.
    specs: dict[str, NodeSpec]
    #: field -> its sources ("<input>" or node names), sorted.
    producers: dict[str, tuple[str, ...]]
    #: Static slots of each bucket, sorted.
    slots: dict[tuple[str, int], tuple[Slot, ...]]
    #: Which rule of the paper's Algorithm 2 computes the aid on each edge: "C" into a bucket
    #: (seed from the diamond root's entry), "A" otherwise (seed from the sending activation).
    edge_rule: dict[tuple[str, str, str, int], str]
    #: Nodes that start SeqId streams: async generators and lb="session" nodes.
    seq_producers: frozenset[str]
    #: Nodes that are the diamond root of at least one bucket (they stamp root entries).
    root_nodes: frozenset[str]
    #: node (or "<input>") -> nodes reachable from it in zero or more steps.
    reach: dict[str, frozenset[str]]
    #: Nodes on a cycle (bounded by max_iterations per call).
    cycle_nodes: frozenset[str]
    #: Output field -> its sources.
    output_producers: dict[str, tuple[str, ...]]
    #: Session parameters by name.
    params: dict[str, GlobalParameters] = field(compare=False)
    #: Bound per node per call for nodes on a cycle.
    max_iterations: int = 1024
    #: Role instances by role name (not part of plan equality).
    roles: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: Module that defines the graph, for worker processes ("" when unknown).
    module: str = field(default="", compare=False)

    def consumers(self, src: str, fld: str) -> list[tuple[str, int]]:
        """(dst, or_group) pairs that receive ``fld`` from ``src``."""
        return [(d, g) for (d, g, f) in self.ctrl_edges.get(src, ()) if f == fld]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (``omniflow plan --format json``)."""
        return {
            "graph": self.graph,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "nodes": [
                {
                    "name": n,
                    "groups": [list(g) for g in self.specs[n].groups],
                    "outputs": list(self.specs[n].outputs),
                    "lb": self.specs[n].lb,
                    "collect": sorted(self.specs[n].collect),
                    "activate_by_count": {
                        f: ("ALL" if isinstance(c, _All) else c) for f, c in self.specs[n].count
                    },
                    "generator": self.specs[n].is_generator,
                    "on_cycle": n in self.cycle_nodes,
                }
                for n in self.nodes
            ],
            "edges": [list(e) for e in sorted(self.edges)],
            "buckets": [
                {
                    "node": n,
                    "or_group": g,
                    "diamond_root": self.diamond_roots[(n, g)],
                    "slots": [list(s) for s in self.slots[(n, g)]],
                    "critical": sorted(
                        f for (cn, cg, f) in self.critical_slots if (cn, cg) == (n, g)
                    ),
                }
                for (n, g) in sorted(self.buckets)
            ],
            "critical_slots": [list(c) for c in sorted(self.critical_slots)],
            "seq_producers": sorted(self.seq_producers),
            "max_iterations": self.max_iterations,
        }
