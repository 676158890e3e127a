#!/usr/bin/env bash
# Runs the whole test suite (on the CPU through Triton's interpreter when no
# CUDA device is visible). Extra arguments go to pytest.  QSA_VENV and
# QSA_TRITON choose the environment (see scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${QSA_VENV:-.venv}/bin/python" -m pytest -q "$@"
