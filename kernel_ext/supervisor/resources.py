"""Runs in a supervisor: what each of its ranks uses, sampled a few times a second.

Why: a user debugging an out-of-memory error or a straggler wants to see, per
rank, how much memory it holds and whether it computes, while it runs; no
peer shows it.  Read from /proc (a rank and the processes it started, a
DataLoader's workers included: their CPU counts, their resident memory too,
pages shared after the fork counted once per process, as ``top`` does), and
from NVML where an NVIDIA GPU and pynvml are there (GPU memory per process).
Never from CUDA: the supervisor must not initialise it.  A rank that is gone
is left out; nothing here raises.
"""
from __future__ import annotations

import os
import time
from typing import Optional

from ..gpu_memory import GpuMemory
from ..process_tree import descendants, stat_fields

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_and_rss(pid: int) -> Optional[tuple[float, int]]:
    """(CPU seconds, resident bytes) of one process; None if gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK, int(fields[21]) * _PAGE


def usage(pid: int) -> Optional[tuple[float, int, list[int]]]:
    """(CPU seconds, resident bytes, the pids counted) of a rank and the
    processes it started; None if it is gone."""
    own = _cpu_and_rss(pid)
    if own is None:
        return None
    cpu, rss = own
    family = [pid]
    for child in descendants(pid):
        more = _cpu_and_rss(child)
        if more is not None:
            cpu, rss = cpu + more[0], rss + more[1]
            family.append(child)
    return cpu, rss, family


class ResourceSampler:
    """Each call of :meth:`sample`: rank -> [CPU % of one core since the last
    sample, resident bytes, GPU bytes or None, GPU % busy or None]."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[float, float]] = {}   # pid -> (CPU seconds, when)
        self.gpu: Optional[GpuMemory] = None   # made at the first sample: a run that ends sooner pays nothing

    def sample(self, ranks: dict[int, int]) -> dict[int, list]:
        """``ranks``: rank -> pid of the ranks still running."""
        if self.gpu is None:
            self.gpu = GpuMemory()
        gpu = self.gpu.used()
        busy = self.gpu.busy() if gpu else {}
        now = time.monotonic()
        out = {}
        for rank, pid in ranks.items():
            got = usage(pid)
            if got is None:
                continue
            cpu, rss, family = got
            before = self.last.get(pid)
            self.last[pid] = (cpu, now)
            percent = 0.0 if before is None or now <= before[1] else 100.0 * (cpu - before[0]) / (now - before[1])
            held = sum(gpu.get(p, 0) for p in family) if gpu else None
            used = [busy[p] for p in family if p in busy]
            out[rank] = [round(max(0.0, percent), 1), rss, held, max(used) if used else None]
        return out
