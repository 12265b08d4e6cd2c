"""Reliability in real kernels: hangs diagnosed, no orphans, odd output, bad input, soak."""
from __future__ import annotations

import os
import random
import socket
import time

import pytest

from cases import run_case
from kernel_harness import KernelSession, descendants, wait_until

pytestmark = pytest.mark.timeout(300)


def test_timeout_shows_where_each_rank_was(clean_kernel):
    k = clean_kernel
    k.ok("import time\ndef stuck_in_my_function():\n    while True:\n        time.sleep(0.05)")
    started = time.monotonic()
    res = k.run(
        "%%distributed -n 2 --output text --timeout 3\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 0:\n"
        "    stuck_in_my_function()\n"
        "dist.barrier()\n",
        timeout=60,
    )
    assert res.error["ename"] == "DistributedTimeoutError"
    assert "exceeded --timeout 3s" in res.error["evalue"]
    report = res.error_text
    rank0 = report.split("rank 0:")[1].split("rank 1:")[0]
    rank1 = report.split("rank 1:")[1]
    # Python and native frames (time.sleep waits in clock_nanosleep, in select before Python 3.11)
    assert "stuck_in_my_function" in rank0 and ("clock_nanosleep" in rank0 or "select in libc" in rank0), rank0
    assert "barrier" in rank1 and "stuck_in_my_function" not in rank1
    assert "kernel_ext" not in report        # the launcher's own frames are trimmed
    assert time.monotonic() - started < 15


def _start_blocked_run(k: KernelSession) -> set[int]:
    k.kc.execute("%%distributed -n 2 --output text\nprint('up', flush=True)\nimport time\ntime.sleep(600)\n")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        msg = k.kc.get_iopub_msg(timeout=120)
        if msg["msg_type"] in ("display_data", "update_display_data") and \
                "[rank 1] up" in msg["content"]["data"].get("text/plain", "") and \
                "[rank 0] up" in msg["content"]["data"].get("text/plain", ""):
            tree = descendants(k.pid)
            assert len(tree) >= 4
            return tree
    raise AssertionError("the ranks never started")


def _all_gone(tree: set[int]) -> bool:
    return not any(os.path.exists(f"/proc/{p}") for p in tree)


@pytest.mark.parametrize("how", ["shutdown", "restart"])
def test_no_orphans_after_kernel_shutdown_or_restart(how):
    k = KernelSession()
    try:
        k.ok("%load_ext accel_magics")
        tree = _start_blocked_run(k)
        if how == "shutdown":
            k.km.shutdown_kernel(now=False)
        else:
            k.km.restart_kernel(now=False)
            k.kc.wait_for_ready(timeout=60)
        wait_until(lambda: _all_gone(tree), 15, f"every process of the old kernel's runs to exit after {how}")
        if how == "restart":   # the restarted kernel works
            k.ok("%load_ext accel_magics")
            assert "[rank 1] fine" in k.ok("%%distributed -n 2 --output text\nprint('fine')", timeout=120).stdout
    finally:
        k.kc.stop_channels()
        if k.km.has_kernel:
            k.km.shutdown_kernel(now=True)


def test_binary_garbage_and_very_long_lines(clean_kernel):
    res = clean_kernel.ok(
        "%%distributed -n 2 --output text\n"
        "import os\n"
        "os.write(1, bytes(range(256)) + b'\\n')\n"
        "print('x' * 1_000_000)\n"
        "print('after')\n"
    )
    for rank in (0, 1):
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(f"[rank {rank}] ")]
        assert lines[-1] == f"[rank {rank}] after"
        # The line is cut for the notebook, saying so; the rank's log has every byte.
        long = [ln for ln in lines if "xxx" in ln]
        assert len(long) == 1 and long[0].endswith(
            f"... [{1_000_000 - 4096 + 64} more bytes of this line are in the rank's log]")
    assert clean_kernel.ok("print(1)").stdout == "1\n"


def test_reading_stdin_where_the_frontend_takes_none_is_end_of_input_said_so(clean_kernel):
    """As nbclient runs a notebook (allow_stdin off): the rank's input() reads
    end of file, and the cell says why."""
    res = clean_kernel.run("%%distributed -n 2 --output text --timeout 30\nname = input('name? ')\n", stdin=False)
    assert res.error["ename"] == "DistributedRunError"
    assert "EOFError" in res.error["evalue"], res.error_text
    assert "this frontend takes no input" in res.stderr and "(name?)" in res.stderr, res.stderr


@pytest.mark.parametrize("flags,needle", [
    ("--num_processes 1000", "more than 4x"),
    ("--master_addr no-such-host.invalid", "does not resolve"),
    ("--master_port 70000", "between 1 and 65535"),
    ("--max_restarts -1", "--max_restarts must be between 0 and 1000"),
    ("--timeout -5", "--timeout must be a positive"),
    ("--mixed_precision fp7", "invalid choice: 'fp7'"),
    ("--return 1abc", "--return expects variable names"),
])
def test_bad_flags_catalogue(clean_kernel, flags, needle):
    res = clean_kernel.run(f"%%distributed {flags}\nraise SystemExit('must not run')\n")
    assert res.error["ename"] == "UsageError", res.error_text
    assert needle in res.error["evalue"]


def test_port_in_use_is_refused(clean_kernel):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = clean_kernel.run(f"%%distributed -n 2 --master_port {port}\nraise SystemExit('must not run')\n")
    assert res.error["ename"] == "UsageError"
    assert f"--master_port {port} is already in use" in res.error["evalue"]


def test_restarts_show_the_attempt_and_the_last_root_cause(clean_kernel):
    res = clean_kernel.run(
        "%%distributed -n 2 --output text --max_restarts 2\n"
        "import os\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('attempt ' + os.environ['TORCHELASTIC_RESTART_COUNT'] + ' broke')\n"
    )
    assert res.error["ename"] == "DistributedRunError"
    assert res.error["evalue"].startswith("rank 1 failed: RuntimeError: attempt 2 broke [after 3 attempts]")
    assert "attempt 3 of 3" in res.stdout
    assert any("restarting the whole group: attempt 2 of 3" in t for t in res.live)


def _kernel_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(900)   # 100 runs, ~2 minutes here; each run has its own bound, which catches a hang
def test_soak_mixed_runs_leak_nothing(clean_kernel):
    """100 runs: success, rank failure, interrupt, timeout; nothing leaks, nothing hangs.
    (The long soak, with the hard cases, is tests/test_soak.py, -m slow.)"""
    k = clean_kernel
    kinds = ["ok"] * 40 + ["fail"] * 30 + ["interrupt"] * 15 + ["timeout"] * 15
    random.Random(1234).shuffle(kinds)
    fds_before = None
    for i, kind in enumerate(kinds):
        started = time.monotonic()
        bound = run_case(k, kind)
        assert time.monotonic() - started < bound, f"run {i} ({kind}) took too long"
        k.assert_no_leaks()
        fds = _kernel_fds(k.pid)
        if fds_before is None:
            fds_before = fds
        assert fds <= fds_before + 2, f"the kernel's open files grew from {fds_before} to {fds} after run {i}"
