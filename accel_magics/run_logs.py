"""Every line of every rank, in a file per rank: the run's full log.

The views keep only the last lines in memory; the complete output of a run
goes to ``<log root>/<time>-<run id>/rank<N>.log``, whose path the views show.
The log root is ``$ACCEL_MAGICS_LOG_DIR``, else ``$XDG_CACHE_HOME/accel_magics/runs``
(``~/.cache/accel_magics/runs``); only the newest ``KEEP_RUNS`` runs are kept.
"""
from __future__ import annotations

import os
import shutil
import time

from kernel_ext import events as ev

KEEP_RUNS = 20


def log_root() -> str:
    root = os.environ.get("ACCEL_MAGICS_LOG_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "accel_magics", "runs")
    return root


class RunLogs:
    """An event consumer writing each rank's lines to its own file."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root or log_root()
        self.dir = ""
        self._files: dict[int, object] = {}

    def open(self, label: str) -> str:
        """Name the run's directory; it is made at the first line (quiet runs leave none)."""
        self.dir = os.path.join(self.root, time.strftime("%Y%m%d-%H%M%S-") + label)
        return self.dir

    def _make_dir(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self._prune()

    def _prune(self) -> None:
        runs = sorted(d for d in os.listdir(self.root) if os.path.isdir(os.path.join(self.root, d)))
        for old in runs[:-KEEP_RUNS]:
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def _file(self, rank: int):
        f = self._files.get(rank)
        if f is None:
            if not self._files:
                self._make_dir()
            f = self._files[rank] = open(os.path.join(self.dir, f"rank{rank}.log"), "a", encoding="utf-8")
        return f

    def __call__(self, event) -> None:
        if not self.dir:
            return
        try:
            self._log(event)
        except OSError:   # an unwritable cache must not break the run: stop logging
            self.close()
            self.dir = ""

    def _log(self, event) -> None:
        if isinstance(event, ev.Output):
            self._file(event.rank).write(event.text + "\n")
        elif isinstance(event, ev.RunStarted) and event.attempt:
            for rank in event.ranks:
                self._file(rank).write(f"--- attempt {event.attempt + 1} of {event.max_restarts + 1} ---\n")
        elif isinstance(event, ev.RankStacks):
            self._file(event.rank).write("--- stack when the run was stopped ---\n" + event.text)
        elif isinstance(event, ev.RankExited) and event.failure is not None:
            f = self._file(event.rank)
            f.write(f"--- {event.failure.summary} ---\n")
            if event.failure.traceback:
                f.write(event.failure.traceback)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
