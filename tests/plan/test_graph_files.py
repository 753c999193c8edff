"""Loading graph files: errors name file:line, and the user's Graph objects are not touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import omniflow as of

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "syn.py", "import omniflow as of\n\nx = 1\ndef f(:\n")
    with pytest.raises(of.GraphError, match=rf"^{path}:4: importing .* failed: SyntaxError"):
        of.parse(path)


def test_exception_while_loading_names_the_line_in_the_graph_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "exc.py",
        "import json\n\n\ndef helper():\n    return json.loads('{')\n\n\nhelper()\n",
    )
    with pytest.raises(of.GraphError, match=rf"^{path}:5: importing graph file .*JSONDecodeError"):
        of.parse(path)


def test_graph_declaration_error_names_the_line_and_keeps_its_fields(tmp_path: Path) -> None:
    path = write(tmp_path, "decl.py", "import omniflow as of\n\ng = of.Graph('g', roles={})\n")
    with pytest.raises(of.GraphError, match=rf"^{path}:3: graph 'g': roles must be") as info:
        of.parse(path)
    assert isinstance(info.value.__cause__, of.GraphError)


def test_missing_module_is_still_a_clear_error() -> None:
    with pytest.raises(of.GraphError, match="cannot import graph module 'no_such_module_x'"):
        of.parse("no_such_module_x")


def test_load_graphs_does_not_mutate_the_graph(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "ok.py",
        "import omniflow as of\n\n\nclass E(of.Role):\n"
        "    @of.interface(inputs_or=[['x']], outputs=['y'])\n"
        "    async def run(self, x):\n        return {'y': x}\n\n\n"
        "g = of.Graph('g', roles={'e': E()}, inputs=[of.Placeholder('x')], outputs=['y'])\n",
    )
    (g,) = of.load_graphs(path)
    before = {k: getattr(g, k) for k in g.__slots__}
    of.parse(path)
    of.parse(g)
    of.load_graphs(path)
    assert {k: getattr(g, k) for k in g.__slots__} == before
    assert before["module"] == str(path)  # recorded by the Graph itself at declaration


@pytest.mark.timeout(120)
def test_serve_reports_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "syn.py", "import omniflow as of\ng = (\n")
    proc = subprocess.run(
        [sys.executable, "-m", "omniflow", "serve", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert f"{path}:2" in proc.stderr, proc.stderr


def test_a_graph_bound_to_two_names_is_loaded_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "alias.py",
        "import omniflow as of\n\n\n"
        "class R(of.Role):\n"
        "    @of.interface(inputs_or=[['x']], outputs=['y'])\n"
        "    async def run(self, x):\n"
        "        return {'y': x}\n\n\n"
        "g = of.Graph('alias_g', roles={'r': R()}, inputs=[of.Placeholder('x')], outputs=['y'])\n"
        "same = g\n",
    )
    (graph,) = of.load_graphs(path)
    assert graph.name == "alias_g"


def test_a_module_whose_own_import_is_missing_names_the_missing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not "cannot import graph module": the graph module exists, a module it imports does
    not; the error says which, at the graph module's line."""
    write(tmp_path, "needs_dep_graphs.py", "import os\n\nimport no_such_dependency_omniflow\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "needs_dep_graphs", raising=False)
    with pytest.raises(of.GraphError, match=r"needs_dep_graphs\.py:3: importing graph module") as e:
        of.parse("needs_dep_graphs")
    assert "no_such_dependency_omniflow" in str(e.value)
    assert "cannot import graph module" not in str(e.value)


def test_where_a_load_failed_without_a_frame_in_the_graph_file(tmp_path: Path) -> None:
    from omniflow._loader import _where

    graph_file = tmp_path / "g.py"
    # Never raised: no traceback at all.
    assert _where(ValueError("x"), graph_file) == str(graph_file)
    assert _where(ValueError("x"), None) == "?"
    # Raised elsewhere (the import machinery reading the file, say): the deepest frame.
    try:
        raise ValueError("x")
    except ValueError as exc:
        here = _where(exc, graph_file)
    assert here.startswith(f"{__file__}:")


def test_a_file_python_cannot_import_is_a_graph_error(tmp_path: Path) -> None:
    path = write(tmp_path, "graph.txt", "not python\n")
    with pytest.raises(of.GraphError, match=f"cannot import graph file '{path}'"):
        of.parse(path)
