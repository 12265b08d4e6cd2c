"""The built-in placement ``local``: ranks forked on this machine by the
kernel's launcher process, for every mode (one-shot, background, restarts,
a session's cells).

:class:`LocalPlacement` starts a run's attempts (:meth:`LocalPlacement.launch`)
and a session's ranks (:meth:`LocalPlacement.open_session`, a
:class:`LocalSession`).  A subclass that only sets ``name`` is a plug-in
that gets all of it (see :mod:`placement`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import zmq

from .. import wire
from .errors import LauncherError, SessionGone
from .placement import Attempt, Placement, SessionAttempt, session_lost_why
from .run_handle import RunHandle
from ..process_tree import running
# The ladders' order: see timing.py.
from ..timing import (
    SESSION_START_WAIT as START_WAIT, SESSION_STOP_WAIT, SESSION_TIMEOUT_SLACK, SESSION_SEND_WAIT as SEND_WAIT,
    SESSION_SEND_SLICE as SEND_SLICE, GONE_DRAIN, SESSION_GONE_WAIT, SESSION_GONE_POLL,
)

log = logging.getLogger("accel_magics.kernel.placement")


class LocalPlacement(Placement):
    """Ranks forked on this machine by the kernel's launcher process; with
    ``--num_nodes`` > 1 it is one node of several, each driven by its own
    kernel (kernel per node), the nodes meeting at node 0's store."""

    name = "local"

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def launch(self, cfg, payload, *, attempt: int = 0, log_dir: str = "", excerpt=None, events=None,
               **launcher_options) -> Attempt:
        """``launcher_options``: more of ``Launcher.launch``'s (a session's
        start gives ``extra`` and ``stop_wait``)."""
        launcher_options.setdefault("persistent", events is not None)
        handle = self.launcher.launch(cfg, payload, attempt=attempt, log_dir=log_dir, excerpt=excerpt,
                                      events=events, **launcher_options)
        log.info("run %s attempt %d: %d rank(s) on node %d of %d (supervisor pid %d, port %d)", handle.run_id,
                 attempt, cfg.num_processes, cfg.node_rank, cfg.num_nodes, handle.supervisor_pid,
                 handle.master_port)
        return handle

    def open_session(self, cfg) -> "LocalSession":
        return LocalSession(self, cfg)

    def done(self, attempt: Attempt) -> None:
        self.launcher.live.pop(attempt.run_id, None)

    def learn_modules(self, modules: list) -> None:
        self.launcher.learn_modules(modules)


def limit_sends(sock) -> None:
    """A PUSH with no peer blocks a send for ever: a supervisor that died
    between the kernel's look and the send must not hang the kernel.  Each
    try waits a slice; ``LocalSession.send`` looks between them."""
    sock.setsockopt(zmq.SNDTIMEO, int(SEND_SLICE * 1000))


class LocalSession(SessionAttempt):
    """A session's ranks on this machine: one run of the launcher whose
    supervisor stays (:mod:`..supervisor.session_supervisor`).  It owns two
    sockets in the launcher's private directory: events (PULL, what the
    supervisor sends, verified per message) and cells (PUSH, each cell signed
    with the session's key)."""

    def __init__(self, placement: LocalPlacement, cfg) -> None:
        self.placement = placement
        self.launcher = placement.launcher
        self.cfg = cfg
        self.pids: dict[int, int] = {}
        self.supervisor_pid = 0
        self.events = self.cells = None
        self._sending = threading.Lock()      # the cells socket: a background cell's stop comes from another thread

    def open(self) -> None:
        name = wire.new_id()
        self.events = self.launcher.channel(zmq.PULL, f"s{name}-ev")
        self.cells = self.launcher.channel(zmq.PUSH, f"s{name}-in")
        limit_sends(self.cells[0])
        try:
            handle = self.placement.launch(self.cfg, None, events=self.events, stop_wait=SESSION_STOP_WAIT,
                                           persistent=True,
                                           extra={"session": True, "cells_addr": self.cells[1], "payload": None,
                                                  "stall_timeout": self.cfg.stall_timeout
                                                  if self.cfg.num_nodes == 1 else 0})
        except BaseException:
            self.release()
            raise
        self.id = handle.run_id
        self.key = handle.session.key
        self.verifier = handle.session
        self.signer = wire.signed_session(self.key)
        self.supervisor_pid = handle.supervisor_pid
        self.master_port = handle.master_port
        handle.timeout_at = time.monotonic() + START_WAIT
        try:
            self._wait_ready(handle)
        except BaseException:
            handle.force_kill()
            raise
        finally:
            handle.close()

    def _wait_ready(self, handle: RunHandle) -> None:
        for msg in handle.messages():
            kind = msg["kind"]
            if kind == "started":
                self.pids = dict(msg["pids"])
            elif kind == "ready":
                handle.finished = True   # the start is over; the session's messages go on
                return
            elif kind == "session_lost":
                raise SessionGone(f"the session could not start: {msg.get('lost')}")
            elif kind == "rendezvous_failed":
                raise SessionGone(f"the session could not start: {msg['message']}")
            elif kind == "supervisor_error":
                raise LauncherError("the session's supervisor failed:\n" + msg["traceback"])
            elif kind == "finished":
                raise SessionGone("the session's ranks could not start"
                                  + (f" ({msg['forced']})" if msg.get("forced") else ""))

    def cell(self, run_id: str, timeout: Optional[float]) -> RunHandle:
        handle = RunHandle(self.launcher, run_id, self.key, self.supervisor_pid, self.master_port, timeout,
                           pull=self.events[0], stop_wait=SESSION_STOP_WAIT, session=self.verifier,
                           timeout_slack=SESSION_TIMEOUT_SLACK,
                           ranks=sorted(self.pids) or [self.cfg.global_rank(i) for i in self.cfg.local_ranks])
        handle.rank_pids = set(self.pids.values())
        handle.session_cell = True
        handle.send_stop = lambda: self.send("interrupt", {"op": "interrupt", "run_id": run_id})
        handle.also = (self.id,)   # the session's "session lost" (a rank died as the cell was sent) ends the cell
        return handle

    def send(self, op: str, content: dict) -> None:
        """Signed with the session's key (LauncherError: nobody took it, the
        supervisor is gone).  A live one takes it at once; one that died as it
        was sent (a rank died at its prompt, the stop came as it lost the
        session) is seen gone within a slice, not after the whole wait (CI: a
        restart took 10 s)."""
        with self._sending:
            deadline = time.monotonic() + SEND_WAIT   # from now: not the time spent waiting for the lock
            while True:
                if self.cells is None:   # released (lost, stopped) while this waited
                    raise LauncherError(f"the session's supervisor did not take the {op}: it is gone")
                try:
                    self.signer.send(self.cells[0], op, content)
                    return
                except zmq.Again:   # nothing was queued: sending again sends it once
                    if not running(self.supervisor_pid) or time.monotonic() >= deadline:
                        raise LauncherError(f"the session's supervisor did not take the {op}: it is gone") from None

    def lost_since(self) -> Optional[str]:
        why = self.said_lost(0)
        if why is None and not running(self.supervisor_pid):
            # A supervisor that lost its session says why, then exits: its word may still be on the way.
            why = self.said_lost(GONE_DRAIN) or \
                "its supervisor process ended (it was killed, or the launcher was stopped or replaced)"
        return why

    def said_lost(self, wait: float) -> Optional[str]:
        """The "session lost" among the messages waiting (for the first, up to ``wait`` seconds)."""
        why = None
        timeout = int(wait * 1000)
        while self.events is not None and self.events[0].poll(timeout):
            timeout = 0
            frames = self.events[0].recv_multipart()
            try:
                content = wire.verified_content(self.verifier, frames)
            except Exception:
                continue
            if content.get("kind") == "session_lost":
                why = session_lost_why(content)
        return why

    def end(self, attempt: Optional[Attempt]) -> None:
        """The supervisor exits after its ranks: wait for that (bounded), else kill."""
        deadline = time.monotonic() + SESSION_GONE_WAIT
        while time.monotonic() < deadline and running(self.supervisor_pid):
            time.sleep(SESSION_GONE_POLL)
        if running(self.supervisor_pid) and attempt is not None:
            attempt.finished = False
            attempt.force_kill()

    def release(self) -> None:
        self.launcher.live.pop(self.id, None)
        # Under the send lock: a background cell's stop is sent from another
        # thread (the events socket's reader is the cell's own, ended or ending).
        with self._sending:
            for pair in (self.events, self.cells):
                if pair is not None:
                    pair[0].close(linger=0)
                    path = pair[1][len("ipc://"):]
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            self.events = self.cells = None

    def learn_modules(self, modules: list) -> None:
        self.placement.learn_modules(modules)


__all__ = ["LocalPlacement", "LocalSession", "limit_sends"]
