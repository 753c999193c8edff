"""Fixtures for the plan tests: the example graphs and a builder of Role classes on the fly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import omniflow as of

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def build_method(kind: str = "coro", params: tuple[str, ...] | None = None) -> Any:
    """An undecorated method: ``kind`` "coro" (async def), "gen" (async generator) or "sync";
    ``params`` gives an explicit signature instead of ``**fields``."""
    if params is not None:
        head = "async def m(self, " + ", ".join(params) + "):"
        body = "    return {}" if kind != "gen" else "    if False:\n        yield {}"
        namespace: dict[str, Any] = {}
        exec(f"{head}\n{body}\n", namespace)
        return namespace["m"]
    if kind == "gen":

        async def gen(self: Any, **fields: Any) -> Any:
            yield {}

        return gen
    if kind == "sync":

        def sync(self: Any, **fields: Any) -> Any:
            return {}

        return sync

    async def coro(self: Any, **fields: Any) -> Any:
        return {}

    return coro


def build_role(methods: Mapping[str, Mapping[str, Any]], name: str = "Dyn") -> of.Role:
    """A Role instance whose methods are declared by ``{method: interface kwargs}``.

    Besides ``of.interface``'s keywords, each entry may hold ``kind`` and ``params`` (see
    build_method). Raises what ``of.interface`` raises for invalid declarations.
    """
    body: dict[str, Any] = {}
    for mname, decl in methods.items():
        decl = dict(decl)
        fn = build_method(decl.pop("kind", "coro"), decl.pop("params", None))
        fn.__name__ = fn.__qualname__ = mname
        body[mname] = of.interface(**decl)(fn)
    cls = type(name, (of.Role,), body)
    return cls()  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def make_role() -> Callable[..., of.Role]:
    """``make_role({"run": {"inputs_or": [["x"]], "outputs": ["y"], "kind": "gen"}})``."""
    return build_role


@pytest.fixture(scope="session")
def fig3_plan() -> of.StaticPlan:
    return of.parse(GRAPHS / "fig3.py")["fig3"]


@pytest.fixture(scope="session")
def t2i_plan() -> of.StaticPlan:
    return of.parse(GRAPHS / "t2i.py")["t2i"]


@pytest.fixture(scope="session")
def agent_plan() -> of.StaticPlan:
    return of.parse(GRAPHS / "agent_loop.py")["agent"]
