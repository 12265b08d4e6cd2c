"""A run's full log: every line of every rank, one file per rank (supervisor side).

Written by the supervisor, which reads every byte the ranks write anyway; the
kernel is sent only what it shows (see ``output_batch.Excerpt``), so a rank
that prints millions of lines costs the kernel nothing, and the log is still
complete, in order, with failures and stacks where they happened.

The directory (``<root>/<time>-In<N>-<random>``) is named by the kernel and
made here at the first write, so quiet runs leave none.  Logs can hold
secrets a rank printed (tokens), and the root may be shared, so:

* the run directory is created by this process (``mkdir`` fails if the name
  exists: nothing planted there is ever used), 0700 whatever the umask, and
  its files are opened relative to it with ``O_EXCL | O_NOFOLLOW``, 0600;
* it carries a marker file, locked (``flock``) while the run writes, and
  pruning (only the newest ``KEEP_RUNS`` runs are kept) removes only marked
  directories of this user whose lock is free: never what another program
  keeps there, never a run still in progress in another kernel.

A log that cannot be written (full or read-only disk) is given up silently:
it must never break the run.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from typing import Optional

KEEP_RUNS = 20
MARKER = ".accel_magics-run"   # in every run directory this project made; locked while the run writes
_OPEN = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW


def make_private_dirs(path: str) -> None:
    """``os.makedirs``, with every directory it makes private (0700) whatever
    the umask: makedirs gives the parents it creates 0777 minus the umask, so
    under umask 000 ``$XDG_CACHE_HOME/accel_magics`` was world-writable."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue   # made meanwhile (another run): not ours to change
        os.chmod(directory, 0o700)   # mkdir's mode is cut by the umask, never widened: set it


class RankLogs:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._dir_fd: Optional[int] = None
        self._lock_fd: Optional[int] = None
        self._files: dict[int, int] = {}

    def write(self, rank: int, data: bytes) -> None:
        if not self.dir:
            return
        try:
            fd = self._files.get(rank)
            if fd is None:
                if self._dir_fd is None:
                    self._open_dir()
                fd = self._files[rank] = self._open_file(f"rank{rank}.log")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            self.close()
            self.dir = ""

    def note(self, rank: int, text: str) -> None:
        """A line of the launcher's own (failure, stack, attempt) in the rank's log."""
        self.write(rank, (text if text.endswith("\n") else text + "\n").encode("utf-8", "replace"))

    def close(self) -> None:
        for fd in self._files.values():
            _close(fd)
        self._files.clear()
        for fd in (self._lock_fd, self._dir_fd):   # the lock goes last: the run is complete
            if fd is not None:
                _close(fd)
        self._lock_fd = self._dir_fd = None

    # -- the run directory -----------------------------------------------------
    def _open_dir(self) -> None:
        """Make the run's directory (or, for a restart, take the one this run made)."""
        root = os.path.dirname(self.dir)
        make_private_dirs(root)
        try:
            os.mkdir(self.dir, 0o700)
            fresh = True
        except FileExistsError:
            fresh = False
        self._dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(self._dir_fd)
        if fresh:
            os.fchmod(self._dir_fd, 0o700)   # mkdir's mode is cut by the umask; a log is private
            self._lock_fd = os.open(MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                    0o600, dir_fd=self._dir_fd)
            os.fchmod(self._lock_fd, 0o600)
        else:
            # An earlier attempt of this run made it: only then is it ours to reuse.
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"{self.dir} exists and is not a private directory of this run")
            self._lock_fd = os.open(MARKER, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fresh:
            prune(root)

    def _open_file(self, name: str) -> int:
        try:
            fd = os.open(name, _OPEN | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._dir_fd)
        except FileExistsError:   # a restart of this run appends to the rank's log
            fd = os.open(name, _OPEN, dir_fd=self._dir_fd)
        os.fchmod(fd, 0o600)
        return fd


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def is_run_dir(path: str) -> bool:
    """A run directory this user's accel_magics made: a real directory, ours,
    holding the marker as a regular file."""
    import stat

    try:
        st = os.lstat(path)
        marker = os.lstat(os.path.join(path, MARKER))
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_ISREG(marker.st_mode)


def _in_use(path: str) -> bool:
    """Whether a run still writes there (its supervisor holds the marker's lock)."""
    try:
        fd = os.open(os.path.join(path, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def prune(root: str, keep: int = KEEP_RUNS) -> None:
    """Remove all but the newest ``keep`` finished run directories under ``root``
    (names start with the time); nothing else there is touched."""
    try:
        runs = sorted(d for d in os.listdir(root) if is_run_dir(os.path.join(root, d)))
    except OSError:
        return
    for old in runs[:-keep] if keep else runs:
        path = os.path.join(root, old)
        if not _in_use(path):
            shutil.rmtree(path, ignore_errors=True)   # fd-based on Linux: never follows a symlink
