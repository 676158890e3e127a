#!/usr/bin/env bash
# One device call for the adapters (issue 54) and the composing attention's head dims (issue 50): the GPU
# tests of the changed code, compute-sanitizer on the padded head dims, then the benchmarks; everything
# under $OUT (at most 8 files come back).
#   QSA_COMMIT=<hash> bash scripts/gpu_adapters_run.sh
# Expects the jax-triton 0.3.1 wheel in .whl/ (pip download --no-deps jax-triton==0.3.1).
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/qsa_path && ln -sfn "$PWD/kernels" /tmp/qsa_path/qsa_kernels
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv; echo "commit ${QSA_COMMIT:-unknown}";
  python3 -c "import torch, jax, triton, jax_triton; print(torch.__version__, jax.__version__, triton.__version__, jax_triton.__version__)"; } > "$OUT/gpu.txt" 2>&1
lap() {  # lap LABEL RC START
  echo "$1 rc $2 wall $(( $(date +%s) - $3 )) s" >> "$OUT/gpu.txt"
}
# The GPU cases of the changed code: stage 1 and the step at every head dim, the generated fused
# kernel, the public functions built from the declarations, the tests reshaped by the duplicate scan.
start=$(date +%s)
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_rope_cache.py tests/test_step.py \
  tests/test_executor.py tests/test_declarations.py tests/test_api.py -k "even_head_dim or padded_lanes or \
  metadata_to_skip or fused or equals_stages or production or public or signature or both_adapters" \
  > "$OUT/pytest.log" 2>&1
lap "pytest rope/step/executor/api" $? "$start"
if [ "${QSA_SKIP_GPU_MARKED:-0}" != 1 ]; then  # QSA_SKIP_GPU_MARKED=1: not run (and no lap line)
  start=$(date +%s)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_fp8.py tests/test_topk.py \
    tests/test_bad_arguments.py tests/test_dynamic_shapes.py -m gpu >> "$OUT/pytest.log" 2>&1
  lap "pytest gpu-marked fp8/topk/bad_arguments/dynamic_shapes" $? "$start"
fi
# compute-sanitizer memcheck on stage 1, attention and the step (the padded head dims are their last cases).
start=$(date +%s)
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 "$SANITIZER" --tool memcheck --print-limit 20 \
  python3 scripts/sanitize.py --framework torch --functions rope,attention,step --no-big > "$OUT/sanitize.log" 2>&1
lap "memcheck rope/attention/step" $? "$start"
# Stage 1's cost at each head dim (the padded tile at 80, 96 and 192 beside the powers of two).
start=$(date +%s)
timeout 60 python3 benchmarks/bench_rope_cache.py --skip-jax --geometries 24,2,256 24,2,192 24,2,128 24,2,96 \
  24,2,80 --tokens 1 2048 8192 --pages 64 --json "$OUT/rope_cache_head_dims.json" > "$OUT/bench.log" 2>&1
lap "bench_rope_cache head dims" $? "$start"
# Host µs of the eager step with the accelerator and with the binding alone, and the engine pattern.
[ "${QSA_SKIP_STEP_BENCH:-0}" = 1 ] && exit 0  # a short device budget: the tests, memcheck and stage 1 only
shapes=decode:1:131072,decode:8:131072,decode:64:131072
start=$(date +%s)
timeout 100 python3 benchmarks/bench_step.py --shapes $shapes --engine-pattern --skip-compile --skip-jax \
  --json "$OUT/step_engine.json" >> "$OUT/bench.log" 2>&1
lap "bench_step (accelerated)" $? "$start"
start=$(date +%s)
QSA_ACCELERATE=0 timeout 60 python3 benchmarks/bench_step.py --shapes decode:1:131072,decode:8:131072 --skip-compile \
  --skip-jax --json "$OUT/step_binding_alone.json" >> "$OUT/bench.log" 2>&1
lap "bench_step (QSA_ACCELERATE=0)" $? "$start"
