#!/usr/bin/env bash
# One device call for issue 51 (fp8 caches that pay): bench_fp8.py first (the step and its
# attention, bf16 beside fp8, with the card's copy rate), then the attention's launch sweep
# around the table (bf16 and fp8 at 64/256 rows, then 1/8 rows, x 128K: double-buffered K/V by
# deeper pipelines, split counts that fill one wave), then the fp8 scorer beside bf16
# (bench_select --fp8, its table in bench.log); under $OUT: gpu.txt, bench.log, sweep.log, fp8_vs_bf16.json,
# attention_sweeps.json (pytest.log with QSA_TESTS): at most 8 files come back.
#   QSA_COMMIT=<hash> bash scripts/gpu_fp8_run.sh
#   QSA_SKIP_SWEEP=1: no sweep (QSA_SWEEPS="bf16_64_256 fp8_64_256": those only; also regs_bf16,
#   regs_fp8: register caps); QSA_SKIP_SELECT=1: no scorer; QSA_SKIP_FP8=1: no bench_fp8;
#   QSA_TESTS="<pytest arguments>": also these tests, first; QSA_NCU=<BLOCK_N:warps:stages:splits>: first,
#   Nsight Compute of the table's 64-row partial launch, bf16 and fp8 (ncu_attention_decode64_*.txt;
#   the configuration given is only timed beside it: the sweep needs one).
set -u
OUT=${OUT:-/tmp/qsa_gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/qsa_path && ln -sfn "$PWD/kernels" /tmp/qsa_path/qsa_kernels
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv; echo "commit ${QSA_COMMIT:-unknown}"; } >> "$OUT/gpu.txt" 2>&1
lap() { echo "$1 rc $2 wall $(( $(date +%s) - $3 )) s" >> "$OUT/gpu.txt"; }
if [ -n "${QSA_TESTS:-}" ]; then
  start=$(date +%s)
  timeout "${QSA_TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rfEs $QSA_TESTS >> "$OUT/pytest.log" 2>&1
  lap "pytest $QSA_TESTS" $? "$start"
fi
cd benchmarks
if [ -n "${QSA_NCU:-}" ]; then
  # Nsight Compute of the table's partial launch at 64 rows x 128K, bf16 then fp8: occupancy,
  # scheduler and warp-state statistics, instruction mix, and each stall reason per issued instruction.
  for cache in bf16 fp8; do
    start=$(date +%s)
    timeout 150 ncu --clock-control none --kernel-name sparse_attention_partial_kernel --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum' \
      python3 bench_sparse_attention.py --sweep --shapes decode:64:131072 --configs "$QSA_NCU" \
      $([ $cache = fp8 ] && echo --fp8) --json /tmp/ncu_sweep.json > "$OUT/ncu_attention_decode64_$cache.txt" 2>&1
    lap "ncu $cache" $? "$start"
  done
fi
if [ "${QSA_SKIP_FP8:-0}" != 1 ]; then
  start=$(date +%s)
  timeout "${QSA_FP8_TIMEOUT:-200}" python3 bench_fp8.py --batches "${QSA_FP8_BATCHES:-1,8,64,256}" --json "$OUT/fp8_vs_bf16.json" >> "$OUT/bench.log" 2>&1
  lap "bench_fp8" $? "$start"
fi
sweep() {  # sweep LABEL TIMEOUT SHAPES CONFIGS [--fp8]: those in QSA_SWEEPS (default: all six)
  case " ${QSA_SWEEPS:-bf16_64_256 fp8_64_256 bf16_1_8 fp8_1_8 regs_bf16 regs_fp8} " in *" $1 "*) ;; *) return ;; esac
  start=$(date +%s)
  echo "=== $1" >> "$OUT/sweep.log"
  timeout "$2" python3 bench_sparse_attention.py --sweep --shapes "$3" --configs "$4" ${5:-} \
    --json "/tmp/sweeps/attention_$1.json" >> "$OUT/sweep.log" 2>&1
  lap "sweep $1" $? "$start"
}
if [ "${QSA_SKIP_SWEEP:-0}" != 1 ]; then
  mkdir -p /tmp/sweeps
  sweep bf16_64_256 "${QSA_SWEEP_TIMEOUT:-100}" decode:64:131072,decode:256:131072 \
    16:2:5:4,32:2:5:4,32:2:5:3,32:4:5:3,16:2:3:8,16:2:5:8,32:2:3:3,64:4:3:2,32:8:5:2,16:2:5,32:2:5,32:4:5,16:2:3,64:8:3
  sweep fp8_64_256 "${QSA_SWEEP_TIMEOUT:-100}" decode:64:131072,decode:256:131072 \
    64:2:3:2,64:2:3:4,64:4:5:2,32:2:5:2,32:2:5:4,32:2:5:3,16:2:5:4,16:2:5:8,64:4:3:2,32:2:5,64:2:3,64:4:5,16:2:5,16:2:3,64:4:3 --fp8
  sweep bf16_1_8 60 decode:1:131072,decode:8:131072 32:4:3,32:2:3,16:2:3,16:2:5,32:4:5,16:4:3,64:4:3,64:8:5
  sweep fp8_1_8 60 decode:1:131072,decode:8:131072 32:4:3,32:2:3,16:2:3,16:2:5,32:4:5,64:4:3,64:8:3,64:2:3 --fp8
  # Registers a thread capped (maxnreg) so that more programs fit an SM (spills per the sm_90 compile:
  # docs/performance.md, "fp8 caches"), beside the same configurations uncapped.
  sweep regs_bf16 "${QSA_SWEEP_TIMEOUT:-100}" decode:64:131072,decode:256:131072 \
    32:2:3:4,32:2:3:4:168,16:2:3:4,16:2:3:4:128,16:2:3:4:144,16:2:5:4:152,16:2:3,16:2:3::128,32:2:3::168,16:2:5::152
  sweep regs_fp8 "${QSA_SWEEP_TIMEOUT:-100}" decode:64:131072,decode:256:131072 \
    64:4:2:2,64:4:2:2:168,32:4:2:4,32:4:2:4:152,32:4:2:2:152,64:8:2:2:128,32:4:3:4:152,32:4:2::152,32:2:3::168,64:4:2::168 --fp8
  # One file for every sweep (the device returns at most 8 files): {"sweeps": {label: its JSON}}.
  python3 -c "import glob, json, os; json.dump({'sweeps': {os.path.basename(p)[10:-11]: json.load(open(p))
    for p in sorted(glob.glob('/tmp/sweeps/*_sweep.json'))}}, open('$OUT/attention_sweeps.json', 'w'), indent=1)"
fi
[ "${QSA_SKIP_SELECT:-0}" = 1 ] && exit 0
start=$(date +%s)
timeout 80 python3 bench_select.py --fp8 --shapes decode:64:131072,decode:256:131072 --json /tmp/select.json \
  >> "$OUT/bench.log" 2>&1
lap "bench_select --fp8" $? "$start"
