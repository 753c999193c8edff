"""Type aliases shared across omniflow's layers."""

from __future__ import annotations

from typing import Any, TypeAlias

#: A field name: the unit by which node outputs are matched to node inputs.
Field: TypeAlias = str
#: A node name, ``"<role>.<method>"``, or one of the pseudo nodes below.
NodeName: TypeAlias = str
#: A frame as a node returns or yields it: a subset of the node's declared outputs.
FrameDict: TypeAlias = dict[str, Any]

#: The pseudo node that stands for a graph's Placeholders (its external inputs).
INPUT: NodeName = "<input>"
#: The pseudo node that stands for the caller (receives the graph's outputs).
OUTPUT: NodeName = "<output>"
