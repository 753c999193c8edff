#!/usr/bin/env bash
# The one test command (README): builds .venv if needed, installs omniflow with its dev extras
# and the Debian packages the tests use, then runs the whole suite. Exit status is pytest's,
# except that "no tests collected" (exit 5) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 || ! command -v dot >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server graphviz >/dev/null
  else
    echo "warning: redis-server or graphviz missing and cannot apt-get; some tests will fail" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 \
  | grep -v -E '^WARNING: Location' || true
.venv/bin/python -m pip check >/dev/null 2>&1 || true

set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
