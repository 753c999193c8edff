#!/usr/bin/env bash
# The one test command (README): builds .venv if needed, installs omniflow with its dev extras
# and the Debian packages the tests use, then runs the whole suite (slow tests included) under
# coverage, worker subprocesses included, and enforces the coverage gates in pyproject
# ([[tool.omniflow.coverage-gate]], checked by scripts/coverage_gate.py). With arguments it
# runs just `pytest ARGS` (no coverage, no gates): `bash scripts/test.sh -m "not slow"` is the
# inner loop. Exit status is pytest's, then the gates'; "no tests collected" (exit 5) fails.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian tools the tests use: redis-server (private servers on free ports), graphviz (plan
# pictures), espeak-ng and sox (the omni_chat graph speaks WAV files and the tests read them),
# chromium (GET /ui drawn headless: tests/serve/test_live.py).
missing=""
for tool in redis-server:redis-server dot:graphviz espeak-ng:espeak-ng soxi:sox chromium:chromium; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing="$missing ${tool##*:}"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "warning: missing$missing and cannot apt-get; some tests will fail" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Reinstall only when the declared dependencies changed (or the venv is new): a stamp holds the
# hash of pyproject.toml that the last successful install saw.
stamp=.venv/.omniflow-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' >"$log" 2>&1; then
    cat "$log" >&2
    echo "error: pip install -e '.[dev]' failed" >&2
    exit 1
  fi
  rm -f "$log"
  echo "$want" > "$stamp"
fi
.venv/bin/python -m pip check >/dev/null 2>&1 || true

set +e
if [ "$#" -eq 0 ]; then
  rm -f .coverage .coverage.*
  # mypy strict (70-100 s cold, one core, mostly torch's stubs) runs beside the suite, whose
  # processes spend much of their time waiting, instead of inside it; same test, own pytest.
  mypy_test=tests/test_lint.py::test_mypy_strict_is_clean
  mypy_log=$(mktemp)
  .venv/bin/python -m pytest "$mypy_test" >"$mypy_log" 2>&1 &
  mypy_pid=$!
  .venv/bin/python -m pytest --cov --cov-report= --durations=20 --deselect "$mypy_test"
  rc=$?
  if [ "$rc" = 0 ] || [ "$rc" = 1 ]; then  # the suite ran: the gates say their part too
    .venv/bin/python scripts/coverage_gate.py
    gate=$?
    [ "$rc" = 0 ] && rc=$gate
  fi
  wait "$mypy_pid"
  mypy_rc=$?
  if [ "$mypy_rc" != 0 ]; then
    cat "$mypy_log"
    echo "error: $mypy_test failed" >&2
    [ "$rc" = 0 ] && rc=1
  else
    echo "$mypy_test passed (beside the suite)"
  fi
  rm -f "$mypy_log"
else
  .venv/bin/python -m pytest "$@"
  rc=$?
fi
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
