"""One rank as the supervisor sees it: a forked process, its pipes, its signals.

The supervisor forks each rank ahead of the run (:func:`fork_idle_rank`): the
rank blocks on its "go" pipe until the spec arrives, and writes to three
pipes the supervisor reads: merged stdout/stderr ("out"), framed events
("ev") and faulthandler stack dumps ("st").  :class:`RankProcess` holds those
fds and what the supervisor learnt about the rank; signalling a rank and
finding processes that escaped it are here too, so that the supervisor
itself only decides *when*.
"""
from __future__ import annotations

import fcntl
import os
import signal
from dataclasses import dataclass, field
from typing import NoReturn, Optional

from . import wire, worker
from .output_batch import Excerpt, OutputBatch
from .process_tree import descendants

PIPE_BYTES = 1 << 20      # a rank's output pipe (see widen_pipe)


@dataclass
class RankProcess:
    local: int
    rank: int
    pid: int
    fds: dict = field(default_factory=dict)   # "out"/"ev"/"st" -> read fd
    output: OutputBatch = field(default_factory=OutputBatch)
    excerpt: Optional[Excerpt] = None  # None: the kernel is sent every line
    frames: wire.FrameBuffer = field(default_factory=wire.FrameBuffer)
    stack: bytearray = field(default_factory=bytearray)
    stack_time: float = 0.0
    status: Optional[int] = None       # waitpid status once exited
    exit_time: float = 0.0
    signalled: bool = False            # the supervisor sent it a stopping signal
    failed: bool = False               # it reported a failure of its own
    done: bool = False                 # it reported its result (it exits with 0 right after)
    reported: bool = False
    native: str = ""                   # its native stack (py-spy) when a diagnosis was asked for
    done_time: float = 0.0             # when it reported its result
    last_output: float = 0.0           # when it last wrote to its output
    cpu_seen: Optional[float] = None   # CPU seconds at cpu_since (stall detection)
    cpu_since: float = 0.0
    go: Optional[int] = None           # write end of its go pipe: the spec goes in; closing it
                                       # lets a rank that succeeded (parked) exit

    def release(self) -> None:
        """Close the go pipe: an idle or parked rank sees EOF and exits."""
        if self.go is not None:
            os.close(self.go)
            self.go = None

    def signal(self, sig: int) -> None:
        """The rank process alone (SIGUSR1: dump stacks)."""
        self.signalled = True
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def signal_group(self, sig: int) -> None:
        """The rank and everything it started (stop, kill): by pid, the rank and
        its descendants (a process can leave its process group, even the rank
        itself), and by group, what is in the rank's process group."""
        if self.status is None:
            self.signalled = True
        for pid in [self.pid, *descendants(self.pid)]:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def widen_pipe(fd: int) -> None:
    """Give a rank's output pipe 1 MB instead of 64 KB (Linux's unprivileged maximum).

    A rank printing in a flood then rarely waits for the supervisor to drain
    the pipe, and the supervisor reads it in fewer, larger pieces.
    """
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:   # a lower limit here (/proc/sys/fs/pipe-max-size): keep the default
        pass


def set_nonblocking(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)


def fork_idle_rank(local: int, close_in_child: list[int], blocked_signals: set) -> RankProcess:
    """Fork a rank that waits for its spec; returns it with its read ends non-blocking.

    ``close_in_child``: the supervisor's fds (and other ranks' pipe ends) the
    rank must not hold.  ``blocked_signals`` stay blocked across the fork so
    the child cannot run the supervisor's handlers before it resets them.
    """
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    widen_pipe(out_w)
    ev_r, ev_w = os.pipe()
    st_r, st_w = os.pipe()
    parent = os.getpid()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, blocked_signals)
    pid = os.fork()
    if pid == 0:  # the rank
        _become_rank(close_in_child + [go_w, out_r, ev_r, st_r], go_r, local, out_w, ev_w, st_w, parent)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    for fd in (go_r, out_w, ev_w, st_w):
        os.close(fd)
    rank = RankProcess(local=local, rank=-1, pid=pid, fds={"out": out_r, "ev": ev_r, "st": st_r}, go=go_w)
    for fd in rank.fds.values():
        set_nonblocking(fd)
    return rank


def _become_rank(close: list[int], go_r: int, local: int, out_w: int, ev_w: int, st_w: int,
                 parent: int) -> NoReturn:
    signal.set_wakeup_fd(-1)
    for fd in close:
        try:
            os.close(fd)
        except OSError:
            pass
    worker.wait_and_run(go_r, local, out_w, ev_w, st_w, parent)


_OWN_FRAMES = (f'File "{os.path.dirname(os.path.abspath(__file__))}{os.sep}', 'File "<frozen runpy>"')


def user_stack(text: str) -> str:
    """A faulthandler dump without the launcher's own frames below the cell."""
    return "".join(line for line in text.splitlines(True) if not line.strip().startswith(_OWN_FRAMES))
