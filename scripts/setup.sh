#!/usr/bin/env bash
# Create (or reuse) a virtual environment with accel_magics and its test tools.
# The CPU build of torch is installed first: the package asks for a torch range,
# which on its own would pull a multi-GB CUDA build. Bring your own torch
# (CUDA/XPU) by installing it into the venv before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q -e '.[test,browser]'
