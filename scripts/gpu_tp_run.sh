#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine (the device tool's nvidia-h200-x2 kind), writing logs and JSON
# under $OUT.  Stages, each well within one 10-minute command:
#   bash scripts/gpu_tp_run.sh tests       # tests/test_sharding.py compiled: JAX shard_map over 2 GPUs
#                                          #   (jax-triton), torch over 2 NCCL processes -> tp_pytest.log
#   bash scripts/gpu_tp_run.sh demo-jax    # the demo at production geometry (8 requests x 32K, 64 steps),
#   bash scripts/gpu_tp_run.sh demo-torch  #   KV heads over 2 GPUs vs 1 GPU: tokens compared -> tp_demo_*.log
#   bash scripts/gpu_tp_run.sh bench       # benchmarks/bench_tp.py: per-GPU step at 1/8/64/256 requests,
#                                          #   128K, 1 vs 2 GPUs, all-reduce apart -> tp_bench.log, tp.json
#   bash scripts/gpu_tp_run.sh bench-jax   # the same step in JAX (shard_map, fori_loop) -> tp_bench_jax.log,
#                                          #   tp_jax.json
#   bash scripts/gpu_tp_run.sh all         # all five in turn (may not fit one 10-minute command)
# Expects the jax-triton 0.3.1 wheel in .whl/ (pip download --no-deps jax-triton==0.3.1), as gpu_run.sh.
# NCCL's NVLink multicast (NVLS) stays off, as the device tool requires.
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
mkdir -p "$OUT"
STAGE=${1:-all}
DEMO_ARGS=${DEMO_ARGS:---requests 8 --context 32768 --steps 64}
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/qsa_path && ln -sfn "$PWD/kernels" /tmp/qsa_path/qsa_kernels
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/tp_gpu.txt"
nvidia-smi topo -m >> "$OUT/tp_gpu.txt" 2>&1
python3 -c "import torch, jax, triton, jax_triton; print(torch.__version__, jax.__version__, triton.__version__, jax_triton.__version__, jax.devices(), torch.cuda.device_count())" | tee -a "$OUT/tp_gpu.txt"
GPUS=$(nvidia-smi --list-gpus | wc -l)
if [ "$GPUS" -lt 2 ]; then echo "needs 2 GPUs, found $GPUS" | tee -a "$OUT/tp_gpu.txt"; exit 2; fi

stage() {  # name, log, command...
  local name=$1 log=$2; shift 2
  local start=$(date +%s)
  echo "=== $name: $*" | tee -a "$OUT/tp_gpu.txt"
  "$@" > "$OUT/$log" 2>&1
  local rc=$?
  tail -25 "$OUT/$log"
  echo "$name: exit $rc, wall $(( $(date +%s) - start )) s" | tee -a "$OUT/tp_gpu.txt"
}

case "$STAGE" in tests|all)
  stage tests tp_pytest.log python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py -rfEs ;;
esac
case "$STAGE" in demo-jax|all)
  stage demo-jax tp_demo_jax.log python3 examples/tensor_parallel.py --framework jax --tensor-parallel 2 \
    --gpu-production $DEMO_ARGS ;;
esac
case "$STAGE" in demo-torch|all)
  stage demo-torch tp_demo_torch.log python3 examples/tensor_parallel.py --framework torch --tensor-parallel 2 \
    --gpu-production $DEMO_ARGS
  # Should capturing NCCL's all-reduce in a CUDA graph fail, the same run with eager steps:
  grep -q "^OK" "$OUT/tp_demo_torch.log" || stage demo-torch-eager tp_demo_torch_eager.log python3 \
    examples/tensor_parallel.py --framework torch --tensor-parallel 2 --gpu-production --no-graphs $DEMO_ARGS ;;
esac
case "$STAGE" in bench|all)
  stage bench tp_bench.log python3 benchmarks/bench_tp.py --frameworks torch --json "$OUT/tp.json" ;;
esac
case "$STAGE" in bench-jax|all)
  stage bench-jax tp_bench_jax.log python3 benchmarks/bench_tp.py --frameworks jax --json "$OUT/tp_jax.json" ;;
esac
