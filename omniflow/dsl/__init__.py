"""The declaration layer: roles, interfaces, graphs. Pure Python, no I/O."""

from omniflow.dsl._context import ActivationContext, batch_contexts, context
from omniflow.dsl._graph import (
    GlobalParameters,
    GlobalParametersRef,
    Graph,
    Placeholder,
    RoleRef,
)
from omniflow.dsl._role import (
    ALL,
    LB_POLICIES,
    Batch,
    InterfaceSpec,
    Role,
    interface,
    interfaces_of,
)

__all__ = [
    "ALL",
    "LB_POLICIES",
    "ActivationContext",
    "Batch",
    "GlobalParameters",
    "GlobalParametersRef",
    "Graph",
    "InterfaceSpec",
    "Placeholder",
    "Role",
    "RoleRef",
    "batch_contexts",
    "context",
    "interface",
    "interfaces_of",
]
