"""The cross-process fast path (cluster/_forward.py): workers start direct-fire runs of other
workers themselves, and the front binds them to the activations its call core makes.

What must hold: the same answers, SeqIds and OR groups as in-process and as with the fast path
off (``OMNIFLOW_FAST_PATH=0``); runs actually go worker to worker (``forwarded``); frames whose
values sit on the data plane take the front's way; a failed or cancelled call leaves nothing
behind, in the front (``remote_inflight``, ``forward_waiting``) or in the workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import omniflow as of
from omniflow.cluster._forward import (
    Hop,
    Route,
    Waiting,
    hops,
    parent_of,
    parse_routes,
    wire_id,
)
from omniflow.runtime.callcore._compiled import compile_plan
from omniflow.transport import FAST_PATH_ENV

from . import fast_graphs as fg

GRAPH_FILE = Path(fg.__file__).resolve()
ZERO = {"open_buckets": 0, "inflight": 0, "active_calls": 0, "data_plane_bytes": 0}


def graphs() -> dict[str, of.Graph]:
    """This module's graphs imported by path (so workers find them)."""
    return {g.name: g for g in of.load_graphs(GRAPH_FILE)}


# ---------------------------------------------------------------- which edges qualify


class _R(of.Role):
    """A role with one method per shape, for building plans (never run)."""

    @of.interface(inputs_or=[["x"]], outputs=["y"])
    async def one(self, x: int) -> dict[str, Any]:
        return {"y": x}


def _role(inputs_or: list[list[str]], outputs: list[str], **kw: Any) -> of.Role:
    async def run(self: Any, **inputs: Any) -> dict[str, Any]:
        return {}

    run.__name__ = "run"
    cls = type("R", (of.Role,), {"run": of.interface(inputs_or=inputs_or, outputs=outputs,
                                                       **kw)(run)})  # fmt: skip
    return cls()


def _hops(roles: dict[str, of.Role], outputs: list[str], src: str,
          remote: set[str] | None = None) -> tuple[Hop, ...]:  # fmt: skip
    g = of.Graph("h", roles=roles, inputs=[of.Placeholder("x")], outputs=outputs)
    c = compile_plan(of.parse(g))
    return hops(c, f"{src}.run", set(roles) if remote is None else remote)


def test_a_chain_edge_qualifies_with_its_seq_rule() -> None:
    roles = {"a": _role([["x"]], ["p"]), "b": _role([["p"]], ["y"])}
    assert _hops(roles, ["y"], "a") == (Hop("p", "b.run", 0, "b", False),)
    # a generator starts a SeqId stream: the downstream index is the frame index
    gen = {"a": _role([["x"]], ["p"]), "b": _role([["p"]], ["y"])}

    async def stream(self: Any, x: int) -> AsyncIterator[dict[str, Any]]:
        yield {"p": x}

    stream.__name__ = "run"
    gen["a"] = type("G", (of.Role,), {"run": of.interface(inputs_or=[["x"]],
                                                           outputs=["p"])(stream)})()  # fmt: skip
    assert _hops(gen, ["y"], "a") == (Hop("p", "b.run", 0, "b", True),)


@pytest.mark.parametrize(
    "why",
    ["in-process target", "two producers", "bucket", "session", "broadcast", "throttled",
     "latched", "loop"],
)  # fmt: skip
def test_edges_the_plan_does_not_fix_do_not_qualify(why: str) -> None:
    remote = None
    outputs = ["y"]
    roles: dict[str, of.Role]
    src = "a"
    if why == "in-process target":
        roles = {"a": _role([["x"]], ["p"]), "b": _role([["p"]], ["y"])}
        remote = {"a"}
    elif why == "two producers":
        roles = {"a": _role([["x"]], ["p"]), "a2": _role([["x"]], ["p"]),
                 "b": _role([["p"]], ["y"])}  # fmt: skip
    elif why == "bucket":
        roles = {"a": _role([["x"]], ["p"]), "a2": _role([["x"]], ["q"]),
                 "b": _role([["p", "q"]], ["y"])}  # fmt: skip
    elif why == "session":
        roles = {"a": _role([["x"]], ["p"]), "b": _role([["p"]], ["y"], lb="session")}
    elif why == "broadcast":
        roles = {"a": _role([["x"]], ["p"]), "b": _role([["p"]], ["y"], lb="broadcast")}
    elif why == "throttled":
        roles = {"a": _role([["x"]], ["p"]), "b": _role([["p"]], ["y"], max_concurrency=1)}
    elif why == "latched":
        roles = {"a": _role([["x"]], ["p", "k"]),
                 "b": _role([["p", "k"]], ["y"], latch=["k"])}  # fmt: skip
    else:  # a loop: b feeds a again
        roles = {"a": _role([["x"], ["back"]], ["p"]), "b": _role([["p"]], ["y", "back"])}
    assert _hops(roles, outputs, src, remote) == ()


def test_a_session_source_forwards_nothing() -> None:
    roles = {"a": _role([["x"]], ["p"], lb="session"), "b": _role([["p"]], ["y"])}
    assert _hops(roles, ["y"], "a") == ()


@given(
    root=st.integers(0, 2**40),
    steps=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 64)), max_size=6),
)
def test_wire_ids_peel_back_to_the_front_run(root: int, steps: list[tuple[int, int]]) -> None:
    chain: list[int | str] = [root]
    for k, r in steps:
        chain.append(wire_id(chain[-1], k, r))
    assert len(set(chain)) == len(chain)
    for child, parent in zip(reversed(chain[1:]), reversed(chain[:-1]), strict=True):
        assert isinstance(child, str)
        assert parent_of(child) == parent


def test_parse_routes_takes_well_formed_routes_only() -> None:
    good = ["p", "b.run", 0, "uds:///tmp/x.sock", "rid", None, None, None, True, None]
    assert parse_routes([good]) == (Route(*good),)
    assert parse_routes([good])[0].wire() == good
    for bad in (
        "nope",
        [good[:-1]],
        [[*good[:2], "0", *good[3:]]],  # group as a str
        [[*good[:8], 1, None]],  # qk as an int
    ):
        with pytest.raises(ValueError):
            parse_routes(bad)


# ---------------------------------------------------------------- across processes


@pytest.fixture(params=["on", "off"])
def fast(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The fast path on (default) or off; spawned workers inherit the setting."""
    monkeypatch.setenv(FAST_PATH_ENV, "1" if request.param == "on" else "0")
    return bool(request.param == "on")


async def idle(rt: of.Runtime) -> dict[str, int]:
    """The front's remote statistics once nothing is in flight (hang guard: 30 s)."""
    assert rt.remote is not None
    for _ in range(3000):
        s = rt.remote.statistics()
        if s["remote_inflight"] == 0 and s["forward_waiting"] == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"still in flight: {rt.remote.statistics()}")


async def calls_held(rt: of.Runtime) -> dict[str, int]:
    """Per worker: the calls whose state there waits for the front's end_call, once none is
    left anywhere or after 30 s (end_call follows a call's end without waiting for it)."""
    assert rt.remote is not None
    held: dict[str, int] = {}
    for _ in range(300):
        held = {n: w["work"]["calls"] for n, w in (await rt.remote.worker_statistics()).items()}
        if not any(held.values()):
            break
        await asyncio.sleep(0.1)
    return held


@pytest.mark.slow
async def test_chain_answers_as_in_process_and_runs_go_worker_to_worker(
    fast: bool, runtime: Callable[..., Any]
) -> None:
    g = graphs()["fp_chain"]
    async with of.Runtime(g) as local:
        want = [await local.run("fp_chain", {"x": x}) for x in range(20)]
    rt = await runtime(g, placement="process")
    got = [await rt.run("fp_chain", {"x": x}) for x in range(20)]
    assert got == want
    assert want[3]["y"] == [(3 + 1) * 2 - 3]
    s = await idle(rt)
    # a -> b and b -> c are forwarded for every call; x -> a comes from the front
    assert s["forwarded"] == (40 if fast else 0)
    assert s["orphaned"] == 0
    # Outputs that could have gone to the data plane but were small leave nothing behind (no
    # end_call comes for them).
    assert set((await calls_held(rt)).values()) == {0}


@pytest.mark.slow
async def test_stream_keeps_every_frame_its_order_and_its_seq(
    fast: bool, runtime: Callable[..., Any]
) -> None:
    g = graphs()["fp_stream"]
    n = 300
    async with of.Runtime(g) as local:
        want = [(f.field, f.value) async for f in local.call("fp_stream", {"n": n})]
    rt = await runtime(g, placement="process")
    for _ in range(2):
        got = [(f.field, f.value) async for f in rt.call("fp_stream", {"n": n})]
        # per field, frames come in SeqId order (s1 finishes out of order underneath)
        for field in ("c", "seq1"):
            assert [v for f, v in got if f == field] == [v for f, v in want if f == field]
    assert sorted(v for f, v in want if f == "seq1") == list(range(n))
    s = await idle(rt)
    frames_to_s2 = n  # every s1 activation returns b
    assert s["forwarded"] == (2 * (n + frames_to_s2) if fast else 0)


@pytest.mark.slow
async def test_values_on_the_data_plane_take_the_front_way(
    fast: bool, runtime: Callable[..., Any]
) -> None:
    g = graphs()["fp_mixed"]
    n = 9
    rt = await runtime(g, placement="process")
    got = await rt.run("fp_mixed", {"n": n})
    kinds = sorted((w[0], w[1], w[2]) for w in got["w"])
    assert kinds == sorted(
        ("big", i, fg.BIG // 8) if i % 3 == 2 else ("small", i, 1) for i in range(n)
    )
    s = await idle(rt)
    assert s["forwarded"] == (6 if fast else 0)  # the small ones only
    assert set((await calls_held(rt)).values()) == {0}  # the big ones' end_call came


@pytest.mark.slow
async def test_a_failing_branch_leaves_nothing_behind(
    fast: bool, runtime: Callable[..., Any]
) -> None:
    rt = await runtime(graphs()["fp_fail"], placement="process")
    for _ in range(3):
        with pytest.raises(of.NodeError, match="frame 5 is bad"):
            await rt.run("fp_fail", {"n": 40})
    s = await idle(rt)
    if fast:
        assert s["forwarded"] > 0
    stats = await rt.pool_stats()
    assert stats  # every worker answered: none is stuck


@pytest.mark.slow
async def test_cancelling_a_stream_leaves_nothing_behind(
    fast: bool, runtime: Callable[..., Any]
) -> None:
    rt = await runtime(graphs()["fp_forever"], placement="process")
    for _ in range(3):
        call = rt.call("fp_forever", {"n": 0})
        seen = 0
        async for _frame in call:
            seen += 1
            if seen == 20:
                break  # leaving the loop cancels the call
        assert await call.wait() == "cancelled"
    s = await idle(rt)
    if fast:
        assert s["forwarded"] >= 3 * 20
    # the runtime still serves: a fresh call streams again
    call = rt.call("fp_forever", {"n": 0})
    async for _frame in call:
        break
    await call.cancel()
    assert call.status == "cancelled"
    await idle(rt)


# ---------------------------------------------------------------- unbound runs, by parent

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 40)),
        st.tuples(st.just("take"), st.integers(0, 40)),
        st.tuples(st.just("end"), st.integers(0, 40)),
        st.tuples(st.just("lost"), st.integers(0, 2)),
    ),
    max_size=60,
)


def _tree_wid(i: int) -> str:
    """Wire id number ``i`` of a small forwarding tree under front run 7 (parents first)."""
    if i < 4:
        return wire_id(7, i, 0)
    return wire_id(_tree_wid(i // 4 - 1), i % 4, 1)


@given(ops=_OPS)
def test_waiting_keeps_its_index_whatever_happens(ops: list[tuple[Any, ...]]) -> None:
    """A model of ``Waiting``: what was added and not taken, orphaned or lost is still there,
    messages in arrival order, and the parent index lists exactly those."""
    w = Waiting()
    model: dict[str, tuple[int, list[int]]] = {}
    n = 0
    for op in ops:
        if op[0] == "add":
            _, rep, i = op
            wid = _tree_wid(i)
            if wid in model and model[wid][0] != rep:
                continue  # one run has one replica
            w.add(rep, wid, n)
            model.setdefault(wid, (rep, []))[1].append(n)
            n += 1
        elif op[0] == "take":
            wid = _tree_wid(op[1])
            got = w.take(wid)
            want = model.pop(wid, None)
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert (got[0], got[1]) == want
        elif op[0] == "end":
            parent: int | str = 7 if op[1] == 0 else _tree_wid(op[1])
            taken = {wid for wid, _r, _m in w.orphans_of(parent)}

            def below(wid: str, parent: int | str = parent) -> bool:
                p: int | str = wid
                while type(p) is str:
                    p = parent_of(p)
                    if p == parent:
                        return True
                    if p not in model and type(p) is str:
                        return False  # an unbound link breaks the chain in the index
                return False

            # every waiting child of the parent goes, and with it its waiting descendants
            expected = {wid for wid in model if below(wid)}
            assert taken == expected
            for wid in taken:
                del model[wid]
        else:
            w.drop_replica(op[1])
            for wid in [k for k, (r, _) in model.items() if r == op[1]]:
                del model[wid]
        assert {k: (r, list(m)) for k, (r, m) in w.early.items()} == model
        index: dict[int | str, set[str]] = {}
        for wid in model:
            index.setdefault(parent_of(wid), set()).add(wid)
        assert w.kids == index
        assert len(w) == len(model)
