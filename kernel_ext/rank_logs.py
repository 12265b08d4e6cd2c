"""A run's full log: every line of every rank, one file per rank.

Written by the supervisor, which reads every byte the ranks write anyway; the
kernel is sent only what it shows (see ``output_batch.Excerpt``), so a rank
that prints millions of lines costs the kernel nothing, and the log is still
complete, in order, with failures and stacks where they happened.

The directory (``<root>/<time>-In<N>``) is named by the kernel and made at
the first write, so quiet runs leave none; only the newest ``KEEP_RUNS``
directories under the root are kept.  A log that cannot be written (full or
read-only disk) is given up silently: it must never break the run.
"""
from __future__ import annotations

import os
import shutil
from typing import BinaryIO

KEEP_RUNS = 20


class RankLogs:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._files: dict[int, BinaryIO] = {}

    def write(self, rank: int, data: bytes) -> None:
        if not self.dir:
            return
        try:
            f = self._files.get(rank)
            if f is None:
                if not self._files:
                    os.makedirs(self.dir, exist_ok=True)
                    prune(os.path.dirname(self.dir))
                f = self._files[rank] = open(os.path.join(self.dir, f"rank{rank}.log"), "ab")
            f.write(data)
        except OSError:
            self.close()
            self.dir = ""

    def note(self, rank: int, text: str) -> None:
        """A line of the launcher's own (failure, stack, attempt) in the rank's log."""
        self.write(rank, (text if text.endswith("\n") else text + "\n").encode("utf-8", "replace"))

    def close(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except OSError:
                pass
        self._files.clear()


def prune(root: str, keep: int = KEEP_RUNS) -> None:
    """Remove all but the newest ``keep`` run directories under ``root``."""
    try:
        runs = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    except OSError:
        return
    for old in runs[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
