"""``omniflow plan``: print the static plan of the graphs a module declares.

    $ omniflow plan graphs/fig3.py                      # readable table
    $ omniflow plan graphs/fig3.py --format json        # StaticPlan.to_dict() by graph name
    $ omniflow plan graphs/fig3.py --format dot | dot -Tsvg > fig3.svg

The renderers are pure functions of the plans, so tests call them directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from omniflow._exceptions import GraphError
from omniflow._loader import parse
from omniflow._types import INPUT, OUTPUT
from omniflow.dsl._role import _All
from omniflow.plan import StaticPlan
from omniflow.plan._plan import NodeSpec

if TYPE_CHECKING:
    from omniflow.cli import Subparsers

__all__ = ["load_plans", "register", "render_dot", "render_json", "render_table"]

FORMATS = ("table", "json", "dot")


def register(subparsers: Subparsers) -> None:
    """Add ``omniflow plan`` to the command line."""
    p = subparsers.add_parser(
        "plan",
        help="print the static plan (buckets, diamond roots, critical slots) of a graph file",
        description="Compile the module-level omniflow.Graph objects of a .py file (or an "
        "importable module) and print their static plans.",
    )
    p.add_argument(
        "target",
        metavar="GRAPH_FILE",
        help="a .py file, or an importable module name, that defines omniflow.Graph objects",
    )
    p.add_argument("--graph", "-g", metavar="NAME", help="only the graph with this name")
    p.add_argument(
        "--format", "-f", choices=FORMATS, default="table", help="output format (default: table)"
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    plans = load_plans(args.target, args.graph)
    sys.stdout.write(RENDERERS[args.format](plans))
    sys.stdout.flush()
    return 0


def load_plans(target: str, graph: str | None = None) -> dict[str, StaticPlan]:
    """The plans of ``target`` by graph name, or only ``graph``'s; GraphError names the fix."""
    plans = parse(target)
    if graph is None:
        return plans
    if graph not in plans:
        raise GraphError(
            f"'{target}' defines no graph named '{graph}'; its graphs are "
            f"{', '.join(repr(n) for n in plans)} (pass one of them to --graph)"
        )
    return {graph: plans[graph]}


# -- table ---------------------------------------------------------------------------------


def _count_text(spec: NodeSpec) -> str:
    return ", ".join(f"{f}={'ALL' if isinstance(n, _All) else n}" for f, n in spec.count)


def _flags(plan: StaticPlan, spec: NodeSpec) -> list[str]:
    flags = []
    if spec.is_generator:
        flags.append("generator")
    if spec.lb == "session":
        flags.append("session")
    if spec.name in plan.cycle_nodes:
        flags.append("on-cycle")
    if spec.name in plan.root_nodes:
        flags.append("diamond-root")
    return flags


def _table_one(plan: StaticPlan) -> list[str]:
    out = [f"graph '{plan.graph}'"]
    out.append(f"  inputs:  {', '.join(plan.inputs) or '(none)'}")
    outs = [f"{f} <- {', '.join(plan.output_producers[f])}" for f in plan.outputs]
    out.append(f"  outputs: {'; '.join(outs) or '(none)'}")
    if plan.params:
        out.append(f"  params:  {', '.join(plan.params)}")
    if plan.cycle_nodes:
        out.append(f"  max_iterations: {plan.max_iterations} (per call, per node on a cycle)")

    out += ["", "  nodes"]
    for n in plan.nodes:
        spec = plan.specs[n]
        flags = "  ".join(_flags(plan, spec))
        out.append(f"    {n}  lb={spec.lb}" + (f"  [{flags}]" if flags else ""))
        for gi, grp in enumerate(spec.groups):
            line = f"      or {gi}: {' & '.join(grp)}"
            collected = [f for f in grp if f in spec.collect]
            if collected:
                line += f"  collect={','.join(collected)}"
            if spec.count:
                line += f"  activate_by_count {_count_text(spec)}"
            if (n, gi) in plan.buckets:
                line += f"  (bucket, root {plan.diamond_roots[(n, gi)]})"
            out.append(line)
        out.append(f"      ->   {', '.join(spec.outputs) or '(no outputs)'}")

    out += ["", "  buckets"]
    if not plan.buckets:
        out.append("    (none: every node fires once per arriving frame)")
    for n, gi in sorted(plan.buckets, key=lambda b: (plan.nodes.index(b[0]), b[1])):
        out.append(f"    {n} or {gi}  root={plan.diamond_roots[(n, gi)]}")
        for f, src in plan.slots[(n, gi)]:
            crit = "  critical" if (n, gi, f) in plan.critical_slots else ""
            out.append(f"      {f} <- {src}{crit}")

    out += ["", "  critical slots (field with exactly one upstream path)"]
    for n, gi, f in sorted(plan.critical_slots, key=lambda c: (plan.nodes.index(c[0]), c[1:])):
        src = plan.producers[f][0]
        where = "  [bucket]" if (n, gi) in plan.buckets else ""
        out.append(f"    {n} or {gi}: {f} <- {src}{where}")
    return out


def render_table(plans: Mapping[str, StaticPlan]) -> str:
    """A readable text rendering: nodes, buckets with roots and slots, critical slots."""
    blocks = ["\n".join(_table_one(p)) for p in plans.values()]
    return "\n\n".join(blocks) + "\n"


# -- json ----------------------------------------------------------------------------------


def render_json(plans: Mapping[str, StaticPlan]) -> str:
    """``{graph name: StaticPlan.to_dict()}`` as indented JSON."""
    return json.dumps({name: p.to_dict() for name, p in plans.items()}, indent=2) + "\n"


# -- dot -----------------------------------------------------------------------------------


def _q(text: str) -> str:
    """A DOT quoted string (``\\n`` line breaks stay line breaks)."""
    lines = text.split("\n")
    return '"' + "\\n".join(ln.replace("\\", "\\\\").replace('"', '\\"') for ln in lines) + '"'


def _attrs(**attrs: str) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in attrs.items()) + "]"


def _dot_one(plan: StaticPlan, ind: str) -> list[str]:
    def nid(node: str) -> str:
        return _q(f"{plan.graph}/{node}")

    out = [
        f"{ind}{nid(INPUT)} "
        + _attrs(label="<input>\n" + "\n".join(plan.inputs), shape="oval", style="dashed"),
        f"{ind}{nid(OUTPUT)} "
        + _attrs(label="<output>\n" + "\n".join(plan.outputs), shape="oval", style="dashed"),
    ]
    for n in plan.nodes:
        spec = plan.specs[n]
        flags = [f for f in _flags(plan, spec) if f != "session"]  # lb=session says it
        lines = [n, f"lb={spec.lb}" + "".join(f" {f}" for f in flags)]
        attrs = {"shape": "box"}
        for gi in range(len(spec.groups)):
            if (n, gi) in plan.buckets:
                lines.append(f"bucket g{gi} root={plan.diamond_roots[(n, gi)]}")
                attrs.update(peripheries="2", style="filled", fillcolor="lightyellow")
        if spec.count:
            lines.append(f"activate_by_count {_count_text(spec)}")
        if spec.collect:
            lines.append(f"collect {', '.join(sorted(spec.collect))}")
        out.append(f"{ind}{nid(n)} " + _attrs(label="\n".join(lines), **attrs))
    for src, f, dst, gi in sorted(plan.edges):
        label = f if len(plan.specs[dst].groups) == 1 else f"{f} [g{gi}]"
        attrs = {"label": label}
        if (dst, gi, f) in plan.critical_slots:
            attrs["style"] = "bold"
            if (dst, gi) in plan.buckets:
                attrs.update(color="red", fontcolor="red", penwidth="2")
        out.append(f"{ind}{nid(src)} -> {nid(dst)} " + _attrs(**attrs))
    for f in plan.outputs:
        for src in plan.output_producers[f]:
            out.append(f"{ind}{nid(src)} -> {nid(OUTPUT)} " + _attrs(label=f, style="dashed"))
    return out


_LEGEND = (
    "double border: bucket (root = diamond root); red bold edge: critical slot of a bucket "
    "(UNREACHABLE there kills the bucket); bold edge: field with one upstream path"
)


def render_dot(plans: Mapping[str, StaticPlan]) -> str:
    """Graphviz source: one digraph, a cluster per graph when there are several."""
    name = next(iter(plans)) if len(plans) == 1 else "omniflow"
    out = [
        f"digraph {_q(name)} {{",
        "  rankdir=TB;",
        '  node [fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=9];',
        f"  label={_q(_LEGEND)}; labelloc=b; fontsize=9;",
    ]
    if len(plans) == 1:
        out += _dot_one(next(iter(plans.values())), "  ")
    else:
        for i, plan in enumerate(plans.values()):
            out.append(f"  subgraph cluster_{i} {{")
            out.append(f"    label={_q(f'graph {plan.graph}')}; labelloc=t; fontsize=12;")
            out += _dot_one(plan, "    ")
            out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"


RENDERERS: dict[str, Callable[[Mapping[str, StaticPlan]], str]] = {
    "table": render_table,
    "json": render_json,
    "dot": render_dot,
}
