#!/usr/bin/env bash
# Runs the test suite compiled on a CUDA machine (the H200 of the device tool)
# and then the named benchmarks, writing logs and JSON under $OUT.
#   bash scripts/gpu_run.sh "<pytest args>" "<bench names ...>" ["<extra bench args>"]
# (the device tool brings back at most 8 files: logs go to pytest.log and
# bench.log, each benchmark writes one JSON)
# Expects the jax-triton 0.3.1 wheel in .whl/ (pip download --no-deps jax-triton==0.3.1).
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
mkdir -p "$OUT"
TESTS=${1:-tests}
BENCHES=${2:-}
BENCH_ARGS=${3:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
# The checkout's kernels/ directory is imported as qsa_kernels (see pyproject.toml).
mkdir -p /tmp/qsa_path && ln -sfn "$PWD/kernels" /tmp/qsa_path/qsa_kernels
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, jax, triton, jax_triton; print(torch.__version__, jax.__version__, triton.__version__, jax_triton.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
if [ "$TESTS" != "none" ]; then
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors $TESTS -rfEs 2>&1 | tee "$OUT/pytest.log" | tail -40
  echo "pytest wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
fi
for bench in $BENCHES; do
  start=$(date +%s)
  echo "=== $bench" >> "$OUT/bench.log"
  python3 "benchmarks/$bench.py" --json "$OUT/$bench.json" $BENCH_ARGS 2>&1 | tee -a "$OUT/bench.log" | tail -30
  echo "$bench wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
done
