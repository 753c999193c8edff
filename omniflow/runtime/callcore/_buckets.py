"""Buckets: where the inputs of one activation of a convergence node gather.

A bucket is identified by (call, node, OR group, key), the key being the entry of the
bucket's diamond root in the arriving frame's table (the paper's activation id, Rule C: every
path from the same root frame lands in the same bucket). Join nodes (activate_by_count) use the
call's own entry, so all their inputs of a call meet in one bucket.

``evaluate`` is pure: given what arrived and which nodes still hold live work under the
bucket's key it answers a ``Verdict``: ``Fire(kwargs)``, ``Dead(reason)`` or ``WAIT``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from omniflow.dsl._role import _All
from omniflow.plan._plan import NodeSpec, StaticPlan
from omniflow.runtime.callcore._liveness import FRAME, Entry, Table

__all__ = [
    "WAIT",
    "Bucket",
    "BucketSpec",
    "Dead",
    "FieldSpec",
    "Fire",
    "Verdict",
    "Wait",
    "bucket_specs",
    "quiescent_pick",
    "rule_error",
]


class Fire(NamedTuple):
    """The bucket is complete: run its node's method with these keyword arguments."""

    kwargs: dict[str, Any]


class Dead(NamedTuple):
    """The bucket can never fire (an input ended with no frame, or it broke a rule)."""

    reason: str


class Wait(NamedTuple):
    """An input may still arrive: decide later."""


#: The one ``Wait`` verdict.
WAIT = Wait()

#: What a bucket's evaluation says.
Verdict = Fire | Dead | Wait


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one field of a bucket's OR group is satisfied."""

    #: Field name.
    name: str
    #: Sources of the field (one static slot each).
    sources: tuple[str, ...]
    #: "plain" (one frame), "collect" (all frames, after the streams end) or "count".
    mode: str
    #: For mode "count": the threshold (int) or None for ALL.
    threshold: int | None
    #: Exactly one source (the plan's critical slot).
    critical: bool
    #: Listed in ``optional=``: ending with no frame passes None ([] for collect) instead of
    #: making the bucket DEAD.
    optional: bool = False
    #: Satisfied only when its streams end (collect, ALL): a frame never completes it.
    ends_only: bool = field(init=False)
    #: Satisfied by its first frame (a plain field of one source, or a count of 1).
    first_frame: bool = field(init=False)

    def __post_init__(self) -> None:
        ends = self.mode == "collect" or (self.mode == "count" and self.threshold is None)
        object.__setattr__(self, "ends_only", ends)
        first = (self.mode == "plain" and len(self.sources) == 1) or self.threshold == 1
        object.__setattr__(self, "first_frame", first)


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """Static facts of one (node, or_group) bucket."""

    node: str
    group: int
    #: The diamond root's node name, or "<input>".
    root: str
    fields: tuple[FieldSpec, ...]
    by_field: dict[str, FieldSpec]
    #: For each field: the nodes whose live work under the bucket's key can still bring one
    #: of its sources a frame keeping that key (``FRAME`` included).
    field_feeders: dict[str, frozenset[str]]
    is_join: bool
    #: The bucket itself is live at its node: discount it when asking about its own slots.
    discount: dict[str, int] = field(default_factory=dict)
    #: node -> the fields whose slots it can still feed (inverse of field_feeders).
    feeds: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Keyed by the call's entry (a join, or rooted at "<input>").
    by_call: bool = field(init=False)
    #: Field names.
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_call", self.is_join or self.root == "<input>")
        object.__setattr__(self, "names", frozenset(self.by_field))


def bucket_specs(
    plan: StaticPlan, roots: dict[tuple[str, int], str]
) -> dict[tuple[str, int], BucketSpec]:
    """Precompute a BucketSpec for every bucket of the plan; ``roots``: the root each bucket
    is keyed by (the plan's diamond roots, except that the runtime keys buckets of
    once-per-call roots by the call's entry: ``_compiled``)."""
    feeders: dict[str, frozenset[str]] = {}
    for src in {s for slots in plan.slots.values() for _f, s in slots}:
        feeders[src] = frozenset(m for m, r in plan.reach.items() if src in r)
    pred: dict[str, set[str]] = {}
    for src, _f, dst, _g in plan.edges:
        pred.setdefault(dst, set()).add(src)
    avoiding: dict[tuple[str, str], frozenset[str]] = {}

    def feeders_of(src: str, root: str) -> frozenset[str]:
        """Nodes whose live work under an entry of ``root`` can still bring ``src`` a frame
        keeping that entry: every path through ``root`` restamps (a loop coming back to the
        root makes a new root frame, hence another bucket), so those paths do not count."""
        if root == "<input>" or root == src:
            return feeders[src]
        got = avoiding.get((src, root))
        if got is None:
            seen = {src}
            stack = [src]
            while stack:
                for m in pred.get(stack.pop(), ()):
                    if m != root and m not in seen:
                        seen.add(m)
                        stack.append(m)
            got = avoiding[(src, root)] = frozenset(seen)
        return got

    out: dict[tuple[str, int], BucketSpec] = {}
    for node, g in plan.buckets:
        spec: NodeSpec = plan.specs[node]
        counts = dict(spec.count)
        fields = []
        for f in spec.groups[g]:
            if f in spec.latch:
                continue  # a per-call constant, paired with the activation after it fires
            srcs = plan.producers[f]
            if f in counts:
                thr = counts[f]
                fields.append(
                    FieldSpec(f, srcs, "count", None if isinstance(thr, _All) else thr, False)
                )
            else:
                mode = "collect" if f in spec.collect else "plain"
                fields.append(
                    FieldSpec(f, srcs, mode, None, len(srcs) == 1, optional=f in spec.optional)
                )
        root = roots[(node, g)]
        keyed = "<input>" if spec.is_join else root
        src_feeders = {s: feeders_of(s, keyed) for fs in fields for s in fs.sources}
        field_feeders = {
            fs.name: frozenset().union(*(src_feeders[s] for s in fs.sources), (FRAME,))
            for fs in fields
        }
        out[(node, g)] = BucketSpec(
            node=node,
            group=g,
            root=root,
            fields=tuple(fields),
            by_field={fs.name: fs for fs in fields},
            field_feeders=field_feeders,
            is_join=spec.is_join,
            discount={node: 1},
            feeds=_invert(field_feeders),
        )
    return out


class Bucket:
    """Frames gathered for one activation of a convergence node."""

    __slots__ = (
        "arrivals",
        "dead_field",
        "frames",
        "key",
        "open",
        "refs",
        "retired",
        "seq",
        "settled",
        "spec",
        "table",
    )

    def __init__(self, spec: BucketSpec, key: Entry, table: Table) -> None:
        #: Static facts.
        self.spec = spec
        #: The root entry that names this bucket within its (call, node, group).
        self.key = key
        #: Entries shared by every frame of this bucket (the arriving table up to ``key``).
        self.table = table
        #: field -> [(sort key, value)] in arrival order.
        self.frames: dict[str, list[tuple[Any, Any]]] = {}
        #: Frames that arrived, all fields together.
        self.arrivals = 0
        #: Seq entry (nearest stream) of the first frame; the activation inherits it.
        self.seq: Entry | None = None
        #: Data-plane refs among its frames (held until it fires, then by its activation).
        self.refs: list[Any] = []
        #: Fields whose every slot has ended (learned at evaluations; ending is final).
        self.settled: set[str] = set()
        #: Fields not yet satisfied (by their frames, or by their slots ending).
        self.open: set[str] = set(spec.names)
        #: Set once it fired or died (it is out of the bucket table then).
        self.retired = False
        #: The field whose ending made it DEAD (for ``call.warnings``).
        self.dead_field: str | None = None

    def add(self, fld: str, value: Any, sort_key: Any) -> str | None:
        """Store a frame; return an error message when the frame breaks the field's rule."""
        fs = self.spec.by_field[fld]
        lst = self.frames.get(fld)
        if lst is None:
            self.frames[fld] = [(sort_key, value)]
            self.arrivals += 1
            if fs.first_frame:
                self.open.discard(fld)
            return None
        err = rule_error(fs, len(lst))
        if err is not None:
            return err
        lst.append((sort_key, value))
        self.arrivals += 1
        if fs.mode == "count" and fs.threshold is not None and len(lst) >= fs.threshold:
            self.open.discard(fld)
        return None

    def wakes_on(self, dropped: Sequence[str]) -> bool:
        """Can live work ending at ``dropped`` change the decision? Only if one of those nodes
        feeds a field still open (or nothing is open, and the bucket is decided anyway)."""
        open_ = self.open
        if not open_:
            return True
        feeds = self.spec.feeds
        for n in dropped:
            fields = feeds.get(n)
            if fields is not None and not open_.isdisjoint(fields):
                return True
        return False

    def fed_only_at(self, counts: Mapping[str, int] | None, node: str) -> bool:
        """Can live work at no node but ``node`` still feed an open field? ``counts``: live
        work per node under the bucket's key. True means only ``node``'s own work (its queued
        activations, its buckets) can still complete the bucket: a loop through ``node``."""
        open_ = self.open
        feeds = self.spec.feeds
        for n in counts or ():
            if n != node:
                fields = feeds.get(n)
                if fields is not None and not open_.isdisjoint(fields):
                    return False
        return True

    def refresh(
        self, counts: Mapping[str, int] | None, dropped: Sequence[str] | None
    ) -> str | None:
        """Settle every open field whose slots have all ended; return why the bucket is DEAD,
        if it is. ``counts``: live work per node under the bucket's key (the liveness counts;
        the bucket itself is discounted at its own node). A field has ended when none of those
        nodes can still feed it. ``dropped``: nodes whose live work under the key just ended,
        so only fields they feed can have ended (None: check every open field, as at
        creation). Ending is final, so ``open`` stays exact as long as every liveness drop
        under the key is passed here."""
        open_ = self.open
        if not open_:
            return None
        spec = self.spec
        if dropped is None:
            candidates = list(open_)
        else:
            feeds = spec.feeds
            candidates = [name for name in open_ if any(name in feeds.get(n, ()) for n in dropped)]
            if not candidates:
                return None
        # One pass over the counts, then set tests.
        if counts:
            discount = spec.discount
            alive = {n for n, c in counts.items() if c > discount.get(n, 0)}
        else:
            alive = set()
        ff = spec.field_feeders
        for name in candidates:
            if not ff[name].isdisjoint(alive):
                continue
            reason = self._ended(name)
            if reason is not None:
                return reason
        return None

    def _ended(self, name: str) -> str | None:
        """Every slot of ``name`` ended: settle it, or say why the bucket is DEAD (the AND
        rule: a field that ended with no frame kills the bucket unless it is optional or a
        count field)."""
        fs = self.spec.by_field[name]
        if not self.frames.get(name) and fs.mode != "count" and not fs.optional:
            self.dead_field = name
            if fs.critical:
                if fs.mode == "plain":
                    return f"critical input '{name}' will never arrive"
                return f"collected input '{name}' ended with no frame"
            return (
                f"input '{name}' ended with no frame on any of its {len(fs.sources)} paths "
                f"({', '.join(fs.sources)})"
            )
        self.settled.add(name)
        self.open.discard(name)
        return None

    def decide(self) -> Verdict:
        """From what arrived and what settled: ``WAIT``, ``Fire(kwargs)`` or ``Dead(reason)``."""
        if self.open:
            return WAIT
        if not self.arrivals:
            return Dead("every input ended without a frame")
        frames = self.frames
        return Fire({fs.name: _settled_value(fs, frames.get(fs.name)) for fs in self.spec.fields})

    def could_fire_now(self, fs: FieldSpec) -> bool:
        """After a frame of ``fs`` arrived: can the bucket fire without waiting for a slot to
        end? A frame never ends another slot, so only a frame that completes the set can;
        collected and ALL fields are satisfied only by their streams ending."""
        return not fs.ends_only and not self.open

    def evaluate(
        self, counts: Mapping[str, int] | None, dropped: Sequence[str] | None = None
    ) -> Verdict:
        """``refresh`` then ``decide``: ``WAIT``, ``Fire(kwargs)`` or ``Dead(reason)``."""
        reason = self.refresh(counts, dropped)
        if reason is not None:
            return Dead(reason)
        return self.decide()


def _settled_value(fs: FieldSpec, lst: list[tuple[Any, Any]] | None) -> Any:
    """The value of a satisfied field: its frame (None when an optional one ended empty), or
    the list."""
    if fs.mode == "plain":
        return lst[0][1] if lst else None
    # A count field never holds more than its threshold (``add`` refuses the frame after).
    return _ordered(lst)


def _invert(field_feeders: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for name, nodes in field_feeders.items():
        for n in nodes:
            out.setdefault(n, set()).add(name)
    return {n: frozenset(v) for n, v in out.items()}


def rule_error(fs: FieldSpec, before: int) -> str | None:
    """The error of a frame of ``fs`` arriving after ``before`` others in one bucket, if any."""
    if fs.mode == "plain" and before:
        return (
            f"field '{fs.name}' received a second frame for the same activation; two streams "
            f"meet here frame by frame. Declare collect=['{fs.name}'] to receive all frames as a "
            "list, or make the streams share a fork source"
        )
    if fs.mode == "count" and fs.threshold is not None and before >= fs.threshold:
        return (
            f"field '{fs.name}' received more than activate_by_count={fs.threshold} frames in "
            "one call; use omniflow.ALL to take every frame, or a larger count"
        )
    return None


def quiescent_pick(buckets: Sequence[Bucket]) -> int:
    """Which of the gathering buckets of a quiescent call (given in plan order) to settle
    first: the earliest that waits only on buckets waiting back on it, i.e. lies in a terminal
    strongly connected part of "waits on" (B waits on C when C's node feeds an open field of B
    and C is live under B's key). A bucket that waits on a bucket which does not wait back is
    never settled before it: that bucket can still fire and produce the field."""
    waits: list[list[int]] = []
    for b in buckets:
        feeders: set[str] = set()
        for name in b.open:
            feeders |= b.spec.field_feeders[name]
        waits.append(
            [
                j
                for j, c in enumerate(buckets)
                if c is not b and c.spec.node in feeders and b.key in c.table
            ]
        )
    reach: list[set[int]] = []
    for i in range(len(buckets)):
        seen = {i}
        stack = [i]
        while stack:
            for j in waits[stack.pop()]:
                if j not in seen:
                    seen.add(j)
                    stack.append(j)
        reach.append(seen)
    # A finite graph always has a terminal strongly connected part, so the search stops
    # within range (the property test in tests/runtime/test_core_props.py checks the pick).
    i = 0
    while not all(i in reach[j] for j in reach[i]):
        i += 1
    return i


def _ordered(lst: list[tuple[Any, Any]] | None) -> list[Any]:
    if not lst:
        return []
    if len(lst) > 1:
        lst = sorted(lst, key=lambda kv: kv[0])
    return [v for _k, v in lst]
