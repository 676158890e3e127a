#!/usr/bin/env bash
# Runs the whole test suite (on the CPU through Triton's interpreter when no
# CUDA device is visible). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
