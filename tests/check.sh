#!/usr/bin/env bash
# The project's full CPU check: lint, types, the main command (parity, CPU mode) in a fresh venv without
# test extras, CPU mutation catalog, tests + coverage.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff";    ruff check .
echo "== mypy";    mypy --strict nmoe
echo "== main command in a fresh venv with the runtime dependencies only (README's first command)"
venv="${TMPDIR:-/tmp}/nmoe-fresh-venv"
rm -rf "$venv" && python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0 -e . 2> >(grep -v "is ignored" >&2)
"$venv/bin/nmoe" parity --report "${TMPDIR:-/tmp}/nmoe-parity-cpu.json"
echo "== mutations (CPU catalog)"
nmoe mutate --device cpu --report "${TMPDIR:-/tmp}/nmoe-mutate-cpu.json"
echo "== tests"
python -m pytest -q -p no:cacheprovider --cov=nmoe.reference --cov-report=term --cov-fail-under=95
