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
    MediaError,
    NodeError,
    OmniflowError,
    PoolExhaustedError,
    RegistryError,
    RuntimeClosedError,
    StartError,
    TransportError,
)
from omniflow._loader import load_graphs, parse
from omniflow._media import Audio, Image
from omniflow.cluster import Deploy, Ray
from omniflow.data.kv import Match, PageLayout, ParamsPool, chain_hashes
from omniflow.dsl import (
    ALL,
    ActivationContext,
    Batch,
    GlobalParameters,
    GlobalParametersRef,
    Graph,
    Placeholder,
    Role,
    RoleRef,
    batch_contexts,
    context,
    interface,
)
from omniflow.plan import StaticPlan, parse_graphs
from omniflow.runtime import Call, Frame, Runtime

__version__ = "0.1.0"

__all__ = [
    "ALL",
    "ActivationContext",
    "Audio",
    "Batch",
    "Call",
    "DataError",
    "DataTimeoutError",
    "DenoiseOutput",
    "DenoiseRequest",
    "Deploy",
    "DiTEngine",
    "EncoderCache",
    "Engine",
    "EngineError",
    "EngineProcessError",
    "Frame",
    "GenerateRequest",
    "GlobalParameters",
    "GlobalParametersRef",
    "Graph",
    "GraphError",
    "Image",
    "InputError",
    "KvPoolBarrier",
    "Match",
    "MediaError",
    "ModelLoadError",
    "NodeError",
    "OmniflowError",
    "PageLayout",
    "ParamsPool",
    "Placeholder",
    "PoolExhaustedError",
    "PublishedPrefix",
    "Ray",
    "RegistryError",
    "RequestError",
    "Role",
    "RoleRef",
    "Runtime",
    "RuntimeClosedError",
    "SamplingParams",
    "SkipCopyBuffer",
    "SkipCopyParameter",
    "StartError",
    "StaticPlan",
    "StepOutput",
    "TorchEngine",
    "TransportError",
    "batch_contexts",
    "chain_hashes",
    "context",
    "interface",
    "load_graphs",
    "pages_that_fit",
    "parse",
    "parse_graphs",
    "shared_module",
]

#: Compute Flow names (those of ``__all__`` not imported above), imported on first use so
#: ``import omniflow`` does not load torch.
_COMPUTE = frozenset(__all__) - frozenset(globals())


def __getattr__(name: str) -> object:
    if name == "roles":  # of.roles.Asr / Ocr / Tts: their model packages load in setup()
        import omniflow.roles

        return omniflow.roles
    if name in _COMPUTE:
        from omniflow import compute

        value = getattr(compute, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'omniflow' has no attribute {name!r}")
