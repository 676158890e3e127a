#!/usr/bin/env bash
# This session's one device call when machines are scarce: issue 50's GPU checks (stage 1 and the
# step at head dims 80/96/192 against the reference, memcheck on the padded dims, stage 1's cost per
# head dim: scripts/gpu_adapters_run.sh without its step benchmark and gpu-marked suites), then, in
# what is left of QSA_BUDGET_S (default 450 s), issue 51's baseline (bench_fp8) and the 64/256-row
# sweep (scripts/gpu_fp8_run.sh).
#   QSA_COMMIT=<hash> bash scripts/gpu_session_run.sh
OUT=${OUT:-/tmp/qsa_gpu_out}
export OUT
end=$(( $(date +%s) + ${QSA_BUDGET_S:-450} ))
QSA_SKIP_STEP_BENCH=1 QSA_SKIP_GPU_MARKED=1 bash scripts/gpu_adapters_run.sh
left=$(( end - $(date +%s) ))
echo "left for issue 51: $left s" >> "$OUT/gpu.txt"
[ "$left" -gt 60 ] || exit 0
fp8=$(( left > 170 ? 150 : left - 20 ))
sweeps=""
[ $(( left - fp8 )) -gt 110 ] && sweeps="bf16_64_256"
[ $(( left - fp8 )) -gt 210 ] && sweeps="bf16_64_256 fp8_64_256"
QSA_SWEEPS="$sweeps" QSA_SKIP_SWEEP=$([ -n "$sweeps" ] && echo 0 || echo 1) QSA_SKIP_SELECT=1 QSA_FP8_TIMEOUT=$fp8 \
  bash scripts/gpu_fp8_run.sh
