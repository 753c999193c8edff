"""The control-flow runtime: call cores (pure scheduling) behind an asyncio shell."""

from omniflow.runtime._call import Call, Frame
from omniflow.runtime._core import Activation, CallCore
from omniflow.runtime._placement import Deploy
from omniflow.runtime._ray_plan import Ray
from omniflow.runtime._runtime import Runtime, RuntimeState

__all__ = ["Activation", "Call", "CallCore", "Deploy", "Frame", "Ray", "Runtime", "RuntimeState"]
