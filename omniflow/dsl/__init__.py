"""The declaration layer: roles, interfaces, graphs. Pure Python, no I/O."""

from omniflow.dsl._context import ActivationContext, context
from omniflow.dsl._graph import (
    GlobalParameters,
    GlobalParametersRef,
    Graph,
    Placeholder,
    RoleRef,
)
from omniflow.dsl._role import ALL, LB_POLICIES, InterfaceSpec, Role, interface, interfaces_of

__all__ = [
    "ALL",
    "LB_POLICIES",
    "ActivationContext",
    "GlobalParameters",
    "GlobalParametersRef",
    "Graph",
    "InterfaceSpec",
    "Placeholder",
    "Role",
    "RoleRef",
    "context",
    "interface",
    "interfaces_of",
]
