#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit tests, end-to-end
# tests in real kernels, and the regression notebooks under nbval.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
python -m pytest "$@"
