"""A sequential reference evaluator for graph calls, written without omniflow.runtime.

>>> result = evaluate(plan, behave, {"request": req})          # doctest: +SKIP
>>> result.outputs, result.errors, result.warnings             # doctest: +SKIP
(Counter({("token", "t0"): 1}), set(), Counter())

It reads only the StaticPlan's declaration facts (specs, producers, ctrl_edges, buckets,
diamond_roots, reach, cycle_nodes, outputs, nodes) and runs one activation at a time. Where
the runtime counts live work per table entry, this model keeps every frame's full *lineage*
and asks, after each activation, which bins can no longer receive anything. The semantics are
CONTRACT §1:

* A frame sends each of its fields to every consumer (dst, or_group) of that field, and to the
  caller when the field is a graph output. Latched fields (``latch=``) go to the node's latch
  instead: the first frame of the call is the value, paired with every activation of the node;
  activations wait for it and are DEAD (a warning each) when it ends with no frame.
* (dst, g) without a bucket: one activation per arriving frame.
* (dst, g) with a bucket: frames are binned by their root frame, the most recent frame in the
  arriving frame's lineage produced by the bucket's diamond root (one bin per call when the
  root is ``<input>`` or the node is a join; the call's bin too when the root does not lie on
  the lineage). Field modes: plain (one frame; a second one is an error of the node), collect
  (all frames in production order), count (ALL: every frame; n: at most n, more is an error).
  The AND rule: a plain or collect field that ended with no frame makes the bin DEAD, unless
  it is ``optional`` (None, or []). A bin fires once if it is not DEAD and at least one frame
  arrived; a DEAD bin that had received frames is a warning.
* A bin's activation descends from what all its frames share: the steps all their lineages
  hold (so a join of one frame still descends from that frame).
* A bin decides once no *possible producer* of its open fields is left: a pending activation,
  a waiting latch activation, or another undecided bin, at a node from which a producer of the
  field can be reached, whose lineage still descends from the bin's root frame (the root's most
  recent frame in it). A bin whose fields are all satisfied by frames (plain of one source,
  count n reached) fires at once.
* With nothing left to run, bins that wait only on each other are settled in plan order as if
  their open fields had ended (among the bins that wait on no bin outside their own cycle).
* Nodes on a cycle run at most ``max_iterations`` activations per call; one more is an error
  of that node (field ``"max_iterations"``). The runtime stops the call at the first such
  error; which node that is depends on the schedule, so the model runs on and names every
  node that exceeds the bound.

A frame's lineage is the chain of ``(node, activation id, yield index)`` frames it descends
from, oldest first, with one step per node: a loop that comes back to a node replaces the
node's older step (a later round starts afresh, as the runtime's tables do). What a bin's
frames share is the steps all their lineages hold.

``behave(node, kwargs)`` is the node's method as a plain function returning its frames.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["INPUT", "RefResult", "evaluate"]

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
    #: (node, field) of every input-rule error (a second frame into a plain or full count slot,
    #: a frame for a bin that already fired) and of max_iterations ("max_iterations").
    errors: set[tuple[str, str]] = field(default_factory=set)
    #: Activations run, by node.
    activations: Counter[str] = field(default_factory=Counter)
    #: Bins that ended DEAD (or empty), by (node, group).
    dead: Counter[tuple[str, int]] = field(default_factory=Counter)
    #: DEAD bins that had received frames and DEAD latch activations, by node.
    warnings: Counter[str] = field(default_factory=Counter)

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
    node: str
    group: int
    root: Lineage
    #: The steps the lineages of all its frames share.
    common: Lineage = ()
    #: field -> [(lineage after the root frame, arrival number, value)].
    frames: dict[str, list[tuple[Lineage, int, Any]]] = field(default_factory=dict)
    arrivals: int = 0


@dataclass
class _Latch:
    has: bool = False
    value: Any = None
    ended: bool = False
    parked: list[_Act] = field(default_factory=list)


def evaluate(plan: Any, behave: Behave, inputs: dict[str, Any]) -> RefResult:
    """Run one call of ``plan`` to completion, sequentially; see the module docstring."""
    ev = _Evaluator(plan, behave)
    ev.run(inputs)
    return ev.result


def _under(lineage: Lineage, root: Lineage) -> bool:
    """Does ``lineage`` still descend from ``root`` (the root node's most recent frame)?"""
    return root == CALL or root[-1] in lineage


def _common(a: Lineage, b: Lineage) -> Lineage:
    """The steps two lineages share, in order."""
    return tuple(s for s in a if s in b)


class _Evaluator:
    def __init__(self, plan: Any, behave: Behave) -> None:
        self.plan = plan
        self.behave = behave
        self.rank = {n: i for i, n in enumerate(plan.nodes)}
        self.outputs = set(plan.outputs)
        self.result = RefResult()
        self.pending: list[_Act] = []
        self.bins: dict[tuple[str, int, Lineage], _Bin] = {}
        #: Decided bins: how ("fired", "dead", "broken") and, for "dead", frames seen per field
        #: (a straggler can still break a plain or count rule).
        self.spent: dict[tuple[str, int, Lineage], tuple[str, Counter[str]]] = {}
        self.latches: dict[tuple[str, str], _Latch] = {}
        self.iterations: Counter[str] = Counter()
        self.aids = 0
        nodes = [INPUT, *plan.nodes]
        #: field -> nodes from which one of its producers can be reached.
        self.feeders: dict[str, frozenset[str]] = {
            f: frozenset(m for m in nodes for s in srcs if s in plan.reach[m])
            for f, srcs in plan.producers.items()
        }

    def run(self, inputs: dict[str, Any]) -> None:
        for f, v in inputs.items():
            self._send(INPUT, f, v, CALL)
        while True:
            self._decide()
            if self.pending:
                act = min(self.pending, key=lambda a: (self.rank[a.node], a.aid))
                self.pending.remove(act)
                self._run(act)
                continue
            if not self.bins:
                break
            self._settle_quiescent()

    # ------------------------------------------------------------------ activations

    def _new_act(self, node: str, group: int, kwargs: dict[str, Any], lineage: Lineage) -> None:
        self.aids += 1
        act = _Act(self.aids, node, group, kwargs, lineage)
        spec = self.plan.specs[node]
        for f in spec.groups[group]:
            if f not in spec.latch:
                continue
            lt = self.latches.setdefault((node, f), _Latch())
            if lt.has:
                act.kwargs[f] = lt.value
                continue
            if lt.ended:
                self.result.warnings[node] += 1
                return
            lt.parked.append(act)
            return
        self._admit(act)

    def _admit(self, act: _Act) -> None:
        if act.node in self.plan.cycle_nodes:
            self.iterations[act.node] += 1
            if self.iterations[act.node] > self.plan.max_iterations:
                # Which cycle node exceeds first depends on the schedule; the model runs on
                # and names every node that exceeds (the runtime stops at one of them).
                self.result.errors.add((act.node, "max_iterations"))
        self.pending.append(act)

    def _run(self, act: _Act) -> None:
        self.result.activations[act.node] += 1
        declared = set(self.plan.specs[act.node].outputs)
        for yidx, frame in enumerate(self.behave(act.node, dict(act.kwargs))):
            if not isinstance(frame, dict) or not set(frame) <= declared:
                raise ValueError(f"behaviour of {act.node} produced {frame!r}")
            # A node keeps one step of its own: a loop that comes back replaces the older one,
            # so lineages (like the runtime's tables) stay bounded, and a frame made by a
            # later round no longer descends from the root frame of an earlier round.
            lineage = (*(s for s in act.lineage if s[0] != act.node), (act.node, act.aid, yidx))
            for f, v in frame.items():
                self._send(act.node, f, v, lineage)

    def _send(self, src: str, f: str, value: Any, lineage: Lineage) -> None:
        for dst, g, fld in self.plan.ctrl_edges.get(src, ()):
            if fld != f:
                continue
            if f in self.plan.specs[dst].latch:
                self._latch(dst, f, value)
            elif (dst, g) in self.plan.buckets:
                self._bin(dst, g, f, value, lineage)
            else:
                self._new_act(dst, g, {f: value}, lineage)
        if src != INPUT and f in self.outputs:
            self.result.outputs[(f, value)] += 1

    def _latch(self, node: str, f: str, value: Any) -> None:
        lt = self.latches.setdefault((node, f), _Latch())
        if lt.has or lt.ended:
            return
        lt.has, lt.value = True, value
        parked, lt.parked = lt.parked, []
        for act in parked:
            spec = self.plan.specs[node]
            again = _Act(act.aid, act.node, act.group, act.kwargs, act.lineage)
            for g in spec.groups[act.group]:
                if g in spec.latch and g not in again.kwargs:
                    other = self.latches.setdefault((node, g), _Latch())
                    if other.has:
                        again.kwargs[g] = other.value
                    elif other.ended:
                        self.result.warnings[node] += 1
                        break
                    else:
                        other.parked.append(again)
                        break
            else:
                self._admit(again)

    # ------------------------------------------------------------------ buckets

    def _root_frame(self, node: str, group: int, lineage: Lineage) -> Lineage:
        root = self.plan.diamond_roots[(node, group)]
        if root == INPUT or self.plan.specs[node].count:
            return CALL
        for i in range(len(lineage) - 1, -1, -1):
            if lineage[i][0] == root:
                # The root frame itself names the bin (lineages drop older steps of a node,
                # so what precedes it may differ between frames of one root frame).
                return (lineage[i],)
        # The root does not lie on this frame's lineage: the call is the only common ancestor.
        return CALL

    def _mode(self, node: str, f: str) -> tuple[str, int | None]:
        spec = self.plan.specs[node]
        counts = dict(spec.count)
        if f in counts:
            n = counts[f]
            return "count", n if isinstance(n, int) else None
        return ("collect" if f in spec.collect else "plain"), None

    def _fields(self, node: str, group: int) -> list[str]:
        spec = self.plan.specs[node]
        return [f for f in spec.groups[group] if f not in spec.latch]

    def _bin(self, node: str, group: int, f: str, value: Any, lineage: Lineage) -> None:
        root = self._root_frame(node, group, lineage)
        key = (node, group, root)
        mode, limit = self._mode(node, f)
        spent = self.spent.get(key)
        if spent is not None:
            how, seen = spent
            if how == "fired":
                self.result.errors.add((node, f))
            elif how == "dead":
                if (mode == "plain" and seen[f]) or (
                    mode == "count" and limit is not None and seen[f] >= limit
                ):
                    self.result.errors.add((node, f))
                    self.spent[key] = ("broken", seen)
                seen[f] += 1
            return
        b = self.bins.get(key)
        if b is None:
            b = self.bins[key] = _Bin(node, group, root, common=lineage)
        else:
            b.common = _common(b.common, lineage)
        lst = b.frames.setdefault(f, [])
        if (mode == "plain" and lst) or (
            mode == "count" and limit is not None and len(lst) >= limit
        ):
            self.result.errors.add((node, f))
            self.result.dead[(node, group)] += 1
            del self.bins[key]
            self.spent[key] = ("broken", Counter())
            return
        after = 1 if root == CALL else lineage.index(root[-1]) + 1
        lst.append((lineage[after:], b.arrivals, value))
        b.arrivals += 1
        if all(self._full(b, fld) for fld in self._fields(node, group)):
            self._fire_or_die(key, b)

    def _full(self, b: _Bin, f: str) -> bool:
        """Satisfied by its frames alone (no stream needs to end first)."""
        mode, limit = self._mode(b.node, f)
        n = len(b.frames.get(f, ()))
        if mode == "plain":
            return n > 0 and len(self.plan.producers[f]) == 1
        return mode == "count" and limit is not None and n >= limit

    def _open(self, b: _Bin) -> list[str]:
        return [f for f in self._fields(b.node, b.group) if not self._full(b, f)]

    def _feeders(self, f: str, root: Lineage) -> frozenset[str]:
        """Nodes from which a producer of ``f`` can be reached; for a bin rooted at a node's
        frame, by paths that do not pass through that node (passing it makes a new root frame,
        whose frames go to another bin)."""
        if root == CALL:
            return self.feeders[f]
        rnode = root[-1][0]
        seen = set(self.plan.producers[f])
        stack = [s for s in seen if s != rnode]
        while stack:
            n = stack.pop()
            for src, _f, dst, _g in self.plan.edges:
                if dst == n and src != rnode and src not in seen:
                    seen.add(src)
                    stack.append(src)
        return frozenset(seen)

    def _waits_on(self, b: _Bin) -> tuple[bool, list[_Bin]]:
        """(a pending activation can still feed ``b``, the other bins that can)."""
        feeders: set[str] = set()
        for f in self._open(b):
            feeders |= self._feeders(f, b.root)
        acts = [a for a in self.pending if a.node in feeders and _under(a.lineage, b.root)]
        acts += [
            a
            for lt in self.latches.values()
            for a in lt.parked
            if a.node in feeders and _under(a.lineage, b.root)
        ]
        bins = [
            c
            for c in self.bins.values()
            if c is not b and c.node in feeders and _under(c.common, b.root)
        ]
        return bool(acts), bins

    def _decide(self) -> None:
        """Decide every bin that nothing can feed any more, and end latches nothing can feed,
        until nothing changes."""
        changed = True
        while changed:
            changed = False
            for key, b in sorted(self.bins.items(), key=lambda kv: self._order(kv[1])):
                if key not in self.bins:
                    continue
                acts, bins = self._waits_on(b)
                if not acts and not bins:
                    self._fire_or_die(key, b)
                    changed = True
            for (node, f), lt in self.latches.items():
                if lt.has or lt.ended or not lt.parked:
                    continue
                feeders = self.feeders[f]
                parked_here = {id(a) for a in lt.parked}
                if any(a.node in feeders for a in self.pending) or any(
                    a.node in feeders and id(a) not in parked_here
                    for other in self.latches.values()
                    for a in other.parked
                    if other is not lt
                ):
                    continue
                if any(c.node in feeders for c in self.bins.values()):
                    continue
                lt.ended = True
                self.result.warnings[node] += len(lt.parked)
                lt.parked = []
                changed = True

    def _order(self, b: _Bin) -> tuple[int, int, Lineage]:
        return (self.rank[b.node], b.group, b.root)

    def _settle_quiescent(self) -> None:
        bins = sorted(self.bins.items(), key=lambda kv: self._order(kv[1]))
        waits = {id(b): {id(c) for c in self._waits_on(b)[1]} for _k, b in bins}
        reach: dict[int, set[int]] = {}
        for _k, b in bins:
            seen = {id(b)}
            stack = [id(b)]
            while stack:
                for j in waits[stack.pop()]:
                    if j not in seen:
                        seen.add(j)
                        stack.append(j)
            reach[id(b)] = seen
        for key, b in bins:
            if all(id(b) in reach[j] for j in reach[id(b)]):
                self._fire_or_die(key, b)
                return
        key, b = bins[0]
        self._fire_or_die(key, b)

    def _fire_or_die(self, key: tuple[str, int, Lineage], b: _Bin) -> None:
        del self.bins[key]
        node, group = b.node, b.group
        spec = self.plan.specs[node]
        kwargs: dict[str, Any] = {}
        dead = False
        for f in self._fields(node, group):
            frames = sorted(b.frames.get(f, []), key=lambda t: (t[0], t[1]))
            values = [v for _lin, _n, v in frames]
            mode, limit = self._mode(node, f)
            if mode == "count":
                kwargs[f] = values if limit is None else values[:limit]
            elif not values and f not in spec.optional:
                dead = True
                break
            elif mode == "collect":
                kwargs[f] = values
            else:
                kwargs[f] = values[0] if values else None
        if not dead and b.arrivals:
            self.spent[key] = ("fired", Counter())
            self._new_act(node, group, kwargs, b.common)
            return
        self.spent[key] = ("dead", Counter({f: len(v) for f, v in b.frames.items()}))
        self.result.dead[(node, group)] += 1
        if dead and b.arrivals:
            self.result.warnings[node] += 1
