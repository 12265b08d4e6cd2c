"""Faults found by hostile tests (issue 44, item 5), each driven as it was
found: a real kernel over the Jupyter protocol, real ranks, real signals."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from cases import DAEMONS, alive
from kernel_harness import wait_until

pytestmark = pytest.mark.timeout(300)


# -- kill -9 of the launcher ---------------------------------------------------------------

ESCAPE = DAEMONS + r"""
import subprocess
def escape():
    '''A child in a session of its own, and a chain of two double-forked daemons.'''
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    r, w = os.pipe()
    start_daemons(2, w)
    return [child.pid, *read_pids(r, 2)]
"""


def _escaped_pids(text: str) -> list[int]:
    return [int(p) for line in re.findall(r"escaped ([\d ]+)", text) for p in line.split()]


def test_a_launcher_killed_mid_cell_leaves_nothing_its_ranks_started():
    """kill -9 of the launcher mid-cell: the ranks' start_new_session children and
    double-forked grandchildren ran on under init after the kernel shut down
    (5 of 5), while the error said the ranks "ended with it"."""
    from conftest import LoadedKernel
    from accel_magics.kernel_ext.process_tree import marked_processes

    k = LoadedKernel()
    try:
        k.ok(ESCAPE)
        launcher, token = k.launcher_pid(), k.launcher_token()
        killed = []

        def kill_once_escaped(text: str) -> None:
            if len(_escaped_pids(text)) == 6 and not killed:   # both ranks' three processes exist
                os.kill(launcher, signal.SIGKILL)
                killed.append(time.monotonic())

        res = k.run("%%distributed -n 2 --output text\nprint('escaped', *escape(), flush=True)\n"
                    "import time\ntime.sleep(600)\n", timeout=90, on_output=kill_once_escaped)
        pids = _escaped_pids(res.stdout)
        assert killed and len(pids) == 6, res.stdout
        assert res.error["ename"] == "LauncherError", res.error_text
        # What the message says is true when it is said.
        assert "ended with it" in res.error["evalue"] and not alive(pids), (res.error["evalue"], alive(pids))
        assert "the kernel ended what they had started outside its tree" in res.error["evalue"], \
            res.error["evalue"]
        wait_until(lambda: not marked_processes(token), 15 - (time.monotonic() - killed[0]),
                   "every process of the killed launcher to be gone")
    finally:
        k.shutdown()


def test_a_launcher_killed_between_cells_leaves_nothing_its_background_run_started(tmp_path):
    """The same kill while no cell runs (a background run holds the escaped
    processes): nothing noticed until the next cell, which may never come."""
    from conftest import LoadedKernel
    from accel_magics.kernel_ext.process_tree import marked_processes

    k = LoadedKernel()
    try:
        k.ok(ESCAPE)
        launcher, token = k.launcher_pid(), k.launcher_token()
        report = tmp_path / "escaped"
        k.ok("%%distributed -n 2 --background --output text\n"
             f"with open({str(report)!r}, 'a') as f:\n    print('escaped', *escape(), file=f)\n"
             "import time\ntime.sleep(600)\n")
        k.ok("h = _")

        def escaped() -> list:
            return _escaped_pids(report.read_text()) if report.exists() else []

        wait_until(lambda: len(escaped()) == 6, 60, "both ranks' escaped processes to start")
        pids = escaped()
        os.kill(launcher, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not alive(pids) and not marked_processes(token), 15 - (time.monotonic() - killed),
                   "every process of the killed launcher to be gone, with no cell run")
        assert k.ok("h._run.wait(60)").result == "True"
        assert k.ok("h.status").result == "'failed'"
        assert "[rank 1] again" in k.ok("%%distributed -n 2 --output text\nprint('again')").stdout
    finally:
        k.shutdown()
