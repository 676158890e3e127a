#!/usr/bin/env bash
# Memory safety of every QSA kernel under NVIDIA compute-sanitizer (the H200 machine):
#   memcheck_torch   memcheck,  qsa_torch, every function, GPU shapes, caches past 2**31 elements
#   memcheck_jax     memcheck,  qsa_jax under jax.jit (jax-triton), the same cases
#   racecheck_torch  racecheck, the kernels with shared memory (scores, top-k, selection,
#                    attention: tl.dot, reductions, histograms), small shapes
# The runs are separate processes on the one GPU and go in parallel, each bounded by
# SANITIZE_TIMEOUT seconds (default 200), so the whole script stays under 4 minutes.
#
#   bash scripts/sanitize.sh [OUT_DIR]        # default: $OUT, else /tmp/qsa_sanitize
#   SANITIZE_RUNS="memcheck_torch" bash scripts/sanitize.sh   # a subset
#
# Writes OUT_DIR/sanitize_summary.txt and .json (per run: exit status, ERROR SUMMARY,
# kernels covered, cases passed/failed, first errors), one program log and one sanitizer
# log per run, and prints the ERROR SUMMARY lines.  Exits 0 only if every run finished
# with 0 errors and every case passed.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/qsa_sanitize}}
mkdir -p "$OUT_DIR"
RUNS=${SANITIZE_RUNS:-memcheck_torch memcheck_jax racecheck_torch}
LIMIT=${SANITIZE_TIMEOUT:-200}

SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
[ -z "$SANITIZER" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SANITIZER=/usr/local/cuda/bin/compute-sanitizer
[ -z "$SANITIZER" ] && SANITIZER=$(ls /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)
if [ -z "$SANITIZER" ]; then
  echo "sanitize.sh: compute-sanitizer not found (PATH, /usr/local/cuda/bin)" | tee "$OUT_DIR/sanitize_summary.txt"
  exit 2
fi

# The environment of scripts/gpu_run.sh: the checkout's packages (kernels/ as qsa_kernels)
# and jax-triton from the carried wheel in .whl/.
mkdir -p /tmp/qsa_path && ln -sfn "$PWD/kernels" /tmp/qsa_path/qsa_kernels
export PYTHONPATH="$PWD:/tmp/qsa_path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import jax_triton" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
# Every array its own allocation (no caching allocator, no XLA arena): an access past an
# array is then outside every allocation, which is what memcheck sees.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 XLA_PYTHON_CLIENT_ALLOCATOR=platform
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

"$SANITIZER" --version 2>&1 | tail -1 | tee "$OUT_DIR/sanitizer_version.txt"
# API errors (benign probing by the frameworks) are not kernel memory errors: not counted.
COMMON=(--print-limit 100 --report-api-errors no --show-backtrace device)

run() {  # run NAME TOOL ARGS... : one sanitized process, bounded by LIMIT
  local name=$1 tool=$2 start
  shift 2
  start=$(date +%s)
  timeout -k 10 "$LIMIT" "$SANITIZER" --tool "$tool" "${COMMON[@]}" --log-file "$OUT_DIR/$name.sanitizer.log" \
    python3 scripts/sanitize.py "$@" > "$OUT_DIR/$name.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" > "$OUT_DIR/$name.status"
}

start=$(date +%s)
for name in $RUNS; do
  case $name in
    memcheck_torch)  run "$name" memcheck --framework torch & ;;
    memcheck_jax)    run "$name" memcheck --framework jax & ;;
    racecheck_torch) run "$name" racecheck --framework torch --functions scores,topk,select,attention --small --no-big & ;;
    *) echo "sanitize.sh: unknown run $name" >&2 ;;
  esac
done
wait

python3 - "$OUT_DIR" "$LIMIT" "$(( $(date +%s) - start ))" $RUNS <<'EOF'
import json, os, re, sys

out_dir, limit, seconds, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]

def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""

report, lines, ok = [], [], True
for name in runs:
    tool, framework = name.split("_")
    status = read(os.path.join(out_dir, name + ".status")).split()
    rc, wall = (int(status[0]), int(status[1])) if len(status) == 2 else (None, None)
    tool_log = read(os.path.join(out_dir, name + ".sanitizer.log"))
    program_log = read(os.path.join(out_dir, name + ".log"))
    summaries = re.findall(r"^=+ (?:ERROR|RACECHECK) SUMMARY:.*$", tool_log, re.M)
    # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
    errors = (re.search(r"ERROR SUMMARY: (\d+) error", tool_log)
              or re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", tool_log))
    errors = int(errors.group(1)) if errors else None
    result = re.search(r"^SANITIZE RESULT (\{.*\})$", program_log, re.M)
    if result:
        result = json.loads(result.group(1))
    else:  # cut short (timeout, crash): what the per-case lines say
        result = dict(cases_passed=re.findall(r"^case (\S+): ok", program_log, re.M),
                      cases_failed=re.findall(r"^case (\S+): FAILED", program_log, re.M),
                      kernels=sorted({k for line in re.findall(r"; kernels: (.*)$", program_log, re.M)
                                      for k in line.split()}))
    first_errors = [l for l in tool_log.splitlines()
                    if re.search(r"Invalid __|Error|error|hazard|Race", l) and "SUMMARY" not in l][:12]
    timed_out = rc in (124, 137)
    entry = dict(name=name, tool=tool, framework=framework, exit_status=rc, seconds=wall, timed_out=timed_out,
                 error_summary=summaries, errors=errors, kernels=result.get("kernels", []),
                 cases_passed=result.get("cases_passed", []), cases_failed=result.get("cases_failed", []),
                 first_errors=first_errors)
    report.append(entry)
    ok &= errors == 0 and not entry["cases_failed"] and rc == 0
    state = "TIMED OUT" if timed_out else f"exit {rc}"
    lines.append(f"{name}: {state}, {wall} s; " + ("; ".join(s.strip("= ") for s in summaries) or "no ERROR SUMMARY"))
    lines.append(f"  cases: {len(entry['cases_passed'])} passed, {len(entry['cases_failed'])} failed "
                 f"{entry['cases_failed'] or ''}")
    lines.append(f"  kernels ({len(entry['kernels'])}): {' '.join(entry['kernels'])}")
    lines += ["  " + l for l in first_errors[:6]]
covered = sorted({k for r in report for k in r["kernels"]})
total = sum(r["errors"] or 0 for r in report)
lines.append(f"kernels covered ({len(covered)}): {' '.join(covered)}")
lines.append(f"errors found: {total}; wall {seconds} s (limit {limit} s per run, runs in parallel); "
             + ("CLEAN" if ok else "NOT CLEAN"))
with open(os.path.join(out_dir, "sanitize_summary.json"), "w") as f:
    json.dump(dict(runs=report, kernels_covered=covered, errors_total=total, clean=bool(ok), seconds=seconds), f, indent=1)
with open(os.path.join(out_dir, "sanitize_summary.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if ok else 1)
EOF
