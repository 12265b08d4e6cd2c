"""A supervisor's rank processes: forked ahead, numbered at the run, their
pipes, their exits, and the ladders that stop them.

The spare (:mod:`spare`) forks the ranks idle, while it has no thread; the
run's supervisor takes as many as it needs and drops the rest
(:meth:`RankSet.take`).  The pipes of every rank are registered in the one
selector of the supervisor's event loop; this class reads and closes them,
and reaps the ranks (the supervisor is their parent, and the subreaper of
what they start).
"""
from __future__ import annotations

import errno
import logging
import os
import selectors
import signal
import time
from typing import Iterator, Optional

from ..stop_ladder import Rung, StopLadder
from .rank_process import RankProcess, fork_idle_rank

READ_BYTES = 1 << 20


class RankSet:
    """The ranks of one supervisor (see the module doc)."""

    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self.idle: list[RankProcess] = []    # forked ahead, pipes registered; numbered at the run
        self.ranks: list[RankProcess] = []   # the run's
        self.fds: list[int] = []             # every fd a rank must not inherit

    # -- forking and handing out ------------------------------------------------
    def prefork(self, n: int, blocked_signals: set) -> None:
        """Fork ``n`` idle ranks; each blocks until it is given the spec."""
        for _ in range(n):
            rank = fork_idle_rank(len(self.idle), self.fds, blocked_signals)
            self.fds += [rank.go, rank.ask, *rank.fds.values()]
            # Registered now, while idle: the run's critical path only numbers the ranks.
            for kind, fd in rank.fds.items():
                self.sel.register(fd, selectors.EVENT_READ, (kind, rank))
            self.idle.append(rank)

    def take(self, need: int) -> None:
        """The run's ranks: the first ``need`` idle ones (the others are dropped)."""
        if len(self.idle) < need:  # the zygote forks a big enough spare: never here
            raise RuntimeError(f"spare supervisor has {len(self.idle)} ranks, the run needs {need}")
        self.discard_idle(len(self.idle) - need)
        self.ranks, self.idle = self.idle, []

    def discard_idle(self, n: int) -> None:
        """Drop the last ``n`` idle ranks (the run needs fewer)."""
        for _ in range(n):
            rank = self.idle.pop()
            self.close_pipes(rank)
            rank.release()   # EOF on the go pipe: the idle rank exits by itself

    def abandon(self) -> None:
        """No run: every idle rank sees EOF on its go pipe and exits by itself."""
        for rank in self.idle:
            rank.release()
        self.idle = []

    def release_all(self, spare_held: bool = False) -> None:
        for r in self.ranks:
            if not (spare_held and r.held_until is not None):
                r.release()

    # -- which ---------------------------------------------------------------------
    def alive(self) -> list[RankProcess]:
        return [r for r in self.ranks if r.status is None]

    def working(self) -> list[RankProcess]:
        """Ranks still running the cell: not exited, not finished (parked)."""
        return [r for r in self.ranks if r.status is None and not r.reported]

    def all_gone(self, spare_held: bool = False) -> bool:
        return all(r.status is not None or (spare_held and r.held_until is not None) for r in self.ranks)

    def all_reported(self) -> bool:
        return all(r.reported for r in self.ranks)

    def held(self) -> list[RankProcess]:
        """Failed ranks held for a post-mortem, still there (see one_shot.py)."""
        return [r for r in self.ranks if r.held_until is not None and r.status is None]

    # -- pipes -----------------------------------------------------------------------
    def read(self, r: RankProcess, kind: str, fd: int) -> Optional[bytes]:
        """What is in one of a rank's pipes now: None if nothing (EAGAIN), b""
        at its end (the pipe is then closed)."""
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            data = b""
        if not data:
            self.sel.unregister(fd)
            os.close(fd)
            del r.fds[kind]
            if kind == "out":
                r.output.end()
        return data

    def close_pipe(self, r: RankProcess, kind: str) -> None:
        fd = r.fds.pop(kind, None)
        if fd is not None:
            self.sel.unregister(fd)
            os.close(fd)

    def close_pipes(self, r: RankProcess) -> None:
        for kind in list(r.fds):
            self.close_pipe(r, kind)

    # -- exits and stops -------------------------------------------------------------
    def reaped(self) -> Iterator[tuple[RankProcess, int]]:
        """Each rank that exited since the last look, with its wait status;
        what it started dies with it (no orphans)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            r = next((r for r in self.ranks if r.pid == pid), None)
            if r is None:
                continue   # a discarded idle rank, or a rank's orphan we killed
            r.status, r.exit_time = status, time.monotonic()
            r.release()
            r.signal_group(signal.SIGKILL)
            yield r, status

    def kill_all(self, sig: int = signal.SIGKILL, spare_held: bool = False) -> None:
        for r in self.alive():
            if not (spare_held and r.held_until is not None):
                r.signal_group(sig)

    def terminate(self) -> None:
        """SIGTERM to every rank still running, but those that failed: they end
        by themselves, as a script that raised (their threads, their atexit
        handlers, worker._execute), within the same grace before SIGKILL."""
        for r in self.ranks:
            if r.status is None and not r.failed:
                r.signal_group(signal.SIGTERM)

    def ladder(self, what: str, wait: float, log: logging.Logger, terminate: bool,
               then_wait: float, spare_held: bool = False) -> StopLadder:
        """The ranks' stop: SIGTERM (``terminate``; else they were told to end
        by themselves: EOF at their go pipe), ``wait`` seconds, SIGKILL to those
        still there, and ``then_wait`` seconds for that (a caller that waits
        for the end: :meth:`StopLadder.run`).  ``spare_held``: a rank held for
        a post-mortem is not stopped (nor waited for)."""
        first = Rung("SIGTERM to its ranks", self.terminate, wait) if terminate else \
            Rung("its ranks end by themselves", None, wait)
        kill = Rung("SIGKILL to its ranks still there", lambda: self.kill_all(signal.SIGKILL, spare_held), then_wait)
        return StopLadder(what, [first, kill], done=lambda: self.all_gone(spare_held), log=log)
