"""Compute Flow: engines that run models, with their KV cache in a ``ParamsPool``.

>>> import omniflow as of
>>> of.SamplingParams(max_new_tokens=8, temperature=0.0).greedy
True

``Engine`` is the interface; ``TorchEngine`` is our own continuous-batching engine for
Llama-family checkpoints (Llama, Qwen2, Mistral) in Hugging Face format; ``DiTEngine`` denoises
images on the same base (``EngineBase``: loading, pool, step loop), its attention reading the
LLM's KV pages in place. ``EncoderCache`` keeps encoder outputs across requests.
"""

from omniflow.compute._colocate import KvPoolBarrier, PoolSeat, pages_that_fit
from omniflow.compute._dit_engine import DenoiseOutput, DenoiseRequest, DiTEngine
from omniflow.compute._encoder_cache import EncoderCache
from omniflow.compute._engine import Engine, PublishedPrefix, TorchEngine
from omniflow.compute._errors import EngineError, EngineProcessError, ModelLoadError, RequestError
from omniflow.compute._request import GenerateRequest, SamplingParams, StepOutput
from omniflow.compute._shared import SkipCopyBuffer, SkipCopyParameter, shared_module

__all__ = [
    "DenoiseOutput",
    "DenoiseRequest",
    "DiTEngine",
    "EncoderCache",
    "Engine",
    "EngineError",
    "EngineProcessError",
    "GenerateRequest",
    "KvPoolBarrier",
    "ModelLoadError",
    "PoolSeat",
    "PublishedPrefix",
    "RequestError",
    "SamplingParams",
    "SkipCopyBuffer",
    "SkipCopyParameter",
    "StepOutput",
    "TorchEngine",
    "pages_that_fit",
    "shared_module",
]
