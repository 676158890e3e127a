#!/usr/bin/env bash
# This session's one device call when machines are scarce: issue 50's GPU checks (stage 1 and the
# step at head dims 80/96/192 against the reference, memcheck on the padded dims, stage 1's cost per
# head dim: scripts/gpu_adapters_run.sh without its step benchmark and gpu-marked suites), then
# issue 51's baseline and sweep (scripts/gpu_fp8_run.sh: bench_fp8, the 64/256-row sweeps).
#   QSA_COMMIT=<hash> bash scripts/gpu_session_run.sh
OUT=${OUT:-/tmp/qsa_gpu_out}
export OUT
QSA_SKIP_STEP_BENCH=1 QSA_SKIP_GPU_MARKED=1 bash scripts/gpu_adapters_run.sh
QSA_SWEEPS="bf16_64_256 fp8_64_256" QSA_SKIP_SELECT=1 QSA_FP8_TIMEOUT=150 bash scripts/gpu_fp8_run.sh
