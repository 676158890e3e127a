#!/usr/bin/env bash
# fp8 speed (issue 15) on the H200: the GPU tests of every fp8 variant, then the
# benchmarks that time the variants side by side (JSON and logs under $OUT).
#   bash scripts/gpu_fp8_run.sh
# Files: gpu.txt, pytest.log, bench.log, sparse_attention.json (fp8 columns), sparse_attention_fp8_sweep.json
# and sparse_attention_sweep.json (--sweep --quick: variants + launch candidates),
# select.json (fp8_scorer_<variant>_* columns).
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
export OUT
SHAPES=decode:64:131072,decode:256:131072,prefill:2048:131072
bash scripts/gpu_run.sh "tests/test_fp8.py tests/test_attention.py" ""
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
run() {
  start=$(date +%s)
  echo "=== $*" >> "$OUT/bench.log"
  python3 "$@" 2>&1 | tee -a "$OUT/bench.log" | tail -20
  echo "$* wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
}
run benchmarks/bench_sparse_attention.py --fp8 --shapes "$SHAPES" --json "$OUT/sparse_attention.json"
run benchmarks/bench_sparse_attention.py --sweep --quick --fp8 --shapes decode:256:131072 --json "$OUT/sparse_attention.json"
run benchmarks/bench_sparse_attention.py --sweep --quick --shapes decode:256:131072 --json "$OUT/sparse_attention.json"
run benchmarks/bench_select.py --fp8 --shapes "$SHAPES" --json "$OUT/select.json"
