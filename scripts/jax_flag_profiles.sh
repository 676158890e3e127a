#!/usr/bin/env bash
# The jitted step's host profile (benchmarks/bench_jax_calls.py --host-profile) under each XLA
# command-buffer setting, one process and one JSON under $OUT each; run on the GPU machine after
# scripts/gpu_run.sh has installed the carried wheels (it sets nothing up itself):
#   bash scripts/gpu_run.sh none "" && bash scripts/jax_flag_profiles.sh "1 64"
# XLA reads XLA_FLAGS once per process, so each setting needs a process of its own.
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
BATCHES=${1:-1}
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
declare -A SETTINGS=(
  [default]=""
  [no_command_buffers]="--xla_gpu_enable_command_buffer="
  [no_custom_calls]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION"
  [skip_temp]="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  [skip_profiled]="--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
)
for name in default no_command_buffers no_custom_calls skip_temp skip_profiled; do
  start=$(date +%s)
  XLA_FLAGS="${SETTINGS[$name]}" timeout 240 python3 benchmarks/bench_jax_calls.py --host-profile \
    --batches $BATCHES --json "$OUT/jax_host_profile_$name.json" 2>&1 | grep -v "^{" | tail -12
  echo "$name: rc ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s"
done
