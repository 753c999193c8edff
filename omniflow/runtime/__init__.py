"""The control-flow runtime: call cores (pure scheduling) behind an asyncio shell."""

from omniflow.runtime._call import Call, Frame
from omniflow.runtime._runtime import Runtime, RuntimeState
from omniflow.runtime.callcore._core import Activation, CallCore

__all__ = ["Activation", "Call", "CallCore", "Frame", "Runtime", "RuntimeState"]
