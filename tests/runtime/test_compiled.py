"""Hot-path tables derived from a StaticPlan: which diamond roots the runtime keys by the call.

A root that fires once per call, whose entry every frame keeps on its way to the root's
buckets, names exactly one bucket per call: the call's own entry does the same job, so the
root stamps nothing (see ``once_per_call`` and ``_entry_droppers`` in ``_compiled``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import omniflow as of
from omniflow.plan import parse_graphs
from omniflow.runtime.callcore._compiled import compile_plan, once_per_call

from .conftest import load_graph_module


def _node(
    name: str,
    inputs_or: list[list[str]],
    outputs: list[str],
    *,
    gen: bool = False,
    **opts: Any,
) -> of.Role:
    """A one-method Role (node ``<name>.m``) that passes its first input on to every output."""
    if gen:

        async def m_gen(self: Any, **kw: Any) -> AsyncIterator[dict[str, Any]]:
            yield {o: next(iter(kw.values())) for o in outputs}

        method: Any = m_gen
    else:

        async def m(self: Any, **kw: Any) -> dict[str, Any]:
            return {o: next(iter(kw.values())) for o in outputs}

        method = m
    iface = of.interface(inputs_or=inputs_or, outputs=outputs, **opts)(method)
    return type(f"R_{name}", (of.Role,), {"m": iface})()  # type: ignore[no-any-return]


def _plan(roles: dict[str, of.Role], inputs: list[str], outputs: list[str]) -> Any:
    graph = of.Graph("g", roles=roles, inputs=[of.Placeholder(p) for p in inputs], outputs=outputs)
    return parse_graphs([graph])["g"]


def _fan(src_opts: dict[str, Any] | None = None, mid: of.Role | None = None) -> Any:
    """x -> src -> (a, b) -> join[[oa, ob]]; ``mid`` optionally sits between src and b."""
    roles = {
        "src": _node("src", [["x"]], ["s"], **(src_opts or {})),
        "a": _node("a", [["s"]], ["oa"]),
        "b": _node("b", [["t" if mid else "s"]], ["ob"]),
        "join": _node("join", [["oa", "ob"]], ["out"]),
    }
    if mid is not None:
        roles["mid"] = mid
    return _plan(roles, ["x"], ["out"])


def test_fan_out_root_is_keyed_by_the_call() -> None:
    plan = _fan()
    assert plan.diamond_roots[("join.m", 0)] == "src.m"
    assert once_per_call(plan) == {"src.m", "a.m", "b.m", "join.m"}
    c = compile_plan(plan)
    assert c.stamping == frozenset()
    assert c.fanout["a.m"]["oa"][0][0][2].root == "<input>"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("why", "src_opts"),
    [
        ("a generator stamps one entry per frame", {"gen": True}),
        ("a session node starts a SeqId stream", {"lb": "session"}),
    ],
)
def test_roots_that_may_fire_more_than_once_keep_their_entry(
    why: str, src_opts: dict[str, Any]
) -> None:
    plan = _fan(src_opts)
    assert "src.m" not in once_per_call(plan), why
    assert "src.m" in compile_plan(plan).stamping, why


def test_two_or_groups_or_two_producers_are_not_once_per_call() -> None:
    plan = _plan(
        {
            "p": _node("p", [["x"], ["y"]], ["s"]),  # each group may fire
            "q": _node("q", [["x"]], ["s"]),  # "s" now has two producers
            "r": _node("r", [["s"]], ["out"]),
        },
        ["x", "y"],
        ["out"],
    )
    assert once_per_call(plan) == {"q.m"}


def test_joins_are_once_per_call_only_for_all() -> None:
    def plan_with(count: Any) -> Any:
        return _plan(
            {
                "g": _node("g", [["x"]], ["s"], gen=True),
                "j": _node("j", [["s"]], ["out"], activate_by_count={"s": count}),
            },
            ["x"],
            ["out"],
        )

    assert once_per_call(plan_with(of.ALL)) == {"j.m"}  # fires after the stream ended
    assert once_per_call(plan_with(2)) == set()  # fires at 2 while the generator may run on


def test_cycle_nodes_are_not_once_per_call() -> None:
    mod = load_graph_module("agent_loop")
    plan = parse_graphs([mod.graph])[mod.graph.name]
    assert plan.cycle_nodes
    assert once_per_call(plan).isdisjoint(plan.cycle_nodes)


def test_a_join_between_root_and_bucket_keeps_the_roots_entry() -> None:
    # src -> mid (a join: its frames carry only the call's entry) -> t -> b -> join: b's frame
    # lands in another bucket than a's, as with a stamped root; keying by the call would
    # merge them.
    mid = _node("mid", [["s"]], ["t"], activate_by_count={"s": of.ALL})
    plan = _fan(mid=mid)
    assert plan.diamond_roots[("join.m", 0)] == "src.m"
    assert "src.m" in once_per_call(plan)
    assert "src.m" in compile_plan(plan).stamping


def test_example_graphs_keep_their_stream_roots() -> None:
    mod = load_graph_module("fig3")
    plan = parse_graphs([mod.graph])[mod.graph.name]
    c = compile_plan(plan)
    assert c.stamping == {"parse.run", "llm.generate"}  # both generators
    assert once_per_call(plan) == {"diffusion.generate_image", "vae.decode"}
