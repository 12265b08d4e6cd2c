"""What a launcher process imported for runs, and what its imports read.

A fork of the launcher is a rank: it must see what a new process would.  So
the kernel keeps track of the modules the launcher preloaded (and their files,
which a ``pip install`` may change), the modules it must never preload, and
the environment variables its imports looked up; :class:`.launcher.Launcher`
replaces the launcher process when they say it is out of date.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

from ..environment import environ_snapshot, import_time_changes, rank_base_environment

log = logging.getLogger("accel_magics.launcher")


class Preloads:
    """The modules a launcher process imported for payloads."""

    def __init__(self) -> None:
        self.preloaded: set[str] = set()
        self.denied: set[str] = set()
        self.pending: list[str] = []
        self.files: dict[str, tuple[int, int]] = {}   # what the launcher imported for runs
        self.stale_warned = False

    def reset(self) -> None:
        """A new launcher preloads from scratch (what it must never preload stays)."""
        self.pending = []
        self.files = {}
        self.stale_warned = False
        self.preloaded.clear()

    def learn(self, modules: list[str]) -> list[str]:
        """The modules of ``modules`` not preloaded yet, nor denied."""
        return [m for m in modules if m not in self.preloaded and m not in self.denied
                and m not in ("__main__", "builtins")]

    def deny(self, modules: list[str]) -> None:
        """Never preload these again (their import hangs, kills or taints the launcher)."""
        self.denied.update(modules)
        self.preloaded.difference_update(modules)

    def stale(self) -> bool:
        """Has a file of a module the launcher keeps imported changed on disk?"""
        for path, (mtime, size) in self.files.items():
            try:
                st = os.stat(path)
            except OSError:
                return True
            if st.st_mtime_ns != mtime or st.st_size != size:
                return True
        return False


class ImportEnvironment:
    """The environment a launcher process imported under (a rank's, from the
    kernel's at its start) and the names its imports looked up."""

    def __init__(self) -> None:
        self.at_start: dict[str, str] = {}
        self.reads: set[str] = set()
        self.warned: Optional[tuple] = None
        # (at_start, the names read, the kernel's environment) when last found
        # unchanged: the same three again need no comparison (a cell asks twice).
        self._unchanged: Optional[tuple] = None

    def reset(self) -> None:
        self.reads = set()
        self.warned = None
        self._unchanged = None

    def _as_last_found_unchanged(self, reads, raw: dict) -> bool:
        seen = self._unchanged
        return seen is not None and seen[0] is self.at_start and seen[1] == reads and seen[2] == raw

    def outdated(self, live: dict, pid: int, reads: Optional[set] = None) -> bool:
        """Has a variable the launcher's imports depend on changed in the
        kernel since it started?  Then a rank forked from it would not be what
        a new process is (torch read TORCH_DISTRIBUTED_DEBUG and
        TORCH_CPP_LOG_LEVEL as it loaded, the OpenMP runtime sized its pool
        from OMP_NUM_THREADS...), so a fresh launcher imports them anew: True,
        after a log line naming them.  Not while a session or a background run
        lives on it (``live``: they would die): a warning says that this run
        and they keep the launcher's environment, and how to get the new one.
        ``reads``: the names looked up, if not those the launcher said."""
        reads = self.reads if reads is None else reads
        raw, decoded = environ_snapshot()   # one snapshot: what is stored as unchanged is what was compared
        if self._as_last_found_unchanged(reads, raw):
            self.warned = None
            return False
        changed = import_time_changes(self.at_start, rank_base_environment(decoded), reads)
        if not changed:
            self.warned = None
            self._unchanged = (self.at_start, set(reads) if isinstance(reads, set) else reads, raw)
            return False
        names = ", ".join(changed)
        if not live:
            log.info("replacing the launcher process (pid %d): %s changed in the kernel since it started, "
                     "and its imports depend on %s", pid, names, "it" if len(changed) == 1 else "them")
            return True
        seen = tuple((name, os.environ.get(name)) for name in changed)
        if seen != self.warned:   # once per change, not every cell
            self.warned = seen
            one = len(changed) == 1
            warnings.warn(f"accel_magics: {names} changed in the kernel since the launcher process started, and "
                          f"what it imported depends on {'it' if one else 'them'} (read as torch and "
                          "the preloaded modules loaded). A session or a background run is alive on the launcher, "
                          f"so this run and they keep the effect of the old {'value' if one else 'values'}. "
                          "Stop them (%distributed_session stop, h.stop() or wait for the background run) and the "
                          "next cell starts a fresh launcher with the new environment.", RuntimeWarning, stacklevel=4)
        return False
