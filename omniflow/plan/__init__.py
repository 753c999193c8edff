"""The compiler from declarations to the static plan. Pure Python, no I/O beyond imports."""

from omniflow.plan._parser import load_graphs, parse, parse_graphs
from omniflow.plan._plan import NodeSpec, StaticPlan

__all__ = ["NodeSpec", "StaticPlan", "load_graphs", "parse", "parse_graphs"]
