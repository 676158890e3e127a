#!/usr/bin/env bash
# Creates .venv (once) with everything the demo and the tests need on a
# CPU-only machine: torch's CPU wheel first (an unpinned torch would pull a
# multi-GB CUDA build), then this package with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, jax, triton, pytest, hypothesis, qsa_torch, qsa_jax" >/dev/null 2>&1; then
  echo "setting up .venv (torch CPU, triton, jax, test tools)..." >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # The CPU interpreter needs NumPy < 2.4 (DESIGN.md); the distribution pins none.
  .venv/bin/python -m pip install -q -c scripts/constraints-cpu.txt -e ".[test]"
fi
