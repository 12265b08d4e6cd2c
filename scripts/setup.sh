#!/usr/bin/env bash
# Create (or reuse) a virtual environment with accel_magics and its test tools.
# The CPU build of torch is installed first: the package asks for a torch range,
# which on its own would pull a multi-GB CUDA build. Bring your own torch
# (CUDA/XPU) by installing it into the venv before running this.
#
# Re-running is cheap: when the venv was set up from the same pyproject.toml
# and this script, and still imports, nothing is installed again
# (ACCEL_MAGICS_REINSTALL=1 forces it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test,browser}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
stamp="$VENV/.accel_magics-setup"
# TORCH_PINS: a pip constraints file (torch and what goes with it, e.g. .ci/torch-floor.txt);
# it replaces any constraint of pip's configuration, so releases newer than a machine's cap come from PyPI.
if [ -n "${TORCH_PINS:-}" ]; then
    export PIP_CONSTRAINT="$(cd "$(dirname "$TORCH_PINS")" && pwd)/$(basename "$TORCH_PINS")"
    TORCH_VERSION=$(sed -n 's/^torch==//p' "$TORCH_PINS")
fi
want="$(cat pyproject.toml scripts/setup.sh ${TORCH_PINS:-} | sha256sum | cut -d' ' -f1) $EXTRAS ${TORCH_VERSION:-2.13.0}"
if [ "${ACCEL_MAGICS_REINSTALL:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && python -c "import importlib.util as u; assert all(map(u.find_spec, ('torch', 'accel_magics.kernel_ext.kernel.run')))" 2>/dev/null; then
    exit 0   # up to date
fi
rm -f "$stamp"
python -m pip install -q --upgrade pip
if ! python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION:-}' or not '${TORCH_VERSION:-}'" 2>/dev/null; then
    # A torch from PyPI (TORCH_PINS: a CUDA build, gigabytes) goes in with uv when it can be had
    # (a tools venv beside this one; scripts/host_check.sh shares it and uv's cache): 36 s here
    # for torch 2.6.0 and its CUDA libraries from a cold cache, where pip took minutes. uv reads
    # no pip configuration, so the constraints are given to it; without uv, pip does it.
    uv=""
    if [ -n "${TORCH_PINS:-}" ]; then
        . scripts/find_uv.sh
        uv=$(find_uv "${UV_TOOLS:-.venv-tools}")
        [ -n "$uv" ] || echo "setup: no uv; pip installs torch ${TORCH_VERSION} (slower)"
    fi
    if [ -n "$uv" ]; then
        "$uv" pip install -q --python "$VENV/bin/python" -c "$PIP_CONSTRAINT" "torch==${TORCH_VERSION}"
    else
        python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
    fi
fi
python -m pip install -q -e ".[$EXTRAS]"
echo "$want" > "$stamp"
