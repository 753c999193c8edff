"""Loading graph files: a module, a dotted module name or a ``.py`` path -> its Graph objects.

>>> import omniflow as of
>>> (graph,) = of.load_graphs("graphs/fig3.py")              # doctest: +SKIP
>>> of.parse("graphs/fig3.py")["fig3"]                       # doctest: +SKIP
StaticPlan(...)

This is the one place that executes user code to find graphs (``plan/`` only compiles). The
user's Graph objects are collected as they are: a Graph records its own module when it is
declared, which is how a worker process finds it again. A module that fails to load is a
GraphError naming ``file:line``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import overload

from omniflow._exceptions import GraphError
from omniflow.dsl._graph import Graph
from omniflow.plan._parser import parse_graphs
from omniflow.plan._plan import StaticPlan

__all__ = ["load_graphs", "parse"]


@overload
def parse(target: Graph, *, others: Sequence[Graph] = ()) -> StaticPlan: ...
@overload
def parse(
    target: ModuleType | str | Path, *, others: Sequence[Graph] = ()
) -> dict[str, StaticPlan]: ...
def parse(
    target: Graph | ModuleType | str | Path, *, others: Sequence[Graph] = ()
) -> StaticPlan | dict[str, StaticPlan]:
    """Compile a Graph to its StaticPlan, or every Graph of a module / ``.py`` file by name.

    ``others`` are graphs that a Graph's RoleRef / GlobalParametersRef may resolve into.
    """
    if isinstance(target, Graph):
        return parse_graphs([target, *others])[target.name]
    if isinstance(target, ModuleType | str | Path):
        return parse_graphs([*load_graphs(target), *others])
    raise GraphError(
        f"omniflow.parse takes a Graph, a module or a path to a .py file, got {target!r}"
    )


def load_graphs(target: ModuleType | str | Path) -> list[Graph]:
    """The module-level Graph objects of a module, a dotted module name or a ``.py`` path."""
    module = _load_module(target) if not isinstance(target, ModuleType) else target
    graphs = [v for v in vars(module).values() if isinstance(v, Graph)]
    if not graphs:
        raise GraphError(
            f"module '{module.__name__}' ({getattr(module, '__file__', '?')}) defines no "
            "omniflow.Graph at module level; assign one, e.g. graph = omniflow.Graph(...)"
        )
    # The user's Graph objects are left as they are (a Graph records its own module when
    # it is declared, which is how a worker process finds it again).
    seen: set[int] = set()
    unique = []
    for g in graphs:
        if id(g) not in seen:
            seen.add(id(g))
            unique.append(g)
    return unique


def _where(exc: BaseException, path: Path | None) -> str:
    """``file:line`` where loading a graph module failed: the syntax error's position, else
    the last frame of the traceback in the graph file itself (else the deepest frame)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    if path is not None:
        mine = [f for f in frames if f.filename == str(path)]
        if mine:
            return f"{mine[-1].filename}:{mine[-1].lineno}"
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}"
    return str(path) if path is not None else "?"


def _load_module(target: str | Path) -> ModuleType:
    text = str(target)
    path = Path(text)
    if text.endswith(".py") or path.exists():
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise GraphError(f"graph file '{text}' {what}; pass the path to a .py file")
        path = path.resolve()
        name = "omniflow_user." + "_".join(path.with_suffix("").parts[-3:]).replace("-", "_")
        if name in sys.modules and getattr(sys.modules[name], "__omniflow_path__", None) == path:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise GraphError(f"cannot import graph file '{text}'")
        module = importlib.util.module_from_spec(spec)
        module.__omniflow_path__ = path  # type: ignore[attr-defined]
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise _load_error(f"graph file '{text}'", exc, path) from exc
        return module
    try:
        return importlib.import_module(text)
    except ModuleNotFoundError as exc:
        if exc.name is not None and text.startswith(exc.name):
            raise GraphError(
                f"cannot import graph module '{text}': {exc}; pass a path to an existing .py "
                "file or an importable module name"
            ) from exc
        raise _load_error(f"graph module '{text}'", exc, None) from exc
    except Exception as exc:
        raise _load_error(f"graph module '{text}'", exc, None) from exc


def _load_error(what: str, exc: Exception, path: Path | None) -> GraphError:
    """A GraphError for a graph module that failed to load, naming file:line."""
    where = _where(exc, path)
    if isinstance(exc, GraphError):  # a declaration error: keep its fields, add the place
        err = GraphError(f"{where}: {exc}", node=exc.node, field=exc.field)
        err.graph = exc.graph
        return err
    if isinstance(exc, SyntaxError):
        return GraphError(f"{where}: importing {what} failed: SyntaxError: {exc.msg}")
    return GraphError(f"{where}: importing {what} failed: {exc!r}")
