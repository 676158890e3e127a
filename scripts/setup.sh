#!/usr/bin/env bash
# Creates a virtual environment (once) with everything the demo and the tests
# need: torch, then this package with its test extra (editable) and a Triton.
#   bash scripts/setup.sh                     # .venv, triton 3.6.0 (the oldest supported)
#   QSA_VENV=.venv-newest QSA_TRITON="triton>=3.9,<3.10" bash scripts/setup.sh
# (also QSA_TORCH, default torch==2.13.0, and QSA_TORCH_INDEX, the CPU index).
#
# torch: PyTorch's CPU wheel index when this machine reaches it (asked with a
# short timeout; a CPU build of ~200 MB), else pip's configured index as it is
# (PyPI: on Linux x86-64 the CUDA build, several GB, which also runs on the
# CPU; a wheel in pip's find-links is taken from there).  Triton: a torch that
# depends on Triton (a CUDA build) brought the one it was built with, which is
# kept; otherwise QSA_TRITON.  tests/test_packaging.py resolves these installs
# against PyPI: change the two together.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${QSA_VENV:-.venv}
TORCH=${QSA_TORCH:-torch==2.13.0}
TRITON=${QSA_TRITON:-triton==3.6.0}
CPU_INDEX=${QSA_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# The Triton this environment must have: the installed torch's own pin, if any, else $TRITON.
# Prints it; fails (before the setup's installs: packaging absent) when it cannot tell.
wanted_triton() {
  "$VENV/bin/python" - "$TRITON" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
pins = [r for r in map(Requirement, requires("torch") or []) if r.name == "triton"
        and (r.marker is None or r.marker.evaluate({"extra": ""}))]
print(f"{pins[0].name}{pins[0].specifier}" if pins else sys.argv[1])  # without its marker
PY
}
# Set up already when everything imports and torch and Triton are the ones asked for.
if ! "$VENV/bin/python" - "$TORCH" "$(wanted_triton 2>/dev/null || echo "$TRITON")" >/dev/null 2>&1 <<'PY'
import sys
import hypothesis, jax, mypy, pytest, qsa_jax, qsa_torch, torch, transformers, triton, xdist
from packaging.requirements import Requirement
torch_wanted, triton_wanted = map(Requirement, sys.argv[1:3])
sys.exit(0 if torch_wanted.specifier.contains(torch.__version__)
         and triton_wanted.specifier.contains(triton.__version__) else 1)
PY
then
  echo "setting up $VENV ($TORCH, Triton, jax, test tools)..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if "$VENV/bin/python" - "$CPU_INDEX" <<'PY'
import sys, urllib.request
try:  # one request with a short timeout: a machine that reaches only PyPI falls back at once
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception as error:
    print(f"PyTorch's CPU wheel index ({sys.argv[1]}) is out of reach ({error.__class__.__name__}):",
          "torch comes from pip's configured index (from PyPI itself, on Linux x86-64: the CUDA build, several GB)",
          file=sys.stderr)
    sys.exit(1)
PY
  then
    "$VENV/bin/python" -m pip install -q --index-url "$CPU_INDEX" "$TORCH" \
      || "$VENV/bin/python" -m pip install -q "$TORCH"
  else
    "$VENV/bin/python" -m pip install -q "$TORCH"
  fi
  # packaging first: wanted_triton reads torch's requirements with it.
  "$VENV/bin/python" -m pip install -q packaging
  triton=$(wanted_triton)
  if [ "$triton" != "$TRITON" ]; then
    echo "this torch (a CUDA build) pins $triton: installing that, not $TRITON" >&2
  fi
  # The CPU interpreter needs NumPy < 2.4 (docs/design.md); the distribution pins none.
  "$VENV/bin/python" -m pip install -q -c scripts/constraints-cpu.txt -e ".[test]" "$triton" packaging
fi
