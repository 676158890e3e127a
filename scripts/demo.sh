#!/usr/bin/env bash
# The main job: the end-to-end demo. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${QSA_VENV:-.venv}/bin/python" examples/demo.py "$@"
