#!/usr/bin/env bash
# The GPU half of the checks (needs an sm_90a/sm_100a GPU and nvidia-cutlass-dsl): fast-path tests, parity
# report, GPU mutation catalog, benchmarks, a training run. Usage: bash tests/gpu_check.sh OUTDIR [STAGES].
# STAGES is a comma list of smoke,tests,parity,mutate,sonic,bench,train,profile,moonlet (default: all but
# smoke, sonic, profile and moonlet); every stage runs even if one fails. smoke launches one elementwise op
# and one GEMM: run it first on a new launch path. sonic times SonicMoE on the MoE layer rows in its own
# process (SONIC_PYTHONPATH from the peer install; its kernels compiled for ~16 minutes on the H200, so they
# compile in the background while tests, parity and mutate run, and are timed only after those, right before
# bench, which puts those rows beside ours; its GEMMs go through quack's autotuner, which compiles and times
# every config on a first call. NMOE_SONIC_CACHE names a folder, one per GPU kind, for CuTeDSL's file cache
# and quack's autotune choices and objects; reuse untried). moonlet trains configs/moonlet.toml for NMOE_MOONLET_STEPS (default 200) steps and writes
# its metrics table, PNG and report JSON (its checkpoint of ~40 GB goes to NMOE_MOONLET_CKPT;
# NMOE_MOONLET_ARGS adds overrides). profile writes where one eager moonlet step's GPU time goes, by op
# family and by the ops that launch the small kernels (bench/stepprofile.py; NMOE_MOONLET_ARGS applies).
# NMOE_GPU_JOBS (default 12) sets the pytest and mutation workers; NMOE_BENCH_K selects bench rows (-k).
set -uo pipefail
out=$(mkdir -p "${1:?usage: gpu_check.sh OUTDIR [STAGES]}" && cd "$1" && pwd)
stages=",${2:-tests,parity,mutate,bench,train},"
jobs=${NMOE_GPU_JOBS:-12}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
run() { local name=$1; shift; echo "== $name: $*"; "$@" > "$out/$name.log" 2>&1 || status=1; tail -n 25 "$out/$name.log"; }
[[ $stages == *,smoke,* ]] && run smoke python3 -m pytest -q -p no:cacheprovider -m gpu -x \
  tests/test_fast_activation.py tests/test_fast_gemm.py -k "test_relu2_any_size or test_fwd_uniform"
sonic_pid=
if [[ $stages == *,sonic,* ]]; then
  : "${SONIC_PYTHONPATH:?install the peer first (bash install-peers.sh prints it)}"
  rm -f "$out/sonic.go"
  echo "== sonic: compiling in the background (log $out/sonic.log); timed before bench"
  env PYTHONPATH="$SONIC_PYTHONPATH:$PWD" \
    ${NMOE_SONIC_CACHE:+CUTE_DSL_CACHE_DIR="$NMOE_SONIC_CACHE/cute" QUACK_CACHE_DIR="$NMOE_SONIC_CACHE/quack"} \
    python3 bench/sonicpeer.py --out "$out/sonic.json" --go "$out/sonic.go" > "$out/sonic.log" 2>&1 &
  sonic_pid=$!
fi
[[ $stages == *,tests,* ]] && run gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu -n "$jobs" tests
[[ $stages == *,parity,* ]] && run parity python3 -m nmoe.cli parity --no-db --jobs "$jobs" --report "$out/parity.json"
[[ $stages == *,mutate,* ]] && run mutate python3 -m nmoe.cli mutate --device gpu --only '*.fast_*' \
  --jobs "$jobs" --report "$out/mutations.json"
if [[ -n $sonic_pid ]]; then
  echo "== sonic: timing once compiled"; touch "$out/sonic.go"; wait "$sonic_pid" || status=1
  tail -n 25 "$out/sonic.log"
fi
[[ -f $out/sonic.json ]] && export NMOE_BENCH_PEER=$out/sonic.json
[[ $stages == *,bench,* ]] && run bench python3 -m nmoe.cli bench ${NMOE_BENCH_K:+-k "$NMOE_BENCH_K"} \
  --out "$out/bench.json"
[[ $stages == *,train,* ]] && run train bash -c "python3 -m nmoe.cli prep && python3 -m nmoe.cli train configs/tiny-gpu.toml"
[[ $stages == *,profile,* ]] && run profile python3 -m bench.stepprofile configs/moonlet.toml --sources \
  --out "$out/stepprofile.json" ${NMOE_MOONLET_ARGS:-}
if [[ $stages == *,moonlet,* ]]; then
  per_step=$(python3 -c "import sys; from nmoe.config import load_config as l; \
c = l('configs/moonlet.toml', env={}, overrides=sys.argv[1:]); \
print(c.data.batch_size * c.data.seq_len * c.train.grad_accum)" ${NMOE_MOONLET_ARGS:-})
  tokens=$(( ${NMOE_MOONLET_STEPS:-200} * per_step ))
  run moonlet bash -c "python3 -m nmoe.cli prep && python3 -m nmoe.cli train configs/moonlet.toml \
    --schedule.total_tokens=$tokens --schedule.warmup_tokens=$(( tokens / 10 )) \
    --checkpoint.dir=${NMOE_MOONLET_CKPT:-checkpoints/moonlet-check} ${NMOE_MOONLET_ARGS:-}"
  rid=$(grep -o 'run [A-Za-z0-9_.-]*$' "$out/moonlet.log" | tail -n 1 | cut -d' ' -f2)
  [[ -n $rid ]] && run moonlet-report python3 -m nmoe.cli metrics "$rid" --db runs/experiments.sqlite --out "$out"
fi
exit $status
