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
