"""Check the coverage gates in pyproject's ``[[tool.omniflow.coverage-gate]]`` (exit 1 on a miss).

Run by scripts/test.sh after the suite wrote its combined data to ``.coverage``::

    python scripts/coverage_gate.py [--data-file .coverage]

A gate is a set of path patterns (fnmatch, relative to the repository root) and a minimum
percentage over statements and branches together, as coverage counts it: 100 means every line
and both directions of every branch ran. A gate with ``enabled = false`` is reported, not
enforced.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Gate:
    name: str
    paths: list[str]
    min: float
    enabled: bool = True
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def covers(self, rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, pattern) for pattern in self.paths)

    @property
    def counts(self) -> tuple[int, int]:
        """(covered, total) over statements and branches of the gate's files."""
        covered = total = 0
        for summary in self.files.values():
            covered += summary["covered_lines"] + summary.get("covered_branches", 0)
            total += summary["num_statements"] + summary.get("num_branches", 0)
        return covered, total

    @property
    def percent(self) -> float:
        covered, total = self.counts
        return 100.0 if total == 0 else 100.0 * covered / total

    def passed(self) -> bool:
        # Compared on counts, not a rounded percentage: 99.996% is not 100%.
        covered, total = self.counts
        return covered * 100 >= self.min * total


def load_gates(pyproject: Path) -> list[Gate]:
    config = tomllib.loads(pyproject.read_text())
    raw = config.get("tool", {}).get("omniflow", {}).get("coverage-gate", [])
    if not raw:
        raise SystemExit(f"error: {pyproject} has no [[tool.omniflow.coverage-gate]] tables")
    gates = []
    for i, table in enumerate(raw):
        missing = {"name", "paths", "min"} - set(table)
        if missing:
            raise SystemExit(
                f"error: {pyproject}: coverage gate #{i + 1} lacks {sorted(missing)}; "
                "each gate needs name, paths and min"
            )
        gates.append(
            Gate(
                table["name"], list(table["paths"]), float(table["min"]), table.get("enabled", True)
            )
        )
    return gates


def file_summaries(data_file: Path) -> dict[str, dict[str, Any]]:
    """``{path relative to ROOT: coverage's per-file summary}`` for every measured file."""
    import coverage

    cov = coverage.Coverage(data_file=str(data_file), config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    # A worker that exited after pytest-cov combined left its own data file: fold it in.
    if list(data_file.parent.glob(data_file.name + ".*")):
        cov.combine(data_paths=[str(data_file.parent)], keep=False)
        cov.save()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "coverage.json"
        cov.json_report(outfile=str(out))
        report = json.loads(out.read_text())
    summaries = {}
    for name, entry in report["files"].items():
        path = Path(name)
        rel = path.resolve().relative_to(ROOT) if path.is_absolute() else path
        summaries[rel.as_posix()] = entry["summary"] | {"missing": _missing(entry)}
    return summaries


def _missing(entry: dict[str, Any]) -> str:
    lines = entry.get("missing_lines", [])
    branches = [f"{a}->{b if b > 0 else 'exit'}" for a, b in entry.get("missing_branches", [])]
    return ", ".join([*map(str, lines), *branches])


def check(gates: list[Gate], summaries: dict[str, dict[str, Any]]) -> bool:
    for rel, summary in summaries.items():
        for gate in gates:
            if gate.covers(rel):
                gate.files[rel] = summary
    ok = True
    print("coverage gates (statements + branches):")
    for gate in gates:
        total = gate.counts[1]
        if not gate.files:
            verdict = "FAIL (no measured file matches its paths)"
        elif gate.passed():
            verdict = "ok"
        else:
            verdict = "FAIL"
        if not gate.enabled:
            verdict = f"off ({verdict})"
        elif verdict != "ok":
            ok = False
        print(
            f"  {gate.name:<14} {gate.percent:6.2f}% of {total:>6}  (min {gate.min:g}%)  {verdict}"
        )
        if gate.enabled and verdict != "ok":
            _print_gaps(gate)
    return ok


def _print_gaps(gate: Gate, most: int = 20) -> None:
    """The files with the most uncovered statements and branches, and what is missing."""

    def uncovered(summary: dict[str, Any]) -> int:
        covered = summary["covered_lines"] + summary.get("covered_branches", 0)
        return int(summary["num_statements"] + summary.get("num_branches", 0) - covered)

    gaps = sorted(gate.files.items(), key=lambda item: (-uncovered(item[1]), item[0]))
    gaps = [(rel, summary) for rel, summary in gaps if uncovered(summary)]
    for rel, summary in gaps[:most]:
        missing = summary["missing"]
        missing = missing if len(missing) <= 200 else missing[:197] + "..."
        pct = summary["percent_covered"]
        print(f"      {rel}: {pct:.1f}% ({uncovered(summary)} missed)  {missing}")
    if len(gaps) > most:
        print(f"      ... and {len(gaps) - most} more files")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-file", type=Path, default=ROOT / ".coverage")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = parser.parse_args(argv)
    if not args.data_file.exists():
        print(f"error: no coverage data at {args.data_file}; run the suite with --cov first")
        return 1
    gates = load_gates(args.pyproject)
    return 0 if check(gates, file_summaries(args.data_file)) else 1


if __name__ == "__main__":
    sys.exit(main())
