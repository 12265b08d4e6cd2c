#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: execute the quickstart
# notebook headless in a real kernel (a real 2-rank gloo run on CPU) and save
# the executed notebook, with the run's record, to out/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
mkdir -p out
jupyter nbconvert --to notebook --execute notebooks/quickstart.ipynb \
    --ExecutePreprocessor.timeout=300 --output-dir out --output quickstart.ipynb
python - <<'PY'
import nbformat
nb = nbformat.read("out/quickstart.ipynb", as_version=4)
text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
print(text)
assert "[rank 1]" in text, "the distributed run produced no rank output"
print("quickstart OK: executed notebook saved to out/quickstart.ipynb")
PY
