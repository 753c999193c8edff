"""Compute Flow: engines that run models, with their KV cache in a ``ParamsPool``.

>>> import omniflow as of
>>> of.SamplingParams(max_new_tokens=8, temperature=0.0).greedy
True

``Engine`` is the interface; ``TorchEngine`` is our own continuous-batching engine for
Llama-family checkpoints (Llama, Qwen2, Mistral) in Hugging Face format. ``EncoderCache`` keeps
encoder outputs across requests.
"""

from omniflow.compute._colocate import KvPoolBarrier, pages_that_fit
from omniflow.compute._encoder_cache import EncoderCache
from omniflow.compute._engine import Engine, TorchEngine
from omniflow.compute._errors import EngineError, ModelLoadError, RequestError
from omniflow.compute._request import GenerateRequest, SamplingParams, StepOutput
from omniflow.compute._shared import SkipCopyBuffer, SkipCopyParameter, shared_module

__all__ = [
    "EncoderCache",
    "Engine",
    "EngineError",
    "GenerateRequest",
    "KvPoolBarrier",
    "ModelLoadError",
    "RequestError",
    "SamplingParams",
    "SkipCopyBuffer",
    "SkipCopyParameter",
    "StepOutput",
    "TorchEngine",
    "pages_that_fit",
    "shared_module",
]
