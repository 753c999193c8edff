"""``omniflow.__all__`` is honest: sorted, complete, and covering the contract's names."""

from __future__ import annotations

import types

import omniflow

#: Every name CONTRACT.md spells as ``of.<name>``. Some arrive with later layers (Runtime,
#: Frame, Deploy); each one that exists must be exported.
CONTRACT_NAMES = (
    "ALL",
    "Deploy",
    "Frame",
    "GlobalParameters",
    "GlobalParametersRef",
    "Graph",
    "GraphError",
    "InputError",
    "NodeError",
    "Placeholder",
    "Ray",
    "Role",
    "RoleRef",
    "Runtime",
    "StaticPlan",
    "context",
    "interface",
    "parse",
)
#: Contract names the foundation layer provides: these must exist today.
FOUNDATION_NAMES = tuple(n for n in CONTRACT_NAMES if n not in ("Deploy", "Frame", "Runtime"))


def test_all_is_sorted_and_unique() -> None:
    assert list(omniflow.__all__) == sorted(omniflow.__all__)
    assert len(set(omniflow.__all__)) == len(omniflow.__all__)


def test_every_name_in_all_exists() -> None:
    missing = [n for n in omniflow.__all__ if not hasattr(omniflow, n)]
    assert missing == []


def test_every_public_attribute_is_in_all() -> None:
    """Nothing public hides outside __all__ (subpackages and modules aside)."""
    public = {
        n
        for n, v in vars(omniflow).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"
    }
    assert public - set(omniflow.__all__) == set()


def test_contract_names_are_exported_once_they_exist() -> None:
    for name in FOUNDATION_NAMES:
        assert hasattr(omniflow, name), name
    for name in CONTRACT_NAMES:
        if hasattr(omniflow, name):
            assert name in omniflow.__all__, name


def test_exceptions_share_one_root() -> None:
    errors = [getattr(omniflow, n) for n in omniflow.__all__ if n.endswith("Error")]
    assert errors
    for exc in errors:
        assert issubclass(exc, omniflow.OmniflowError), exc
    assert issubclass(omniflow.InputError, ValueError)


def test_version() -> None:
    assert isinstance(omniflow.__version__, str) and omniflow.__version__


def test_import_omniflow_does_not_import_ray() -> None:
    """Ray is an optional extra: ``of.Ray`` is declared without importing ray."""
    import subprocess
    import sys

    code = "import sys, omniflow as of; of.Ray({}); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
