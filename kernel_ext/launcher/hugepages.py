"""The launcher's heap moved into transparent huge pages, so that forks are cheap.

Every cell forks a supervisor from the launcher and its ranks from that
supervisor, and every one of those processes exits at the cell's end.  With
torch imported the launcher holds about 150 MB of anonymous memory in 4 KiB
pages: a fork copies tens of thousands of page-table entries and an exit
frees them again (measured on a 2-core VM: fork 7-8 ms, exit of an idle
child 7-10 ms).  With that heap in 2 MiB pages (``MADV_COLLAPSE``, Linux
6.1+) a fork copies a few hundred entries: 1.7 ms and 3.9 ms.  That is what a
cell sent as soon as the last one ended ("Run All") waits for.

Collapsing copies the memory into freshly allocated huge pages, which costs
from under a millisecond to ~40 ms per 2 MiB (a VM slow to hand out fresh
pages), so the launcher does it in steps, only while idle (see
:class:`Collapser`); a cell that arrives waits for one step at most.  Where a
step takes more CPU than ``COLLAPSE_SLOW`` (memory fragmented, or a cgroup at
its limit: the kernel compacts or reclaims for each page) the launcher stops
for good: a huge page saves a fork a few microseconds, not worth that.  Where the
kernel lacks ``MADV_COLLAPSE`` (or THP is off) ``madvise`` fails and nothing
changes.  Memory use barely moves: the pages are copied, not added (their
copies shared with an existing child are that child's until it exits).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import time
from typing import Iterable, Optional

from .. import hooks
from ..timing import COLLAPSE_SLOW

log = logging.getLogger("accel_magics.launcher")

HUGE = 2 << 20            # a PMD-sized transparent huge page on x86-64 and arm64 (4 KiB base pages)
MADV_COLLAPSE = 25


def collapsible(maps: str) -> list[tuple[int, int]]:
    """The huge-page-aligned ranges of private anonymous writable memory in a
    ``/proc/PID/maps`` text (the heap and anonymous mappings), largest first."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        path = fields[5] if len(fields) > 5 else ""
        perms = fields[1]
        if not (perms.startswith("rw") and perms[3] == "p") or path not in ("", "[heap]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        start = (start + HUGE - 1) & ~(HUGE - 1)
        end &= ~(HUGE - 1)
        if end > start:
            ranges.append((start, end))
    return sorted(ranges, key=lambda r: r[0] - r[1])


def chunks(ranges: Iterable[tuple[int, int]]) -> list[int]:
    """Each range cut into huge pages: the start address of each."""
    return [a for start, end in ranges for a in range(start, end, HUGE)]


def supported() -> bool:
    """Whether this kernel collapses anonymous memory on request: tried on a
    fresh mapping of its own (a failure on the heap can also mean memory that
    cannot be huge)."""
    import mmap

    try:
        madvise = _madvise()
        area = mmap.mmap(-1, 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError):   # pragma: no cover - not glibc/Linux
        return False
    try:
        view = ctypes.c_char.from_buffer(area)
        base = ctypes.addressof(view)
        del view
        start = (base + HUGE - 1) & ~(HUGE - 1)
        area[start - base] = 1   # one page present in the range
        return madvise(start, HUGE, MADV_COLLAPSE) == 0
    finally:
        area.close()


def unsupported() -> Optional[str]:
    """The ``hugepages`` hook's guard."""
    return None if supported() else "this kernel does not collapse memory on request (no MADV_COLLAPSE)"


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Collapser:
    """The launcher's heap collapsed one huge page per :meth:`step`.

    :meth:`plan` lists the pages (at start, and after an import grew the
    heap: only pages not tried before, so the launcher's CPU time for this is
    spent once, about 1.5 s on this VM, under 0.1 s on hardware);
    :meth:`step` collapses one; :meth:`run_for` collapses for a time budget.
    Nothing is planned where the kernel cannot collapse (:func:`supported`).
    A page that fails is skipped for good, counted as one that cannot be
    huge (``EINVAL``: not whole inside one suitable mapping) or one the kernel
    refused just then (``ENOMEM``: no free huge page, memory too fragmented,
    or the range unmapped since the plan; ``EBUSY``: the cgroup's memory
    limit; ``EAGAIN``: its small pages busy).
    The pass ends with one log line of both counts: on a machine short of
    huge pages the heap stays partly in small pages, which only makes forks
    slower, and that line says why.
    """

    def __init__(self, maps_path: str = "/proc/self/maps") -> None:
        self.maps_path = maps_path
        self.pending: list[int] = []
        self.tried: set[int] = set()            # every page collapsed (or skipped) already: never again
        self.supported: Optional[bool] = None   # probed at the first plan
        self.collapsed = self.failed = 0
        self.refused = 0                        # ... of which the kernel refused (ENOMEM, EBUSY, EAGAIN)
        self.started: Optional[float] = None    # when this pass began (monotonic), for its report
        self.stopped_by: Optional[float] = None # a step that took longer than COLLAPSE_SLOW: none after it

    def _take(self) -> str:
        self._madvise = _madvise()
        return "the launcher's heap moves to huge pages while idle"

    def plan(self) -> None:
        if self.supported is None:
            self.supported = hooks.install("hugepages", self._take, guard=unsupported)
        if not self.supported or self.stopped_by is not None:
            return
        try:
            with open(self.maps_path) as f:
                self.pending = [a for a in chunks(collapsible(f.read())) if a not in self.tried]
        except OSError:   # pragma: no cover - no procfs
            self.pending = []

    def step(self) -> bool:
        """Collapse the next page; whether any is left."""
        if not self.pending:
            return False
        addr = self.pending.pop(0)
        self.tried.add(addr)
        if self.started is None:
            self.started = time.monotonic()
        began = time.thread_time()   # CPU, the kernel's compaction too: a busy machine's preemption is not the page's
        if self._madvise(addr, HUGE, MADV_COLLAPSE) == 0:
            self.collapsed += 1
        elif ctypes.get_errno() in (errno.ENOMEM, errno.EAGAIN, errno.EBUSY):
            self.refused += 1   # no free huge page, the memory limit, pages busy, or unmapped since
        else:
            self.failed += 1   # memory that cannot be huge (or is gone): skipped
        took = time.thread_time() - began
        if took > COLLAPSE_SLOW:
            self.stopped_by = took
            self.tried.update(self.pending)
            self.pending = []
        if not self.pending:
            self._report()
        return bool(self.pending)

    def _report(self) -> None:
        """One line for the pass: how much moved and why the rest did not."""
        stopped = ("" if self.stopped_by is None else
                   f"; stopped for good: one page took {self.stopped_by:.2f} s, "
                   f"the kernel is short of free huge pages")
        log.info("launcher: %d MiB of the heap moved to huge pages in %.1f s "
                 "(%d MiB cannot be huge; %d MiB refused by the kernel just then: "
                 "no free huge page, the memory limit, or busy%s)",
                 self.collapsed * HUGE >> 20, time.monotonic() - self.started,
                 self.failed * HUGE >> 20, self.refused * HUGE >> 20, stopped)
        self.started = None

    def run_for(self, seconds: float) -> None:
        """Collapse pages until ``seconds`` have passed or none is left."""
        deadline = time.monotonic() + seconds
        while self.step() and time.monotonic() < deadline:
            pass
