"""The code base stays ruff-clean and mypy-strict-clean (the whole package: pyproject's files)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # Not under coverage (scripts/test.sh measures subprocesses): the tools run no omniflow code.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_PROCESS_")}
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )


def test_ruff_check_is_clean() -> None:
    done = _run("ruff", "check", "omniflow", "graphs", "examples", "tests", "benchmarks", "scripts")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_clean() -> None:
    done = _run("ruff", "format", "--check", "omniflow", "graphs", "examples", "tests", "scripts")
    assert done.returncode == 0, done.stdout + done.stderr


def mypy_cache_dir() -> Path:
    """mypy's incremental cache: in the interpreter's venv, one per checkout.

    Warm, an unchanged tree (or one with a module edited) checks in ~1 s instead of 70-100 s
    cold on the shared 2-core machine (most of a cold run is torch's stubs). In the venv, not
    the tree: it survives a fresh clone that reuses the venv (.ci) and is not a predictable /tmp
    name another user could plant. Keyed by checkout because the cache records paths and
    several worktrees share one venv. Unwritable venv: mypy's default.
    """
    key = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    cache = Path(sys.prefix) / "omniflow-mypy-cache" / key
    if os.access(sys.prefix, os.W_OK):
        return cache
    return ROOT / ".mypy_cache"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_strict_is_clean() -> None:
    done = _run("mypy", "--cache-dir", str(mypy_cache_dir()))
    assert done.returncode == 0, done.stdout + done.stderr
