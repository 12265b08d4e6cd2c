"""A rank's sys.stdout and sys.stderr: live like a terminal, fast under floods.

Printed lines normally go out one write per line, so a print reaches the
notebook at once and stays in order with output written to the fd directly
(native code).  When a rank prints in a flood (over ``BURST_LINES`` lines in
``BURST_WINDOW`` seconds), stdout switches to block buffering in a 1 MB buffer
(the size of the supervisor's pipe), flushed by a small thread every
``FLUSH_INTERVAL`` (as ipykernel batches its streams): a print then costs a
buffer append instead of a system call, and the supervisor wakes once per
megabyte, not once per line.  stderr stays
line-buffered and flushes stdout before each write, so the order of the two
streams is kept.

The flusher thread is fork-safe: a fork waits until it is not flushing and
empties the buffer first (a child never writes the parent's lines again), and
a child process (a DataLoader worker, say) goes back to line buffering
without a flusher.
"""
from __future__ import annotations

import io
import os
import threading
import time

from ..timing import RANK_BURST_WINDOW as BURST_WINDOW, RANK_FLUSH_INTERVAL as FLUSH_INTERVAL

BURST_LINES = 200
BURST_BUFFER_BYTES = 1 << 20


class RankStdout(io.TextIOWrapper):
    def __init__(self, fd: int) -> None:
        super().__init__(io.BufferedWriter(io.FileIO(fd, "w", closefd=False), 1 << 16),
                         encoding="utf-8", errors="backslashreplace", line_buffering=False)
        self._burst = False
        self.fast = None
        self._lines = 0
        self._window = time.monotonic()
        self._lock = threading.Lock()
        self._flusher = None
        os.register_at_fork(before=self._before_fork, after_in_parent=self._lock.release,
                            after_in_child=self._after_fork_in_child)

    def write(self, s: str) -> int:
        fast = self.fast
        if fast is not None:   # flooding: everything goes through the one big buffer, in order
            return fast.write(s)
        n = super().write(s)
        if not self._burst and ("\n" in s or "\r" in s):
            super().flush()
            self._lines += 1
            if self._lines >= BURST_LINES:
                now = time.monotonic()
                if now - self._window < BURST_WINDOW:
                    self._start_burst()
                self._lines, self._window = 0, now
        return n

    def _start_burst(self) -> None:
        """Hand sys.stdout to a plain (C) wrapper with a big buffer: from now
        on a print costs no Python-level call of ours, and a thread flushes.
        Writes through this object go to the same wrapper, so order is kept."""
        import sys

        self._burst = True
        super().flush()
        # A buffer as big as the supervisor's pipe: one write per megabyte.
        raw = io.FileIO(self.buffer.raw.fileno(), "w", closefd=False)   # FileIO: C fast paths
        self.fast = io.TextIOWrapper(io.BufferedWriter(raw, BURST_BUFFER_BYTES),
                                     encoding="utf-8", errors="backslashreplace", line_buffering=False)
        if sys.stdout is self:
            sys.stdout = self.fast
        self._flusher = threading.Thread(target=self._flush_loop, name="accel_magics-stdout", daemon=True)
        self._flusher.start()

    def flush(self) -> None:
        fast = self.fast
        if fast is not None:
            fast.flush()
        super().flush()

    def _flush_loop(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL)
            with self._lock:
                try:
                    self.flush()
                except (ValueError, OSError):
                    return

    def _before_fork(self) -> None:
        """Not while the flusher flushes; and with the buffer empty, so that a
        child (a DataLoader worker, say) has no copy of lines to write again."""
        self._lock.acquire()
        try:
            self.flush()
        except (ValueError, OSError):
            pass

    def _after_fork_in_child(self) -> None:
        import sys

        self._lock.release()
        if sys.stdout is self.fast:
            sys.stdout = self
        self._burst, self._flusher, self._lines, self.fast = False, None, 0, None


class RankStderr(io.TextIOWrapper):
    def __init__(self, fd: int, stdout: RankStdout) -> None:
        super().__init__(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                         line_buffering=True)
        self._stdout = stdout

    def write(self, s: str) -> int:
        self._stdout.flush()   # keep the order of the two streams (also flushes the fast wrapper)
        return super().write(s)
