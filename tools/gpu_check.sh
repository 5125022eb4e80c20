#!/bin/bash
# The GPU paths this machine can check, in at most ten minutes: bash tools/gpu_check.sh
# (tools/gpu_check.py prints a table; docs/gpus.md says what each path is and how far it is verified)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec timeout 600 "$PY" tools/gpu_check.py "$@"
