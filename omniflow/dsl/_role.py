"""Roles and their interfaces: the user's unit of computation.

>>> class Vae(Role):
...     @interface(inputs_or=[["image"]], outputs=["vae_feat"])
...     async def encode(self, image):
...         return {"vae_feat": image}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, TypeVar

from omniflow._exceptions import GraphError

__all__ = ["ALL", "LB_POLICIES", "Batch", "InterfaceSpec", "Role", "interface", "interfaces_of"]

#: Load-balancing policies an interface may name.
LB_POLICIES: Final = ("round_robin", "session", "broadcast")

_ATTR: Final = "__omniflow_interface__"


class _All:
    """Sentinel for ``activate_by_count={field: ALL}``: wait until every stream has ended."""

    _instance: _All | None = None

    def __new__(cls) -> _All:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "omniflow.ALL"

    def __reduce__(self) -> str:
        return "ALL"


#: ``activate_by_count={"cond_image": ALL}`` joins every frame of every upstream stream.
ALL: Final = _All()


@dataclass(frozen=True, slots=True)
class Batch:
    """Run a node's activations together: ``@interface(..., batch=Batch(16, 5))``.

    >>> class Vit(Role):
    ...     @interface(inputs_or=[["image"]], outputs=["feat"], batch=Batch(16, 5))
    ...     async def encode(self, image):           # image: a list, one per activation
    ...         return [{"feat": len(im)} for im in image]

    A batch runs once it holds ``max_size`` activations, or ``max_wait_ms`` after its first
    one arrived (docs/contract.md §1).
    """

    #: Most activations in one call of the method.
    max_size: int
    #: Longest time (ms) the first activation of a batch waits for others to join it.
    max_wait_ms: float

    def __post_init__(self) -> None:
        size, wait = self.max_size, self.max_wait_ms
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise GraphError(f"Batch(max_size={size!r}): max_size must be an int >= 1")
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < 1e9:
            raise GraphError(
                f"Batch(max_wait_ms={wait!r}): max_wait_ms must be a number of milliseconds >= 0"
            )


@dataclass(frozen=True, slots=True)
class InterfaceSpec:
    """What ``@interface`` records on a method; the parser turns it into a node."""

    #: OR groups of AND-ed field names, in declaration order.
    inputs_or: tuple[tuple[str, ...], ...]
    #: Fields this node may produce.
    outputs: tuple[str, ...]
    #: One of LB_POLICIES.
    lb: str
    #: Fields received as the list of all their frames for the activation.
    collect: frozenset[str]
    #: Multi-stream join thresholds: field -> count (int >= 1) or ALL.
    activate_by_count: tuple[tuple[str, int | _All], ...] | None
    #: Most activations of this node running at once in one process (None: unbounded).
    max_concurrency: int | None
    #: Fields that may end with no frame: the method gets None ([] for collect) instead of
    #: the bucket going DEAD.
    optional: frozenset[str] = frozenset()
    #: Per-call constants: taken once per call (the first frame) and paired with every
    #: activation of the node.
    latch: frozenset[str] = frozenset()
    #: Run activations together (one call of the method per batch); None: one at a time.
    batch: Batch | None = None


F = TypeVar("F", bound=Callable[..., Any])


def _names(value: object, what: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence | set | frozenset):
        raise GraphError(f"{where}: {what} must be a list of field names, got {value!r}")
    out = tuple(value)
    for name in out:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{where}: {what} holds {name!r}, which is not a field name")
    return out


def interface(
    inputs_or: Sequence[Sequence[str]],
    outputs: Sequence[str],
    lb: str = "round_robin",
    collect: Sequence[str] = (),
    activate_by_count: dict[str, int | _All] | None = None,
    *,
    max_concurrency: int | None = None,
    optional: Sequence[str] = (),
    latch: Sequence[str] = (),
    batch: Batch | None = None,
) -> Callable[[F], F]:
    """Declare a method of a Role as a graph node.

    >>> class Llm(Role):
    ...     @interface(inputs_or=[["text_emb"], ["vit_feat", "vae_feat"]], outputs=["token"])
    ...     async def generate(self, **fields):
    ...         yield {"token": "hi"}

    ``inputs_or`` is a list of OR groups. Each group fires on its own whenever all of its
    fields (AND) are there: two complete groups give two activations. A field all of whose
    upstream paths ended without a frame makes the activation DEAD (it never runs, and the
    call reports it in ``call.warnings`` when other fields had arrived), unless the field is
    listed in ``optional``: then the method gets ``None`` (``[]`` for a ``collect`` field).

    ``latch`` names per-call constants: a latched field is taken once per call (its first
    frame) and paired with every activation of the node, which the other fields fire frame by
    frame as usual; activations wait for the latched value, and are DEAD (and reported in
    ``call.warnings``) when it ends without a frame:

    >>> class Tts(Role):
    ...     @interface(inputs_or=[["token", "voice"]], outputs=["audio"], latch=("voice",))
    ...     async def speak(self, token, voice):
    ...         return {"audio": f"{token} in {voice}"}      # every token, in one voice

    >>> class Caption(Role):
    ...     @interface(inputs_or=[["image", "hint"]], outputs=["text"], optional=("hint",))
    ...     async def run(self, image, hint):                # hint is None when it never came
    ...         return {"text": f"{image} {hint or ''}"}

    ``batch=Batch(max_size, max_wait_ms)`` runs the node's activations, across calls and
    sessions, in batches: each field is a list (one entry per activation) and the method
    returns a list (a dict, None or an exception instance per activation); see ``Batch``.

    ``collect``, ``activate_by_count`` and ``lb`` are described in the package docs.
    Structural problems are reported here; problems that need the whole graph (no producer,
    bad signature, a latched or optional field that is not an input, ...) are reported by
    ``omniflow.parse``.
    """

    def decorate(fn: F) -> F:
        where = f"interface '{getattr(fn, '__qualname__', fn)}'"
        if isinstance(inputs_or, str) or not isinstance(inputs_or, Sequence):
            raise GraphError(f"{where}: inputs_or must be a list of OR groups, got {inputs_or!r}")
        groups = tuple(_names(g, "each OR group", where) for g in inputs_or)
        outs = _names(outputs, "outputs", where)
        col = frozenset(_names(collect, "collect", where))
        abc: tuple[tuple[str, int | _All], ...] | None = None
        if activate_by_count is not None:
            if not isinstance(activate_by_count, dict) or not activate_by_count:
                raise GraphError(
                    f"{where}: activate_by_count must be a non-empty dict "
                    f"{{field: count or ALL}}, got {activate_by_count!r}"
                )
            items: list[tuple[str, int | _All]] = []
            for fld, n in activate_by_count.items():
                if not (n is ALL or (isinstance(n, int) and not isinstance(n, bool) and n >= 1)):
                    raise GraphError(
                        f"{where}: activate_by_count[{fld!r}] is {n!r}; use an int >= 1 or "
                        "omniflow.ALL",
                        field=fld,
                    )
                items.append((fld, n))
            abc = tuple(items)
        if max_concurrency is not None and (
            isinstance(max_concurrency, bool)
            or not isinstance(max_concurrency, int)
            or max_concurrency < 1
        ):
            raise GraphError(f"{where}: max_concurrency must be an int >= 1 or None")
        if batch is not None and not isinstance(batch, Batch):
            raise GraphError(
                f"{where}: batch must be omniflow.Batch(max_size, max_wait_ms), got {batch!r}"
            )
        spec = InterfaceSpec(
            inputs_or=groups,
            outputs=outs,
            lb=lb,
            collect=col,
            activate_by_count=abc,
            max_concurrency=max_concurrency,
            optional=frozenset(_names(optional, "optional", where)),
            latch=frozenset(_names(latch, "latch", where)),
            batch=batch,
        )
        setattr(fn, _ATTR, spec)
        return fn

    return decorate


def interfaces_of(role: object) -> list[tuple[str, InterfaceSpec]]:
    """The ``(method name, spec)`` pairs of a role, in definition order (MRO base-first)."""
    seen: dict[str, InterfaceSpec] = {}
    for klass in reversed(type(role).__mro__):
        for name, attr in vars(klass).items():
            spec = getattr(attr, _ATTR, None)
            if isinstance(spec, InterfaceSpec):
                seen.pop(name, None)
                seen[name] = spec
            elif name in seen:
                del seen[name]  # a subclass overrode it without the decorator
    return list(seen.items())


class Role:
    """A computing role: holds weights or state and exposes interface methods as nodes.

    >>> class Echo(Role):
    ...     async def setup(self):
    ...         self.ready = True
    ...     @interface(inputs_or=[["x"]], outputs=["y"])
    ...     async def run(self, x):
    ...         return {"y": x}
    """

    #: The Params Pools of the graphs the role serves, by name (set by the runtime before setup).
    pools: Mapping[str, Any] = MappingProxyType({})

    async def setup(self) -> None:
        """Awaited once before the role serves its first activation."""

    async def teardown(self) -> None:
        """Awaited once when the runtime that set the role up closes."""
