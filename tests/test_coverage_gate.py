"""scripts/coverage_gate.py: the per-path coverage gates scripts/test.sh enforces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "coverage_gate", ROOT / "scripts/coverage_gate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["coverage_gate"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gate_mod = _load()


def summary(
    lines: int, covered: int, branches: int = 0, covered_branches: int = 0
) -> dict[str, Any]:
    total = lines + branches
    return {
        "num_statements": lines,
        "covered_lines": covered,
        "num_branches": branches,
        "covered_branches": covered_branches,
        "percent_covered": 100.0 * (covered + covered_branches) / total if total else 100.0,
        "missing": "" if covered == lines and covered_branches == branches else "7, 9->11",
    }


def gates(*specs: tuple[str, list[str], float, bool]) -> list[Any]:
    return [gate_mod.Gate(name, paths, minimum, enabled) for name, paths, minimum, enabled in specs]


def test_the_repository_gates() -> None:
    found = {g.name: g for g in gate_mod.load_gates(ROOT / "pyproject.toml")}
    assert (found["package"].paths, found["package"].min, found["package"].enabled) == (
        ["omniflow/*"],
        90,
        True,
    )
    assert (found["plan"].min, found["plan"].enabled) == (100, True)
    core = found["runtime core"]
    assert core.min == 100
    assert {Path(p).name for p in core.paths} == {
        "_core.py",
        "_callstate.py",
        "_latches.py",
        "_orders.py",
        "_gather.py",
        "_settle.py",
        "_validate.py",
        "_buckets.py",
        "_liveness.py",
        "_ordering.py",
        "_compiled.py",
        "_events.py",
        "_waiting.py",
    }  # (_validate.py and _core.py: the call core's and the fast path's)
    assert "omniflow/cluster/fastpath/_core.py" in core.paths
    assert "omniflow/cluster/fastpath/_validate.py" in core.paths


def test_gates_pass_at_their_minimum(capsys: pytest.CaptureFixture[str]) -> None:
    gs = gates(("package", ["omniflow/*"], 90, True), ("plan", ["omniflow/plan/*"], 100, True))
    files = {
        "omniflow/plan/_plan.py": summary(50, 50, 10, 10),
        "omniflow/runtime/_x.py": summary(40, 34, 10, 6),  # 90/100 overall with the plan
    }
    assert gate_mod.check(gs, files)
    out = capsys.readouterr().out
    assert "package" in out and "ok" in out and "FAIL" not in out


def test_a_missed_branch_fails_a_100_gate(capsys: pytest.CaptureFixture[str]) -> None:
    gs = gates(("plan", ["omniflow/plan/*"], 100, True))
    # 9999 of 10000: rounds to 100.00% but is not 100.
    files = {"omniflow/plan/_parser.py": summary(5000, 5000, 5000, 4999)}
    assert not gate_mod.check(gs, files)
    out = capsys.readouterr().out
    assert "FAIL" in out and "omniflow/plan/_parser.py" in out and "9->11" in out


def test_a_package_below_its_minimum_fails() -> None:
    gs = gates(("package", ["omniflow/*"], 90, True))
    assert not gate_mod.check(gs, {"omniflow/a.py": summary(100, 89)})


def test_a_disabled_gate_is_reported_not_enforced(capsys: pytest.CaptureFixture[str]) -> None:
    gs = gates(("core", ["omniflow/runtime/callcore/_core.py"], 100, False))
    assert gate_mod.check(gs, {"omniflow/runtime/callcore/_core.py": summary(10, 5)})
    assert "off (FAIL)" in capsys.readouterr().out


def test_a_gate_matching_no_file_fails() -> None:
    # A renamed module must not silently empty a gate.
    gs = gates(("core", ["omniflow/runtime/_gone.py"], 100, True))
    assert not gate_mod.check(gs, {"omniflow/runtime/callcore/_core.py": summary(10, 10)})


def test_a_gate_without_a_minimum_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[[tool.omniflow.coverage-gate]]\nname = "x"\npaths = ["omniflow/*"]\n')
    with pytest.raises(SystemExit, match=r"gate #1 lacks \['min'\]"):
        gate_mod.load_gates(bad)
