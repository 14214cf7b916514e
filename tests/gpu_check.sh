#!/usr/bin/env bash
# The GPU half of the checks (needs an sm_90a/sm_100a GPU and nvidia-cutlass-dsl): fast-path tests,
# parity report, GPU mutation catalog, benchmarks. Usage: bash tests/gpu_check.sh OUTDIR [STAGES]
# STAGES is a comma list of tests,parity,mutate,bench (default: all); every stage runs even if one fails.
set -uo pipefail
out=$(mkdir -p "${1:?usage: gpu_check.sh OUTDIR [STAGES]}" && cd "$1" && pwd)
stages=",${2:-tests,parity,mutate,bench},"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
run() { local name=$1; shift; echo "== $name: $*"; "$@" > "$out/$name.log" 2>&1 || status=1; tail -n 25 "$out/$name.log"; }
[[ $stages == *,tests,* ]] && run gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests
[[ $stages == *,parity,* ]] && run parity python3 -m nmoe.cli parity --no-db --report "$out/parity.json"
[[ $stages == *,mutate,* ]] && run mutate python3 -m nmoe.cli mutate --device gpu --only '*.fast_*' \
  --jobs 4 --report "$out/mutations.json"
[[ $stages == *,bench,* ]] && run bench python3 -m nmoe.cli bench --out "$out/bench.json"
exit $status
