"""The activation context: what a running interface method may ask about itself.

>>> import omniflow as of
>>> class Chat(of.Role):
...     @of.interface(inputs_or=[["msg"]], outputs=["reply"])
...     async def answer(self, msg):
...         history = of.context().params["history"]
...         history.append(msg)
...         return {"reply": len(history)}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from omniflow._exceptions import OmniflowError

__all__ = [
    "ActivationContext",
    "Colocation",
    "batch_contexts",
    "colocation",
    "context",
    "role_pools",
]


@dataclass(frozen=True, slots=True)
class ActivationContext:
    """Identity of one activation of one node within one call."""

    #: Graph name.
    graph: str
    #: Session id of the call (None for session-less calls).
    session: str | None
    #: Id of the graph call.
    call_id: str
    #: Node name, "<role>.<method>".
    node: str
    #: Index of the OR group that fired.
    or_group: int
    #: The session's GlobalParameters by name.
    params: dict[str, Any]
    #: Position of the activation's input in its originating stream.
    seq: int
    #: Activation id, unique within the call: the front's int, or, for a run one worker
    #: started on another (the cross-process fast path), its wire id (a str).
    aid: int | str
    #: The graph's Params Pools by name (``omniflow.ParamsPool``); pages allocated with
    #: ``owner=call_id`` are released by the runtime when the call ends.
    pools: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


#: Set by the runtime around every activation: an ActivationContext, a cheap handle whose
#: ``activation_context()`` builds one, or a tuple ``(builder, *args)`` (most methods never ask,
#: so the context is built only on demand).
_current: ContextVar[Any] = ContextVar("omniflow_activation")
#: Set by the runtime around a role's ``setup()``: that role's ``pools`` (so an engine started
#: there resolves ``pool="name"`` as it would inside a method).
_setup_pools: ContextVar[Mapping[str, Any] | None] = ContextVar(
    "omniflow_setup_pools", default=None
)


#: Set by the runtime around a batched method (``batch=``): what ``_current`` would hold for
#: each activation of the batch, in the batch's order.
_batch: ContextVar[tuple[Any, ...] | None] = ContextVar("omniflow_batch", default=None)


@dataclass(frozen=True, slots=True)
class Colocation:
    """Where a role's process sits: what a co-located pool's barrier needs to know."""

    #: The roles this process hosts.
    local: frozenset[str]
    #: This process's co-location group: the deployment and the replica slot (or Ray bundle)
    #: it fills; processes of one node with the same key are co-located.
    key: str
    #: Leaves word of what this process is doing, for the front to read should the process die
    #: before it is ready (None: nobody reads it); ``None`` as the word clears it.
    last_words: Callable[[str | None], None] | None = None


#: Set by the runtime around a role's ``setup()`` when roles run in several processes (None:
#: every role of the graph is in this process, as inproc).
_colocation: ContextVar[Colocation | None] = ContextVar("omniflow_colocation", default=None)


def colocation() -> Colocation | None:
    """This process's co-location facts while a role sets up (None: everything is local)."""
    return _colocation.get()


def context() -> ActivationContext:
    """The context of the activation running in this task; raises outside of one. In a
    batched method (``batch=``), the context of the batch's first activation."""
    try:
        cur = _current.get()
    except LookupError:
        cur = None
    return _built(cur)


def batch_contexts() -> list[ActivationContext]:
    """The contexts of every activation of the running batch, in the order of the method's
    lists; ``[context()]`` in a method that is not batched.

    >>> import omniflow as of
    >>> class Vit(of.Role):
    ...     @of.interface(inputs_or=[["image"]], outputs=["feat"], batch=of.Batch(8, 5))
    ...     async def encode(self, image):
    ...         calls = [ctx.call_id for ctx in of.batch_contexts()]
    ...         return [{"feat": (im, c)} for im, c in zip(image, calls)]
    """
    held = _batch.get()
    if held is None:
        return [context()]
    return [_built(cur) for cur in held]


def _built(cur: Any) -> ActivationContext:
    if isinstance(cur, ActivationContext):
        return cur
    if type(cur) is tuple:  # (builder, *args): built only when a method asks
        built: ActivationContext = cur[0](*cur[1:])
        return built
    if cur is not None:
        ctx: ActivationContext = cur.activation_context()
        return ctx
    raise OmniflowError(
        "omniflow.context() was called outside a running interface method; call it from "
        "within a method decorated with @omniflow.interface while a graph call runs it"
    )


def role_pools() -> Mapping[str, Any]:
    """The Params Pools of the role running in this task: the activation's inside a method, the
    role's own in its ``setup()``; raises anywhere else."""
    try:
        cur = _current.get()
    except LookupError:
        cur = None
    if cur is not None:
        return context().pools
    pools = _setup_pools.get()
    if pools is not None:
        return pools
    raise OmniflowError(
        "no role is running here: the graph's pools are reachable from a role's setup() or "
        "from within an interface method"
    )
