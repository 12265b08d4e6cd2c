"""The supervisor's samples of each rank's CPU and memory (issue 25 item 7), on real processes."""
from __future__ import annotations

import os
import signal
import time

import pytest

from accel_magics.kernel_ext.process_tree import descendants
from accel_magics.kernel_ext.supervisor.resources import ResourceSampler

pytestmark = pytest.mark.timeout(60)


def test_a_rank_that_holds_memory_and_computes_shows_both():
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # a rank: 200 MB touched, then busy, with a child that holds 50 MB more
        try:
            held = bytearray(200 << 20)
            if os.fork() == 0:
                more = bytearray(50 << 20)
                time.sleep(60)
                os._exit(len(more) & 0)
            os.write(ready_w, b"x")
            while True:
                held[0] = (held[0] + 1) % 256
        finally:
            os._exit(0)
    try:
        os.read(ready_r, 1)
        sampler = ResourceSampler()
        sampler.sample({0: pid})
        deadline = time.monotonic() + 20
        while True:
            time.sleep(0.5)   # a rate over a wall-clock window, not a synchronisation
            got = sampler.sample({0: pid})
            cpu, rss, gpu, busy = got[0]
            if rss >= 240 << 20 or time.monotonic() > deadline:
                break
        assert rss >= 240 << 20, rss                   # the rank's 200 MB and its child's 50 MB
        assert cpu > 5, cpu                            # it computes (a loaded CI machine shares the core)
        assert gpu is None and busy is None, (gpu, busy)   # no GPU here: no GPU columns
        assert sampler.sample({1: 999_999_999}) == {}  # a rank that is gone is left out
    finally:
        for p in [*descendants(pid), pid]:   # the child it started too: nothing left behind
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(pid, 0)
