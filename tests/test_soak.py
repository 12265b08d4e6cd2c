"""Soak (``-m slow``): 220 mixed runs in one kernel, the hard cases included.

Every run must end within its own bound (the timeout it was given + 10 s, or
a few seconds for runs without one), and after every run the kernel's
processes (escaped ones included), ports, temp files, open files, threads,
shared memory (/dev/shm, memfds) are back at their baseline.
"""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from test_hardening import DAEMONS, DDP_TRAIN, STUCK_IN_NATIVE, _alive, _memfds, _stopped_supervisor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _shm() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _press_stop_when(k, predicate, what: str):
    """Press the stop button (from a thread) once ``predicate()`` holds."""
    from kernel_harness import wait_until

    def press():
        wait_until(predicate, 60, what)
        k.interrupt()

    thread = threading.Thread(target=press, daemon=True)
    thread.start()
    return thread


def _run_kind(k, kind: str):
    """Run one case; returns (result, the bound in seconds it had to end within)."""
    if kind == "ok":
        res = k.run("%%distributed -n 2 --output text\nimport os\nprint('ok', os.environ['RANK'])", timeout=60)
        assert res.status == "ok" and "[rank 1] ok 1" in res.stdout, res.error_text
        return 10
    if kind == "fail":
        res = k.run("%%distributed -n 2 --output text\nimport os, time\n"
                    "if os.environ['RANK'] == '0':\n    raise ValueError('soak')\ntime.sleep(30)\n", timeout=60)
        assert res.error["evalue"].startswith("rank 0 failed: ValueError: soak"), res.error_text
        return 10
    if kind == "interrupt":
        def on_output(text, fired=[]):
            if "[rank 0] up" in text and "[rank 1] up" in text and not fired:
                fired.append(True)
                k.interrupt()
        res = k.run("%%distributed -n 2 --output text\nprint('up', flush=True)\nimport time\ntime.sleep(60)\n",
                    on_output=on_output, timeout=60)
        assert res.error["ename"] == "RunInterrupted", res.error_text
        return 15
    if kind == "timeout":
        res = k.run("%%distributed -n 2 --output text --timeout 1\nimport time\ntime.sleep(60)\n", timeout=60)
        assert res.error["ename"] == "DistributedTimeoutError", res.error_text
        return 1 + 10
    if kind == "ddp":
        res = k.run("%%distributed -n 2 --output text --timeout 20\ntrain()\n", timeout=60)
        assert res.status == "ok" and "[rank 1] done 1 2.0" in res.stdout, res.error_text
        return 10
    if kind == "leave":
        res = k.run("%%distributed -n 2 --output text --timeout 30\n"
                    "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                    "if dist.get_rank() == 1:\n    dist.all_reduce(torch.ones(1))\n", timeout=60)
        assert res.error["ename"] == "DistributedRunError" and "already finished" in res.error["evalue"], \
            res.error_text
        return 10
    if kind == "stall":
        res = k.run("%%distributed -n 2 --output text --stall_timeout 2\nimport os\n"
                    "if os.environ['RANK'] == '1':\n    wait_in_native_code()\n", timeout=60)
        assert res.error["ename"] == "DistributedStallError", res.error_text
        return 2 + 10
    if kind == "long_lines":
        res = k.run("%%distributed -n 2 --output widget\nfor i in range(20):\n    print(list(range(3000)))\n"
                    "print('x' * 5_000_000)\n", timeout=60)
        assert res.status == "ok", res.error_text
        return 10
    if kind == "daemons":
        res = k.ok("%%distributed -n 1 --output text\nr, w = os.pipe()\nstart_daemons(2, w)\n"
                   "print('daemons', *read_pids(r, 2))\n")
        pids = [int(p) for p in res.stdout.split("daemons", 1)[1].split()]
        from kernel_harness import wait_until
        wait_until(lambda: not _alive(pids), 10, f"the daemons {pids} to be killed")
        return 10
    if kind == "leave_group":
        res = k.run("%%distributed -n 2 --output text --timeout 1\nimport os, time\n"
                    "os.setpgid(0, os.getppid())\ntime.sleep(600)\n", timeout=60)
        assert res.error["ename"] == "DistributedTimeoutError", res.error_text
        return 1 + 10
    if kind == "sigstop":
        res = k.run("%%distributed -n 2 --output text --timeout 2\nimport os, signal, time\n"
                    "if os.environ['RANK'] == '0':\n    os.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(120)\n",
                    timeout=60)
        assert res.error["ename"] == "DistributedTimeoutError" and "did not respond" in res.error_text, \
            res.error_text
        return 2 + 10
    if kind == "sigstop_interrupt":
        presser = _press_stop_when(k, lambda: _stopped_supervisor(k) is not None, "a stopped supervisor")
        res = k.run("%%distributed -n 2 --output text\nimport os, signal, time\n"
                    "if os.environ['RANK'] == '0':\n    os.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(120)\n",
                    timeout=60)
        presser.join()
        assert res.error["ename"] == "RunInterrupted", res.error_text
        return 15
    if kind == "big_global_interrupt":
        presser = _press_stop_when(k, lambda: _memfds(k.pid) > 0, "the big global in shared memory")
        res = k.run("%%distributed -n 2 --output text\nprint(big.sum(), slow)\n", timeout=60)
        presser.join()
        assert res.error["ename"] == "KeyboardInterrupt", res.error_text
        return 15
    if kind == "huge_error":
        res = k.run("%%distributed -n 2 --output text\nraise ValueError('e' * 5_000_000)\n", timeout=60)
        assert res.error["ename"] == "DistributedRunError", res.error_text
        return 10
    raise AssertionError(kind)


KINDS = {"ok": 60, "fail": 30, "interrupt": 20, "timeout": 15, "ddp": 40, "leave": 10, "stall": 8,
         "long_lines": 8, "daemons": 8, "leave_group": 6, "sigstop": 3, "sigstop_interrupt": 3,
         "big_global_interrupt": 4, "huge_error": 5}


def test_soak_220_mixed_runs_in_one_kernel(clean_kernel):
    k = clean_kernel
    k.ok(DDP_TRAIN)
    k.ok(STUCK_IN_NATIVE)
    k.ok(DAEMONS)
    k.ok("import numpy as np, time\nbig = np.ones(2_000_000)   # 16 MB: through shared memory\n"
         "class SlowToSend:\n    def __reduce__(self):\n        time.sleep(60)\n        return (SlowToSend, ())\n"
         "slow = SlowToSend()\n")
    for kind in KINDS:   # once each first: first uses (the widget module, ...) open files for good
        _run_kind(k, kind)
        k.assert_no_leaks()
    kinds = [kind for kind, n in KINDS.items() for _ in range(n)]
    assert len(kinds) == 220
    random.Random(12).shuffle(kinds)
    base = None
    worst = {}
    for i, kind in enumerate(kinds):
        started = time.monotonic()
        bound = _run_kind(k, kind)
        took = time.monotonic() - started
        worst[kind] = max(worst.get(kind, 0.0), took)
        assert took < bound, f"run {i} ({kind}) kept the kernel {took:.1f}s (bound {bound}s)"
        k.assert_no_leaks()
        now = (_fds(k.pid), _threads(k.pid), _shm(), _memfds(k.pid))
        if base is None:
            base = now
        assert now[0] <= base[0] + 2, f"run {i} ({kind}): the kernel's open files grew {base[0]} -> {now[0]}"
        assert now[1] <= base[1], f"run {i} ({kind}): the kernel's threads grew {base[1]} -> {now[1]}"
        assert now[2] == base[2], f"run {i} ({kind}): /dev/shm changed: {now[2] ^ base[2]}"
        assert now[3] == 0, f"run {i} ({kind}): a shared-memory global leaked"
    print("slowest run of each kind (s):", {kind: round(t, 1) for kind, t in sorted(worst.items())})
