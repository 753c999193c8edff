"""GraphParser: exact plans of the example graphs, diamond-root rules, and every GraphError."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import omniflow as of
from omniflow.plan import NodeSpec

IN = "<input>"
GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
RoleFactory = Callable[..., of.Role]

# -- the example graphs, pinned index by index ------------------------------------------------


def test_fig3_plan(fig3_plan: of.StaticPlan) -> None:
    p = fig3_plan
    assert p.graph == "fig3"
    assert p.inputs == ("request",)
    assert p.outputs == ("token", "picture")
    assert p.nodes == (
        "parse.run",
        "embedding.embed",
        "vae.encode",
        "vit.encode",
        "llm.generate",
        "diffusion.generate_image",
        "vae.decode",
    )
    assert p.edges == {
        (IN, "request", "parse.run", 0),
        ("parse.run", "text", "embedding.embed", 0),
        ("parse.run", "image", "vit.encode", 0),
        ("parse.run", "image", "vae.encode", 0),
        ("embedding.embed", "text_emb", "llm.generate", 0),
        ("vit.encode", "vit_feat", "llm.generate", 1),
        ("vae.encode", "vae_feat", "llm.generate", 1),
        ("llm.generate", "token", "diffusion.generate_image", 0),
        ("diffusion.generate_image", "latent", "vae.decode", 0),
    }
    assert p.ctrl_edges == {
        IN: [("parse.run", 0, "request")],
        "parse.run": [
            ("vae.encode", 0, "image"),
            ("vit.encode", 0, "image"),
            ("embedding.embed", 0, "text"),
        ],
        "embedding.embed": [("llm.generate", 0, "text_emb")],
        "vit.encode": [("llm.generate", 1, "vit_feat")],
        "vae.encode": [("llm.generate", 1, "vae_feat")],
        "llm.generate": [("diffusion.generate_image", 0, "token")],
        "diffusion.generate_image": [("vae.decode", 0, "latent")],
    }
    assert p.buckets == {("llm.generate", 1), ("diffusion.generate_image", 0)}
    assert p.diamond_roots == {
        ("llm.generate", 1): "parse.run",
        ("diffusion.generate_image", 0): IN,
    }
    assert p.slots == {
        ("llm.generate", 1): (("vae_feat", "vae.encode"), ("vit_feat", "vit.encode")),
        ("diffusion.generate_image", 0): (("token", "llm.generate"),),
    }
    assert p.critical_slots == {
        ("parse.run", 0, "request"),
        ("embedding.embed", 0, "text"),
        ("vit.encode", 0, "image"),
        ("vae.encode", 0, "image"),
        ("llm.generate", 0, "text_emb"),
        ("llm.generate", 1, "vit_feat"),
        ("llm.generate", 1, "vae_feat"),
        ("diffusion.generate_image", 0, "token"),
        ("vae.decode", 0, "latent"),
    }
    into_buckets = {
        ("vit.encode", "vit_feat", "llm.generate", 1),
        ("vae.encode", "vae_feat", "llm.generate", 1),
        ("llm.generate", "token", "diffusion.generate_image", 0),
    }
    assert p.edge_rule == {e: ("C" if e in into_buckets else "A") for e in p.edges}
    assert p.seq_producers == {"parse.run", "llm.generate"}
    assert p.root_nodes == {"parse.run"}
    assert p.cycle_nodes == frozenset()
    assert p.output_producers == {"token": ("llm.generate",), "picture": ("vae.decode",)}
    assert p.producers == {
        "request": (IN,),
        "text": ("parse.run",),
        "image": ("parse.run",),
        "text_emb": ("embedding.embed",),
        "vit_feat": ("vit.encode",),
        "vae_feat": ("vae.encode",),
        "token": ("llm.generate",),
        "latent": ("diffusion.generate_image",),
        "picture": ("vae.decode",),
    }
    tail = {"llm.generate", "diffusion.generate_image", "vae.decode"}
    assert p.reach == {
        IN: {IN, *p.nodes},
        "parse.run": set(p.nodes),
        "embedding.embed": {"embedding.embed", *tail},
        "vit.encode": {"vit.encode", *tail},
        "vae.encode": {"vae.encode", *tail},
        "llm.generate": tail,
        "diffusion.generate_image": {"diffusion.generate_image", "vae.decode"},
        "vae.decode": {"vae.decode"},
    }
    assert set(p.params) == {"history"}
    assert p.max_iterations == 1024
    assert p.specs["diffusion.generate_image"].count == (("token", of.ALL),)
    assert p.specs["llm.generate"].lb == "session"


def test_fig3_acceptance_image_group_holds_bucket_text_group_none(fig3_plan: of.StaticPlan) -> None:
    assert ("llm.generate", 1) in fig3_plan.buckets
    assert fig3_plan.diamond_roots[("llm.generate", 1)] == "parse.run"
    assert ("llm.generate", 0) not in fig3_plan.buckets
    assert ("llm.generate", 0) not in fig3_plan.diamond_roots


def test_t2i_plan(t2i_plan: of.StaticPlan) -> None:
    p = t2i_plan
    assert p.graph == "t2i"
    assert p.inputs == ("request",)
    assert p.outputs == ("picture",)
    # BFS order from the entry: diffusion.denoise is one hop closer than adapter.fuse.
    assert p.nodes == (
        "parse.run",
        "text.encode",
        "vae.encode",
        "vit.encode",
        "diffusion.denoise",
        "adapter.fuse",
        "vae.decode",
    )
    assert p.edges == {
        (IN, "request", "parse.run", 0),
        ("parse.run", "prompt", "text.encode", 0),
        ("parse.run", "cond_image", "vit.encode", 0),
        ("parse.run", "cond_image", "vae.encode", 0),
        ("vit.encode", "vit_feat", "adapter.fuse", 0),
        ("vae.encode", "vae_feat", "adapter.fuse", 0),
        ("adapter.fuse", "cond", "diffusion.denoise", 0),
        ("text.encode", "text_emb", "diffusion.denoise", 0),
        ("diffusion.denoise", "latent", "vae.decode", 0),
    }
    assert p.ctrl_edges == {
        IN: [("parse.run", 0, "request")],
        "parse.run": [
            ("vae.encode", 0, "cond_image"),
            ("vit.encode", 0, "cond_image"),
            ("text.encode", 0, "prompt"),
        ],
        "text.encode": [("diffusion.denoise", 0, "text_emb")],
        "vit.encode": [("adapter.fuse", 0, "vit_feat")],
        "vae.encode": [("adapter.fuse", 0, "vae_feat")],
        "adapter.fuse": [("diffusion.denoise", 0, "cond")],
        "diffusion.denoise": [("vae.decode", 0, "latent")],
    }
    assert p.buckets == {("adapter.fuse", 0), ("diffusion.denoise", 0)}
    assert p.diamond_roots == {("adapter.fuse", 0): "parse.run", ("diffusion.denoise", 0): IN}
    assert p.slots == {
        ("adapter.fuse", 0): (("vae_feat", "vae.encode"), ("vit_feat", "vit.encode")),
        ("diffusion.denoise", 0): (("cond", "adapter.fuse"), ("text_emb", "text.encode")),
    }
    assert p.critical_slots == {
        ("parse.run", 0, "request"),
        ("text.encode", 0, "prompt"),
        ("vit.encode", 0, "cond_image"),
        ("vae.encode", 0, "cond_image"),
        ("adapter.fuse", 0, "vit_feat"),
        ("adapter.fuse", 0, "vae_feat"),
        ("diffusion.denoise", 0, "cond"),
        ("diffusion.denoise", 0, "text_emb"),
        ("vae.decode", 0, "latent"),
    }
    into_buckets = {e for e in p.edges if e[2] in ("adapter.fuse", "diffusion.denoise")}
    assert len(into_buckets) == 4
    assert p.edge_rule == {e: ("C" if e in into_buckets else "A") for e in p.edges}
    assert p.seq_producers == {"parse.run"}
    assert p.root_nodes == {"parse.run"}
    assert p.cycle_nodes == frozenset()
    assert p.output_producers == {"picture": ("vae.decode",)}
    assert p.specs["diffusion.denoise"].count == (("cond", of.ALL),)
    assert p.specs["diffusion.denoise"].is_join
    assert p.reach["vit.encode"] == {
        "vit.encode",
        "adapter.fuse",
        "diffusion.denoise",
        "vae.decode",
    }
    assert p.reach["text.encode"] == {"text.encode", "diffusion.denoise", "vae.decode"}
    assert p.reach[IN] == {IN, *p.nodes}


def test_agent_loop_plan(agent_plan: of.StaticPlan) -> None:
    p = agent_plan
    assert p.graph == "agent"
    assert p.inputs == ("prompt",)
    assert p.outputs == ("answer", "step")
    assert p.nodes == ("llm.think", "calc.run")
    assert p.edges == {
        (IN, "prompt", "llm.think", 0),
        ("llm.think", "tool_call", "calc.run", 0),
        ("calc.run", "tool_result", "llm.think", 1),
    }
    assert p.ctrl_edges == {
        IN: [("llm.think", 0, "prompt")],
        "llm.think": [("calc.run", 0, "tool_call")],
        "calc.run": [("llm.think", 1, "tool_result")],
    }
    assert p.buckets == frozenset()
    assert p.diamond_roots == {}
    assert p.slots == {}
    assert p.critical_slots == {
        ("llm.think", 0, "prompt"),
        ("llm.think", 1, "tool_result"),
        ("calc.run", 0, "tool_call"),
    }
    assert p.edge_rule == dict.fromkeys(p.edges, "A")
    assert p.seq_producers == {"llm.think"}
    assert p.root_nodes == frozenset()
    assert p.cycle_nodes == {"llm.think", "calc.run"}
    assert p.output_producers == {"answer": ("llm.think",), "step": ("llm.think",)}
    assert p.reach == {
        IN: {IN, "llm.think", "calc.run"},
        "llm.think": {"llm.think", "calc.run"},
        "calc.run": {"llm.think", "calc.run"},
    }
    assert p.max_iterations == 16
    assert p.specs["llm.think"].groups == (("prompt",), ("tool_result",))


def test_plan_helpers(fig3_plan: of.StaticPlan) -> None:
    assert fig3_plan.consumers("parse.run", "image") == [("vae.encode", 0), ("vit.encode", 0)]
    assert fig3_plan.consumers("parse.run", "nothing") == []
    d = fig3_plan.to_dict()
    assert d["buckets"][1] == {
        "node": "llm.generate",
        "or_group": 1,
        "diamond_root": "parse.run",
        "slots": [["vae_feat", "vae.encode"], ["vit_feat", "vit.encode"]],
        "critical": ["vae_feat", "vit_feat"],
    }
    assert d["nodes"][5]["activate_by_count"] == {"token": "ALL"}


def test_plans_pickle(fig3_plan: of.StaticPlan) -> None:
    """Worker processes receive NodeSpecs; ALL survives as the same singleton."""
    spec = fig3_plan.specs["diffusion.generate_image"]
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec
    assert again.count[0][1] is of.ALL


# -- diamond roots ------------------------------------------------------------------------------


def _chain_graph(make_role: RoleFactory, **extra: dict[str, Any]) -> of.Graph:
    """p.run (gen) yields x and y; a.run: x -> u; b.run: y -> v; plus ``extra`` roles' methods."""
    roles: dict[str, object] = {
        "p": make_role({"run": {"inputs_or": [["req"]], "outputs": ["x", "y"], "kind": "gen"}}),
        "a": make_role({"run": {"inputs_or": [["x"]], "outputs": ["u"], "kind": "gen"}}),
        "b": make_role({"run": {"inputs_or": [["y"]], "outputs": ["v"]}}),
    }
    for rname, decl in extra.items():
        roles[rname] = make_role({"run": decl})
    return of.Graph("g", roles=roles, inputs=[of.Placeholder("req")], outputs=["out"])


def test_root_of_two_sources_is_their_nearest_common_dominator(make_role: RoleFactory) -> None:
    g = _chain_graph(make_role, j={"inputs_or": [["u", "v"]], "outputs": ["out"]})
    plan = of.parse(g)
    assert plan.buckets == {("j.run", 0)}
    assert plan.diamond_roots == {("j.run", 0): "p.run"}
    assert plan.root_nodes == {"p.run"}


def test_collect_of_one_stream_roots_at_strict_dominator(make_role: RoleFactory) -> None:
    """A collect of one multi-yield producer gathers the whole stream: the root is above it."""
    g = _chain_graph(make_role, j={"inputs_or": [["u"]], "outputs": ["out"], "collect": ["u"]})
    plan = of.parse(g)
    assert plan.buckets == {("j.run", 0)}
    assert plan.slots[("j.run", 0)] == (("u", "a.run"),)
    assert plan.diamond_roots[("j.run", 0)] == "p.run"
    assert plan.critical_slots >= {("j.run", 0, "u")}


def test_source_that_dominates_the_other_is_the_root(make_role: RoleFactory) -> None:
    g = _chain_graph(make_role, j={"inputs_or": [["x", "u"]], "outputs": ["out"]})
    plan = of.parse(g)
    assert plan.diamond_roots[("j.run", 0)] == "p.run"  # p.run produces x and feeds a.run
    g2 = _chain_graph(make_role, j={"inputs_or": [["u", "x"]], "outputs": ["out"]})
    assert of.parse(g2).diamond_roots == plan.diamond_roots


def test_paths_meeting_only_at_entry_root_at_input(make_role: RoleFactory) -> None:
    g = of.Graph(
        "g",
        roles={
            "a": make_role({"run": {"inputs_or": [["req"]], "outputs": ["u"]}}),
            "b": make_role({"run": {"inputs_or": [["req"]], "outputs": ["v"]}}),
            "j": make_role({"run": {"inputs_or": [["u", "v"]], "outputs": ["out"]}}),
        },
        inputs=[of.Placeholder("req")],
        outputs=["out"],
    )
    assert of.parse(g).diamond_roots == {("j.run", 0): IN}


def test_placeholder_source_roots_at_input(make_role: RoleFactory) -> None:
    g = _chain_graph(make_role, j={"inputs_or": [["req", "u"]], "outputs": ["out"]})
    plan = of.parse(g)
    assert plan.diamond_roots[("j.run", 0)] == IN
    assert plan.slots[("j.run", 0)] == (("req", IN), ("u", "a.run"))


def test_field_with_two_producers_makes_a_bucket_with_no_critical_slot(
    make_role: RoleFactory,
) -> None:
    g = of.Graph(
        "g",
        roles={
            "a": make_role({"run": {"inputs_or": [["req"]], "outputs": ["u"]}}),
            "b": make_role({"run": {"inputs_or": [["req"]], "outputs": ["u"]}}),
            "j": make_role({"run": {"inputs_or": [["u"]], "outputs": ["out"]}}),
        },
        inputs=[of.Placeholder("req")],
        outputs=["out"],
    )
    plan = of.parse(g)
    assert plan.buckets == {("j.run", 0)}
    assert plan.slots[("j.run", 0)] == (("u", "a.run"), ("u", "b.run"))
    assert ("j.run", 0, "u") not in plan.critical_slots
    assert plan.producers["u"] == ("a.run", "b.run")


def test_join_node_roots_at_input_even_with_one_source(make_role: RoleFactory) -> None:
    g = _chain_graph(
        make_role, j={"inputs_or": [["u"]], "outputs": ["out"], "activate_by_count": {"u": 2}}
    )
    plan = of.parse(g)
    assert plan.diamond_roots == {("j.run", 0): IN}
    assert plan.specs["j.run"].count == (("u", 2),)


# -- parse() entry points -----------------------------------------------------------------------


def test_parse_forms(fig3_plan: of.StaticPlan) -> None:
    path = GRAPHS / "fig3.py"
    by_path = of.parse(str(path))
    assert list(by_path) == ["fig3"]
    assert by_path["fig3"] == fig3_plan
    assert of.parse(path)["fig3"] == fig3_plan
    graph = of.load_graphs(path)[0]
    module = sys.modules[type(graph.roles["parse"]).__module__]
    assert of.parse(module) == by_path
    assert of.parse(module.graph) == fig3_plan
    assert fig3_plan.module == str(path)


def test_parse_dotted_module_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mygraphs_for_test.py").write_text(
        "import omniflow as of\n"
        "class E(of.Role):\n"
        "    @of.interface(inputs_or=[['x']], outputs=['y'])\n"
        "    async def run(self, x):\n"
        "        return {'y': x}\n"
        "g = of.Graph('e', roles={'e': E()}, inputs=[of.Placeholder('x')], outputs=['y'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plans = of.parse("mygraphs_for_test")
    assert list(plans) == ["e"]
    assert plans["e"].module == str(tmp_path / "mygraphs_for_test.py")  # workers import by path


def test_shared_role_across_graphs_via_roleref(make_role: RoleFactory) -> None:
    enc = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    g1 = of.Graph(
        "one",
        roles={"enc": enc},
        inputs=[of.Placeholder("x")],
        outputs=["y"],
        params=[of.GlobalParameters("hist", factory=list)],
    )
    g2 = of.Graph(
        "two",
        roles={"enc": of.RoleRef("enc")},
        inputs=[of.Placeholder("x")],
        outputs=["y"],
        params=[of.GlobalParametersRef("hist")],
    )
    plans = of.parse_graphs([g1, g2])
    assert plans["two"].roles["enc"] is enc
    assert plans["two"].params["hist"] is plans["one"].params["hist"]
    assert of.parse(g2, others=[g1]) == plans["two"]
    # The same instance under the same name in two graphs is fine, too.
    g3 = of.Graph("three", roles={"enc": enc}, inputs=[of.Placeholder("x")], outputs=["y"])
    assert set(of.parse_graphs([g1, g3])) == {"one", "three"}


def test_parse_of_a_signature_with_named_params(make_role: RoleFactory) -> None:
    role = make_role(
        {
            "run": {
                "inputs_or": [["a"], ["b", "c"]],
                "outputs": ["y"],
                "params": ("a=None", "b=None", "c=None"),
            }
        }
    )
    g = of.Graph("g", roles={"r": role}, inputs=[of.Placeholder(f) for f in "abc"], outputs=["y"])
    assert of.parse(g).specs["r.run"] == NodeSpec(
        name="r.run",
        role="r",
        method="run",
        groups=(("a",), ("b", "c")),
        outputs=("y",),
        lb="round_robin",
        collect=frozenset(),
        count=(),
        is_generator=False,
        max_concurrency=None,
    )


# -- every GraphError, naming graph, node and field ---------------------------------------------


def _graph(
    roles: dict[str, object],
    inputs: tuple[str, ...] = ("x",),
    outputs: tuple[str, ...] = (),
    name: str = "g",
    **kw: Any,
) -> of.Graph:
    return of.Graph(
        name, roles=roles, inputs=[of.Placeholder(i) for i in inputs], outputs=outputs, **kw
    )


def _raises(target: of.Graph | Any, *fragments: str, **attrs: Any) -> of.GraphError:
    with pytest.raises(of.GraphError) as info:
        of.parse(target)
    err = info.value
    for frag in fragments:
        assert frag in str(err), (frag, str(err))
    for k, v in attrs.items():
        assert getattr(err, k) == v, (k, getattr(err, k), v)
    return err


def test_input_with_no_producer(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x", "image"]], "outputs": ["y"]}})
    _raises(
        _graph({"vit": role}),
        "graph 'g'",
        "node 'vit.run'",
        "input 'image' has no producer",
        "Placeholder('image')",
        graph="g",
        node="vit.run",
        field="image",
    )


def test_graph_output_nobody_produces(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    _raises(
        _graph({"r": role}, outputs=("y", "picture")),
        "graph 'g'",
        "graph output 'picture' is produced by no node",
        field="picture",
    )


def test_graph_output_that_is_only_a_placeholder(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    _raises(
        _graph({"r": role}, outputs=("x",)),
        "graph 'g'",
        "graph output 'x' is only a Placeholder",
        field="x",
    )


def test_graph_output_named_twice(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    _raises(_graph({"r": role}, outputs=("y", "y")), "graph 'g'", "'y' twice", field="y")


def test_non_async_interface(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"], "kind": "sync"}})
    _raises(_graph({"r": role}), "graph 'g'", "node 'r.run'", "not async", node="r.run")


def test_empty_or_group(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"], []], "outputs": ["y"]}})
    _raises(_graph({"r": role}), "graph 'g'", "node 'r.run'", "OR group 1 is empty", node="r.run")


def test_empty_inputs_or(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [], "outputs": ["y"]}})
    _raises(_graph({"r": role}), "node 'r.run'", "inputs_or is empty", node="r.run")


def test_field_twice_in_one_group(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x", "x"]], "outputs": ["y"]}})
    _raises(_graph({"r": role}), "node 'r.run'", "names a field twice", node="r.run")


def test_output_twice(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y", "y"]}})
    _raises(_graph({"r": role}), "node 'r.run'", "outputs name a field twice", node="r.run")


def test_cycle_with_no_entry_can_never_fire(make_role: RoleFactory) -> None:
    roles = {
        "start": make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}}),
        "a": make_role({"run": {"inputs_or": [["ping"]], "outputs": ["pong"]}}),
        "b": make_role({"run": {"inputs_or": [["pong"]], "outputs": ["ping"]}}),
    }
    err = _raises(_graph(roles), "graph 'g'", "can never fire", "cycle")
    assert err.node in ("a.run", "b.run")
    assert err.field in ("ping", "pong")
    assert f"node '{err.node}'" in str(err)
    assert f"'{err.field}'" in str(err)


def test_node_that_needs_its_own_output_can_never_fire(make_role: RoleFactory) -> None:
    roles = {
        "start": make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}}),
        "loop": make_role({"run": {"inputs_or": [["y", "acc"]], "outputs": ["acc"]}}),
    }
    _raises(
        _graph(roles),
        "node 'loop.run' can never fire",
        "'acc'",
        node="loop.run",
        field="acc",
    )


def test_cycle_with_an_entry_is_fine(make_role: RoleFactory) -> None:
    roles = {"loop": make_role({"run": {"inputs_or": [["x"], ["acc"]], "outputs": ["acc"]}})}
    plan = of.parse(_graph(roles, outputs=("acc",)))
    assert plan.cycle_nodes == {"loop.run"}
    assert ("loop.run", "acc", "loop.run", 1) in plan.edges


@pytest.mark.parametrize("what", ["collect", "activate_by_count"])
def test_collect_or_count_naming_a_non_input(make_role: RoleFactory, what: str) -> None:
    decl: dict[str, Any] = {"inputs_or": [["x"]], "outputs": ["y"]}
    decl[what] = ["image"] if what == "collect" else {"image": of.ALL}
    role = make_role({"run": decl})
    _raises(
        _graph({"r": role}),
        "graph 'g'",
        "node 'r.run'",
        f"{what} names 'image', which is not an input",
        node="r.run",
        field="image",
    )


def test_count_field_also_collected(make_role: RoleFactory) -> None:
    decl = {"inputs_or": [["x"]], "outputs": ["y"], "collect": ["x"], "activate_by_count": {"x": 2}}
    role = make_role({"run": decl})
    _raises(_graph({"r": role}), "node 'r.run'", "both collect and activate_by_count", field="x")


def test_unknown_lb(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"], "lb": "fastest"}})
    _raises(
        _graph({"r": role}),
        "graph 'g'",
        "node 'r.run'",
        "unknown lb 'fastest'",
        "round_robin, session, broadcast",
        node="r.run",
    )


def test_signature_missing_a_group_field(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x", "image"]], "outputs": ["y"], "params": ("x",)}})
    _raises(
        _graph({"r": role}, inputs=("x", "image")),
        "graph 'g'",
        "node 'r.run'",
        "no parameter 'image'",
        node="r.run",
        field="image",
    )


def test_signature_requires_a_param_outside_the_group(make_role: RoleFactory) -> None:
    decl = {"inputs_or": [["x"], ["image"]], "outputs": ["y"], "params": ("x", "image=None")}
    role = make_role({"run": decl})
    _raises(
        _graph({"r": role}, inputs=("x", "image")),
        "node 'r.run'",
        "OR group 1 ['image'] does not provide required parameter 'x'",
        node="r.run",
        field="x",
    )


def test_signature_with_kwargs_accepts_every_group(make_role: RoleFactory) -> None:
    decl = {"inputs_or": [["x"], ["image"]], "outputs": ["y"], "params": ("x=None", "**rest")}
    role = make_role({"run": decl})
    assert of.parse(_graph({"r": role}, inputs=("x", "image"))).nodes == ("r.run",)


def test_var_positional_and_defaulted_positional_only_parameters_are_ignored(
    make_role: RoleFactory,
) -> None:
    """Fields are passed by keyword: ``*args`` and a positional-only parameter with a default
    never receive one, and do not make the node unfireable."""
    decl = {"inputs_or": [["x"]], "outputs": ["y"], "params": ("p=0", "/", "*rest", "x")}
    role = make_role({"run": decl})
    assert of.parse(_graph({"r": role})).nodes == ("r.run",)


def test_positional_only_parameter(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"], "params": ("x", "/")}})
    _raises(_graph({"r": role}), "node 'r.run'", "positional-only", node="r.run")


def test_count_with_two_or_groups(make_role: RoleFactory) -> None:
    decl = {"inputs_or": [["x"], ["z"]], "outputs": ["y"], "activate_by_count": {"x": of.ALL}}
    role = make_role({"run": decl})
    _raises(
        _graph({"r": role}, inputs=("x", "z")),
        "graph 'g'",
        "node 'r.run'",
        "exactly one OR group",
        node="r.run",
    )


def test_roleref_resolving_nowhere(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    _raises(
        _graph({"r": role, "enc": of.RoleRef("encoder")}),
        "graph 'g'",
        "RoleRef('encoder')",
        "resolves nowhere",
        graph="g",
    )


def test_role_name_bound_to_two_instances(make_role: RoleFactory) -> None:
    decl = {"run": {"inputs_or": [["x"]], "outputs": ["y"]}}
    g1 = _graph({"enc": make_role(decl)}, name="one")
    g2 = _graph({"enc": make_role(decl)}, name="two")
    with pytest.raises(of.GraphError, match="role name 'enc' is bound to two different") as info:
        of.parse_graphs([g1, g2])
    assert info.value.graph == "two"
    assert "graph 'two'" in str(info.value)
    assert "RoleRef" in str(info.value)


def test_conflicting_global_parameters_factories(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    g1 = _graph({"r": role}, name="one", params=[of.GlobalParameters("hist", factory=list)])
    g2 = _graph({"r": role}, name="two", params=[of.GlobalParameters("hist", factory=dict)])
    with pytest.raises(of.GraphError, match="GlobalParameters 'hist' is declared with two") as e:
        of.parse_graphs([g1, g2])
    assert "graph 'two'" in str(e.value)
    assert "GlobalParametersRef" in str(e.value)


def test_global_parameters_declared_twice_in_one_graph(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    p = of.GlobalParameters("hist", factory=list)
    _raises(_graph({"r": role}, params=[p, p]), "graph 'g'", "'hist' is declared twice")


def test_global_parameters_ref_resolving_nowhere(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    _raises(
        _graph({"r": role}, params=[of.GlobalParametersRef("hist")]),
        "graph 'g'",
        "GlobalParametersRef('hist') resolves nowhere",
    )


def test_two_graphs_with_one_name(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    with pytest.raises(of.GraphError, match="two different graphs are named 'g'"):
        of.parse_graphs([_graph({"r": role}), _graph({"r": role})])


def test_duplicate_placeholder(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    _raises(_graph({"r": role}, inputs=("x", "x")), "Placeholder 'x' is declared twice", field="x")


def test_role_without_interfaces() -> None:
    _raises(_graph({"r": of.Role()}), "graph 'g'", "role 'r' (Role) declares no")


def test_role_given_as_a_class(make_role: RoleFactory) -> None:
    cls = type(make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}}))
    _raises(_graph({"r": cls}), "graph 'g'", "role 'r' is the class Dyn, not an instance", "Dyn()")


def test_role_name_that_is_not_an_identifier(make_role: RoleFactory) -> None:
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    _raises(_graph({"my-role": role}), "graph 'g'", "'my-role' is not a Python identifier")


def test_duplicate_node_names_are_impossible_but_checked(make_role: RoleFactory) -> None:
    """Role names are identifier dict keys and method names unique per role, so two nodes cannot
    share a name (the parser asserts it as an invariant). A dict of roles keeps one per key."""
    role = make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"]}})
    g = _graph({"r": role})
    assert of.parse(g).nodes == ("r.run",)


def test_parse_of_something_else() -> None:
    with pytest.raises(of.GraphError, match="takes a Graph, a module or a path"):
        of.parse(42)  # type: ignore[call-overload]
    with pytest.raises(of.GraphError, match=r"expected omniflow\.Graph objects"):
        of.parse_graphs(["g"])  # type: ignore[list-item]


def test_module_with_no_graph(tmp_path: Path) -> None:
    f = tmp_path / "empty_graphs.py"
    f.write_text("import omniflow as of\nx = 1\n")
    err = _raises(str(f), "defines no omniflow.Graph", "graph = omniflow.Graph(")
    assert "empty_graphs" in str(err)


def test_parse_of_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    _raises(str(missing), f"graph file '{missing}' does not exist")
    _raises(missing, "does not exist")
    _raises(str(tmp_path), "is not a file")


def test_parse_of_an_unimportable_module() -> None:
    _raises("no_such_module_omniflow_test", "cannot import graph module", "No module named")


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("raise RuntimeError('boom')\n", "RuntimeError('boom')"),
        ("def broken(:\n", "SyntaxError"),
    ],
)
def test_graph_file_that_fails_to_import(tmp_path: Path, source: str, fragment: str) -> None:
    f = tmp_path / "bad_graphs.py"
    f.write_text(source)
    err = _raises(str(f), f"importing graph file '{f}' failed", fragment)
    assert isinstance(err.__cause__, Exception)
    assert not any(name.endswith("bad_graphs") for name in sys.modules)


def test_graph_file_whose_declaration_is_invalid(tmp_path: Path) -> None:
    f = tmp_path / "bad_decl.py"
    f.write_text(
        "import omniflow as of\n"
        "class E(of.Role):\n"
        "    @of.interface(inputs_or=['x'], outputs=['y'])\n"
        "    async def run(self, x):\n"
        "        return {}\n"
    )
    _raises(str(f), "each OR group must be a list of field names, got 'x'")


def test_dotted_module_that_fails_to_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "raising_graphs_for_test.py").write_text("raise KeyError('weights')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _raises("raising_graphs_for_test", "importing graph module", "KeyError('weights')")
    assert isinstance(err.__cause__, KeyError)
