#!/usr/bin/env bash
# Regenerate the committed pictures of example plans (docs/*.svg) from the graphs themselves:
#   omniflow plan graphs/X.py --format dot | dot -Tsvg > docs/X-plan.svg
# tests/test_docs.py checks that the committed dot sources (docs/*.dot) match what this script writes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for g in fig3; do
  "$PY" -m omniflow plan "graphs/$g.py" --format dot > "docs/$g-plan.dot"
  dot -Tsvg "docs/$g-plan.dot" > "docs/$g-plan.svg"
  echo "wrote docs/$g-plan.svg"
done
