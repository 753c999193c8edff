"""Stateful property tests of the pure scheduling structures, with no event loop.

* ``CallCoreMachine`` plays the async shell against a real ``CallCore``, through
  ``CallCore.handle`` alone: it starts a call, delivers frames (random subsets of a node's
  outputs) for random running activations, finishes them (normally, with an exception,
  cancelled), cancels the call or crashes it, in any interleaving hypothesis finds, checking
  every ``Instructions`` it gets back, with ``core.validate()`` as the invariant after every
  step. At the end it drains everything and the call must be finished with nothing left.
* ``StreamOrderMachine`` pushes indices in random order into a ``StreamOrder`` and releases them
  the way the core does; released indices never go down.
* ``Bucket.evaluate`` against a small hand-written truth table.
* Illegal activation moves raise ``TransitionError`` naming node, states and story.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import omniflow as of
from omniflow.runtime.callcore._buckets import (
    WAIT,
    Bucket,
    BucketSpec,
    Dead,
    FieldSpec,
    Fire,
    Wait,
    quiescent_pick,
)
from omniflow.runtime.callcore._compiled import Compiled, compile_plan
from omniflow.runtime.callcore._core import Activation, CallCore
from omniflow.runtime.callcore._ordering import StreamOrder
from omniflow.runtime.callcore._stimuli import (
    NOTHING,
    SETTLE,
    ActState,
    Cancel,
    Crash,
    Ended,
    Instructions,
    Produced,
    Returned,
    Start,
    Stimulus,
    TransitionError,
    render_story,
)

from .conftest import load_graph_module

# ------------------------------------------------------------------ plans


class _Split(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["a", "b"])
    async def run(self, request: Any) -> Any:
        yield {"a": request}


class _Left(of.Role):
    @of.interface(inputs_or=[["a"]], outputs=["x"])
    async def run(self, a: Any) -> Any:
        return {"x": a}


class _Right(of.Role):
    @of.interface(inputs_or=[["a"]], outputs=["x", "y"], lb="session")
    async def run(self, a: Any) -> Any:
        yield {"x": a, "y": a}


class _Merge(of.Role):
    # x has two producers (a bucket rooted at split.run), collected; y is critical.
    @of.interface(inputs_or=[["x", "y"]], outputs=["merged"], collect=["x"])
    async def run(self, x: Any, y: Any) -> Any:
        return {"merged": (x, y)}


class _Pick(of.Role):
    # Two producers meeting frame by frame: a second frame is an input-rule error.
    @of.interface(inputs_or=[["x"], ["b"]], outputs=["picked"])
    async def run(self, x: Any = None, b: Any = None) -> Any:
        return {"picked": x}


class _Tally(of.Role):
    # A single multi-yield producer collected whole (rooted at the call).
    @of.interface(inputs_or=[["b"]], outputs=["tally"], collect=["b"])
    async def run(self, b: Any) -> Any:
        return {"tally": b}


class _Join(of.Role):
    @of.interface(inputs_or=[["y", "request"]], outputs=["joined"], activate_by_count={"y": 2})
    async def run(self, y: Any, request: Any) -> Any:
        return {"joined": y}


MIXED = of.Graph(
    "mixed",
    roles={
        "split": _Split(),
        "left": _Left(),
        "right": _Right(),
        "merge": _Merge(),
        "pick": _Pick(),
        "tally": _Tally(),
        "join": _Join(),
    },
    inputs=[of.Placeholder("request")],
    outputs=["x", "merged", "picked", "tally", "joined"],
)


class _Src(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["tok", "voice", "w", "z"])
    async def run(self, request: Any) -> Any:
        yield {"tok": request}


class _Alt(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["z"])
    async def run(self, request: Any) -> Any:
        return {"z": request}


class _Tts(of.Role):
    # A per-call constant from a node (activations park until it comes, or die with it).
    @of.interface(inputs_or=[["tok", "voice"]], outputs=["audio"], latch=("voice",))
    async def run(self, tok: Any, voice: Any) -> Any:
        return {"audio": tok}


class _Opt(of.Role):
    # z has two producers and is optional (the AND rule's escape); w is critical.
    @of.interface(inputs_or=[["w", "z"]], outputs=["o"], optional=("z",))
    async def run(self, w: Any, z: Any) -> Any:
        return {"o": w}


class _Lp(of.Role):
    # A loop whose outputs feed a collect and a join outside it (issue 18's shape).
    @of.interface(inputs_or=[["w"], ["again"]], outputs=["again", "lo"])
    async def run(self, **kw: Any) -> Any:
        return {"lo": 1}


class _Col(of.Role):
    @of.interface(inputs_or=[["tok", "lo"]], outputs=["col"], collect=["lo"])
    async def run(self, tok: Any, lo: Any) -> Any:
        return {"col": lo}


class _All(of.Role):
    @of.interface(inputs_or=[["lo"]], outputs=["all"], activate_by_count={"lo": of.ALL})
    async def run(self, lo: Any) -> Any:
        return {"all": lo}


LATCHED = of.Graph(
    "latched",
    roles={
        "src": _Src(),
        "alt": _Alt(),
        "tts": _Tts(),
        "opt": _Opt(),
        "lp": _Lp(),
        "col": _Col(),
        "all": _All(),
    },
    inputs=[of.Placeholder("request")],
    outputs=["audio", "o", "col", "all"],
    max_iterations=20,
)


def _compiled() -> dict[str, Compiled]:
    fig3 = load_graph_module("fig3").graph
    return {
        "fig3": compile_plan(of.parse(fig3)),
        "mixed": compile_plan(of.parse(MIXED)),
        "latched": compile_plan(of.parse(LATCHED)),
    }


COMPILED = _compiled()


def test_mixed_plan_has_the_shapes_the_machine_needs() -> None:
    plan = COMPILED["mixed"].plan
    assert plan.diamond_roots[("merge.run", 0)] == "split.run"
    assert plan.diamond_roots[("tally.run", 0)] == "<input>"
    assert ("pick.run", 0) in plan.buckets and ("pick.run", 1) not in plan.buckets
    assert plan.seq_producers == {"split.run", "right.run"}


# ------------------------------------------------------------------ CallCore


class CallCoreMachine(RuleBasedStateMachine):
    """The async shell, played by hypothesis. Rules carry no preconditions (a rule with
    nothing to act on does nothing), so that hypothesis never gives up drawing one."""

    @initialize(which=st.sampled_from(sorted(COMPILED)), payload=st.integers(0, 9))
    def plan(self, which: str, payload: int) -> None:
        self.c = COMPILED[which]
        self.calls = 0
        #: What the calls of this run did, for the statistics.
        self.seen: Counter[str] = Counter()
        self.core: CallCore | None = None
        self.start(payload)

    @rule(payload=st.integers(0, 9))
    def start(self, payload: int) -> None:
        """Start the next call once the current one has finished."""
        if self.core is not None and not self.core.finished:
            return
        self.calls += 1
        self.story: deque[tuple[Any, ...]] = deque()
        self.core = CallCore(self.c, f"c{self.calls}", story=self.story)
        #: Activations handed out to run and not started yet (the shell's ready queue).
        self.ready: deque[Activation] = deque()
        #: Activations the shell runs (started, not done).
        self.running: list[Activation] = []
        #: Frames for the caller, in release order.
        self.emitted: list[tuple[str, Any, str, int]] = []
        #: Warnings of the call seen so far.
        self.warned: list[dict[str, str]] = []
        #: Data-plane refs released so far (none in these plans).
        self.released: list[Any] = []
        self.finished = False
        self._handle(Start({p: payload for p in self.c.plan.inputs}))
        self._pump()

    # -- the shell's side of every stimulus

    def _handle(self, stimulus: Stimulus) -> Instructions:
        """Hand one stimulus to the core and carry out the answer, as the shell does; check
        what the answer may say."""
        core = self.core
        assert core is not None
        known = {id(a) for a in self.running}
        ins = core.handle(stimulus)
        assert isinstance(ins, Instructions)
        # Every stimulus leaves a record under its id (the last record is the latest's).
        assert self.story and self.story[-1][1] == core.stimuli
        for act in ins.run:
            assert act.state is ActState.RUNNING, act
            assert id(act) not in known and act not in self.ready, f"{act} handed out twice"
        for act in ins.cancel:
            assert act.state is ActState.RUNNING, act
        if ins.finished:
            assert core.finished and not ins.run
        elif core.finished:
            raise AssertionError("finished, but the instructions did not say so")
        if ins is NOTHING:
            assert not (ins.run or ins.emit or ins.release or ins.cancel)
        self.ready.extend(ins.run)
        self.emitted.extend(ins.emit)
        self.released.extend(ins.release)
        # Cancelled methods finish later (the rules end them); a crashed call forgets them.
        if ins.finished:
            self.finished = True
            self.seen.update(rec[2] for rec in self.story)
            self.story.clear()
            if core.crashed:
                self.running = []
                self.ready.clear()
        return ins

    def _pump(self, data: st.DataObject | None = None) -> None:
        """Start what the core asks for, as the shell does: a method may suspend (it runs on,
        in ``running``) or return within its first step (``Returned`` with ``settle`` off
        while more of the batch waits), then ``SETTLE`` once per batch when the core asks."""
        core = self.core
        assert core is not None
        while True:
            while self.ready:
                act = self.ready.popleft()
                spec = self.c.specs[act.node]
                if (
                    data is not None
                    and not spec.is_generator
                    and data.draw(st.integers(0, 2), label="returns at once") == 0
                ):
                    frame = {f: self._value(act) for f in spec.outputs}
                    value = frame if data.draw(st.booleans(), label="frame") else None
                    self._handle(Returned(act, value, settle=not self.ready))
                else:
                    self.running.append(act)
            if not core.unsettled or core.finished:
                break
            self._handle(SETTLE)
        self.running = [a for a in self.running if a.state is not ActState.DONE]

    def _value(self, act: Activation) -> tuple[Any, ...]:
        """(stream, index) the caller should see the frame with; stream None for a session
        node's stream, whose indices count the node's frames across activations."""
        spec = self.c.specs[act.node]
        if spec.lb == "session":
            return (None, None, act.aid, act.yidx)
        if spec.is_generator:
            return ((act.node, act.aid), act.yidx, act.aid, act.yidx)
        return ((act.seq[0], act.seq[1]), act.seq[2], act.aid, act.yidx)

    # -- rules

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """A running method returns (coroutine) or yields (generator) a frame."""
        core = self.core
        if core is None or not self.running:
            return
        act = data.draw(st.sampled_from(self.running), label="act")
        outputs = list(self.c.specs[act.node].outputs)
        if data.draw(st.booleans(), label="all outputs"):
            fields = outputs
        else:
            fields = data.draw(st.lists(st.sampled_from(outputs), unique=True), label="fields")
        frame: Any = {f: self._value(act) for f in fields}
        if data.draw(st.integers(0, 19), label="bad") == 0:
            frame = {"no_such_field": 1} if data.draw(st.booleans()) else "not a dict"
        errors = len(core.errors)
        if not self.c.specs[act.node].is_generator:
            self._handle(Returned(act, frame))  # a coroutine returns its one frame
        elif not self._handle(Produced(act, frame)).accepted:
            # The shell stops a method whose frame was rejected (or whose call is closing).
            assert core.closing or len(core.errors) == errors + 1
            self._handle(Ended(act))
        self._pump(data)

    @rule(data=st.data(), how=st.sampled_from(["ok", "ok", "error", "cancelled"]))
    def finish(self, data: st.DataObject, how: str) -> None:
        """A running method ends: returns None, ends its stream, raises, or is cancelled."""
        if self.core is None or not self.running:
            return
        act = data.draw(st.sampled_from(self.running), label="act")
        exc: BaseException | None = None
        if how == "error":
            exc = RuntimeError("boom")
        elif how == "cancelled":
            exc = asyncio.CancelledError()
        self._handle(Ended(act, exc))
        self._pump(data)

    @rule(dice=st.integers(0, 5))
    def cancel(self, dice: int) -> None:
        """The caller cancels (rarely: a cancelled call ends soon and explores little)."""
        if dice == 0 and self.core is not None and not self.core.finished:
            ins = self._handle(Cancel())
            assert {id(a) for a in ins.cancel} <= {id(a) for a in self.running}
            self._pump()

    @rule(dice=st.integers(0, 30))
    def crash(self, dice: int) -> None:
        """An internal error surfaces in the shell (very rarely): the core ends the call with
        an error naming the bug, cancels everything that runs, and takes no more stimuli."""
        core = self.core
        if dice or core is None or core.finished:
            return
        running = {id(a) for a in self.running}
        ins = self._handle(Crash(RuntimeError("shell bug")))
        assert ins.finished and core.crashed
        assert core.status == ("cancelled" if core.cancelled else "error")
        assert {id(a) for a in ins.cancel} == running
        assert core.errors[-1].node == "<runtime>" and "shell bug" in str(core.errors[-1])
        assert core.handle(SETTLE).accepted is False  # ignored from now on

    # -- invariants

    @invariant()
    def valid(self) -> None:
        core = self.core
        if core is None:
            return
        core.validate()
        assert core.n_acts >= len(self.running) or core.closing
        if core.finished:
            assert not self.running

    @invariant()
    def warnings_name_a_dead_activation(self) -> None:
        """Every warning names a node that gathers (a bucket) or latches, and one of its
        fields; a warning is only ever added, never withdrawn."""
        core = self.core
        if core is None:
            return
        for w in core.warnings:
            assert set(w) == {"node", "field", "message"}
            spec = self.c.specs[w["node"]]
            assert w["field"] in {f for g in spec.groups for f in g}
            assert w["node"] in self.c.bucket_nodes or w["field"] in spec.latch
        assert core.warnings[: len(self.warned)] == self.warned
        self.warned = list(core.warnings)

    @invariant()
    def caller_frames_in_seq_order(self) -> None:
        if self.core is None:
            return
        last: dict[tuple[Any, ...], int] = {}
        outputs = set(self.c.plan.outputs)
        for f, value, node, seq in self.emitted:
            assert f in outputs and f in self.c.specs[node].outputs
            stream, idx, _aid, _y = value
            if stream is None:
                stream = (node, "session")
            else:
                assert seq == idx, (f, value, node, seq)
            key = (f, *stream)
            assert seq >= last.get(key, -1), f"{f} of {stream}: seq {seq} after {last[key]}"
            last[key] = seq

    def teardown(self) -> None:
        core = self.core
        if core is None:
            return
        for _ in range(10_000):
            if not self.running:
                break
            self._handle(Ended(self.running[0]))
            self._pump()
            core.validate()
        assert core.finished and self.finished, (core.n_acts, core.buckets, core.live.counts)
        if not core.crashed:
            assert not core.buckets and core.n_acts == 0 and not core.live.counts
            assert not self.ready and not core.running
        event(f"calls: {min(self.calls, 4)}{'+' if self.calls >= 4 else ''}")
        for ev in ("fire", "dead", "error", "cancel", "warning", "crash"):
            n = self.seen[ev]
            event(f"{ev}: {min(n, 3)}{'+' if n >= 3 else ''}")


TestCallCore = CallCoreMachine.TestCase
TestCallCore.pytestmark = [pytest.mark.slow]
TestCallCore.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ------------------------------------------------------------------ StreamOrder


class StreamOrderMachine(RuleBasedStateMachine):
    """Items arrive in any order; the owner releases index ``exp`` and advances once every
    item of that index has arrived (its index has *settled*)."""

    @initialize(
        schedule=st.lists(st.integers(0, 5), min_size=1, max_size=20).flatmap(st.permutations)
    )
    def setup(self, schedule: list[int]) -> None:
        self.so = StreamOrder("gen.run", 7)
        #: Items still to push, in arrival order: (index, tag).
        self.todo = [(idx, n) for n, idx in enumerate(schedule)]
        self.all = list(self.todo)
        self.released: list[tuple[int, int]] = []

    def _settled(self, idx: int) -> bool:
        return all(i != idx for i, _n in self.todo)

    @precondition(lambda self: self.todo)
    @rule(data=st.data())
    def push(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(0, min(2, len(self.todo) - 1)), label="which")
        idx, n = self.todo.pop(k)
        self.so.push(idx, (idx, n))

    @rule()
    def take(self) -> None:
        exp = self.so.exp
        for item in self.so.take_current():
            assert item[0] == exp
            self.released.append(item)

    @rule()
    def pop_one(self) -> None:
        item = self.so.pop_current()
        if item is not None:
            assert item[0] == self.so.exp
            self.released.append(item)

    @precondition(lambda self: self._settled(self.so.exp) and self.so.exp not in self.so.pending)
    @rule()
    def advance(self) -> None:
        self.so.advance()

    @precondition(lambda self: self.so.exp > 0)
    @rule()
    def late_push_is_refused(self) -> None:
        with pytest.raises(AssertionError, match="arrived after"):
            self.so.push(self.so.exp - 1, "late")

    @invariant()
    def valid(self) -> None:
        self.so.validate()
        idxs = [i for i, _n in self.released]
        assert idxs == sorted(idxs)
        assert self.so.entry() == ("gen.run", 7, self.so.exp)

    def teardown(self) -> None:
        while self.todo:
            idx, n = self.todo.pop(0)
            self.so.push(idx, (idx, n))
        while self.so.pending:
            self.released.extend(self.so.take_current())
            self.so.advance()
        # Every item released once, by index, in arrival order within an index.
        assert sorted(self.released) == sorted(self.all)
        assert [i for i, _n in self.released] == sorted(i for i, _n in self.all)


TestStreamOrder = StreamOrderMachine.TestCase
TestStreamOrder.pytestmark = [pytest.mark.slow]
TestStreamOrder.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------ Bucket.evaluate


def _spec(*fields: tuple[str, tuple[str, ...], str, int | None]) -> BucketSpec:
    """Fields as (name, sources, mode, threshold); a single source makes a slot critical,
    except for count fields."""
    fs = tuple(
        FieldSpec(
            name, srcs, mode, thr, len(srcs) == 1 and mode != "count", optional=name.endswith("?")
        )
        for name, srcs, mode, thr, *_ in fields
    )
    return BucketSpec(
        node="n.run",
        group=0,
        root="r.run",
        fields=fs,
        by_field={f.name: f for f in fs},
        field_feeders={f.name: frozenset(f.sources) for f in fs},
        is_join=any(f.mode == "count" for f in fs),
    )


PLAIN_A = ("x", ("A",), "plain", None)
PLAIN_AB = ("x", ("A", "B"), "plain", None)
PLAIN_C = ("y", ("C",), "plain", None)
COLLECT_A = ("c", ("A",), "collect", None)
COLLECT_AB = ("c", ("A", "B"), "collect", None)
COUNT_ALL = ("t", ("A",), "count", None)
OPT_AB = ("x?", ("A", "B"), "plain", None)
OPT_COLLECT_A = ("c?", ("A",), "collect", None)
COUNT_2 = ("t", ("A", "B"), "count", 2)

#: (fields, arrivals as (field, value, sort key), ended sources, verdict, kwargs or reason).
TRUTH: list[tuple[Any, ...]] = [
    # plain, critical (one source)
    ((PLAIN_A,), [], "", Wait, None),
    ((PLAIN_A,), [], "A", Dead, "critical input 'x'"),
    ((PLAIN_A,), [("x", 1, 0)], "", Fire, {"x": 1}),  # nobody else can deliver: fire at once
    # plain, two sources: wait until the other path has settled (a second frame is an error)
    ((PLAIN_AB,), [("x", 1, 0)], "A", Wait, None),
    ((PLAIN_AB,), [("x", 1, 0)], "AB", Fire, {"x": 1}),
    # AND rule: a field all of whose paths ended empty kills the bucket, one path or many...
    ((PLAIN_AB, PLAIN_C), [("y", 2, 0)], "ABC", Dead, "input 'x' ended with no frame on any"),
    # ... unless it is optional: then None ([] for collect)
    ((OPT_AB, PLAIN_C), [("y", 2, 0)], "ABC", Fire, {"x?": None, "y": 2}),
    ((OPT_AB, PLAIN_C), [("x?", 1, 0), ("y", 2, 0)], "ABC", Fire, {"x?": 1, "y": 2}),
    ((OPT_COLLECT_A, PLAIN_C), [("y", 2, 0)], "AC", Fire, {"c?": [], "y": 2}),
    ((OPT_AB,), [], "AB", Dead, "every input ended without a frame"),
    ((PLAIN_AB,), [], "AB", Dead, "input 'x' ended with no frame"),
    ((PLAIN_AB, PLAIN_C), [("x", 1, 0)], "AB", Wait, None),
    ((PLAIN_AB, PLAIN_C), [("x", 1, 0)], "ABC", Dead, "critical input 'y'"),
    # collect: all frames in production order (sort key), after every source ended
    ((COLLECT_A,), [("c", "b", (1,)), ("c", "a", (0,))], "", Wait, None),
    ((COLLECT_A,), [("c", "b", (1,)), ("c", "a", (0,))], "A", Fire, {"c": ["a", "b"]}),
    ((COLLECT_A,), [], "A", Dead, "collected input 'c' ended with no frame"),
    ((COLLECT_AB, PLAIN_C), [("y", 2, 0)], "ABC", Dead, "input 'c' ended with no frame"),
    ((COLLECT_AB, PLAIN_C), [("c", 5, 0), ("y", 2, 0)], "AC", Wait, None),
    # count ALL: every frame once the streams ended, possibly none, never DEAD on its own
    ((COUNT_ALL,), [("t", 1, (0,))], "", Wait, None),
    ((COUNT_ALL, PLAIN_C), [("y", 2, 0)], "AC", Fire, {"t": [], "y": 2}),
    ((COUNT_ALL,), [("t", 2, (1,)), ("t", 1, (0,))], "A", Fire, {"t": [1, 2]}),
    ((COUNT_ALL,), [], "A", Dead, "every input ended without a frame"),
    # count n: fires at n frames without waiting; fewer once the streams ended
    ((COUNT_2,), [("t", 1, (0,))], "A", Wait, None),
    ((COUNT_2,), [("t", 2, (1,)), ("t", 1, (0,))], "", Fire, {"t": [1, 2]}),
    ((COUNT_2,), [("t", 1, (0,))], "AB", Fire, {"t": [1]}),
    ((COUNT_2, PLAIN_C), [("t", 1, (0,)), ("t", 2, (1,))], "", Wait, None),
]


@pytest.mark.parametrize(("fields", "arrivals", "ended", "verdict", "expect"), TRUTH)
def test_bucket_evaluate_truth_table(
    fields: Any, arrivals: Any, ended: str, verdict: type, expect: Any
) -> None:
    spec = _spec(*fields)
    b = Bucket(spec, ("r.run", 1, 0), (("<input>", 0, 0), ("r.run", 1, 0)))
    for f, value, key in arrivals:
        assert b.add(f, value, key) is None
    # Live work under the key: one activation at every source that has not ended.
    live = {s: 1 for fs in spec.fields for s in fs.sources if s not in ended}
    got = b.evaluate(live)
    assert type(got) is verdict
    if isinstance(got, Fire):
        assert got.kwargs == expect
    elif isinstance(got, Dead):
        assert expect in got.reason
    else:
        assert got is WAIT


def test_bucket_add_refuses_frames_that_break_the_input_rules() -> None:
    b = Bucket(_spec(PLAIN_AB, COUNT_2), ("r.run", 1, 0), (("<input>", 0, 0),))
    assert b.add("x", 1, 0) is None
    err = b.add("x", 2, 1)
    assert err is not None and "'x'" in err and "collect=['x']" in err
    assert b.add("t", 1, 0) is None and b.add("t", 2, 1) is None
    err = b.add("t", 3, 2)
    assert err is not None and "activate_by_count=2" in err and "ALL" in err
    # A refused frame is not stored.
    assert b.arrivals == 3
    assert b.evaluate(None) == Fire({"x": 1, "t": [1, 2]})


# ------------------------------------------------------------------ quiescent settling


@settings(max_examples=200, deadline=None)
@given(
    edges=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=12),
    n=st.integers(1, 5),
)
def test_quiescent_pick_never_settles_a_bucket_that_waits_on_one_not_waiting_back(
    edges: list[tuple[int, int]], n: int
) -> None:
    """Buckets n0..n{n-1} (plan order), all keyed by the call's entry, each with one open
    field ``f{i}`` fed by the nodes listed in ``edges`` (i waits on j for (i, j)). The pick
    lies in a terminal strongly connected part of the waits-on graph, and is the earliest
    such bucket in plan order."""
    waits = {i: {j for a, j in edges if a == i and j != i and j < n} for i in range(n)}
    buckets = []
    for i in range(n):
        feeders = frozenset(f"n{j}.run" for j in waits[i])
        fs = FieldSpec(f"f{i}", ("src",), "plain", None, True)
        spec = BucketSpec(
            node=f"n{i}.run",
            group=0,
            root="<input>",
            fields=(fs,),
            by_field={fs.name: fs},
            field_feeders={fs.name: feeders},
            is_join=False,
        )
        buckets.append(Bucket(spec, ("<input>", 0, 0), (("<input>", 0, 0),)))
    got = quiescent_pick(buckets)

    def reach(i: int) -> set[int]:
        seen, stack = {i}, [i]
        while stack:
            for j in waits[stack.pop()]:
                if j not in seen:
                    seen.add(j)
                    stack.append(j)
        return seen

    terminal = [i for i in range(n) if all(i in reach(j) for j in reach(i))]
    assert terminal, "every finite graph has a terminal strongly connected part"
    assert got == terminal[0]


# ------------------------------------------------------------------ the transition table


def test_an_illegal_move_names_node_states_and_story() -> None:
    """Ending an activation twice is a shell bug: the core refuses it with a TransitionError
    that names the node, both states and the story of the call so far."""
    story: deque[tuple[Any, ...]] = deque()
    core = CallCore(COMPILED["mixed"], "c1", story=story)
    ins = core.handle(Start({"request": 1}))
    (act,) = ins.run
    core.handle(Ended(act))
    with pytest.raises(TransitionError) as info:
        core.handle(Ended(act))
    err = info.value
    assert (err.node, err.state, err.to) == (act.node, ActState.DONE, ActState.DONE)
    text = str(err)
    assert "split.run#1" in text and "done -> done" in text and "call c1" in text
    assert "start" in text and "end" in text  # the story so far
    assert [ev for ev, _d in err.story if ev in {"start", "end"}] == ["start", "end", "end"]
    # Every record carries the id of the stimulus that caused it.
    ids = {ev: d["stimulus"] for ev, d in render_story(story, "c1") if ev != "end"}
    assert ids["start"] == ids["bucket"] == 1


def test_every_stimulus_gets_an_id_and_a_story_record() -> None:
    story: deque[tuple[Any, ...]] = deque()
    core = CallCore(COMPILED["mixed"], "c7", story=story)
    (split,) = core.handle(Start({"request": 1})).run
    assert core.handle(Produced(split, {"a": 1})).accepted
    ins = core.handle(Ended(split))
    for act in ins.run:
        core.handle(Returned(act, None))
    got = render_story(story, "c7")
    stimuli = [(ev, d["stimulus"]) for ev, d in got if ev in {"start", "frame", "end", "return"}]
    assert [ev for ev, _sid in stimuli][:3] == ["start", "frame", "end"]
    assert [sid for _ev, sid in stimuli] == sorted({sid for _ev, sid in stimuli})
    assert render_story(story, "other") == []


def test_a_rejected_frame_is_not_accepted_and_errs() -> None:
    core = CallCore(COMPILED["mixed"], "c2")
    (split,) = core.handle(Start({"request": 1})).run
    ins = core.handle(Produced(split, {"nope": 1}))
    assert not ins.accepted and "nope" in str(core.errors[-1])
    assert core.handle(Produced(split, "not a dict")).accepted is False
    ready = list(core.handle(Ended(split)).run)
    while ready:
        ready.extend(core.handle(Ended(ready.pop())).run)
    assert core.finished and core.status == "error"


# ------------------------------------------------------------------ the pieces' own rules


def test_liveness_reaches_discounts_the_asker_and_validate_names_a_drift() -> None:
    from omniflow.runtime.callcore._liveness import INPUT_ENTRY, Liveness

    live = Liveness()
    table = (INPUT_ENTRY,)
    live.inc(table, "a")
    assert live.reaches(INPUT_ENTRY, frozenset({"a"}))
    assert not live.reaches(INPUT_ENTRY, frozenset({"a"}), {"a": 1})  # only the asker is there
    assert not live.reaches(("x", 1, 0), frozenset({"a"}))
    live.validate([(table, "a")])
    with pytest.raises(AssertionError, match="liveness drifted"):
        live.validate([(table, "b")])


def test_stream_order_validate_names_a_stale_index() -> None:
    so = StreamOrder("gen.run", 3)
    so.push(0, "a")
    so.advance()
    with pytest.raises(AssertionError, match=r"pending index 0 \(exp 1\)"):
        so.validate()


def test_bucket_wakes_and_refreshes_only_for_fields_a_drop_can_end() -> None:
    spec = _spec(PLAIN_AB, PLAIN_C)
    spec = BucketSpec(
        node=spec.node,
        group=spec.group,
        root=spec.root,
        fields=spec.fields,
        by_field=spec.by_field,
        field_feeders=spec.field_feeders,
        is_join=False,
        feeds={"A": frozenset({"x"}), "B": frozenset({"x"}), "C": frozenset({"y"})},
    )
    b = Bucket(spec, ("r.run", 1, 0), (("<input>", 0, 0), ("r.run", 1, 0)))
    assert b.add("x", 1, 0) is None
    assert b.wakes_on(["A"]) and not b.wakes_on(["Z"])
    # C's drop cannot end x: nothing settles, and y still waits on C's live work.
    assert b.refresh({"C": 1}, ["Z"]) is None and b.open == {"x", "y"}
    assert b.refresh({"C": 1}, ["A", "B"]) is None and b.open == {"y"}
    assert b.add("y", 2, 0) is None and not b.open
    assert b.wakes_on(["Z"])  # nothing open: any drop may let it be decided
    assert b.refresh(None, None) is None
    assert b.evaluate(None) == Fire({"x": 1, "y": 2})
