"""Static planning: Graph declarations -> StaticPlan. Compiles only (no file is imported here;
``omniflow.load_graphs`` / ``omniflow.parse(path)`` load graph files, in ``omniflow._loader``)."""

from omniflow.plan._parser import parse_graphs
from omniflow.plan._plan import NodeSpec, StaticPlan

__all__ = ["NodeSpec", "StaticPlan", "parse_graphs"]
