"""A supervisor forked ahead of its run (the zygote's spare), and what it becomes.

The zygote forks the next run's supervisor before the run exists, so a cell
starts with a message, not a fork.  While it waits, that process is a
:class:`Spare`: it forks idle ranks (each waiting on its "go" pipe) while it
has no thread, then connects the run channel (ZMQ starts a thread) and waits
on its control pipe for a spec.  The spec says what the run is: a one-shot
run (:class:`one_shot.OneShotSupervisor`) or a session
(:class:`session_supervisor.SessionSupervisor`), each built from the spare's
resources, which are handed over by name (:meth:`Supervisor.__init__`).
:func:`serve_spare` is the process's entry point; it is the one module that
knows both kinds, so neither imports the other's.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import selectors
import signal
from typing import NoReturn, Optional

from .. import wire
from ..wire import transport
from ..rank import worker
from . import error_file
from .rendezvous import NodeRendezvous
from .one_shot import OneShotSupervisor
from .rank_process import set_nonblocking
from .rank_set import RankSet
from .session_supervisor import SessionSupervisor
from .supervisor import PR_SET_CHILD_SUBREAPER, SIGNALS


#: The signing session every spare starts from, made once in the launcher
#: (:func:`make_session_ahead`), with a throwaway key: building a traitlets
#: Session in each freshly forked spare wrote its way through ~450 pages of
#: the inherited heap (2.5 ms of copy-on-write faults a run).  The run's key
#: replaces the throwaway one when the spec comes; message ids carry the pid.
_session_ahead = None


def make_session_ahead() -> None:
    """In the launcher, before it forks spares (after each preload)."""
    global _session_ahead
    if _session_ahead is None:
        _session_ahead = wire.signed_session(wire.new_key())


class Spare:
    """What a supervisor holds before it knows its run (see the module doc)."""

    def __init__(self, control_fd: int, status_fd: int = -1) -> None:
        self.control_fd = control_fd
        self.status_fd = status_fd            # to the launcher: see run_state
        self.sel = selectors.DefaultSelector()
        self.rank_set = RankSet(self.sel)     # idle ranks forked ahead, numbered at the run
        self.wakeup_r = self.wakeup_w = -1
        self.ctx = self.sock = self.session = None
        self.events_addr = ""
        self.events_keys = None   # CURVE keys of the kernel's events socket (a Slurm node: over TCP)
        self.errors_ahead: Optional[str] = None   # the next run's folders of error files (error_file.make_ahead)

    def install_signals(self) -> None:
        worker.set_parent_death_signal(signal.SIGKILL)
        r, w = os.pipe()
        set_nonblocking(r)
        set_nonblocking(w)
        self.wakeup_r, self.wakeup_w = r, w
        signal.set_wakeup_fd(w)
        for sig in (signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the wake-up byte does the work
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.sel.register(r, selectors.EVENT_READ, ("signal", None))
        # every fd a rank must not inherit (its own pipes join as it is forked)
        self.rank_set.fds = [self.control_fd, r, w, self.sel.fileno(),
                             *([self.status_fd] if self.status_fd >= 0 else [])]
        # Orphans of the ranks (children that escaped their process group)
        # become this process's children, so none can outlive the run.
        try:
            ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - non-Linux
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # blocked across the zygote's fork

    def prefork(self, n: int) -> None:
        """Fork ``n`` idle ranks; each blocks until it is given the spec."""
        self.rank_set.prefork(n, SIGNALS)

    def connect(self, events_addr: str, events_keys=None) -> None:
        import zmq  # only now: the ranks were forked from a single-threaded process

        self.ctx = zmq.Context()
        self.events_keys = events_keys
        self.sock = transport.events_socket(self.ctx, events_addr, events_keys)
        self.events_addr = events_addr
        # The run's key arrives with the spec; until then a throwaway one.
        if _session_ahead is not None:
            self.session = _session_ahead
            self.session.pid = os.getpid()   # Session.send refuses to sign from a fork of its maker
        else:
            self.session = wire.signed_session(wire.new_key())
        # Walk the signing path once while idle: its first use after the fork
        # (copy-on-write faults, lazy imports) would otherwise cost the run ~0.5 ms.
        self.session.serialize(self.session.msg("run_event", {"kind": "warm-up", "pids": {0: 1}}))
        self.session.key = wire.new_key()   # and the key's change (traitlets, a new HMAC), as the spec's will
        # ... and a one-node rendezvous's first step: a loopback listener (an
        # ephemeral port, closed at once).  Only a warm-up: a machine whose
        # loopback refuses it still runs (the run's own bind says why).
        rdzv = NodeRendezvous("127.0.0.1", 0, 1, 0, 1.0)
        try:
            rdzv.listen()
        except OSError:
            pass
        rdzv.close()

    def wait_for_spec(self) -> Optional[tuple]:
        """Block until the zygote hands over a run (None: it dropped this spare)."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # idle: a stop just ends it
        try:
            return wire.read_frame(self.control_fd)
        finally:
            signal.signal(signal.SIGTERM, lambda *_: None)

    def abandon(self) -> None:
        """No run: every idle rank sees EOF on its go pipe and exits by itself."""
        self.rank_set.abandon()
        error_file.remove_ahead(self.errors_ahead)


def serve_spare(control_fd: int, status_fd: int, prefork: int, events_addr: str, events_keys=None,
                private_dir: str = "") -> NoReturn:
    """Entry point in a supervisor forked ahead by the zygote. Never returns.
    ``private_dir``: the launcher's directory, where the runs' folders of
    error files go (one is made ahead here)."""
    spare = Spare(control_fd, status_fd)
    try:
        spare.install_signals()
        spare.prefork(prefork)
        spare.connect(events_addr, events_keys)   # after the last fork: ZMQ starts a thread
        spare.errors_ahead = error_file.make_ahead(private_dir, prefork)
        ahead = OneShotSupervisor(spare)    # the usual kind, built while idle (its first use costs page faults)
        handed = spare.wait_for_spec()
        if handed is None:           # the zygote is gone or dropped the spare
            spare.abandon()
            os._exit(0)
        key, spec_bytes = handed
        spec = pickle.loads(spec_bytes)
    except BaseException:
        spare.abandon()
        os._exit(1)
    (SessionSupervisor(spare) if spec.get("session") else ahead).serve(key, spec, spec_bytes)
