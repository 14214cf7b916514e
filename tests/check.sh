#!/usr/bin/env bash
# The project's full CPU check: lint, types, parity (CPU mode), CPU mutation catalog, tests + coverage.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff";    ruff check .
echo "== mypy";    mypy --strict nmoe
echo "== parity (CPU: reference self-checks + sm_90a/sm_100a compiles)"
nmoe parity --report "${TMPDIR:-/tmp}/nmoe-parity-cpu.json"
echo "== mutations (CPU catalog)"
nmoe mutate --device cpu --report "${TMPDIR:-/tmp}/nmoe-mutate-cpu.json"
echo "== tests"
python -m pytest -q -p no:cacheprovider --cov=nmoe.reference --cov-report=term --cov-fail-under=95
