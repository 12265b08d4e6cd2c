"""Terminal IPython (no Jupyter kernel, no widgets): the magic works in text."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def test_terminal_ipython_prints_rank_lines_and_the_result():
    code = ("ip = get_ipython(); ip.run_line_magic('load_ext', 'accel_magics'); "
            "ip.run_cell_magic('distributed', '-n 2', "
            "'import os\\nprint(\"hi from\", os.environ[\"RANK\"])\\n40 + 2')")
    ipython = os.path.join(os.path.dirname(sys.executable), "ipython")
    out = subprocess.run([ipython, "--quick", "--colors=NoColor", "-c", code],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert "[rank 0] hi from 0" in out.stdout and "[rank 1] hi from 1" in out.stdout
    assert "42" in out.stdout.splitlines()[-1]
