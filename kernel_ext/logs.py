"""Logging in every process of a run: one logger tree, ``accel_magics.*``.

Why: a bug report needs what each process decided (which attempt, which
stop, which escalation, which node said what), not only what the user saw.

* The kernel: :class:`RunLog` keeps the records of one run's thread while it
  runs, and writes them to ``kernel.log`` in the run's log directory (beside
  every rank's full output) when the run made one: a quiet run leaves none.
* The launcher process (and the supervisors and ranks it forks): records go
  to the launcher's log (``launcher.log`` in its private directory, whose
  tail the kernel shows when the launcher fails), through a descriptor of
  its own, so a rank's records never land in the rank's output.
* A node agent (``--launcher slurm``): its stderr, which is srun's log.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Optional

ROOT = "accel_magics"
FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s"


def of_process(line: str, pid: int) -> bool:
    """Is ``line`` (a record in FORMAT) one of process ``pid``'s?"""
    return line.split(" ", 3)[2:3] == [str(pid)]


def to_log_file(fd: int = 2, level: int = logging.INFO) -> None:
    """A process of the engine (launcher, agent): records at ``level`` and above
    to ``fd``'s file, through a duplicate descriptor (not inherited by what
    the process starts; kept when ``fd`` itself is pointed elsewhere, as a
    rank's stderr is)."""
    logger = logging.getLogger(ROOT)
    if any(getattr(h, "accel_magics", False) for h in logger.handlers):
        return
    stream = os.fdopen(os.dup(fd), "a", buffering=1, encoding="utf-8", errors="replace")
    handler = logging.StreamHandler(stream)
    handler.accel_magics = True
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False   # this process's own log; nothing of the user's to share it with


class RunLog(logging.Handler):
    """The kernel's records of one run (made in the thread that drives it),
    written to ``<log_dir>/kernel.log`` at the end if the run has a log
    directory (see ``accel_magics.run_logs``)."""

    def __init__(self, log_dir: str, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.log_dir = log_dir
        self.thread = threading.get_ident()
        self.records: list[logging.LogRecord] = []   # formatted only if saved (most runs leave no log)
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread and len(self.records) < 10_000:
            record.msg, record.args = record.getMessage(), None   # its arguments as they are now
            self.records.append(record)

    def __enter__(self) -> "RunLog":
        logger = logging.getLogger(ROOT)
        if logger.level == logging.NOTSET or logger.level > self.level:
            logger.setLevel(self.level)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(ROOT).removeHandler(self)
        self.save()

    def save(self) -> Optional[str]:
        """Write the records; the file's path (None: no log directory, or nothing to write)."""
        from .supervisor.rank_logs import is_run_dir

        # Only into a directory a run's supervisor made (a real directory, ours,
        # with its marker): never through a planted symlink or into someone else's.
        if not self.log_dir or not self.records or not is_run_dir(self.log_dir):
            return None
        path = os.path.join(self.log_dir, "kernel.log")
        try:
            # Private whatever the umask, as the ranks' logs are (they may quote a secret a rank
            # printed); never through a symlink, never blocked by a FIFO planted in its place.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write("\n".join(self.format(record) for record in self.records) + "\n")
        except OSError:
            return None
        return path
