"""The random graphs of test_random_graphs.py: their model, their behaviour, and the Graph.

A worker process rebuilds its roles by importing this file by path, so the graph of one
hypothesis example is also built here, at import, from a description: ``$OMNIFLOW_RANDOM_GRAPH``
names a JSON file holding the example's ``Model`` and seed (``Model.to_json``). The test writes
the file, sets the variable, and starts the Runtime; the workers it spawns inherit the variable
and build the identical graph. Without the variable the module defines no graph (the test
builds each example's graph with ``build``). Like every graph module that a worker imports, it
imports only the standard library and omniflow.

Every frame value is ``(label, lineage, origin)``; see test_random_graphs.py for what the
methods check while the runtime drives them. In a worker (``World(strict=True)``) a broken rule
fails the activation with an error whose message starts with ``VIOLATION``, so that it reaches
the test through the call's errors; in-process the test reads ``World.violations`` directly.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import omniflow as of

#: Names a JSON file ``{"model": Model.to_json(), "seed": int}``: the graph to build at import.
GRAPH_ENV = "OMNIFLOW_RANDOM_GRAPH"
#: The plan's name for the call's entry (tests/runtime/reference.py's INPUT).
INPUT = "<input>"
#: Calls per example.
N_CALLS = 6
#: Calls from this index on share one session (FIFO); the others have none (concurrent).
SESSION_FROM = 3
#: How an error raised for a broken rule starts (the test looks for it in every call's errors).
VIOLATION = "rule violation"

# ------------------------------------------------------------------ the model


@dataclass
class NodeModel:
    name: str  # role name; the node is "<name>.m"
    groups: list[list[str]]
    outputs: list[str]
    #: 0: a coroutine; k >= 1: an async generator yielding 0..k frames.
    gen: int = 0
    #: Omit an output from a frame when a digest % cond == 0 (0: never).
    cond: int = 0
    #: Return None (zero frames) when a digest % none_mod == 0 (0: never; coroutines only).
    none_mod: int = 0
    collect: list[str] = field(default_factory=list)
    count: dict[str, Any] | None = None
    lb: str = "round_robin"
    max_concurrency: int | None = None
    optional: list[str] = field(default_factory=list)
    latch: list[str] = field(default_factory=list)
    #: Loop back edge: (field, node it re-enters, bound): the field is produced only while
    #: the re-entered node occurs fewer than ``bound`` times in the frame's lineage.
    back: tuple[str, str, int] | None = None
    #: k >= 1: a coroutine run in batches of up to k activations (``of.Batch(k, 1)``); 0: not.
    batch: int = 0

    @property
    def node(self) -> str:
        return f"{self.name}.m"


@dataclass
class Model:
    placeholders: list[str]
    nodes: list[NodeModel]
    outputs: list[str]
    max_iterations: int = 1024

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description (``from_json`` rebuilds an equal Model)."""
        out = asdict(self)
        for n in out["nodes"]:
            if n["count"] is not None:
                n["count"] = {f: "ALL" if c is of.ALL else c for f, c in n["count"].items()}
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Model:
        nodes = []
        for n in raw["nodes"]:
            n = dict(n)
            if n["count"] is not None:
                n["count"] = {f: of.ALL if c == "ALL" else c for f, c in n["count"].items()}
            if n["back"] is not None:
                n["back"] = tuple(n["back"])
            nodes.append(NodeModel(**n))
        return cls(raw["placeholders"], nodes, raw["outputs"], raw["max_iterations"])


# ------------------------------------------------------------------ behaviour


def digest(*parts: Any) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def canonical(kw: dict[str, Any]) -> tuple[Any, ...]:
    """The inputs without any order the contract leaves open: lists enter sorted by label."""
    out = []
    for k in sorted(kw):
        v = kw[k]
        if v is None:
            out.append((k, None))
        elif isinstance(v, list):
            out.append((k, tuple(sorted(x[0] for x in v))))
        else:
            out.append((k, v[0]))
    return tuple(out)


def frames_of(kw: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every frame value among the inputs, with its field."""
    out = []
    for k, v in kw.items():
        if isinstance(v, list):
            out.extend((k, x) for x in v)
        elif v is not None:
            out.append((k, v))
    return out


def root_prefix(lineage: tuple[Any, ...], root: str) -> tuple[Any, ...]:
    if root != INPUT:
        for i in range(len(lineage) - 1, -1, -1):
            if lineage[i][0] == root:
                return lineage[: i + 1]
    return lineage[:1]


def table_of(lineage: tuple[Any, ...]) -> tuple[Any, ...]:
    """The lineage as the runtime's table keeps it: one step per node, the latest."""
    latest = {e[0]: i for i, e in enumerate(lineage)}
    return tuple(e for i, e in enumerate(lineage) if latest[e[0]] == i)


def must_precede(x: tuple[Any, ...], y: tuple[Any, ...], tree: bool = True) -> bool:
    """Production order: x before y when y descends from x, or when they first part at two
    frames of one activation with x's earlier (``tree``: whatever came after; on graphs with
    cycles only when x and y are those two frames, since a loop that comes back restarts a
    round and the frames of a later round are not ordered against the earlier round's
    later frames). Anything else is left open by the contract."""
    if not tree:
        if len(x) < len(y) and y[: len(x)] == x:
            return True
        return (
            len(x) == len(y) and x[:-1] == y[:-1] and x[-1][:2] == y[-1][:2] and x[-1][2] < y[-1][2]
        )
    for ex, ey in zip(x, y, strict=False):
        if ex != ey:
            return ex[0] == ey[0] and ex[1] == ey[1] and ex[2] < ey[2]
    return len(x) < len(y)


class RuleViolation(Exception):
    """A rule the runtime broke, seen by a method in a worker (the activation fails)."""


class World:
    """One example's graph: behaviours, the shared check log, and the seeded jitter."""

    def __init__(self, model: Model, seed: int, *, strict: bool = False) -> None:
        self.model = model
        #: Raise RuleViolation at a broken rule (in a worker: the log stays in its process).
        self.strict = strict
        self.by_node = {m.node: m for m in model.nodes}
        self.rng = random.Random(seed)
        self.plan: of.StaticPlan | None = None
        self.violations: list[str] = []
        #: (call tag, session node) -> activations running now.
        self.session_running: Counter[tuple[str, str]] = Counter()
        #: (call tag, session node, stream) -> last index started.
        self.session_last: dict[tuple[str, str, Any], int] = {}
        #: ("start"/"end", call tag) in the order they happened.
        self.events: list[tuple[str, str]] = []
        #: Call tag -> its activations running now (in this process).
        self.call_running: Counter[str] = Counter()
        #: The latest call of the session that started an activation here (-1: none yet).
        self.session_call = -1

    # -- the pure part, shared with the reference

    def stream_nodes(self) -> set[str]:
        return {m.node for m in self.model.nodes if m.gen or m.lb == "session"} | {INPUT}

    def arrived(self, node: str, kw: dict[str, Any]) -> tuple[int, list[tuple[str, Any]]]:
        """The OR group and the frames that fired it (latched values are not among them)."""
        m = self.by_node[node]
        group = next(g for g, fs in enumerate(m.groups) if set(fs) == set(kw))
        return group, frames_of({k: v for k, v in kw.items() if k not in m.latch})

    def prefix(self, node: str, kw: dict[str, Any]) -> tuple[Any, ...]:
        """The lineage the activation descends from: what all its frames share."""
        assert self.plan is not None
        _group, arrived = self.arrived(node, kw)
        common = tuple(arrived[0][1][1])
        for _f, v in arrived[1:]:
            n = 0
            for x, y in zip(common, v[1], strict=False):
                if x != y:
                    break
                n += 1
            common = common[:n]
        return common

    def seq_origin(self, node: str, kw: dict[str, Any]) -> tuple[Any, ...]:
        """The SeqId entry the activation carries: its input's, or for a bucket the nearest
        stream frame at or above its root frame."""
        assert self.plan is not None
        m = self.by_node[node]
        group, arrived = self.arrived(node, kw)
        if (node, group) not in self.plan.buckets:
            return tuple(arrived[0][1][2])
        root = INPUT if m.count else self.plan.diamond_roots[(node, group)]
        rp = root_prefix(table_of(arrived[0][1][1]), root)
        streams = self.stream_nodes()
        return tuple(next(e for e in reversed(rp) if e[0] in streams))

    def behave(self, node: str, kw: dict[str, Any]) -> list[dict[str, Any]]:
        m = self.by_node[node]
        act = digest(node, canonical(kw))
        h = int(act, 16)
        if m.gen:
            n = 0 if h % 5 == 0 else 1 + (h >> 4) % m.gen
        else:
            n = 0 if m.none_mod and h % m.none_mod == 0 else 1
        prefix = self.prefix(node, kw)
        origin = self.seq_origin(node, kw)
        frames = []
        for y in range(n):
            lineage = (*prefix, (node, act, y))
            seqo = (node, act, y) if node in self.stream_nodes() else origin
            frame = {}
            for f in m.outputs:
                if m.back is not None and f == m.back[0]:
                    if sum(1 for e in prefix if e[0] == m.back[1]) >= m.back[2]:
                        continue
                elif m.cond and int(digest(act, f, y), 16) % m.cond == 0:
                    continue
                frame[f] = (digest(node, f, y, act), lineage, seqo)
            frames.append(frame)
        return frames

    # -- what only the runtime run checks

    def check_inputs(self, node: str, kw: dict[str, Any]) -> None:
        assert self.plan is not None
        m = self.by_node[node]
        group, arrived = self.arrived(node, kw)
        if (node, group) in self.plan.buckets:
            root = INPUT if m.count else self.plan.diamond_roots[(node, group)]
            roots = {root_prefix(v[1], root) for _f, v in arrived}
            if len(roots) > 1:
                self.violations.append(f"{node}: one bucket got frames of {len(roots)} roots")
        for f, v in kw.items():
            if isinstance(v, list):
                for i, a in enumerate(v):
                    for b in v[i + 1 :]:
                        if must_precede(b[1], a[1], tree=not self.plan.cycle_nodes):
                            self.violations.append(
                                f"{node}: collected '{f}' out of production order: "
                                f"{b[1]} should precede {a[1]}"
                            )

    def session_enter(self, node: str, kw: dict[str, Any]) -> tuple[str, str]:
        prefix = self.prefix(node, kw)
        key = (prefix[0][1], node)
        self.session_running[key] += 1
        if self.session_running[key] > 1:
            self.violations.append(f"{node}: two session activations ran at once")
        origin = self.seq_origin(node, kw)
        if origin[0] == INPUT or self.by_node[origin[0]].lb != "session":
            skey = (*key, origin[:2])
            last = self.session_last.get(skey, -1)
            if origin[2] < last:
                self.violations.append(
                    f"{node}: session activation of index {origin[2]} ran after {last}"
                )
            self.session_last[skey] = max(last, origin[2])
        return key

    def call_enter(self, tag: str) -> None:
        """Session FIFO as one process sees it: an activation of a session call starts when no
        other call of the session runs here and no later one has started here. (The
        test's ``events`` check is the whole-runtime version; a worker sees only its part.)"""
        i = int(tag[1:])
        if i >= SESSION_FROM:
            for other, n in self.call_running.items():
                if n and other != tag and int(other[1:]) >= SESSION_FROM:
                    self.violations.append(f"calls {other} and {tag} of one session overlapped")
            if i < self.session_call:
                self.violations.append(f"call {tag} of the session ran after c{self.session_call}")
            self.session_call = max(self.session_call, i)
        self.call_running[tag] += 1

    async def jitter(self) -> None:
        r = self.rng.random()
        # Everyday user code around the awaits: asyncio.timeout needs the method's one task
        # (a failure here fails the method, and so the example).
        async with asyncio.timeout(120):
            if r < 0.2:
                return  # no suspension at all: the method ends in its first step
            await asyncio.sleep(0 if r < 0.4 else self.rng.random() * 0.002)


def make_method(world: World, m: NodeModel) -> Callable[..., Any]:
    node = m.node

    def enter(kw: dict[str, Any]) -> tuple[str, str] | None:
        seen = len(world.violations)
        world.check_inputs(node, kw)
        tag = world.prefix(node, kw)[0][1]
        world.events.append(("start", tag))
        world.call_enter(tag)
        key = world.session_enter(node, kw) if m.lb == "session" else None
        if world.strict and len(world.violations) > seen:
            leave(key, kw)
            raise RuleViolation(f"{VIOLATION}: " + "; ".join(world.violations[seen:]))
        return key

    def leave(key: tuple[str, str] | None, kw: dict[str, Any]) -> None:
        if key is not None:
            world.session_running[key] -= 1
        tag = world.prefix(node, kw)[0][1]
        world.call_running[tag] -= 1
        world.events.append(("end", tag))

    if m.gen:

        async def gen(self: Any, **kw: Any) -> Any:
            key = enter(kw)
            try:
                for frame in world.behave(node, kw):
                    await world.jitter()
                    yield frame
            finally:
                leave(key, kw)

        fn: Callable[..., Any] = gen
    else:

        async def coro(self: Any, **kw: Any) -> Any:
            key = enter(kw)
            try:
                await world.jitter()
                frames = world.behave(node, kw)
                return frames[0] if frames else None
            finally:
                leave(key, kw)

        fn = coro
        if m.batch:

            async def batched(self: Any, **lists: Any) -> Any:
                # One activation per entry; its fields are its OR group's (the lists hold
                # None where another group's activation has no such field).
                kws = [
                    {f: lists[f][i] for f in m.groups[ctx.or_group]}
                    for i, ctx in enumerate(of.batch_contexts())
                ]
                results: list[Any] = []
                entered = []
                for kw in kws:
                    try:
                        entered.append((enter(kw), kw))
                        results.append(_PENDING)
                    except RuleViolation as exc:  # that activation fails, the others go on
                        results.append(exc)
                try:
                    await world.jitter()
                    for i, kw in enumerate(kws):
                        if results[i] is _PENDING:
                            frames = world.behave(node, kw)
                            results[i] = frames[0] if frames else None
                finally:
                    for key, kw in entered:
                        leave(key, kw)
                return results

            fn = batched
    fn.__name__ = fn.__qualname__ = "m"
    return of.interface(
        inputs_or=m.groups,
        outputs=m.outputs,
        lb=m.lb,
        collect=m.collect,
        activate_by_count=m.count,
        max_concurrency=m.max_concurrency,
        optional=m.optional,
        latch=m.latch,
        batch=of.Batch(m.batch, 1) if m.batch else None,
    )(fn)


_PENDING = object()


def build(world: World) -> of.Graph:
    roles = {}
    for m in world.model.nodes:
        cls = type(f"R{m.name}", (of.Role,), {"m": make_method(world, m)})
        roles[m.name] = cls()
    return of.Graph(
        "rand",
        roles=roles,
        inputs=[of.Placeholder(p) for p in world.model.placeholders],
        outputs=world.model.outputs,
        max_iterations=world.model.max_iterations,
    )


# ------------------------------------------------------------------ across processes


def save(path: Path, model: Model, seed: int) -> None:
    """Write the description that ``load`` (and a worker's import of this module) reads."""
    path.write_text(json.dumps({"model": model.to_json(), "seed": seed}))


def load(path: str | Path, *, strict: bool) -> tuple[World, of.Graph]:
    """The World and Graph that ``save`` described, the plan parsed into the World."""
    raw = json.loads(Path(path).read_text())
    world = World(Model.from_json(raw["model"]), raw["seed"], strict=strict)
    graph = build(world)
    world.plan = of.parse(graph)
    return world, graph


if GRAPH_ENV in os.environ:  # a worker process of a test that described its graph
    world, graph = load(os.environ[GRAPH_ENV], strict=True)
