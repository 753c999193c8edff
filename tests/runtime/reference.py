"""A sequential reference evaluator for DAG calls, written without omniflow.runtime.

>>> result = evaluate(plan, behave, {"request": req})          # doctest: +SKIP
>>> result.outputs, result.errors                              # doctest: +SKIP
(Counter({("token", "t0"): 1}), set())

It reads only the StaticPlan's declaration facts (specs, producers, ctrl_edges, buckets,
diamond_roots, outputs) and runs one activation at a time, always the pending one whose node
comes first in a topological order, so that a bucket is looked at only once nothing upstream of
it can still produce anything: then every slot has ended and its verdict is final. That is the
whole trick that makes this model simple where the runtime has to be clever (liveness counts,
waiters, SeqId queues). The semantics are CONTRACT §1:

* A frame sends each of its fields to every consumer (dst, or_group) of that field, and to the
  caller when the field is a graph output.
* (dst, g) without a bucket: one activation per arriving frame.
* (dst, g) with a bucket: frames are binned by their root frame, the most recent frame in the
  arriving frame's lineage produced by the bucket's diamond root (one bin per call when the
  root is ``<input>`` or the node is a join). Field modes: plain (one frame; a second one is an
  error of the node; none: DEAD when critical, else None), collect (all frames in production
  order; none: DEAD when critical, else []), count (ALL: every frame, never DEAD; n: at most n
  frames, more is an error). A bin fires once if it is not DEAD and at least one frame arrived.

A frame's lineage is the chain of ``(node, activation id, yield index)`` frames it descends
from, oldest first; a bucket activation descends from its root frame. Production order within a
bin is the lexicographic order of the lineages after the root frame.

``behave(node, kwargs)`` is the node's method as a plain function returning its frames.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["INPUT", "RefResult", "evaluate", "topological_order"]

INPUT = "<input>"

#: One lineage step: (node, activation id, yield index).
Step = tuple[str, int, int]
Lineage = tuple[Step, ...]
Behave = Callable[[str, dict[str, Any]], Iterable[dict[str, Any]]]

#: The lineage of the Placeholders: the call itself.
CALL: Lineage = ((INPUT, 0, 0),)


@dataclass
class RefResult:
    #: (field, value) pairs streamed to the caller, as a multiset.
    outputs: Counter[tuple[str, Any]] = field(default_factory=Counter)
    #: (node, field) of every input-rule error (a second frame into a plain or full count slot).
    errors: set[tuple[str, str]] = field(default_factory=set)
    #: Activations run, by node.
    activations: Counter[str] = field(default_factory=Counter)
    #: Bins that ended DEAD (or empty), by (node, group).
    dead: Counter[tuple[str, int]] = field(default_factory=Counter)

    @property
    def error_nodes(self) -> set[str]:
        return {n for n, _f in self.errors}


@dataclass
class _Act:
    aid: int
    node: str
    group: int
    kwargs: dict[str, Any]
    lineage: Lineage


@dataclass
class _Bin:
    #: field -> [(lineage after the root frame, arrival number, value)].
    frames: dict[str, list[tuple[Lineage, int, Any]]] = field(default_factory=dict)
    arrivals: int = 0
    broken: bool = False


def topological_order(plan: Any) -> list[str]:
    """Kahn's algorithm over the plan's control edges, ties broken by plan order."""
    rank = {n: i for i, n in enumerate(plan.nodes)}
    indeg = dict.fromkeys(plan.nodes, 0)
    succ: dict[str, set[str]] = {n: set() for n in plan.nodes}
    for src, lst in plan.ctrl_edges.items():
        for dst, _g, _f in lst:
            if src != INPUT and dst not in succ[src]:
                succ[src].add(dst)
                indeg[dst] += 1
    ready = sorted((n for n, d in indeg.items() if d == 0), key=rank.__getitem__)
    order: list[str] = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
        ready.sort(key=rank.__getitem__)
    if len(order) != len(plan.nodes):
        raise ValueError("the reference evaluator handles DAGs only; this graph has a cycle")
    return order


def evaluate(plan: Any, behave: Behave, inputs: dict[str, Any]) -> RefResult:
    """Run one call of ``plan`` to completion, sequentially; see the module docstring."""
    return _Evaluator(plan, behave).run(inputs)


class _Evaluator:
    def __init__(self, plan: Any, behave: Behave) -> None:
        self.plan = plan
        self.behave = behave
        self.topo = {n: i for i, n in enumerate(topological_order(plan))}
        self.outputs = set(plan.outputs)
        self.result = RefResult()
        self.pending: list[_Act] = []
        #: (node, group) -> bin key (the root frame's lineage) -> bin.
        self.bins: dict[tuple[str, int], dict[Lineage, _Bin]] = {}
        self.aids = 0

    def run(self, inputs: dict[str, Any]) -> RefResult:
        for f, v in inputs.items():
            self._send(INPUT, f, v, CALL)
        while self.pending or self.bins:
            first_act = min((self.topo[a.node] for a in self.pending), default=len(self.topo))
            first_bin = min((self.topo[n] for n, _g in self.bins), default=len(self.topo))
            if first_bin <= first_act:
                # Nothing upstream of this node is pending: every slot of its bins has ended.
                for key in sorted(k for k in self.bins if self.topo[k[0]] == first_bin):
                    for root, b in self.bins.pop(key).items():
                        self._settle(key[0], key[1], root, b)
                continue
            act = min(self.pending, key=lambda a: (self.topo[a.node], a.aid))
            self.pending.remove(act)
            self._run(act)
        return self.result

    # ------------------------------------------------------------------ activations

    def _new_act(self, node: str, group: int, kwargs: dict[str, Any], lineage: Lineage) -> None:
        self.aids += 1
        self.pending.append(_Act(self.aids, node, group, kwargs, lineage))

    def _run(self, act: _Act) -> None:
        self.result.activations[act.node] += 1
        declared = set(self.plan.specs[act.node].outputs)
        for yidx, frame in enumerate(self.behave(act.node, dict(act.kwargs))):
            if not isinstance(frame, dict) or not set(frame) <= declared:
                raise ValueError(f"behaviour of {act.node} produced {frame!r}")
            lineage = (*act.lineage, (act.node, act.aid, yidx))
            for f, v in frame.items():
                self._send(act.node, f, v, lineage)

    def _send(self, src: str, f: str, value: Any, lineage: Lineage) -> None:
        for dst, g, fld in self.plan.ctrl_edges.get(src, ()):
            if fld != f:
                continue
            if (dst, g) in self.plan.buckets:
                self._bin(dst, g, f, value, lineage)
            else:
                self._new_act(dst, g, {f: value}, lineage)
        if src != INPUT and f in self.outputs:
            self.result.outputs[(f, value)] += 1

    # ------------------------------------------------------------------ buckets

    def _root_frame(self, node: str, group: int, lineage: Lineage) -> Lineage:
        root = self.plan.diamond_roots[(node, group)]
        if root == INPUT or self.plan.specs[node].count:
            return CALL
        for i in range(len(lineage) - 1, -1, -1):
            if lineage[i][0] == root:
                return lineage[: i + 1]
        # The root does not lie on this frame's lineage (it was cut by a bucket between them):
        # the call is the only common ancestor left.
        return CALL

    def _bin(self, node: str, group: int, f: str, value: Any, lineage: Lineage) -> None:
        root = self._root_frame(node, group, lineage)
        b = self.bins.setdefault((node, group), {}).setdefault(root, _Bin())
        if b.broken:
            return
        lst = b.frames.setdefault(f, [])
        mode, limit = self._mode(node, f)
        if (mode == "plain" and lst) or (
            mode == "count" and limit is not None and len(lst) >= limit
        ):
            self.result.errors.add((node, f))
            b.broken = True
            return
        lst.append((lineage[len(root) :], b.arrivals, value))
        b.arrivals += 1

    def _mode(self, node: str, f: str) -> tuple[str, int | None]:
        spec = self.plan.specs[node]
        counts = dict(spec.count)
        if f in counts:
            n = counts[f]
            return "count", n if isinstance(n, int) else None
        return ("collect" if f in spec.collect else "plain"), None

    def _settle(self, node: str, group: int, root: Lineage, b: _Bin) -> None:
        if b.broken:
            self.result.dead[(node, group)] += 1
            return
        kwargs: dict[str, Any] = {}
        for f in self.plan.specs[node].groups[group]:
            critical = len(self.plan.producers[f]) == 1
            frames = sorted(b.frames.get(f, []), key=lambda t: (t[0], t[1]))
            values = [v for _lin, _n, v in frames]
            mode, limit = self._mode(node, f)
            if mode == "count":
                kwargs[f] = values if limit is None else values[:limit]
            elif mode == "collect":
                if not values and critical:
                    break
                kwargs[f] = values
            else:
                if not values and critical:
                    break
                kwargs[f] = values[0] if values else None
        else:
            if b.arrivals:
                self._new_act(node, group, kwargs, root)
                return
        self.result.dead[(node, group)] += 1
