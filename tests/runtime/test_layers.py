"""Import rules of the runtime's neighbourhood, read from the source (no import is run).

- ``data/`` is below the runtime: it imports nothing of runtime, plan, dsl, serve or compute.
- ``plan/`` only compiles: it imports only dsl/plan (and the shared ``_exceptions``/``_types``),
  and no standard module that loads files or does I/O.
- The runtime's pure modules (call core, buckets, liveness, ordering, compiled tables,
  placement planning, replica lifecycle) reach no socket: neither the data plane
  (``data._plane``), the transport, the registry, nor ``socket``/``zmq``/``subprocess``,
  directly or through the modules they import (package ``__init__`` files aside).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import omniflow

PACKAGE = Path(omniflow.__file__).parent

PURE_RUNTIME = (
    "_core",
    "_callstate",
    "_latches",
    "_session",
    "_gather",
    "_settle",
    "_validate",
    "_buckets",
    "_liveness",
    "_ordering",
    "_compiled",
    "_placement",
    "_replica",
)
SOCKETS = ("omniflow.data._plane", "omniflow.transport", "omniflow.registry")
IO_STDLIB = ("socket", "zmq", "subprocess", "importlib", "asyncio", "runpy")


@cache
def imports_of(module: str) -> frozenset[str]:
    """Absolute names ``module`` imports at any level of its source (TYPE_CHECKING ones too:
    they must hold for the type checker's picture as well)."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        return frozenset()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return frozenset(found)


def reach(module: str) -> set[str]:
    """Every omniflow module ``module`` imports, transitively (package __init__s left out)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in imports_of(todo.pop()):
            if name.startswith("omniflow.") and name not in seen:
                seen.add(name)
                todo.append(name)
    return seen | {n for m in seen for n in imports_of(m) if not n.startswith("omniflow")}


def modules_in(sub: str) -> list[str]:
    return sorted(f"omniflow.{sub}.{p.stem}" for p in (PACKAGE / sub).glob("*.py"))


@pytest.mark.parametrize("module", modules_in("data"))
def test_data_imports_nothing_above_it(module: str) -> None:
    above = ("runtime", "plan", "dsl", "serve", "compute", "cli")
    bad = {n for n in imports_of(module) if n.split(".")[:2][-1] in above}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", modules_in("plan"))
def test_plan_only_compiles(module: str) -> None:
    allowed = ("omniflow._exceptions", "omniflow._types", "omniflow.dsl", "omniflow.plan")
    for name in imports_of(module):
        if name.startswith("omniflow"):
            assert name.startswith(allowed), f"{module} imports {name}"
        assert name.split(".")[0] not in IO_STDLIB, f"{module} imports {name}"


@pytest.mark.parametrize("module", [f"omniflow.runtime.{m}" for m in PURE_RUNTIME])
def test_pure_runtime_modules_reach_no_socket(module: str) -> None:
    reached = reach(module) | {module}
    bad = {n for n in reached if n.startswith(SOCKETS) or n.split(".")[0] in IO_STDLIB[:3]}
    assert not bad, f"{module} reaches {sorted(bad)}"
