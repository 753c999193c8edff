"""Deterministic paths of the call core the property machine reaches only by luck: data-plane
refs held and released by every holder (direct activations, buckets, latches) when the call
ends, cancels or errs; cancelling a call with work queued behind a session order, a
concurrency limit or a latch; and ``validate()`` naming each kind of corrupted state."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest

import omniflow as of
from omniflow.data._handle import BlockHandle
from omniflow.data._ref import DataRef
from omniflow.runtime.callcore._compiled import compile_plan
from omniflow.runtime.callcore._core import Activation, CallCore
from omniflow.runtime.callcore._stimuli import (
    SETTLE,
    ActState,
    Cancel,
    Ended,
    Instructions,
    Produced,
    Returned,
    Start,
    Stimulus,
)

from .test_core_props import COMPILED


def _ref(n: int) -> DataRef:
    return DataRef(BlockHandle("pool", n, 0, 8), "host", 1, "", ("src.run", "c", "f", str(n)))


class _Shell:
    """Feeds stimuli and keeps what the instructions said, like the async shell."""

    def __init__(self, core: CallCore) -> None:
        self.core = core
        self.running: list[Activation] = []
        self.released: list[DataRef] = []
        self.emitted: list[Any] = []
        self.cancelled: list[Activation] = []

    def __call__(self, stimulus: Stimulus) -> Instructions:
        ins = self.core.handle(stimulus)
        self.running.extend(ins.run)
        self.released.extend(ins.release)
        self.emitted.extend(ins.emit)
        self.cancelled.extend(ins.cancel)
        if self.core.unsettled:
            self(SETTLE)
        self.running = [a for a in self.running if a.state is ActState.RUNNING]
        return ins

    def of(self, node: str) -> list[Activation]:
        return [a for a in self.running if a.node == node]

    def drain(self) -> None:
        while self.running:
            self(Ended(self.running[0]))
        assert self.core.finished
        self.core.validate()


# ------------------------------------------------------------------ plans


class _Echo(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["out"])
    async def run(self, request: Any) -> Any:
        return {"out": request}


ECHO = compile_plan(
    of.parse(
        of.Graph(
            "echo",
            roles={"a": _Echo(), "b": _Echo()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
        )
    )
)


class _Gen(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["item", "unused"])
    async def run(self, request: Any) -> Any:
        yield {"item": request}


class _Slow(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["done"], max_concurrency=1)
    async def run(self, item: Any) -> Any:
        return {"done": item}


class _Ordered(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["seen"], lb="session")
    async def run(self, item: Any) -> Any:
        return {"seen": item}


QUEUED = compile_plan(
    of.parse(
        of.Graph(
            "queued",
            roles={"gen": _Gen(), "slow": _Slow(), "ordered": _Ordered()},
            inputs=[of.Placeholder("request")],
            outputs=["done", "seen"],
        )
    )
)


# ------------------------------------------------------------------ data-plane refs


def test_a_direct_activation_holds_its_ref_until_it_ends() -> None:
    ref = _ref(1)
    core = CallCore(ECHO, "c1")
    sh = _Shell(core)
    a, b = sh(Start({"request": ref})).run  # both consume the input: one hold each
    assert a.refs == b.refs == [ref] and core.refcounts == {ref: 2}
    core.validate()
    ins = sh(Ended(a))
    assert not ins.release and core.refcounts == {ref: 1}
    ins = sh(Ended(b))
    assert ins.release == (ref,) and ins.finished and core.refcounts == {}


def test_refs_are_released_when_the_call_is_cancelled_or_a_node_errs() -> None:
    ref = _ref(2)
    core = CallCore(QUEUED, "c2")
    sh = _Shell(core)
    (gen,) = sh(Start({"request": 1})).run
    # Two frames with refs: slow (max_concurrency=1) runs one and blocks the other; the
    # session node orders its two activations.
    sh(Produced(gen, {"item": ref}))
    sh(Produced(gen, {"item": ref}))
    assert len(sh.of("slow.run")) == 1 and len(core._blocked["slow.run"]) == 1
    assert core.refcounts[ref] == 4
    core.validate()
    ins = sh(Cancel())
    # Queued work is dropped at once; running work is cancelled and lets go when it ends.
    assert {a.node for a in ins.cancel} == {"gen.run", "slow.run", "ordered.run"}
    assert core.refcounts == {ref: 2} and not ins.release
    core.validate()
    for act in list(ins.cancel):
        sh(Ended(act, RuntimeError("boom") if act.node == "slow.run" else None))
    assert sh.released == [ref] and core.refcounts == {}
    assert core.finished and core.status == "cancelled"


def test_a_throttled_node_runs_its_blocked_activation_when_one_ends() -> None:
    core = CallCore(QUEUED, "c3", shuffle=random.Random(0))
    sh = _Shell(core)
    (gen,) = sh(Start({"request": 1})).run
    sh(Produced(gen, {"item": 1}))
    sh(Produced(gen, {"item": 2}))
    (first,) = sh.of("slow.run")
    ins = sh(Returned(first, {"done": 1}))
    (second,) = [a for a in ins.run if a.node == "slow.run"]
    assert second.kwargs == {"item": 2} and ins.emit[0][:2] == ("done", 1)
    sh.drain()
    assert core.status == "ok"


def test_a_bucket_holds_its_frames_refs_and_lets_go_when_cancelled() -> None:
    ref = _ref(3)
    core = CallCore(COMPILED["mixed"], "c4")
    sh = _Shell(core)
    (split,) = sh(Start({"request": 1})).run
    # tally collects b (its bucket gathers); pick runs on b at once.
    sh(Produced(split, {"b": ref}))
    assert [b.refs for b in core.buckets.values() if b.refs] == [[ref]]
    assert [a.refs for a in sh.of("pick.run")] == [[ref]]
    assert core.refcounts == {ref: 2}
    core.validate()
    ins = sh(Cancel())  # the bucket is dropped and lets go; pick still holds it
    assert not ins.release and core.refcounts == {ref: 1}
    sh.drain()
    assert sh.released == [ref] and core.refcounts == {}
    assert core.status == "cancelled"


def test_a_latched_ref_is_held_once_per_pairing_and_by_the_latch_until_the_call_ends() -> None:
    ref = _ref(4)
    core = CallCore(COMPILED["latched"], "c5")
    sh = _Shell(core)
    (src, alt) = sorted(sh(Start({"request": 1})).run, key=lambda a: a.node)[::-1]
    assert src.node == "src.run"
    sh(Produced(src, {"tok": 1}))  # tts parks: voice has not come
    assert core.n_parked == 1
    core.validate()
    sh(Produced(src, {"voice": ref, "tok": 2}))  # the latch takes it, both tts run
    tts = sh.of("tts.run")
    assert len(tts) == 2 and all(a.kwargs["voice"] == ref for a in tts)
    assert core.refcounts == {ref: 3}  # the latch and two activations
    core.validate()
    sh(Produced(src, {"voice": "again", "tok": 3}))  # a later voice frame changes nothing
    assert all(a.kwargs["voice"] == ref for a in sh.of("tts.run"))
    sh(Ended(alt))
    sh.drain()
    assert sh.released == [ref] and core.refcounts == {}


def test_cancel_drops_activations_parked_on_a_latch() -> None:
    core = CallCore(COMPILED["latched"], "c6")
    sh = _Shell(core)
    src = next(a for a in sh(Start({"request": 1})).run if a.node == "src.run")
    sh(Produced(src, {"tok": 1}))
    assert core.n_parked == 1
    sh(Cancel())
    assert core.n_parked == 0 and not core.latches.parked()
    core.validate()
    sh.drain()
    assert core.status == "cancelled"


# ------------------------------------------------------------------ validate


def _midway() -> tuple[CallCore, _Shell]:
    core = CallCore(COMPILED["mixed"], "cv", story=deque())
    sh = _Shell(core)
    (split,) = sh(Start({"request": 1})).run
    sh(Produced(split, {"a": 1, "b": 2}))
    assert core.buckets and core.running
    core.validate()
    return core, sh


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda c: c._touched.append(next(iter(c.buckets.values()))), "left unsettled"),
        (lambda c: setattr(c, "n_parked", 1), "parked on latches, 1 counted"),
        (lambda c: c._waiters.clear(), "gathers but nobody wakes it"),
        (lambda c: c.refcounts.__setitem__(_ref(9), 1), "refcounts drifted"),
        (lambda c: setattr(c, "n_acts", c.n_acts + 1), "activations are known"),
        (lambda c: c.gather.spent.update(dict.fromkeys(c.buckets, "dead")), "gathering and spent"),
        (lambda c: setattr(c, "finished", True), "finished with work left"),
        (lambda c: c.live.inc(((("x", 1, 0)),), "left.run"), "liveness drifted"),
    ],
)
def test_validate_names_a_corrupted_state(corrupt: Any, message: str) -> None:
    core, _sh = _midway()
    corrupt(core)
    with pytest.raises(AssertionError, match=message):
        core.validate()


def test_validate_names_liveness_counted_by_an_uncounted_call() -> None:
    assert not ECHO.counted
    core = CallCore(ECHO, "cu")
    _Shell(core)(Start({"request": 1}))
    core.validate()
    core.live.counts[("x", 1, 0)] = {"a.run": 1}
    with pytest.raises(AssertionError, match="uncounted call counted"):
        core.validate()


def test_validate_accepts_whatever_a_crash_left() -> None:
    from omniflow.runtime.callcore._stimuli import Crash

    core, sh = _midway()
    sh(Crash(RuntimeError("bug")))
    core.n_acts = 99  # anything goes after a crash
    core.validate()
    assert repr(next(iter(core.running))).startswith("<Activation ")


# ------------------------------------------------------------------ more routing paths


class _Head(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["mid", "unused"])
    async def run(self, request: Any) -> Any:
        return {"mid": request}


class _Tail(of.Role):
    @of.interface(inputs_or=[["mid"]], outputs=["out"])
    async def run(self, mid: Any) -> Any:
        return {"out": mid}


CHAIN = compile_plan(
    of.parse(
        of.Graph(
            "chain",
            roles={"head": _Head(), "t1": _Tail(), "t2": _Tail()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
        )
    )
)


def test_a_return_that_starts_work_and_releases_a_ref_answers_both() -> None:
    """One stimulus whose answer runs two activations (shuffled under validate) and releases
    the ref its returning activation held last; a field nobody consumes is dropped."""
    ref = _ref(5)
    core = CallCore(CHAIN, "c8", shuffle=random.Random(1))
    sh = _Shell(core)
    (head,) = sh(Start({"request": ref, "not_an_input": 1})).run
    ins = sh(Returned(head, {"mid": 1, "unused": 2}))
    assert sorted(a.node for a in ins.run) == ["t1.run", "t2.run"]
    assert ins.release == (ref,) and not ins.finished
    sh.drain()
    assert core.status == "ok"


class _Loop(of.Role):
    @of.interface(inputs_or=[["request"], ["again"]], outputs=["again", "side"])
    async def run(self, **kw: Any) -> Any:
        return {"side": 1, "again": 1}


class _Free(of.Role):
    @of.interface(inputs_or=[["side"]], outputs=["out"])
    async def run(self, side: Any) -> Any:
        return {"out": side}


class _Capped(of.Role):
    @of.interface(inputs_or=[["side"]], outputs=["out"], max_concurrency=4)
    async def run(self, side: Any) -> Any:
        return {"out": side}


LOOP = compile_plan(
    of.parse(
        of.Graph(
            "loop",
            roles={"loop": _Loop(), "free": _Free(), "capped": _Capped()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
            max_iterations=1,
        )
    )
)


def test_a_loop_past_max_iterations_retires_the_work_its_frame_already_started() -> None:
    """The frame that breaks max_iterations first started capped (throttled) and free: the
    call is cancelled within that stimulus, so neither reaches the shell, and the throttle's
    count goes back to zero."""
    ref = _ref(6)
    core = CallCore(LOOP, "c9")
    sh = _Shell(core)
    (loop,) = sh(Start({"request": 1})).run
    ins = sh(Returned(loop, {"side": ref, "again": 1}))
    assert not ins.run and ins.finished and ins.release == (ref,)
    assert core.status == "error" and "max_iterations=1" in str(core.errors[0])
    assert core._running_per_node == {"capped.run": 0} and core.refcounts == {}
    core.validate()
    assert sh(Cancel()).finished  # a second cancel of a closed call changes nothing


def test_settle_timeout_and_a_closing_call_refusing_frames() -> None:
    """SETTLE on a settled call changes nothing; a timeout's own error is recorded first and
    the call ends "error"; a frame of a method still running in a closing call is refused."""
    from omniflow._exceptions import NodeError
    from omniflow.runtime.callcore._stimuli import NOTHING, CancelKind

    core = CallCore(QUEUED, "c10")
    sh = _Shell(core)
    (gen,) = sh(Start({"request": 1})).run
    assert sh(SETTLE) is NOTHING
    timeout = NodeError("<call>", "deadline passed", kind="error", call_id="c10")
    ins = sh(Cancel(CancelKind.TIMEOUT, "deadline passed", timeout))
    assert ins.cancel == (gen,) and core.errors == [timeout]
    assert not sh(Produced(gen, {"item": 1})).accepted
    assert not core._out_run and core.n_acts == 1  # nothing admitted after closing
    sh.drain()
    assert core.status == "error"


def test_a_crashed_call_ignores_every_later_stimulus() -> None:
    from omniflow.runtime.callcore._stimuli import Crash

    core, sh = _midway()
    running = list(core.running)
    ins = sh(Crash(RuntimeError("bug")))
    assert ins.finished and set(ins.cancel) == set(running)
    for stimulus in (SETTLE, Returned(running[0], None), Ended(running[0]), Cancel()):
        assert core.handle(stimulus).accepted is False
    assert running[0].state is ActState.RUNNING  # nothing moved after the crash


def test_the_call_life_moves_only_along_its_table() -> None:
    from omniflow.runtime.callcore._callstate import CallLife, LifeError

    core, sh = _midway()
    assert core.life is CallLife.OPEN and not core.closing and not core.finished
    sh(Cancel())
    assert core.life is CallLife.CLOSING and core.closing and not core.finished
    with pytest.raises(LifeError, match="cannot move from CLOSING to FINISHED"):
        core._become(CallLife.FINISHED)
    assert core.life is CallLife.CLOSING  # nothing moved


def test_frames_after_a_bucket_fired_are_errors_naming_the_rule() -> None:
    """join takes exactly two y frames (a third breaks activate_by_count, though its bucket
    already fired); pick's plain x meets two producers frame by frame (a second x breaks it)."""
    core = CallCore(COMPILED["mixed"], "c11")
    sh = _Shell(core)
    (split,) = sh(Start({"request": 1})).run
    sh(Produced(split, {"a": 1}))
    (left,) = sh.of("left.run")
    (right,) = sh.of("right.run")
    sh(Produced(right, {"y": 2}))
    sh(Produced(right, {"y": 3}))
    assert [a.kwargs["y"] for a in sh.of("join.run")] == [[2, 3]]
    assert [e.node for e in core.errors] == ["merge.run"]  # merge's y is plain
    sh(Produced(right, {"y": 4}))
    assert "more than activate_by_count=2" in str(core.errors[-1])
    assert (core.errors[-1].node, core.errors[-1].field) == ("join.run", "y")
    sh(Returned(left, {"x": 1}))
    sh(Produced(right, {"x": 2}))
    assert (core.errors[-1].node, core.errors[-1].field) == ("pick.run", "x")
    core.validate()
    sh.drain()
    assert core.status == "error"


def test_stream_order_keeps_items_of_one_index_and_refuses_a_settled_one() -> None:
    from omniflow.runtime.callcore._ordering import StreamOrder

    so = StreamOrder("gen.run", 1)
    so.push(0, (1, "b"))
    so.push(0, (0, "a"))  # same index: kept in push order, picked by key
    so.push(1, (0, "c"))
    assert so.pop_current(lambda item: item[0]) == (0, "a")
    assert so.pop_current() == (1, "b") and so.pop_current() is None
    so.advance()
    with pytest.raises(AssertionError, match=r"index 0 arrived after 1 settled"):
        so.push(0, (0, "late"))
    assert so.take_current() == [(0, "c")]


# ------------------------------------------------------------------ two latches


class _Voice(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["style", "voice"])
    async def run(self, request: Any) -> Any:
        yield {"style": request}


class _Toks(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["tok"])
    async def run(self, request: Any) -> Any:
        yield {"tok": request}


class _Say(of.Role):
    @of.interface(inputs_or=[["tok", "style", "voice"]], outputs=["said"], latch=("style", "voice"))
    async def run(self, tok: Any, style: Any, voice: Any) -> Any:
        return {"said": tok}


LATCH2 = compile_plan(
    of.parse(
        of.Graph(
            "latch2",
            roles={"v": _Voice(), "t": _Toks(), "say": _Say()},
            inputs=[of.Placeholder("request")],
            outputs=["said"],
        )
    )
)


def _latch2(call: str) -> tuple[CallCore, _Shell, Activation, Activation]:
    core = CallCore(LATCH2, call)
    sh = _Shell(core)
    sh(Start({"request": 1}))
    (v,) = sh.of("v.run")
    (t,) = sh.of("t.run")
    return core, sh, v, t


def test_an_activation_parked_on_its_second_latch_keeps_the_first_value() -> None:
    ref = _ref(7)
    core, sh, v, t = _latch2("c12")
    first = LATCH2.latch_of[("say.run", 0)][0]
    second = "voice" if first == "style" else "style"
    sh(Produced(v, {first: "one"}))
    sh(Produced(t, {"tok": ref}))  # pairs the first latch, parks on the second
    assert core.n_parked == 1 and not sh.of("say.run")
    core.validate()
    sh(Produced(v, {second: ref}))
    (say,) = sh.of("say.run")
    assert say.kwargs == {"tok": ref, first: "one", second: ref}
    assert say.refs == [ref, ref] and core.refcounts == {ref: 3}
    core.validate()
    sh.drain()
    assert sh.released == [ref] and core.status == "ok"


def test_a_latch_that_ended_empty_kills_parked_and_later_activations() -> None:
    ref = _ref(8)
    core, sh, v, t = _latch2("c13")
    sh(Produced(t, {"tok": ref}))
    assert core.n_parked == 1
    sh(Ended(v))  # no latched frame ever: the parked activation is DEAD, with a warning
    assert core.n_parked == 0 and len(core.warnings) == 1
    assert core.refcounts == {} and sh.released == [ref]
    sh(Produced(t, {"tok": 2}))  # a later one is DEAD at once
    assert len(core.warnings) == 2 and not sh.of("say.run")
    assert all(w["node"] == "say.run" for w in core.warnings)
    core.validate()
    sh.drain()
    assert core.status == "ok"


def test_one_activation_started_and_a_ref_released_in_one_answer() -> None:
    """slow#1 held the ref last: its end releases it and starts the blocked slow#2 (a batch
    of one is not shuffled); a stamped field nobody consumes is dropped; a NodeError a
    method raises about itself is recorded as it is."""
    from omniflow._exceptions import NodeError

    ref = _ref(10)
    core = CallCore(QUEUED, "c14", shuffle=random.Random(2))
    sh = _Shell(core)
    (gen,) = sh(Start({"request": 1})).run
    sh(Produced(gen, {"item": ref, "unused": 0}))
    (ordered,) = sh.of("ordered.run")
    sh(Ended(ordered))
    sh(Produced(gen, {"item": 2}))
    (slow,) = sh.of("slow.run")
    assert core.refcounts == {ref: 1}
    own = NodeError("slow.run", "model refused", kind="error", call_id="c14")
    ins = sh(Ended(slow, own))
    assert ins.release == (ref,) and [a.kwargs for a in ins.run] == [{"item": 2}]
    assert core.errors == [own]
    sh.drain()
    assert core.status == "error"


def test_fields_after_the_breaking_one_are_dropped_in_a_closing_call() -> None:
    """A frame whose first field breaks max_iterations: the fields after it reach a closing
    call, which starts nothing for them and holds nothing (their ref is never released,
    let alone once per route)."""
    ref = _ref(11)
    core = CallCore(LOOP, "c15")
    sh = _Shell(core)
    (loop,) = sh(Start({"request": 1})).run
    ins = sh(Returned(loop, {"again": 1, "side": ref}))
    assert not ins.run and ins.finished and not ins.release
    assert core.status == "error" and core.refcounts == {}
    core.validate()


# ------------------------------------------------------------------ session OR groups


class _Two(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["p", "q"])
    async def run(self, request: Any) -> Any:
        yield {"q": request, "p": request}


class _Either(of.Role):
    @of.interface(inputs_or=[["p"], ["q"]], outputs=["got"], lb="session")
    async def run(self, p: Any = None, q: Any = None) -> Any:
        return {"got": (p, q)}


EITHER = compile_plan(
    of.parse(
        of.Graph(
            "either",
            roles={"two": _Two(), "either": _Either()},
            inputs=[of.Placeholder("request")],
            outputs=["got"],
        )
    )
)


def test_a_session_node_runs_one_index_in_or_group_declaration_order() -> None:
    """q's activation (group 1) arrives before p's (group 0) within one frame: the session
    node still runs group 0 first, one at a time, then group 1, then the next index."""
    core = CallCore(EITHER, "c16")
    sh = _Shell(core)
    (two,) = sh(Start({"request": 1})).run
    sh(Produced(two, {"q": "q0", "p": "p0"}))
    sh(Produced(two, {"q": "q1"}))
    order = []
    while sh.of("either.run"):
        (act,) = sh.of("either.run")
        order.append((act.group, act.kwargs))
        core.validate()
        sh(Returned(act, None))
    assert order == [(0, {"p": "p0"}), (1, {"q": "q0"}), (1, {"q": "q1"})]
    sh.drain()
    assert core.status == "ok"


class _Gather(of.Role):
    @of.interface(inputs_or=[["tok", "style"]], outputs=["said"], collect=["tok"], latch=("style",))
    async def run(self, tok: Any, style: Any) -> Any:
        return {"said": tok}


def test_bucket_specs_leave_latched_fields_to_the_latch() -> None:
    """A collecting node with a latched field: its bucket gathers tok only; style is paired
    with the activation after it fires."""
    c = compile_plan(
        of.parse(
            of.Graph(
                "gather",
                roles={"v": _Voice(), "t": _Toks(), "say": _Gather()},
                inputs=[of.Placeholder("request")],
                outputs=["said"],
            )
        )
    )
    assert "say.run" in c.bucket_nodes and c.latch_of[("say.run", 0)] == ("style",)
    ((dst, group, bspec, _direct),) = c.fanout["t.run"]["tok"][0]
    assert (dst, group) == ("say.run", 0) and bspec is not None
    assert [f.name for f in bspec.fields] == ["tok"]


class _A(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["x"])
    async def run(self, request: Any) -> Any:
        return {"x": request}


class _B(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["y"])
    async def run(self, request: Any) -> Any:
        return None


class _Both(of.Role):
    @of.interface(inputs_or=[["x", "y"]], outputs=["both"], collect=["x", "y"])
    async def run(self, x: Any, y: Any) -> Any:
        return {"both": (x, y)}


BOTH = compile_plan(
    of.parse(
        of.Graph(
            "both",
            roles={"a": _A(), "b": _B(), "both": _Both()},
            inputs=[of.Placeholder("request")],
            outputs=["both"],
        )
    )
)


def test_a_collect_bucket_dies_when_a_critical_field_ends_empty_and_warns() -> None:
    """x arrived, y's only producer ended without a frame: the bucket is DEAD, the warning
    names y, and x's frame (a ref) is let go; with only collected fields there is no input
    rule left for a straggler to break."""
    ref = _ref(12)
    core = CallCore(BOTH, "c17")
    sh = _Shell(core)
    a, b = sorted(sh(Start({"request": 1})).run, key=lambda act: act.node)
    sh(Returned(a, {"x": ref}))
    ins = sh(Returned(b, None))
    assert ins.finished and ins.release == (ref,)
    assert [(w["node"], w["field"]) for w in core.warnings] == [("both.run", "y")]
    assert not core.gather._dead_seen and core.status == "ok"


class _Feed(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["item", "other"])
    async def run(self, request: Any) -> Any:
        yield {"item": request}


class _Styled(of.Role):
    @of.interface(
        inputs_or=[["item", "style"], ["other"]], outputs=["got"], lb="session", latch=("style",)
    )
    async def run(self, item: Any = None, style: Any = None, other: Any = None) -> Any:
        return {"got": (item, other)}


STYLED = compile_plan(
    of.parse(
        of.Graph(
            "styled",
            roles={"feed": _Feed(), "v": _Voice(), "styled": _Styled()},
            inputs=[of.Placeholder("request")],
            outputs=["got"],
        )
    )
)


def test_a_session_index_waits_for_its_activation_parked_on_a_latch() -> None:
    """Index 0's activation waits for style (parked); index 1's is ready but must not run
    before it: the session order holds until style comes and index 0 ran."""
    core = CallCore(STYLED, "c18")
    sh = _Shell(core)
    sh(Start({"request": 1}))
    (feed,) = sh.of("feed.run")
    (v,) = sh.of("v.run")
    sh(Produced(feed, {"item": "i0"}))
    sh(Produced(feed, {"other": "o1"}))
    assert not sh.of("styled.run") and core.n_parked == 1
    core.validate()
    sh(Produced(v, {"style": "s"}))
    (first,) = sh.of("styled.run")
    assert first.kwargs == {"item": "i0", "style": "s"}
    sh(Returned(first, None))
    (second,) = sh.of("styled.run")
    assert second.kwargs == {"other": "o1"}
    sh.drain()
    assert core.status == "ok"


# ------------------------------------------------------------------ a loop through a diamond root


class _Root(of.Role):
    @of.interface(inputs_or=[["request"], ["again"]], outputs=["side", "again"])
    async def run(self, **kw: Any) -> Any:
        yield {"side": 1}


class _Left(of.Role):
    @of.interface(inputs_or=[["side"]], outputs=["x"])
    async def run(self, side: Any) -> Any:
        return {"x": side}


class _Right(of.Role):
    @of.interface(inputs_or=[["side"]], outputs=["y"])
    async def run(self, side: Any) -> Any:
        return {"y": side}


class _Meet(of.Role):
    @of.interface(inputs_or=[["x", "y"]], outputs=["out"])
    async def run(self, x: Any, y: Any) -> Any:
        return {"out": (x, y)}


DIAMOND_LOOP = compile_plan(
    of.parse(
        of.Graph(
            "diamond_loop",
            roles={"root": _Root(), "left": _Left(), "right": _Right(), "meet": _Meet()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
            max_iterations=3,
        )
    )
)


def test_a_loop_back_through_a_diamond_root_keeps_one_entry_and_pairs_per_pass() -> None:
    """root forks side to left and right, which meet again; root also feeds itself. Its
    second pass's frames carry one root entry (the new one), so meet pairs x and y of the
    same pass and never a first-pass x with a second-pass y."""
    assert "root.run" in DIAMOND_LOOP.stamping and "root.run" in DIAMOND_LOOP.cycle_nodes
    core = CallCore(DIAMOND_LOOP, "c20")
    sh = _Shell(core)
    (root1,) = sh(Start({"request": 0})).run
    sh(Produced(root1, {"side": "p1"}))
    sh(Produced(root1, {"again": 1}))
    sh(Ended(root1))
    (root2,) = sh.of("root.run")
    assert [e[0] for e in root2.table].count("root.run") == 1
    sh(Produced(root2, {"side": "p2"}))
    left1, left2 = sh.of("left.run")
    right1, right2 = sh.of("right.run")
    entries = [a.table[-1] for a in (left1, left2)]
    assert [e[0] for e in left2.table].count("root.run") == 1  # the loop's entry replaced
    assert entries[0] != entries[1]
    sh(Returned(left1, {"x": "x1"}))
    sh(Returned(right2, {"y": "y2"}))
    assert not sh.of("meet.run")  # x of pass 1 and y of pass 2 never pair
    sh(Returned(left2, {"x": "x2"}))
    sh(Returned(right1, {"y": "y1"}))
    assert sorted((a.kwargs["x"], a.kwargs["y"]) for a in sh.of("meet.run")) == [
        ("x1", "y1"),
        ("x2", "y2"),
    ]
    core.validate()
    sh(Ended(root2))
    sh.drain()
    assert core.status == "ok"


# ------------------------------------------------------------------ a loop re-entering a collect


class _Src(of.Role):
    @of.interface(inputs_or=[["request"], ["w"]], outputs=["v"])
    async def run(self, **kw: Any) -> Any:
        yield {"v": 1}


class _Coll(of.Role):
    @of.interface(inputs_or=[["v"]], outputs=["w", "out"], collect=["v"])
    async def run(self, v: Any) -> Any:
        return {"w": v}


COLLECT_LOOP = compile_plan(
    of.parse(
        of.Graph(
            "collect_loop",
            roles={"src": _Src(), "coll": _Coll()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
            max_iterations=3,
        )
    )
)


def test_a_collect_frame_after_its_bucket_fired_through_a_loop_names_the_loop() -> None:
    """coll collects every v of the call and feeds src again: src's second pass produces a v
    for a bucket that already fired, an error that says a loop re-entered the stream (not
    that two streams meet frame by frame) and names coll's field."""
    core = CallCore(COLLECT_LOOP, "c21")
    sh = _Shell(core)
    (src,) = sh(Start({"request": 0})).run
    sh(Produced(src, {"v": 1}))
    sh(Produced(src, {"v": 2}))
    sh(Ended(src))
    (coll,) = sh.of("coll.run")
    assert coll.kwargs == {"v": [1, 2]}
    sh(Returned(coll, {"w": 5}))
    (src2,) = sh.of("src.run")
    assert not core.errors
    sh(Produced(src2, {"v": 3}))
    (err,) = core.errors
    assert (err.node, err.field) == ("coll.run", "v")
    assert "(collect) received a frame after its bucket already fired" in str(err)
    assert "a loop came back" in str(err)
    core.validate()
    sh.drain()
    assert core.status == "error"


# ------------------------------------------------------------------ a bucket firing while closing


class _Again(of.Role):
    @of.interface(inputs_or=[["request"], ["again"]], outputs=["again"])
    async def run(self, **kw: Any) -> Any:
        return {"again": 1}


class _FirstAgain(of.Role):
    @of.interface(inputs_or=[["again"]], outputs=["out"], activate_by_count={"again": 1})
    async def run(self, again: Any) -> Any:
        return {"out": again}


CLOSING_FIRE = compile_plan(
    of.parse(
        of.Graph(
            "closing_fire",
            roles={"loop": _Again(), "zfirst": _FirstAgain()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
            max_iterations=1,
        )
    )
)


def test_a_bucket_that_fires_in_a_closing_call_starts_nothing_and_lets_go_of_its_ref() -> None:
    """loop's frame goes to loop (breaking max_iterations: the call closes) and then to
    zfirst's count bucket, which fires on that one frame in the closing call: its activation
    never runs, and the ref the bucket held is released, as is the refused loop's."""
    routes = [dst for dst, *_ in CLOSING_FIRE.fanout["loop.run"]["again"][0]]
    assert routes == ["loop.run", "zfirst.run"]  # the loop breaks before the bucket fires
    ref = _ref(21)
    core = CallCore(CLOSING_FIRE, "c22")
    sh = _Shell(core)
    (loop,) = sh(Start({"request": 0})).run
    ins = sh(Returned(loop, {"again": ref}))
    assert not ins.run and ins.finished
    assert ins.release == (ref, ref)  # one hold each: the refused loop's, zfirst's bucket's
    assert core.refcounts == {} and not core.buckets and core.n_acts == 0
    assert core.gather.spent == {("zfirst.run", 0, ("<input>", 0, 0)): "fired"}
    assert core.status == "error" and "max_iterations=1" in str(core.errors[0])
    core.validate()


# ------------------------------------------------------------------ caller order at finish


class _Tap(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["out"])
    async def run(self, item: Any) -> Any:
        return {"out": item}


STREAM_OUT = compile_plan(
    of.parse(
        of.Graph(
            "stream_out",
            roles={"gen": _Gen(), "tap": _Tap()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
        )
    )
)


def _out_of_order() -> tuple[CallCore, _Shell, Activation]:
    """gen's index 1 reached the caller's output before index 0 (still running): held."""
    core = CallCore(STREAM_OUT, "c23")
    sh = _Shell(core)
    (gen,) = sh(Start({"request": 0})).run
    sh(Produced(gen, {"item": 0}))
    sh(Produced(gen, {"item": 1}))
    sh(Ended(gen))
    tap0, tap1 = sh.of("tap.run")
    sh(Returned(tap1, {"out": 1}))
    assert not sh.emitted
    (so,) = core.orders._caller.values()
    assert so.watching == 0 and list(so.pending) == [1]
    core.validate()
    return core, sh, tap0


def test_caller_frames_still_held_when_a_cancel_ends_the_call_are_flushed() -> None:
    """Index 0 ends without a frame in a batch the shell has not settled yet; a cancel then
    ends the call before any settle could release index 1: the finish flushes it, so the
    caller gets the frame that was produced instead of losing it."""
    core, _sh, tap0 = _out_of_order()
    assert core.handle(Returned(tap0, None, False)).emit == ()
    assert core.unsettled and not core.finished
    ins = core.handle(Cancel())
    assert ins.finished and ins.emit == (("out", 1, "tap.run", 1),)
    assert core.status == "cancelled" and not core.errors
    assert not core._waiters  # the settle after the finish woke the order and unwatched it
    core.validate()


def test_validate_names_a_stream_order_nobody_wakes() -> None:
    core, _sh, _tap0 = _out_of_order()
    core._waiters.clear()
    with pytest.raises(AssertionError, match=r"stream order watches \('gen.run', 1, 0\)"):
        core.validate()


# ------------------------------------------------------------------ a touched bucket dropped


class _X(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["x"])
    async def run(self, request: Any) -> Any:
        return {"x": request}


class _YLoop(of.Role):
    @of.interface(inputs_or=[["request"], ["again"]], outputs=["y", "again"])
    async def run(self, **kw: Any) -> Any:
        return {"y": 1, "again": 1}


class _Pair(of.Role):
    @of.interface(inputs_or=[["x", "y"]], outputs=["out"])
    async def run(self, x: Any, y: Any) -> Any:
        return {"out": (x, y)}


TOUCHED_DROP = compile_plan(
    of.parse(
        of.Graph(
            "touched_drop",
            roles={"a": _X(), "loop": _YLoop(), "pair": _Pair()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
            max_iterations=1,
        )
    )
)


def test_a_bucket_completed_then_dropped_in_one_stimulus_never_fires() -> None:
    """loop's frame completes pair's bucket (y after x: it waits for the settle), then its
    next field breaks max_iterations and the cancel drops that bucket: the settle finds it
    retired and pair never runs; both frames' refs are released once."""
    x, y = _ref(31), _ref(32)
    core = CallCore(TOUCHED_DROP, "c24")
    sh = _Shell(core)
    a, loop = sorted(sh(Start({"request": 0})).run, key=lambda act: act.node)
    sh(Returned(a, {"x": x}))
    assert list(core.buckets) == [("pair.run", 0, ("<input>", 0, 0))]
    ins = sh(Returned(loop, {"y": y, "again": 1}))
    assert not ins.run and ins.finished and sorted(ins.release, key=str) == [x, y]
    assert core.gather.spent == {("pair.run", 0, ("<input>", 0, 0)): "dead"}
    assert core.refcounts == {} and not core._touched
    assert core.status == "error" and "max_iterations=1" in str(core.errors[0])
    core.validate()


# ------------------------------------------------------------------ a plain field after its fire


class _Ys(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["y"])
    async def run(self, request: Any) -> Any:
        yield {"y": request}


PLAIN_LATE = compile_plan(
    of.parse(
        of.Graph(
            "plain_late",
            roles={"a": _X(), "ys": _Ys(), "pair": _Pair()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
        )
    )
)


def test_a_plain_frame_after_its_activation_fired_says_streams_meet_frame_by_frame() -> None:
    """pair's x and y come from two nodes of the call's input: ys's first y fires pair, its
    second finds the bucket spent, an error naming pair's y that suggests collect."""
    core = CallCore(PLAIN_LATE, "c25")
    sh = _Shell(core)
    a, ys = sorted(sh(Start({"request": 0})).run, key=lambda act: act.node)
    sh(Returned(a, {"x": 1}))
    sh(Produced(ys, {"y": 2}))
    (pair,) = sh.of("pair.run")
    assert pair.kwargs == {"x": 1, "y": 2} and not core.errors
    sh(Produced(ys, {"y": 3}))
    (err,) = core.errors
    assert (err.node, err.field) == ("pair.run", "y")
    assert "after its activation already fired" in str(err) and "collect=['y']" in str(err)
    assert not sh.of("pair.run")[1:]  # the late frame started nothing
    core.validate()
    sh.drain()
    assert core.status == "error"


# ------------------------------------------------------------ a fired bucket parked on a latch


GATHER = compile_plan(
    of.parse(
        of.Graph(
            "gather_late_style",
            roles={"v": _Voice(), "t": _Toks(), "say": _Gather()},
            inputs=[of.Placeholder("request")],
            outputs=["said"],
        )
    )
)


def test_a_collect_activation_waits_on_its_latch_and_runs_when_the_value_comes() -> None:
    """say's bucket fires once t's stream ends; its activation parks until v's style comes,
    then runs with every tok and the style, and the call ends ok with nothing left live."""
    core = CallCore(GATHER, "c26")
    sh = _Shell(core)
    t, v = sorted(sh(Start({"request": 0})).run, key=lambda act: act.node)
    assert (t.node, v.node) == ("t.run", "v.run")
    sh(Produced(t, {"tok": 1}))
    sh(Produced(t, {"tok": 2}))
    sh(Ended(t))
    assert not sh.of("say.run") and core.n_parked == 1 and not core.buckets
    core.validate()
    sh(Produced(v, {"style": "calm"}))
    (say,) = sh.of("say.run")
    assert say.kwargs == {"tok": [1, 2], "style": "calm"} and core.n_parked == 0
    core.validate()
    sh.drain()
    assert core.status == "ok" and not core.live.counts


# ------------------------------------------------------------------ one settle for a batch


class _Y(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["y"])
    async def run(self, request: Any) -> Any:
        return {"y": request}


class _Twice(of.Role):
    @of.interface(inputs_or=[["request"], ["x", "y"]], outputs=["out"])
    async def run(self, **kw: Any) -> Any:
        return {"out": kw}


BATCH = compile_plan(
    of.parse(
        of.Graph(
            "batch",
            roles={"a": _X(), "b": _Y(), "j": _Twice()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
        )
    )
)


def test_ends_in_one_unsettled_batch_are_settled_together() -> None:
    """b's y completes j's bucket and b's end, then j's first activation's end (leaving j
    only its gathering bucket under the call's entry), arrive before the shell settles:
    both drops are kept for that entry, and the one SETTLE fires j's second group."""
    core = CallCore(BATCH, "c27")
    sh = _Shell(core)
    a, b, j = sorted(sh(Start({"request": 0})).run, key=lambda act: act.node)
    assert (a.node, b.node, j.node) == ("a.run", "b.run", "j.run")
    sh(Returned(a, {"x": 1}))
    assert len(core.buckets) == 1
    assert core.handle(Returned(b, {"y": 2}, False)).run == ()
    assert core.handle(Returned(j, None, False)).run == ()
    assert sorted(core.live.dirty[("<input>", 0, 0)]) == ["b.run", "j.run"]
    ins = sh(SETTLE)
    ((act,),) = [ins.run]
    assert (act.node, act.group, act.kwargs) == ("j.run", 1, {"x": 1, "y": 2})
    core.validate()
    sh.drain()
    assert core.status == "ok" and not core.warnings


class _Aside(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["note"])
    async def run(self, item: Any) -> Any:
        return {"note": item}


STREAM_ASIDE = compile_plan(
    of.parse(
        of.Graph(
            "stream_aside",
            roles={"gen": _Gen(), "tap": _Tap(), "aside": _Aside()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
        )
    )
)


def test_an_end_that_cannot_feed_the_output_leaves_its_held_index_waiting() -> None:
    """out of gen's index 1 waits for index 0; aside (which never feeds out) ending under
    index 0 wakes the order, which keeps waiting for tap; tap's frame then releases both in
    index order."""
    assert "aside.run" not in STREAM_ASIDE.seq_out_feeders["out"]
    core = CallCore(STREAM_ASIDE, "c28")
    sh = _Shell(core)
    (gen,) = sh(Start({"request": 0})).run
    sh(Produced(gen, {"item": 0}))
    sh(Produced(gen, {"item": 1}))
    sh(Ended(gen))
    aside0, _aside1 = sh.of("aside.run")
    tap0, tap1 = sh.of("tap.run")
    sh(Returned(tap1, {"out": 1}))
    sh(Returned(aside0, {"note": 0}))
    assert not sh.emitted
    (so,) = core.orders._caller.values()
    assert so.watching == 0
    core.validate()
    sh(Returned(tap0, {"out": 0}))
    assert [e[1] for e in sh.emitted] == [0, 1]
    sh.drain()
    assert core.status == "ok"


class _Z(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["z"])
    async def run(self, request: Any) -> Any:
        return {"z": request}


class _W(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["w"])
    async def run(self, request: Any) -> Any:
        return {"w": request}


class _Thrice(of.Role):
    @of.interface(inputs_or=[["x", "y"], ["x", "z"], ["x", "w"]], outputs=["out"])
    async def run(self, **kw: Any) -> Any:
        return {"out": kw}


THRICE = compile_plan(
    of.parse(
        of.Graph(
            "thrice",
            roles={"a": _X(), "b": _Y(), "c": _Z(), "d": _W(), "j": _Thrice()},
            inputs=[of.Placeholder("request")],
            outputs=["out"],
        )
    )
)


def test_two_buckets_dying_in_one_settle_leave_the_third_gathering() -> None:
    """b and c end without a frame in one unsettled batch: the settle finds two of j's
    buckets dead (each warned), the third still gathers for d's w and fires on it."""
    core = CallCore(THRICE, "c29")
    sh = _Shell(core)
    a, b, c, d = sorted(sh(Start({"request": 0})).run, key=lambda act: act.node)
    sh(Returned(a, {"x": 1}))
    assert len(core.buckets) == 3
    core.handle(Returned(b, None, False))
    core.handle(Returned(c, None, False))
    assert sorted(core.live.dirty[("<input>", 0, 0)]) == ["b.run", "c.run"]
    assert not sh(SETTLE).run
    assert [k[1] for k in core.buckets] == [2] and len(core.warnings) == 2
    assert all("j.run" in str(w) for w in core.warnings)
    core.validate()
    ((act,),) = [sh(Returned(d, {"w": 4})).run]
    assert (act.node, act.group, act.kwargs) == ("j.run", 2, {"x": 1, "w": 4})
    sh.drain()
    assert core.status == "ok"


# ------------------------------------------------------------------ a bucket keeping shared entries


class _Item(of.Role):
    @of.interface(inputs_or=[["request"]], outputs=["item", "sout"])
    async def run(self, request: Any) -> Any:
        yield {"item": request}


class _ItemX(of.Role):
    @of.interface(inputs_or=[["item"]], outputs=["x"])
    async def run(self, item: Any) -> Any:
        return {"x": item}


class _EitherY(of.Role):
    @of.interface(inputs_or=[["request"], ["item"]], outputs=["y", "rout"])
    async def run(self, **kw: Any) -> Any:
        yield {"y": 1}


SHARED = compile_plan(
    of.parse(
        of.Graph(
            "shared",
            roles={"s": _Item(), "p": _ItemX(), "r": _EitherY(), "j": _Pair()},
            inputs=[of.Placeholder("request")],
            outputs=["out", "sout", "rout"],
        )
    )
)


def test_a_bucket_keeps_the_entries_a_later_frame_still_carries() -> None:
    """j's bucket is keyed by the call's entry but its first frame (x) descends from s's
    frame 0; r's y from that same s frame carries s's entry too (and its own): the bucket
    keeps s's entry, and j's activation descends from s's frame 0."""
    assert {"s.run", "r.run"} <= SHARED.stamping
    core = CallCore(SHARED, "c30")
    sh = _Shell(core)
    s, _r = sorted(sh(Start({"request": 0})).run, key=lambda act: act.node, reverse=True)
    assert s.node == "s.run"
    sh(Produced(s, {"item": 7}))
    (p,) = sh.of("p.run")
    (r_item,) = [a for a in sh.of("r.run") if a.group == 1]
    s0 = p.table[-1]
    assert s0[0] == "s.run" and r_item.table == p.table
    sh(Returned(p, {"x": 7}))
    ((bid, b),) = core.buckets.items()
    assert bid[2] == ("<input>", 0, 0) and b.table == p.table
    sh(Produced(r_item, {"y": 2}))
    (j,) = sh.of("j.run")
    assert j.kwargs == {"x": 7, "y": 2} and j.table == (("<input>", 0, 0), s0)
    core.validate()
    sh.drain()
    assert core.status == "ok" and not core.errors


# ------------------------------------------------------------------ session OR-group order


def _role(
    inputs_or: list[list[str]], outputs: list[str], *, gen: bool = False, lb: str = ""
) -> Any:
    """A role whose one node ``<name>.run`` the tests drive by stimuli (its body never runs)."""
    if gen:

        async def run(self: Any, **kw: Any) -> Any:
            yield {}

    else:

        async def run(self: Any, **kw: Any) -> Any:
            return None

    run.__name__ = run.__qualname__ = "run"
    method = of.interface(inputs_or=inputs_or, outputs=outputs, lb=lb or "round_robin")(run)
    return type("R", (of.Role,), {"run": method})()


def _plan(name: str, outputs: list[str], **roles: Any) -> Any:
    graph = of.Graph(name, roles=roles, inputs=[of.Placeholder("request")], outputs=outputs)
    return compile_plan(of.parse(graph))


# g yields a; a -> x, b -> y, c -> z; n (session): group 0 is a bucket [x, y] rooted at g,
# group 1 takes z. One frame of g is one SeqId index for both groups.
ORDERED = _plan(
    "ordered",
    ["o"],
    g=_role([["request"]], ["a"], gen=True),
    a=_role([["a"]], ["x"]),
    b=_role([["a"]], ["y"]),
    c=_role([["a"]], ["z"]),
    n=_role([["x", "y"], ["z"]], ["o"], lb="session"),
)


def _started(compiled: Any, call_id: str) -> tuple[CallCore, _Shell, Activation]:
    core = CallCore(compiled, call_id, story=deque())
    sh = _Shell(core)
    (g,) = sh(Start({"request": 1})).run
    sh(Produced(g, {"a": 0}))
    return core, sh, g


def _session_story(core: CallCore) -> list[tuple[int, int, str]]:
    assert core._story is not None
    return [
        (group, aid, why)
        for _c, _s, ev, *vals in core._story
        if ev == "session"
        for _node, group, aid, _seq, why in [vals]
    ]


def test_a_later_group_waits_while_an_earlier_groups_bucket_of_its_index_gathers() -> None:
    """z (group 1) is queued while group 0's bucket holds x and waits for y: group 1 waits;
    y completes the bucket, group 0 runs, then group 1."""
    core, sh, g = _started(ORDERED, "c40")
    (a,), (b,), (c,) = sh.of("a.run"), sh.of("b.run"), sh.of("c.run")
    sh(Returned(a, {"x": "x0"}))
    ins = sh(Returned(c, {"z": "z0"}))
    assert ins.run == () and not sh.of("n.run") and core._held == {"n.run"}
    core.validate()
    (n0,) = sh(Returned(b, {"y": "y0"})).run
    assert (n0.node, n0.group, n0.kwargs) == ("n.run", 0, {"x": "x0", "y": "y0"})
    core.validate()
    (n1,) = sh(Returned(n0, None)).run
    assert (n1.group, n1.kwargs) == (1, {"z": "z0"}) and n1.seq == n0.seq
    assert not core._held
    sh(Ended(g))
    sh.drain()
    assert _session_story(core) == [(0, n0.aid, "order"), (1, n1.aid, "order")]
    assert core.status == "ok" and not core.warnings


def test_a_later_group_is_released_when_the_earlier_groups_bucket_dies() -> None:
    """y ends with no frame: group 0's bucket is DEAD (a warning), and group 1, which waited
    for it, runs in the same step."""
    core, sh, g = _started(ORDERED, "c41")
    (a,), (b,), (c,) = sh.of("a.run"), sh.of("b.run"), sh.of("c.run")
    sh(Returned(a, {"x": "x0"}))
    assert sh(Returned(c, {"z": "z0"})).run == ()
    (n1,) = sh(Returned(b, None)).run
    assert (n1.node, n1.group, n1.kwargs) == ("n.run", 1, {"z": "z0"})
    assert [(w["node"], w["field"]) for w in core.warnings] == [("n.run", "y")]
    core.validate()
    sh(Returned(n1, None))
    sh(Ended(g))
    sh.drain()
    assert _session_story(core) == [(1, n1.aid, "order")]


# The same, but group 0's second field w comes back from n itself (n -> l -> w): the bucket
# can only complete through n's own activations, so group 1 runs first.
LOOPED = _plan(
    "looped",
    ["o"],
    g=_role([["request"]], ["a"], gen=True),
    a=_role([["a"]], ["x"]),
    c=_role([["a"]], ["z"]),
    n=_role([["x", "w"], ["z"]], ["o"], lb="session"),
    l=_role([["o"]], ["w"]),
)


def test_a_later_group_runs_first_when_only_it_can_complete_the_earlier_bucket() -> None:
    core, sh, g = _started(LOOPED, "c42")
    (a,), (c,) = sh.of("a.run"), sh.of("c.run")
    sh(Returned(a, {"x": "x0"}))
    (n1,) = sh(Returned(c, {"z": "z0"})).run  # waiting would deadlock: it runs
    assert (n1.node, n1.group) == ("n.run", 1) and not core._held
    core.validate()
    (lp,) = sh(Returned(n1, {"o": "o1"})).run
    (n0,) = sh(Returned(lp, {"w": "w1"})).run
    assert (n0.group, n0.kwargs, n0.seq) == (0, {"x": "x0", "w": "w1"}, n1.seq)
    sh(Returned(n0, None))
    sh(Ended(g))
    sh.drain()
    assert _session_story(core) == [(1, n1.aid, "loop"), (0, n0.aid, "order")]
    assert core.status == "ok"


def test_each_index_decides_its_own_loop_bucket() -> None:
    """Index 1's work (a1, c1) runs beside index 0's loop but is no feeder of index 0's
    bucket: group 1 of index 0 runs at once; its loop never comes back, so that bucket dies
    with a warning; index 1 goes the same way."""
    core, sh, g = _started(LOOPED, "c43")
    (a,), (c,) = sh.of("a.run"), sh.of("c.run")
    sh(Produced(g, {"a": 1}))  # index 1: its own a and c
    a1, c1 = sh.of("a.run")[1], sh.of("c.run")[1]
    sh(Returned(a, {"x": "x0"}))
    (n1,) = sh(Returned(c, {"z": "z0"})).run
    sh(Returned(n1, None))  # index 0's loop never comes back: its bucket dies
    assert [(w["node"], w["field"]) for w in core.warnings] == [("n.run", "w")]
    sh(Returned(a1, {"x": "x1"}))
    (m1,) = sh(Returned(c1, {"z": "z1"})).run
    assert m1.kwargs == {"z": "z1"}
    sh(Returned(m1, None))
    sh(Ended(g))
    sh.drain()
    assert [w for _g, _a, w in _session_story(core)] == ["loop", "loop"]


# r runs once per frame of p and of q, both children of one frame of g: each r frame roots a
# bucket [s1, s2] of n, and both buckets carry g's index.
FANNED = _plan(
    "fanned",
    ["o"],
    g=_role([["request"]], ["a"], gen=True),
    p=_role([["a"]], ["p"]),
    q=_role([["a"]], ["q"]),
    c=_role([["a"]], ["z"]),
    r=_role([["p"], ["q"]], ["r"]),
    s1=_role([["r"]], ["s1"]),
    s2=_role([["r"]], ["s2"]),
    n=_role([["s1", "s2"], ["z"]], ["o"], lb="session"),
)


def test_activations_of_one_group_under_one_index_run_in_the_order_their_buckets_fired() -> None:
    """Two group-0 buckets of one index fire while n runs: the later-rooted one fired first
    and runs first; group 1's second activation waits for both."""
    core, sh, g = _started(FANNED, "c44")
    (p,), (q,), (c,) = sh.of("p.run"), sh.of("q.run"), sh.of("c.run")
    (busy,) = sh(Returned(c, {"z": "z0"})).run  # no bucket yet: group 1 runs
    (rp,) = sh(Returned(p, {"p": 0})).run
    (rq,) = sh(Returned(q, {"q": 0})).run
    s_q = sh(Returned(rq, {"r": "rq"})).run
    s_p = sh(Returned(rp, {"r": "rp"})).run
    for act in s_q:  # the bucket rooted at rq's frame fires first
        sh(Returned(act, {act.node.split(".")[0]: "q-" + act.node}))
    for act in s_p:
        sh(Returned(act, {act.node.split(".")[0]: "p-" + act.node}))
    assert [a.node for a in sh.running] == ["g.run", "n.run"]  # both queued behind busy
    core.validate()
    (first,) = sh(Returned(busy, None)).run
    (second,) = sh(Returned(first, None)).run
    assert first.group == second.group == 0
    assert first.kwargs == {"s1": "q-s1.run", "s2": "q-s2.run"}
    assert second.kwargs == {"s1": "p-s1.run", "s2": "p-s2.run"}
    assert first.seq == second.seq == busy.seq
    sh(Returned(second, None))
    sh(Ended(g))
    sh.drain()
    assert [(gr, w) for gr, _a, w in _session_story(core)] == [
        (1, "order"),
        (0, "order"),
        (0, "order"),
    ]


def test_a_held_activation_waits_again_when_its_node_frees_up() -> None:
    """n runs index 0's group 1; meanwhile index 1's group-0 bucket gathers and its group 1
    queues. When n frees up, index 0 has settled and index 1's group 1 waits for its bucket
    (to be decided after the step settles), then runs after group 0."""
    core, sh, g = _started(ORDERED, "c45")
    (a,), (b,), (c,) = sh.of("a.run"), sh.of("b.run"), sh.of("c.run")
    sh(Returned(a, None))
    sh(Returned(b, None))
    (busy,) = sh(Returned(c, {"z": "z0"})).run
    sh(Produced(g, {"a": 1}))
    a1, b1, c1 = sh.of("a.run")[0], sh.of("b.run")[0], sh.of("c.run")[0]
    sh(Returned(a1, {"x": "x1"}))
    sh(Returned(c1, {"z": "z1"}))
    assert sh(Returned(busy, None)).run == () and core._held == {"n.run"}
    core.validate()
    (n0,) = sh(Returned(b1, {"y": "y1"})).run
    (n1,) = sh(Returned(n0, None)).run
    assert (n0.group, n1.group, n1.kwargs) == (0, 1, {"z": "z1"})
    sh(Returned(n1, None))
    sh(Ended(g))
    sh.drain()


# n's group-0 bucket [x, w] waits for w from l, whose own bucket [o, v] waits for o from n:
# the wait goes through another bucket, so only "nothing else can run" shows it is a loop.
CROSSED = _plan(
    "crossed",
    ["o"],
    g=_role([["request"]], ["a"], gen=True),
    a=_role([["a"]], ["x"]),
    c=_role([["a"]], ["z"]),
    d=_role([["a"]], ["v"]),
    n=_role([["x", "w"], ["z"]], ["o"], lb="session"),
    l=_role([["o", "v"]], ["w"]),
)


def test_a_held_activation_runs_when_nothing_else_can() -> None:
    core, sh, g = _started(CROSSED, "c46")
    (a,), (c,), (d,) = sh.of("a.run"), sh.of("c.run"), sh.of("d.run")
    sh(Returned(a, {"x": "x0"}))
    sh(Returned(d, {"v": "v0"}))
    assert sh(Returned(c, {"z": "z0"})).run == () and core._held == {"n.run"}
    core.validate()
    (n1,) = sh(Ended(g)).run  # nothing else runs: the wait would never end
    assert (n1.group, n1.kwargs) == (1, {"z": "z0"})
    (lp,) = sh(Returned(n1, {"o": "o1"})).run
    (n0,) = sh(Returned(lp, {"w": "w1"})).run
    assert n0.kwargs == {"x": "x0", "w": "w1"}
    sh(Returned(n0, None))
    sh.drain()
    assert [(gr, w) for gr, _a, w in _session_story(core)] == [(1, "stuck"), (0, "order")]


def test_validate_names_a_broken_session_group_order() -> None:
    core, sh, _g = _started(ORDERED, "c47")
    (a,), (c,) = sh.of("a.run"), sh.of("c.run")
    sh(Returned(a, {"x": "x0"}))
    sh(Returned(c, {"z": "z0"}))
    core.validate()
    core._held.clear()
    with pytest.raises(AssertionError, match="waits at index 0 for nothing"):
        core.validate()
    core._held.add("n.run")
    running, core.running = core.running, set()
    with pytest.raises(AssertionError, match="while nothing runs"):
        core.validate()
    core.running = running
    (key,) = core.orders.seq_buckets
    buckets = core.orders.seq_buckets.pop(key)
    with pytest.raises(AssertionError, match="session buckets by SeqId drifted"):
        core.validate()
    core.orders.seq_buckets[key] = buckets
    core.validate()


# As ORDERED, but group 0 gathers three fields: a frame that arrives at (and an end that
# leaves) its bucket still open while group 1 is held schedules the held node to be looked at
# again (it may be down to a loop's work), and the wait goes on.
TRIPLE = _plan(
    "triple",
    ["o"],
    g=_role([["request"]], ["a"], gen=True),
    a=_role([["a"]], ["x"]),
    b=_role([["a"]], ["y"]),
    d=_role([["a"]], ["w"]),
    e=_role([["a"]], ["w"]),
    c=_role([["a"]], ["z"]),
    n=_role([["x", "y", "w"], ["z"]], ["o"], lb="session"),
)


def test_a_held_group_waits_on_while_the_earlier_bucket_still_gathers() -> None:
    """w has two producers (d, e). While group 1 is held, y arrives and d ends without w: the
    bucket still gathers (e may still give w), so group 1 waits on; e's w fires group 0."""
    core, sh, g = _started(TRIPLE, "c47")
    (a,), (b,), (c,) = sh.of("a.run"), sh.of("b.run"), sh.of("c.run")
    (d,), (e,) = sh.of("d.run"), sh.of("e.run")
    sh(Returned(a, {"x": "x0"}))
    assert sh(Returned(c, {"z": "z0"})).run == () and core._held == {"n.run"}
    assert sh(Returned(b, {"y": "y0"})).run == () and core._held == {"n.run"}
    assert sh(Returned(d, None)).run == () and core._held == {"n.run"}
    core.validate()
    (n0,) = sh(Returned(e, {"w": "w0"})).run
    assert (n0.group, n0.kwargs) == (0, {"x": "x0", "y": "y0", "w": "w0"})
    (n1,) = sh(Returned(n0, None)).run
    assert (n1.group, n1.kwargs) == (1, {"z": "z0"})
    sh(Returned(n1, None))
    sh(Ended(g))
    sh.drain()
    assert _session_story(core) == [(0, n0.aid, "order"), (1, n1.aid, "order")]
    assert core.status == "ok" and not core.warnings
