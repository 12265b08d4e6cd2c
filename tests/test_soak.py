"""Soak (``-m slow``): 248 mixed runs in one kernel, the hard cases included
(sessions, background runs, re-initialised process groups and ranks that only
wait after their peers finished among them).

Every run must end within its own bound (the timeout it was given + 10 s, or
a few seconds for runs without one), and after every run the kernel's
processes (escaped ones included), ports, temp files, open files, threads,
shared memory (/dev/shm, memfds) are back at their baseline.
"""
from __future__ import annotations

import os
import random
import time

import pytest

from cases import SETUP, memfds, run_case
from kernel_harness import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _shm() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


KINDS = {"ok": 60, "fail": 30, "interrupt": 20, "timeout": 15, "ddp": 40, "leave": 10, "stall": 8,
         "long_lines": 8, "daemons": 8, "leave_group": 6, "sigstop": 3, "sigstop_interrupt": 3,
         "big_global_interrupt": 4, "huge_error": 5, "session": 6, "background": 6, "reinit": 8, "quiet": 4,
         "skip_round": 4}


def test_soak_248_mixed_runs_in_one_kernel(clean_kernel):
    k = clean_kernel
    for setup in SETUP:
        k.ok(setup)
    for kind in KINDS:   # once each first: first uses (the widget module, ...) open files for good
        run_case(k, kind)
        k.assert_no_leaks()
    kinds = [kind for kind, n in KINDS.items() for _ in range(n)]
    assert len(kinds) == 248
    random.Random(12).shuffle(kinds)
    base = None
    worst = {}
    for i, kind in enumerate(kinds):
        started = time.monotonic()
        bound = run_case(k, kind)
        took = time.monotonic() - started
        worst[kind] = max(worst.get(kind, 0.0), took)
        assert took < bound, f"run {i} ({kind}) kept the kernel {took:.1f}s (bound {bound}s)"
        k.assert_no_leaks()
        now = (_fds(k.pid), _threads(k.pid), _shm(), memfds(k.pid))
        if base is None:
            base = now
        if now[0] > base[0] + 2:
            # A background run's sockets are closed by ZMQ's I/O thread, a moment
            # after the run is over (CI, once in 248 runs): a leak stays, that does not.
            wait_until(lambda: _fds(k.pid) <= base[0] + 2, 10, "the kernel's open files to settle")
            now = (_fds(k.pid), *now[1:])
        assert now[0] <= base[0] + 2, f"run {i} ({kind}): the kernel's open files grew {base[0]} -> {now[0]}"
        assert now[1] <= base[1], f"run {i} ({kind}): the kernel's threads grew {base[1]} -> {now[1]}"
        assert now[2] == base[2], f"run {i} ({kind}): /dev/shm changed: {now[2] ^ base[2]}"
        # big's memfd is kept across cells while the kernel holds it: one, never one per run
        assert now[3] <= 1, f"run {i} ({kind}): a shared-memory global leaked ({now[3]} memfds)"
    print("slowest run of each kind (s):", {kind: round(t, 1) for kind, t in sorted(worst.items())})
