"""Every module of the package imports only from its own layer and the layers below it.

The table is the architecture (design/ARCHITECTURE.md, STYLE.md "Layout shows the architecture"):
``dsl → plan → runtime``; ``data`` below ``runtime``; ``transport`` below ``data``; ``compute``
on ``data.kv``; ``serve`` on top; nothing but the command line imports ``serve``. Imports are read
with ``ast`` from every file (function-local and ``TYPE_CHECKING`` imports included: a lazy
upward import is still an upward import), so the check needs no import side effects.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "omniflow"

#: Importable by every layer; they import nothing of omniflow themselves.
BASE = frozenset({"_exceptions", "_types"})

#: Value types every layer may hold, carry or build (of.Audio, of.Image); they import only BASE.
VALUES = frozenset({"_media"})

#: Every layer below serve: what serve, the package root and the test helpers may import.
BELOW_SERVE = frozenset(
    {
        "dsl",
        "plan",
        "_loader",
        "runtime",
        "cluster",
        "transport",
        "registry",
        "data",
        "data.kv",
        "compute",
        "roles",
    }
)

#: layer -> the layers it may import (itself and BASE always).
LAYERS: dict[str, frozenset[str]] = {
    "_exceptions": frozenset(),
    "_types": frozenset(),
    "_media": frozenset(),
    "transport": frozenset(),  # codec, wire, auth: no knowledge of what it carries
    "registry": frozenset(),  # replica records and load balancing, stores behind a URL
    "data": frozenset({"transport"}),  # buffer pool and data plane; handles ride the wire
    "data.kv": frozenset({"data", "transport"}),  # the Params Pool on the data plane
    # Graph(pools=...) checks for a ParamsPool; data.kv imports no dsl and no torch.
    "dsl": frozenset({"data.kv"}),
    "plan": frozenset({"dsl"}),  # compiles Graphs; loads no files
    "_loader": frozenset({"dsl", "plan"}),  # graph files and modules -> Graphs -> plans
    # The runtime schedules calls and runs the roles it hosts; it never imports the cluster,
    # which registers itself with the runtime (runtime._executor).
    "runtime": frozenset({"dsl", "plan", "_loader", "transport", "registry", "data", "data.kv"}),
    # Roles placed off the front: router, fleet, workers, fast path, launchers, Ray.
    "cluster": frozenset(
        {"runtime", "dsl", "plan", "_loader", "transport", "registry", "data", "data.kv"}
    ),
    "compute": frozenset({"dsl", "data", "data.kv"}),  # model code inside roles
    "roles": frozenset({"dsl"}),  # roles on pretrained models (ASR, OCR, TTS)
    "serve": BELOW_SERVE,
    # The package root re-exports the public API: everything but serve, cli and testing.
    "omniflow": BELOW_SERVE,
    # Test helpers, for omniflow's tests and users' (nothing in the package imports them).
    "testing": BELOW_SERVE,
    # The command line (cli.py, _cli_*.py, __main__.py) sits on everything.
    "cli": BELOW_SERVE | {"omniflow", "serve", "testing"},
}

#: Nested packages that are layers of their own (every other module belongs to its top folder).
NESTED = ("data.kv",)


def layer_of(module: str) -> str | None:
    """The layer of ``omniflow.<module>`` (dotted, without the ``omniflow.`` prefix)."""
    if module == "":
        return "omniflow"
    for nested in NESTED:
        if module == nested or module.startswith(nested + "."):
            return nested
    top = module.split(".")[0]
    if top in ("cli", "__main__") or top.startswith("_cli_"):
        return "cli"
    return top if top in LAYERS else None


@dataclass(frozen=True)
class Violation:
    path: str  #: file, relative to the package's parent
    line: int
    imported: str  #: the module as written, resolved to absolute
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.imported}: {self.why}"


def module_names(package_dir: Path) -> dict[str, Path]:
    """``{dotted name below the package: file}`` for every module; a package is its __init__."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(path: Path, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute dotted target) for every import in ``path`` that names omniflow."""
    found: list[tuple[int, str]] = []
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module, level-1 folders up
                up = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join(["omniflow", *up, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            # `from omniflow.data import kv` imports the subpackage kv: keep the alias name
            # and let resolution fall back to `base` when it names an attribute instead.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "omniflow"]


def _resolve(target: str, known: dict[str, Path]) -> str:
    """The longest prefix of ``omniflow.<target>`` that is a module of the package."""
    parts = target.split(".")[1:]
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def check_layering(package_dir: Path) -> list[Violation]:
    """Every import in the package at ``package_dir`` that the LAYERS table does not allow."""
    known = module_names(package_dir)
    violations = []
    for module, path in known.items():
        rel = path.relative_to(package_dir.parent).as_posix()
        layer = layer_of(module)
        if layer is None:
            violations.append(
                Violation(
                    rel,
                    1,
                    "-",
                    f"module 'omniflow.{module}' is in no layer; add its "
                    "folder to LAYERS in tests/test_layering.py",
                )
            )
            continue
        allowed = LAYERS[layer] | BASE | VALUES | {layer}
        if layer in BASE:
            allowed = {layer}
        for line, target in _imports(path, module, path.name == "__init__.py"):
            imported = _resolve(target, known)
            other = layer_of(imported)
            if other is None or other in allowed:
                continue  # an unknown module is reported where it is defined
            violations.append(
                Violation(
                    rel,
                    line,
                    f"omniflow.{imported}".rstrip("."),
                    f"layer '{layer}' may not import layer '{other}'",
                )
            )
    return violations


def test_every_module_imports_only_allowed_layers() -> None:
    violations = check_layering(PACKAGE_DIR)
    assert not violations, "upward or sideways imports:\n" + "\n".join(map(str, violations))


def test_every_top_level_folder_and_module_has_a_layer() -> None:
    for entry in PACKAGE_DIR.iterdir():
        if entry.name.startswith("__pycache__") or entry.suffix not in ("", ".py"):
            continue
        if entry.is_dir() and not (entry / "__init__.py").exists():
            continue
        name = entry.stem if entry.is_file() else entry.name
        if name == "__init__":
            continue
        assert layer_of(name) is not None, f"omniflow/{entry.name} has no row in LAYERS"


def test_nothing_imports_serve_but_the_command_line() -> None:
    importers = {layer for layer, allowed in LAYERS.items() if "serve" in allowed}
    assert importers == {"cli"}


def test_layers_form_no_cycle() -> None:
    seen: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(layer: str, path: tuple[str, ...]) -> None:
        assert seen.get(layer) != 1, f"cycle: {' -> '.join((*path, layer))}"
        if seen.get(layer) == 2:
            return
        seen[layer] = 1
        for lower in sorted(LAYERS[layer]):
            visit(lower, (*path, layer))
        seen[layer] = 2

    for layer in sorted(LAYERS):
        visit(layer, ())


def module_cycles(package_dir: Path) -> list[list[str]]:
    """The import circles among the modules of the package (every import counted, lazy and
    ``TYPE_CHECKING`` ones too; importing a package's ``__init__`` is no edge): each a sorted
    list of modules that import each other, directly or through one another (Tarjan)."""
    known = module_names(package_dir)
    inits = {m for m, p in known.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = {_resolve(t, known) for _, t in _imports(path, module, module in inits)}
        graph[module] = {t for t in targets if t in known and t not in inits and t != module}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    """No import circle anywhere in the package: a circle means two modules are one concept
    split in two, or a helper reaching back into its owner."""
    assert module_cycles(PACKAGE_DIR) == []


def test_the_circle_check_finds_a_lazy_and_a_type_only_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "runtime/_a.py": "def f():\n    from omniflow.runtime._b import g\n",
            "runtime/_b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from omniflow.runtime._a import f\n",
            "runtime/_c.py": "from . import _a\n",
        },
    )
    assert module_cycles(root) == [["runtime._a", "runtime._b"]]


# -- the checker itself, on synthetic trees ------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "omniflow"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


LEGAL = {
    "_exceptions.py": "class OmniflowError(Exception): ...\n",
    "transport/_wire.py": "from omniflow._exceptions import OmniflowError\n",
    "data/_plane.py": "from omniflow.transport._wire import x\nfrom . import _alloc\n",
    "data/_alloc.py": "",
    "plan/__init__.py": "",
    "data/kv/_pool.py": "from ...data import _plane\nfrom .._alloc import y\n",
    "runtime/_core.py": (
        "from omniflow.data._plane import DataRef\ndef f():\n    from omniflow.plan import parse\n"
    ),
    "serve/_app.py": "import omniflow.runtime._core\n",
    "cli.py": "from omniflow import __version__\nfrom omniflow.serve import _app\n",
}


def test_checker_accepts_a_legal_tree(tmp_path: Path) -> None:
    assert check_layering(_tree(tmp_path, LEGAL)) == []


@pytest.mark.parametrize(
    ("path", "text", "imported", "why"),
    [
        # a plain upward import
        (
            "transport/_bad.py",
            "from omniflow.runtime._core import f\n",
            "omniflow.runtime._core",
            "layer 'transport' may not import layer 'runtime'",
        ),
        # a relative one, two folders up, hidden in a function
        (
            "data/_bad.py",
            "def g():\n    from ..runtime import _core\n",
            "omniflow.runtime._core",
            "layer 'data' may not import layer 'runtime'",
        ),
        # `import a.b.c` form, and the subpackage named as an attribute
        (
            "data/kv/_bad.py",
            "import omniflow.runtime\n",
            "omniflow.runtime",
            "layer 'data.kv' may not import layer 'runtime'",
        ),
        (
            "data/_bad.py",
            "from omniflow.data import kv\n",
            "omniflow.data.kv",
            "layer 'data' may not import layer 'data.kv'",
        ),
        # only the command line imports serve
        (
            "runtime/_bad.py",
            "from omniflow.serve._app import x\n",
            "omniflow.serve._app",
            "layer 'runtime' may not import layer 'serve'",
        ),
        # a submodule importing the package root (which re-exports everything)
        (
            "plan/_bad.py",
            "import omniflow as of\n",
            "omniflow",
            "layer 'plan' may not import layer 'omniflow'",
        ),
        # under TYPE_CHECKING is still an import
        (
            "dsl/_bad.py",
            "if TYPE_CHECKING:\n    from omniflow.runtime import Call\n",
            "omniflow.runtime",
            "layer 'dsl' may not import layer 'runtime'",
        ),
    ],
)
def test_checker_catches_an_upward_import(
    tmp_path: Path, path: str, text: str, imported: str, why: str
) -> None:
    violations = check_layering(_tree(tmp_path, {**LEGAL, path: text}))
    assert [(v.path, v.imported, v.why) for v in violations] == [
        (f"omniflow/{path}", imported, why)
    ]


def test_checker_reports_a_module_in_no_layer(tmp_path: Path) -> None:
    violations = check_layering(_tree(tmp_path, {**LEGAL, "gadgets/_x.py": ""}))
    assert [v.path for v in violations] == [
        "omniflow/gadgets/__init__.py",
        "omniflow/gadgets/_x.py",
    ]
    assert "add its folder to LAYERS" in violations[0].why


#: The most lines a module of the package may have (issue 38): a longer one is split by concern.
MAX_MODULE_LINES = 500


def modules_over(package_dir: Path, limit: int) -> list[tuple[str, int]]:
    """(path below the package's parent, line count) of every module longer than ``limit``."""
    return [
        (str(path.relative_to(package_dir.parent)), n)
        for path in sorted(package_dir.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > limit
    ]


def test_no_module_is_over_the_line_limit() -> None:
    assert modules_over(PACKAGE_DIR, MAX_MODULE_LINES) == []


def test_the_line_limit_check_finds_a_long_module(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {**LEGAL, "plan/_long.py": "x = 1\n" * 12})
    assert modules_over(tree, 11) == [("omniflow/plan/_long.py", 12)]
