#!/usr/bin/env bash
# The GPU suite (tests/test_gpu.py, issue 26) on this machine, with a summary:
# the GPUs seen, each test's verdict and time, the timed rows (the seed
# tutorial on GPU vs CPU, the stop inside an NCCL collective).
#
# Set-up: a venv (.venv-gpu) whose torch is a CUDA build.  A python that
# already has one (a cluster's module, a CUDA image) is used as it is, through
# --system-site-packages; otherwise torch comes from the package index, whose
# default Linux wheels are CUDA builds (the driver must be recent enough for
# them: nvidia-smi's "CUDA Version" is the newest the driver runs).  Elsewhere
# the CPU build stays the default (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
PY=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}}

echo "== GPUs"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L || true
    nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader || true
else
    echo "no nvidia-smi: no NVIDIA driver here (the suite will skip, saying why)"
fi

has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

gpus=0
if command -v nvidia-smi >/dev/null; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
if [ "$gpus" -eq 0 ]; then
    # No GPU: the CPU set-up (scripts/setup.sh); the suite skips, saying why.
    # (A CUDA build of torch is gigabytes, of no use here.)
    VENV=${VENV_CPU:-.venv} scripts/setup.sh
    . "${VENV_CPU:-.venv}/bin/activate"
else
    if [ ! -x "$VENV/bin/python" ]; then
        if has_cuda_torch "$PY"; then
            # --system-site-packages reaches the *base* interpreter's packages:
            # where $PY is itself a venv (a CUDA image's /opt/.../.venv, a
            # conda env) its torch would be lost, so its own site-packages go
            # into a .pth file of the new venv, after the venv's own.
            "$PY" -m venv --system-site-packages "$VENV" \
                || "$PY" -m venv --system-site-packages --without-pip "$VENV"   # no ensurepip (Debian's python3 without python3-venv)
            "$PY" -c "import site, sysconfig; print('\n'.join(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']])))" \
                > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/accel_magics_gpu_base.pth"
        else
            "$PY" -m venv "$VENV"
        fi
    fi
    . "$VENV/bin/activate"
    # The venv's own pip, else the creating interpreter's pip aimed at it.
    if python -m pip --version >/dev/null 2>&1; then pip=(python -m pip); else pip=("$PY" -m pip --python "$VENV/bin/python"); fi
    if ! has_cuda_torch python; then
        echo "== installing a CUDA build of torch (the index's default Linux wheel)"
        "${pip[@]}" install -q "torch>=2.1,<3" || echo "could not install torch: the tests will say why they skip"
    fi
    # Offline (an air-gapped GPU box): PIP_NO_INDEX=1 PIP_FIND_LINKS=<a folder of wheels>.
    "${pip[@]}" install -q -e ".[test]" \
        || "${pip[@]}" install -q --no-deps --no-build-isolation -e . \
        || echo "could not install accel_magics into $VENV"
    "${pip[@]}" install -q nvidia-ml-py timm 2>/dev/null || true   # optional: NVML's rows, the tutorial's model
fi

times="$OUT/accel_magics-gpu-times.jsonl"
report="$OUT/accel_magics-gpu-junit.xml"
rm -f "$times" "$report"
set +e
ACCEL_MAGICS_GPU_TIMES="$times" python -m pytest -p no:cacheprovider -m gpu tests/test_gpu.py -rs \
    --junitxml="$report" "$@"
code=$?
set -e
python - "$report" "$times" <<'PY'
import json, os, sys
import xml.etree.ElementTree as ET

report, times = sys.argv[1:3]
print("\n== accel_magics GPU check")
try:
    import torch
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
except Exception as exc:
    print(f"torch: {exc}")
if os.path.exists(report):
    print(f"{'test':<78} {'s':>7}  verdict")
    for case in ET.parse(report).getroot().iter("testcase"):
        verdict = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                verdict = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                if tag == "skipped":
                    text = node.text or node.get("message") or ""
                    reason = text.split("Skipped: ", 1)[-1].rstrip("\")'")
                    verdict += f": {reason}"
        print(f"{case.get('name'):<78} {float(case.get('time', 0)):>7.1f}  {verdict}")
if os.path.exists(times):
    print("\n== timed")
    for line in open(times):
        row = json.loads(line)
        print(f"{row['name']:<50} {row['seconds']:>8.2f}")
PY
exit $code
