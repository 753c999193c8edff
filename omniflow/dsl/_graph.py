"""Graph declarations: which roles, which external inputs, which outputs, which shared state.

>>> import omniflow as of
>>> class Echo(of.Role):
...     @of.interface(inputs_or=[["x"]], outputs=["y"])
...     async def run(self, x):
...         return {"y": x}
>>> g = of.Graph("echo", roles={"echo": Echo()}, inputs=[of.Placeholder("x")], outputs=["y"])
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

from omniflow._exceptions import GraphError

__all__ = ["GlobalParameters", "GlobalParametersRef", "Graph", "Placeholder", "RoleRef"]

DEFAULT_MAX_ITERATIONS = 1024


@dataclass(frozen=True, slots=True)
class Placeholder:
    """An external field injected at the graph entry: ``rt.call(g, {"request": ...})``."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"Placeholder name must be a non-empty str, got {self.name!r}")


@dataclass(frozen=True, slots=True)
class GlobalParameters:
    """Session-scoped state shared by every role of a graph, created lazily by ``factory``.

    >>> GlobalParameters("history", factory=list)
    GlobalParameters(name='history', factory=<class 'list'>)
    """

    name: str
    factory: Callable[[], Any]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"GlobalParameters name must be a non-empty str, got {self.name!r}")
        if not callable(self.factory):
            raise GraphError(f"GlobalParameters '{self.name}': factory must be callable")


@dataclass(frozen=True, slots=True)
class RoleRef:
    """A role declared in another graph of the same runtime (one instance, several graphs)."""

    name: str


@dataclass(frozen=True, slots=True)
class GlobalParametersRef:
    """GlobalParameters declared in another graph of the same runtime."""

    name: str


T = TypeVar("T")


def _listed(graph: str, what: str, value: Iterable[T]) -> tuple[T, ...]:
    """``value`` as a tuple; a lone item (``outputs="picture"``) is an error, not its chars."""
    if isinstance(value, str | Placeholder | GlobalParameters | GlobalParametersRef) or not (
        isinstance(value, Iterable)
    ):
        raise GraphError(f"graph '{graph}': {what} must be a list, got {value!r}; wrap it: [...]")
    return tuple(value)


class Graph:
    """A declared graph: roles (by name), Placeholders, streamed outputs and session params.

    Declaring a Graph checks only its own shape; ``omniflow.parse`` checks the wiring.
    """

    __slots__ = (
        "inputs", "max_iterations", "module", "name", "outputs", "params", "pools", "roles"
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        roles: Mapping[str, object],
        inputs: Iterable[Placeholder] = (),
        outputs: Iterable[str] = (),
        params: Iterable[GlobalParameters | GlobalParametersRef] = (),
        max_iterations: int = DEFAULT_MAX_ITERATIONS,
        pools: Iterable[Any] = (),
    ) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"Graph name must be a non-empty str, got {name!r}")
        if not isinstance(roles, Mapping) or not roles:
            raise GraphError(f"graph '{name}': roles must be a non-empty dict of name -> Role")
        self.name = name
        self.roles: dict[str, object] = dict(roles)
        self.inputs: tuple[Placeholder, ...] = _listed(name, "inputs", inputs)
        self.outputs: tuple[str, ...] = _listed(name, "outputs", outputs)
        self.params: tuple[GlobalParameters | GlobalParametersRef, ...] = _listed(
            name, "params", params
        )
        if (
            isinstance(max_iterations, bool)
            or not isinstance(max_iterations, int)
            or (max_iterations < 1)
        ):
            raise GraphError(f"graph '{name}': max_iterations must be an int >= 1")
        self.max_iterations = max_iterations
        #: Where a worker process finds this graph again: the defining module's file path
        #: (or dotted name when it has no file); None for graphs built in ``__main__``.
        self.module: str | None = _defining_module(sys._getframe(1))
        for p in self.inputs:
            if not isinstance(p, Placeholder):
                raise GraphError(f"graph '{name}': inputs must be Placeholder objects, got {p!r}")
        for o in self.outputs:
            if not isinstance(o, str) or not o:
                raise GraphError(f"graph '{name}': outputs must be field names, got {o!r}")
        #: Params Pools (``omniflow.ParamsPool``) the roles reach as ``of.context().pools[name]``.
        self.pools: tuple[Any, ...] = _listed(name, "pools", pools)
        from omniflow.data.kv import ParamsPool  # data.kv imports no dsl, and no torch

        seen: set[str] = set()
        for pool in self.pools:
            if not isinstance(pool, ParamsPool):
                raise GraphError(f"graph '{name}': pools must be omniflow.ParamsPool, got {pool!r}")
            if pool.name in seen:
                raise GraphError(f"graph '{name}': two pools are named '{pool.name}'")
            seen.add(pool.name)
        for prm in self.params:
            if not isinstance(prm, GlobalParameters | GlobalParametersRef):
                raise GraphError(
                    f"graph '{name}': params must be GlobalParameters or GlobalParametersRef, "
                    f"got {prm!r}"
                )

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, roles={list(self.roles)}, outputs={list(self.outputs)})"


def _defining_module(frame: FrameType | None) -> str | None:
    """The file (or module name) of the code that declared a Graph, for worker processes."""
    if frame is None:
        return None
    g = frame.f_globals
    name = g.get("__name__")
    if not isinstance(name, str) or name == "__main__":
        return None
    path = g.get("__omniflow_path__") or g.get("__file__")
    return str(path) if path else name
