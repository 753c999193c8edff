"""transport/ and registry/ are low layers: they import nothing above them (nor each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import omniflow

PACKAGE = Path(omniflow.__file__).parent
HIGHER = ("runtime", "plan", "dsl", "serve", "cli", "compute", "data")
FORBIDDEN = {
    "transport": {*HIGHER, "registry"},
    "registry": {*HIGHER, "transport"},
}


def imported_omniflow_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "omniflow" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(layer: str) -> None:
    files = sorted((PACKAGE / layer).glob("*.py"))
    assert files
    for path in files:
        bad = imported_omniflow_modules(path) & FORBIDDEN[layer]
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports omniflow.{sorted(bad)}"
