#!/usr/bin/env bash
# One device call for the adapters' issues (54, 56) and the composing attention (50): the GPU tests
# of the changed code, then the benchmarks, everything under $OUT (at most 8 files come back).
#   bash scripts/gpu_adapters_run.sh
# Expects the jax-triton 0.3.1 wheel in .whl/ (pip download --no-deps jax-triton==0.3.1).
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/qsa_path && ln -sfn "$PWD/kernels" /tmp/qsa_path/qsa_kernels
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv; git log -1 --format=%H 2>/dev/null;
  python3 -c "import torch, jax, triton, jax_triton; print(torch.__version__, jax.__version__, triton.__version__, jax_triton.__version__)"; } > "$OUT/gpu.txt" 2>&1
start=$(date +%s)
# The GPU cases of the changed code (the engine pattern at 1, 8, 64 requests x 128K; LSE, sinks and
# head dims at production shapes; merge; the step's production geometry and JAX lowerings; ops).
timeout 290 python3 -m pytest -q -p no:cacheprovider -rfEs \
  tests/test_dynamic_shapes.py tests/test_merge.py tests/test_tensor_kinds.py tests/test_binding.py \
  "tests/test_attention.py" "tests/test_step.py" -m "gpu or not gpu" \
  -k "engine or gpu or production or lse or sink or head_dim or merge or negative or kinds or binding or one_compiled" \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc $? wall $(( $(date +%s) - start )) s" >> "$OUT/gpu.txt"
shapes=decode:1:131072,decode:8:131072,decode:64:131072
start=$(date +%s)
timeout 130 python3 benchmarks/bench_step.py --shapes $shapes --engine-pattern --skip-compile --skip-jax \
  --json "$OUT/step_engine.json" > "$OUT/bench.log" 2>&1
echo "bench_step (accelerated) rc $? wall $(( $(date +%s) - start )) s" >> "$OUT/gpu.txt"
start=$(date +%s)
QSA_ACCELERATE=0 timeout 75 python3 benchmarks/bench_step.py --shapes decode:1:131072,decode:8:131072 --skip-compile \
  --skip-jax --json "$OUT/step_binding.json" >> "$OUT/bench.log" 2>&1
echo "bench_step (QSA_ACCELERATE=0) rc $? wall $(( $(date +%s) - start )) s" >> "$OUT/gpu.txt"
start=$(date +%s)
timeout 60 python3 benchmarks/bench_sparse_attention.py --only decode --json "$OUT/attention_options.json" \
  >> "$OUT/bench.log" 2>&1
echo "bench_sparse_attention rc $? wall $(( $(date +%s) - start )) s" >> "$OUT/gpu.txt"
