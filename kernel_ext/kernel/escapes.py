"""What a launcher's runs leave outside its process tree, ended when it dies.

Every process of a launcher carries its marker (:data:`process_tree.MARKER`,
ranks keep it too).  Supervisors and ranks die with the launcher (their
parent-death signal), but what they started in a session of their own or
double-forked (reparented to init, out of every subreaper's reach) carries
only the marker, and only the kernel is left to look for it.
"""
from __future__ import annotations

import os
import select
import subprocess
import threading
import time
from typing import Optional

from .. import process_tree
from ..timing import ESCAPED_KILL_POLL, ESCAPED_KILL_WAIT


class EscapeWatch:
    """One launcher's watch on its processes that escaped its tree."""

    def __init__(self) -> None:
        self._lock = threading.Lock()   # see end()
        self._escaped: Optional[tuple] = None   # (token, done, [how many were killed])

    def watch(self, proc: subprocess.Popen, token: str) -> None:
        """End what the launcher leaves when it dies however it dies (kill -9
        included), at once and whether or not a cell is running: its
        supervisors and ranks die with it (their parent-death signal), but
        what they started in a session of their own or double-forked
        (reparented to init, out of every subreaper's reach) carries only
        the launcher's marker, and only this process is left to look for it."""
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):   # no pidfds: close() still ends them, at the next cell at the latest
            return
        done = threading.Event()
        self._escaped = (token, done, [0])

        def watch() -> None:
            try:
                select.select([pidfd], [], [])
            finally:
                os.close(pidfd)
            self.end(token, done)

        threading.Thread(target=watch, name="accel_magics launcher watch", daemon=True).start()

    def end(self, token: str, done: threading.Event) -> None:
        """SIGKILL every process that carries ``token`` until none is left (a
        process may fork as it is killed): once, from whichever thread comes first."""
        escaped = self._escaped
        if escaped is None or escaped[0] != token:
            return
        with self._lock:
            if done.is_set():
                return
            deadline = time.monotonic() + ESCAPED_KILL_WAIT
            killed: set[int] = set()
            while time.monotonic() < deadline:
                found = process_tree.marked_processes(token)
                if not found:
                    break
                process_tree.kill_marked(token)
                killed.update(found)
                time.sleep(ESCAPED_KILL_POLL)
            escaped[2][0] = len(killed)
            done.set()

    def ended(self, token: Optional[str]) -> int:
        """For a launcher that died (its marker ``token``): wait until what its
        runs left outside its tree is ended (see :meth:`watch`); how many
        processes that was."""
        escaped = self._escaped
        if escaped is None or escaped[0] != token:   # not watched: one look
            return process_tree.kill_marked(token) if token else 0
        token, done, count = escaped
        self.end(token, done)
        return count[0]
