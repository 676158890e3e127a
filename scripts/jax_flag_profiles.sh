#!/usr/bin/env bash
# The jitted step under each XLA command-buffer setting, one process and one JSON under $OUT each;
# run on the GPU machine after scripts/gpu_run.sh has installed the carried wheels (it sets nothing
# up itself):
#   bash scripts/gpu_run.sh none "" && bash scripts/jax_flag_profiles.sh "1 64" [MODE] [SETTINGS] [ARGS]
# MODE: "profile" (default; benchmarks/bench_jax_calls.py --host-profile, where the host's time goes)
# or "steady" (its plain mode: the 10-step loop's and the one-step call's wall, no profiler);
# SETTINGS: names from the table below (default: all); ARGS: more bench_jax_calls.py arguments;
# QSA_SUFFIX: appended to each JSON's name (runs with other ARGS).
# XLA reads XLA_FLAGS once per process, so each setting needs a process of its own.
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
BATCHES=${1:-1}
MODE=${2:-profile}
ARGS=${4:-}
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
declare -A SETTINGS=(
  [default]=""
  [no_command_buffers]="--xla_gpu_enable_command_buffer="
  [no_custom_calls]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION"
  [skip_temp]="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  [skip_profiled]="--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
)
case $MODE in
  profile) FLAG=--host-profile; PREFIX=jax_host_profile; HIDE="^{" ;;  # its rows are long: the summaries only
  steady) FLAG=""; PREFIX=jax_calls_steady; HIDE="^$" ;;
  *) echo "MODE: profile or steady, not $MODE" >&2; exit 2 ;;
esac
for name in ${3:-default no_command_buffers no_custom_calls skip_temp skip_profiled}; do
  start=$(date +%s)
  XLA_FLAGS="${SETTINGS[$name]}" timeout 240 python3 benchmarks/bench_jax_calls.py $FLAG $ARGS \
    --batches $BATCHES --json "$OUT/${PREFIX}_$name${QSA_SUFFIX:-}.json" 2>&1 | grep -v "$HIDE" | tail -12
  echo "$name: rc ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s"
done
