#!/usr/bin/env bash
# The next session's one device call when machines are scarce (about 8 minutes):
#  1. issue 51: Nsight Compute of the 64-row decode attention, bf16 and fp8 (stall reasons, instruction
#     mix), and the register-cap sweeps (scripts/gpu_fp8_run.sh with QSA_NCU, regs_bf16 / regs_fp8);
#  2. issue 55: the prefill baseline, 2048 rows x 128K and 256 rows x 32K at the default overlaps
#     (benchmarks/bench_prefill.py -> $OUT/prefill.json), in what is left of QSA_BUDGET_S (default 480 s).
# At most 8 files come back: gpu.txt, sweep.log, attention_sweeps.json, ncu_attention_decode64_{bf16,fp8}.txt,
# prefill.json, prefill.log.
#   QSA_COMMIT=<hash> bash scripts/gpu_session_run.sh
OUT=${OUT:-/tmp/qsa_gpu_out}
export OUT
end=$(( $(date +%s) + ${QSA_BUDGET_S:-480} ))
QSA_NCU=${QSA_NCU:-16:2:3:4} QSA_SKIP_FP8=1 QSA_SWEEPS="regs_bf16 regs_fp8" QSA_SKIP_SELECT=1 \
  QSA_SWEEP_TIMEOUT=80 bash scripts/gpu_fp8_run.sh
left=$(( end - $(date +%s) ))
echo "left for the prefill baseline: $left s" >> "$OUT/gpu.txt"
[ "$left" -gt 60 ] || exit 0
# gpu_fp8_run.sh's environment (the package and jax-triton on the path), for bench_prefill too.
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
cd benchmarks
start=$(date +%s)
timeout $(( left - 10 )) python3 bench_prefill.py --shapes prefill:2048:131072,prefill:256:32768 \
  --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "bench_prefill rc $? wall $(( $(date +%s) - start )) s" >> "$OUT/gpu.txt"
