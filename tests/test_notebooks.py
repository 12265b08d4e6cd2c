"""The regression notebooks can catch regressions: a changed rank output fails nbval."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")

pytestmark = pytest.mark.timeout(300)


def _nbval(path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--nbval",
         "--nbval-sanitize-with", os.path.join(NOTEBOOKS, "sanitize.cfg"), path],
        capture_output=True, text=True, cwd=os.path.dirname(path), timeout=240,
    )


def _distributed_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%distributed")]


def test_stored_outputs_are_compared_for_distributed_cells():
    compared = 0
    for name in os.listdir(NOTEBOOKS):
        if name.endswith(".ipynb"):
            nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
            compared += sum(1 for c in _distributed_cells(nb) if any(o.get("text") or o.get("evalue")
                                                                      for o in c.outputs))
            assert not any("nbval-ignore-output" in c.metadata.get("tags", []) for c in nb.cells), name
    assert compared >= 3


def test_a_changed_rank_output_fails_nbval(tmp_path):
    original = os.path.join(NOTEBOOKS, "quickstart.ipynb")
    same = tmp_path / "same.ipynb"
    shutil.copy(original, same)
    ok = _nbval(str(same))
    assert ok.returncode == 0, ok.stdout[-3000:]

    nb = nbformat.read(original, as_version=4)
    cell = _distributed_cells(nb)[0]
    stream = next(o for o in cell.outputs if o.output_type == "stream")
    assert "sum = 30" in stream.text
    stream.text = stream.text.replace("sum = 30", "sum = 31", 1)
    changed = tmp_path / "changed.ipynb"
    nbformat.write(nb, changed)
    bad = _nbval(str(changed))
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert "mismatch 'stdout'" in bad.stdout and "sum = 31" in bad.stdout
