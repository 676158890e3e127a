#!/usr/bin/env bash
# Creates a virtual environment (once) with everything the demo and the tests
# need on a CPU-only machine: torch's CPU wheel first (an unpinned torch would
# pull a multi-GB CUDA build), then this package with its test extra
# (editable) and the chosen Triton.
#   bash scripts/setup.sh                     # .venv, triton 3.6.0 (the oldest supported)
#   QSA_VENV=.venv-newest QSA_TRITON="triton>=3.9,<3.10" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${QSA_VENV:-.venv}
TRITON=${QSA_TRITON:-triton==3.6.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Set up already when everything imports and Triton is the one asked for.
if ! "$VENV/bin/python" - "$TRITON" >/dev/null 2>&1 <<'PY'
import sys
import hypothesis, jax, pytest, qsa_jax, qsa_torch, torch, triton
from packaging.requirements import Requirement
sys.exit(0 if Requirement(sys.argv[1]).specifier.contains(triton.__version__) else 1)
PY
then
  echo "setting up $VENV (torch CPU, $TRITON, jax, test tools)..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  # The CPU interpreter needs NumPy < 2.4 (docs/design.md); the distribution pins none.
  "$VENV/bin/python" -m pip install -q -c scripts/constraints-cpu.txt -e ".[test]" "$TRITON" packaging
fi
