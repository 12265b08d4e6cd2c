"""The run's full log: every line of every rank on disk, while the notebook
(and the kernel) get only the head and tail they show."""
from __future__ import annotations

import os

import pytest

from accel_magics.kernel_ext.kernel import events as ev
from accel_magics.kernel_ext.environment import LaunchConfig
from accel_magics.kernel_ext.wire.payload import build_payload
from accel_magics.kernel_ext.kernel.run import execute

pytestmark = pytest.mark.timeout(180)

FLOOD = ("%%distributed -n 2 --output text\n"
         "import os\n"
         "rank = os.environ['RANK']\n"
         "for i in range({n}):\n"
         "    print(f'line {{i}} of rank {{rank}}')\n")


def run_dir(res) -> str:
    """The log directory of the run a cell made (named after its In[N])."""
    root = os.environ["ACCEL_MAGICS_LOG_DIR"]
    # Other kernels of this test session had an In[N] too: the newest is this one's.
    # (A rank stopped before it printed has no log file: any rank's log will do.)
    found = sorted((d for d in os.listdir(root) if f"-In{res.execution_count}-" in d
                    and any(f.startswith("rank") for f in os.listdir(os.path.join(root, d)))),
                   key=lambda d: (d.split("-In")[0], os.path.getmtime(os.path.join(root, d))))
    assert found, os.listdir(root)
    return os.path.join(root, found[-1])


def log_lines(directory: str, rank: int) -> list[str]:
    with open(os.path.join(directory, f"rank{rank}.log"), encoding="utf-8") as f:
        return f.read().splitlines()


def test_a_flood_is_whole_in_the_log_and_head_and_tail_in_the_notebook(clean_kernel):
    n = 30_000
    res = clean_kernel.ok(FLOOD.format(n=n), timeout=120)
    directory = run_dir(res)
    for rank in (0, 1):
        assert log_lines(directory, rank) == [f"line {i} of rank {rank}" for i in range(n)]
        shown = [ln for ln in res.stdout.splitlines() if ln.startswith(f"[rank {rank}] ")]
        # The record: the first 200 lines, an exact count of the rest, the last 800.
        assert shown[:200] == [f"[rank {rank}] line {i} of rank {rank}" for i in range(200)]
        assert shown[200] == (f"[rank {rank}] ... {n - 1000} lines omitted; the full log is in {directory} ...")
        assert shown[201:] == [f"[rank {rank}] line {i} of rank {rank}" for i in range(n - 800, n)]


def test_a_failure_and_its_traceback_follow_the_output_in_the_log(clean_kernel):
    res = clean_kernel.run("%%distributed -n 2 --output text\n"
                           "import os\n"
                           # both ranks have printed before rank 1 raises (one line: line numbers stay)
                           "print('before', flush=True); import torch.distributed as d; "
                           "d.init_process_group('gloo'); d.barrier()\n"
                           "if os.environ['RANK'] == '1':\n"
                           "    raise ValueError('boom in the log')\n")
    assert res.status == "error"
    lines = log_lines(run_dir(res), 1)
    assert lines[0] == "before"
    assert lines[1] == "--- ValueError: boom in the log ---"
    assert "raise ValueError('boom in the log')" in "\n".join(lines[2:])
    # The traceback names the cell as the notebook numbers it.
    assert f'File "Cell In[{res.execution_count}]", line 5' in "\n".join(lines[2:])
    assert log_lines(run_dir(res), 0)[0] == "before"


def test_each_attempt_is_marked_in_the_log(clean_kernel, tmp_path):
    marker = tmp_path / "failed-once"
    res = clean_kernel.ok("%%distributed -n 2 --max_restarts 1 --output text\n"
                          "import os, pathlib\n"
                          f"marker = pathlib.Path({str(marker)!r})\n"
                          "print('attempt starts', flush=True)\n"
                          "if os.environ['RANK'] == '0' and not marker.exists():\n"
                          "    marker.touch()\n"
                          "    raise RuntimeError('first attempt fails')\n")
    assert "attempt 2 of 2" in res.stdout
    lines = log_lines(run_dir(res), 0)
    assert lines[0] == "attempt starts"
    assert lines[1] == "--- RuntimeError: first attempt fails ---"
    second = lines.index("--- attempt 2 of 2 ---")
    assert lines[second + 1] == "attempt starts"


def test_the_kernel_is_sent_an_excerpt_of_a_flood_and_an_exact_count(launcher, tmp_path):
    n = 50_000
    events = []
    src = "import os\nrank = os.environ['RANK']\nfor i in range(%d):\n    print(f'line {i} of rank {rank}')\n" % n
    execute(launcher, LaunchConfig(num_processes=2), build_payload(src, {}), on_event=events.append,
            log_dir=str(tmp_path / "run"), excerpt=(200, 800))
    for rank in (0, 1):
        outputs = [e for e in events if isinstance(e, ev.Output) and e.rank == rank]
        assert sum(e.count for e in outputs) == n                    # every line counted
        sent = [line for e in outputs for line in e.lines]
        assert len(sent) < n                                         # not every line sent
        assert sent[:200] == [f"line {i} of rank {rank}" for i in range(200)]
        assert sent[-800:] == [f"line {i} of rank {rank}" for i in range(n - 800, n)]
        assert log_lines(str(tmp_path / "run"), rank) == [f"line {i} of rank {rank}" for i in range(n)]


def test_without_an_excerpt_every_line_is_sent(launcher, tmp_path):
    n = 5_000
    events = []
    src = "import os\nfor i in range(%d):\n    print(i)\n" % n
    execute(launcher, LaunchConfig(num_processes=2), build_payload(src, {}), on_event=events.append)
    for rank in (0, 1):
        sent = [line for e in events if isinstance(e, ev.Output) and e.rank == rank for line in e.lines]
        assert sent == [str(i) for i in range(n)]


def test_the_engine_logs_each_attempt_beside_the_ranks_output_and_its_processes_in_the_launcher_log(
        launcher, tmp_path):
    """A bug report can carry what each process decided: the kernel's records of
    the run (kernel.log, in the run's directory) and the launcher's, supervisors'
    and ranks' (launcher.log); neither reaches the ranks' own output."""
    events = []
    src = ("import os\nprint('hello')\n"
           "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
           "    raise RuntimeError('first attempt only')\n")
    run = tmp_path / "run"
    execute(launcher, LaunchConfig(num_processes=2, max_restarts=1), build_payload(src, {}),
            on_event=events.append, log_dir=str(run))
    kernel_log = (run / "kernel.log").read_text()
    assert "attempt 0: failed (root cause: rank 1: RuntimeError: first attempt only)" in kernel_log, kernel_log
    assert "attempt 1 of 2 failed" in kernel_log or "attempt 1: ok" in kernel_log, kernel_log
    assert "accel_magics.kernel.run" in kernel_log and "accel_magics.kernel.placement" in kernel_log
    with open(launcher.log_path) as f:
        launcher_log = f.read()
    assert "accel_magics.supervisor" in launcher_log and "stopping its ranks (failed)" in launcher_log, launcher_log
    lines = [line for e in events if isinstance(e, ev.Output) for line in e.lines]
    assert not any("accel_magics." in line for line in lines), lines


def test_a_quiet_run_leaves_no_log_directory(launcher, tmp_path):
    run = tmp_path / "quiet"
    execute(launcher, LaunchConfig(num_processes=2), build_payload("x = 1", {}), log_dir=str(run))
    assert not run.exists()
