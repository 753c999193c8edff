"""omniflow: serve multimodal any-to-any inference pipelines as dataflow graphs.

>>> import omniflow as of
>>> class Upper(of.Role):
...     @of.interface(inputs_or=[["text"]], outputs=["upper"])
...     async def run(self, text):
...         return {"upper": text.upper()}
>>> graph = of.Graph("upper", roles={"up": Upper()},
...                  inputs=[of.Placeholder("text")], outputs=["upper"])
>>> of.parse(graph).nodes
('up.run',)
"""

from omniflow._exceptions import (
    DataError,
    DataTimeoutError,
    GraphError,
    InputError,
    NodeError,
    OmniflowError,
    RegistryError,
    RuntimeClosedError,
    TransportError,
)
from omniflow.dsl import (
    ALL,
    ActivationContext,
    GlobalParameters,
    GlobalParametersRef,
    Graph,
    Placeholder,
    Role,
    RoleRef,
    context,
    interface,
)
from omniflow.plan import StaticPlan, load_graphs, parse, parse_graphs
from omniflow.runtime import Call, Deploy, Frame, Runtime

__version__ = "0.1.0"

__all__ = [
    "ALL",
    "ActivationContext",
    "Call",
    "DataError",
    "DataTimeoutError",
    "Deploy",
    "Frame",
    "GlobalParameters",
    "GlobalParametersRef",
    "Graph",
    "GraphError",
    "InputError",
    "NodeError",
    "OmniflowError",
    "Placeholder",
    "RegistryError",
    "Role",
    "RoleRef",
    "Runtime",
    "RuntimeClosedError",
    "StaticPlan",
    "TransportError",
    "context",
    "interface",
    "load_graphs",
    "parse",
    "parse_graphs",
]
