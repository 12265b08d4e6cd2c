"""Kernel side of a session: ranks that live across cells (``%distributed_session``).

A :class:`DistributedSession` is one run of the launcher whose supervisor
stays (:mod:`session_supervisor`) and whose ranks keep their namespaces.  It
owns two sockets in the launcher's private directory: events (PULL, what the
supervisor sends, verified per message) and cells (PUSH, each cell signed
with the session's key).  It runs one cell at a time.

Names (the rule docs/how-to/sessions.md states): a name a session cell bound (on any
rank) belongs to the session from then on: later session cells use the
ranks' own value and the kernel's is never sent, not even inside a notebook
function that uses it.  Every other name a cell uses comes from the kernel,
sent with each cell that uses it.  ``owned`` maps each session name to the
cell that bound it last; :meth:`push` hands names back to the kernel.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Optional

import zmq

from .. import wire
from ..environment import LaunchConfig
from .errors import (CompletedBeforeTheStop, DistributedRunError, DistributedStallError, DistributedTimeoutError,
                     LauncherError, ReportedError, RunInterrupted, SessionLostError)
from .launcher import Launcher
from .placement import LocalPlacement
from ..logs import RunLog
from ..wire.payload import Payload
from ..gpu_memory import GpuMemory
from ..process_tree import running, stat_fields
from ..sigint import sigint_deferred
from .run import RunControl, RunResult, collect, conclude
from .run_handle import RunHandle
# The ladders' order: see timing.py.
from ..timing import (
    SESSION_START_WAIT as START_WAIT, SESSION_STOP_WAIT, SESSION_END_WAIT as STOP_WAIT, SESSION_TIMEOUT_SLACK,
    SESSION_SEND_WAIT as SEND_WAIT, SESSION_SEND_SLICE as SEND_SLICE, GONE_DRAIN, FORCE_AFTER,
    SESSION_GONE_WAIT, SESSION_GONE_POLL,
)


log = logging.getLogger("accel_magics.kernel.session")

ALIVE_NOTE = ("The session lives on: every rank is back at its prompt with its state (what the cell did "
              "before it stopped is kept).")
_APART = (" so each stopped where it was: their state may differ (a loop counter one step apart); check it on "
          "each rank, or re-run from a known state.")


def apart_note(outcome, ranks: int) -> str:
    """After a session cell's stop: the warning that the ranks' states may
    differ, unless every rank stopped after the optimizer step they agreed on
    (worker._after_optimizer_step).  Without a process group there was
    nothing to agree through; with one, the cell stepped no optimizer before
    the second stop signal (or a rank was already out of the cell)."""
    if ranks < 2 or len(outcome.agreed) >= ranks:
        return ""
    if not outcome.in_world:
        return " The ranks had no process group to agree on a step," + _APART
    return (" The ranks did not all stop after an optimizer step they agreed on (only a loop that steps an "
            "optimizer can stop at one: the cell stepped none within "
            f"{FORCE_AFTER:g} s of the stop)," + _APART)


def _lost_why(msg: dict) -> Optional[str]:
    """Why the supervisor says it lost the session, if ``msg`` says so."""
    if msg.get("kind") == "session_lost" or (msg.get("kind") == "finished" and msg.get("lost")):
        return msg.get("lost") or "its ranks ended"
    return None


def _ended_by_itself(msg: dict) -> Optional[str]:
    """What a message of the session's end says ended it before the stop did:
    its supervisor's "session lost", or a rank that died of a signal nobody
    of ours sent (the out-of-memory killer, a kill -9)."""
    why = _lost_why(msg)
    if why is not None:
        return why
    if msg.get("kind") == "exit" and msg.get("signal") and not msg.get("stopped"):
        return f"rank {msg['rank']} killed by {msg['signal']}"
    return None


class SessionGone(RuntimeError):
    """The session is not there (never started, stopped, or lost)."""


def limit_sends(sock) -> None:
    """A PUSH with no peer blocks a send for ever: a supervisor that died
    between the kernel's look and the send must not hang the kernel.  Each
    try waits a slice; ``DistributedSession._send`` looks between them."""
    sock.setsockopt(zmq.SNDTIMEO, int(SEND_SLICE * 1000))


class DistributedSession:
    def __init__(self, launcher: Launcher, cfg: LaunchConfig, options: Optional[dict] = None,
                 placement: Optional[LocalPlacement] = None) -> None:
        self.launcher = launcher
        # What starts its ranks: the placement it was started on (this machine's, through ``launcher``).
        self.placement = placement if placement is not None else LocalPlacement(launcher) if launcher else None
        self.cfg = cfg
        self.options = dict(options or {})   # the flags it was started with (restart reuses them)
        self.id = ""
        self.alive = False
        self.lost: Optional[str] = None
        self.pids: dict[int, int] = {}
        self.supervisor_pid = 0
        self.owned: dict[str, str] = {}       # name -> label of the session cell that bound it
        self.kinds: dict[str, tuple] = {}     # name -> (type, bytes or None), as rank 0 last had it
        self.told: set[str] = set()           # names the "session's own ... used" notice named already
        self.current: Optional[str] = None    # label of the cell running now
        self.current_control: Optional[RunControl] = None
        self.cells_run = 0
        self.completed: Optional[str] = None   # the running cell's label once every rank completed it
        self._busy = threading.Lock()         # one cell at a time
        self._sending = threading.Lock()      # the cells socket: a background cell's stop comes from another thread
        self._idle = threading.Event()        # no cell runs: what a waiting cell waits for (see wait_idle)
        self._idle.set()
        self.events = self.cells = None
        self.master_port = 0

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start the ranks; returns once every rank is set up (raises if one could not)."""
        self._open()
        log.info("session %s: %d rank(s) ready", self.id, len(self.pids))

    # -- where the ranks are: these hooks are the placement's part (this machine,
    # through the launcher; every node of an allocation: slurm_session) ------------
    def _open(self) -> None:
        """Start the ranks and wait until every one is set up (``pids``, ``id``,
        ``verifier``, ``master_port`` known, ``alive``), or raise SessionGone."""
        name = uuid.uuid4().hex[:12]
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
            self._close_sockets()
            raise
        self.id = handle.run_id
        self.key = handle.session.key
        self.verifier = handle.session
        self.signer = wire.signed_session(self.key)
        self.supervisor_pid = handle.supervisor_pid
        self.master_port = handle.master_port
        handle.timeout_at = time.monotonic() + START_WAIT
        try:
            for msg in handle.messages():
                kind = msg["kind"]
                if kind == "started":
                    self.pids = dict(msg["pids"])
                elif kind == "ready":
                    self.alive = True
                    handle.finished = True   # the start is over; the session's messages go on
                    break
                elif kind == "session_lost":
                    raise SessionGone(f"the session could not start: {msg.get('lost')}")
                elif kind == "rendezvous_failed":
                    raise SessionGone(f"the session could not start: {msg['message']}")
                elif kind == "supervisor_error":
                    raise LauncherError("the session's supervisor failed:\n" + msg["traceback"])
                elif kind == "finished":
                    raise SessionGone("the session's ranks could not start"
                                      + (f" ({msg['forced']})" if msg.get("forced") else ""))
        except BaseException:
            handle.force_kill()
            self._forget()
            raise
        finally:
            handle.close()

    def stop(self) -> None:
        """Let every rank end (frees its memory, GPU memory included); returns
        when they are gone (the kernel kills what does not end in time)."""
        if not self.alive:
            self._forget()
            return
        run_id = self._stop_id()
        handle = self._handle(run_id, None)
        handle.timeout_at = time.monotonic() + STOP_WAIT
        try:
            why = self._lost_since()
            if why is not None:   # it ended by itself (a rank died at its prompt): nobody to ask
                self.lost = why
                return            # what is left of it is killed below
            self._send("stop", {"op": "stop", "run_id": run_id})
            for msg in handle.messages():
                # It may have been ending by itself as the stop came: say what ended it.
                self.lost = self.lost or _ended_by_itself(msg)
        except LauncherError:   # it is gone already: what matters is that nothing is left
            self.lost = self.lost or self._lost_since() or "its supervisor was gone"
        finally:
            handle.close()
            self._wait_gone(handle)
            self._forget()

    def _stop_id(self) -> str:
        """The id the stop's messages carry: the session's own, so that its
        "session lost" (a rank died as the stop came) is read, not dropped."""
        return self.id

    def _send(self, op: str, content: dict) -> None:
        """A cell or the stop to the session's supervisor, signed with its key
        (LauncherError: nobody took it, the supervisor is gone).  A live one
        takes it at once; one that died as it was sent (a rank died at its
        prompt, the stop came as it lost the session) is seen gone within a
        slice, not after the whole wait (CI: a restart took 10 s)."""
        with self._sending:
            deadline = time.monotonic() + SEND_WAIT   # from now: not the time spent waiting for the lock
            while True:
                if self.cells is None:   # forgotten (lost, stopped) while this waited
                    raise LauncherError(f"the session's supervisor did not take the {op}: it is gone")
                try:
                    self.signer.send(self.cells[0], op, content)
                    return
                except zmq.Again:   # nothing was queued: sending again sends it once
                    if not running(self.supervisor_pid) or time.monotonic() >= deadline:
                        raise LauncherError(f"the session's supervisor did not take the {op}: it is gone") from None

    def _learn(self, modules: list) -> None:
        self.placement.learn_modules(modules)

    def _wait_gone(self, handle: RunHandle) -> None:
        """The supervisor exits after its ranks: wait for that (bounded), else kill."""
        deadline = time.monotonic() + SESSION_GONE_WAIT
        while time.monotonic() < deadline and running(self.supervisor_pid):
            time.sleep(SESSION_GONE_POLL)
        if running(self.supervisor_pid):
            handle.finished = False
            handle.force_kill()

    def _forget(self) -> None:
        self.alive = False
        self.launcher.live.pop(self.id, None)
        self.owned.clear()
        self.kinds.clear()
        self._close_sockets()

    def _close_sockets(self) -> None:
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

    def check(self) -> None:
        """Raise SessionGone if the session ended by itself since the last cell
        (a rank died at its prompt, the launcher was replaced)."""
        if not self.alive:
            raise SessionGone(self.lost or "the session is not running")
        why = self._lost_since()
        if why is not None:
            self.lost = why
            self._forget()
            raise SessionGone(f"the session was lost between cells: {why}")

    def _lost_since(self) -> Optional[str]:
        """Why the session ended by itself since the last cell, or None."""
        why = self._said_lost(0)
        if why is None and not running(self.supervisor_pid):
            # A supervisor that lost its session says why, then exits: its word may still be on the way.
            why = self._said_lost(GONE_DRAIN) or \
                "its supervisor process ended (it was killed, or the launcher was stopped or replaced)"
        return why

    def _said_lost(self, wait: float) -> Optional[str]:
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
                why = _lost_why(content)
        return why

    # -- cells ------------------------------------------------------------------------
    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no cell runs (a background one); the stop button ends the wait."""
        # An Event, not the lock itself: a stop landing just after acquire()
        # returned (before release()) left the lock held, and every later
        # session cell waited for it for ever (CI caught it).
        return self._idle.wait(timeout)

    def _handle(self, run_id: str, timeout: Optional[float]) -> RunHandle:
        handle = RunHandle(self.launcher, run_id, self.key, self.supervisor_pid, self.master_port, timeout,
                           pull=self.events[0], stop_wait=SESSION_STOP_WAIT, session=self.verifier,
                           timeout_slack=SESSION_TIMEOUT_SLACK,
                           ranks=sorted(self.pids) or [self.cfg.global_rank(i) for i in self.cfg.local_ranks])
        handle.rank_pids = set(self.pids.values())
        handle.session_cell = True
        handle.send_stop = lambda: self._send("interrupt", {"op": "interrupt", "run_id": run_id})
        handle.also = (self.id,)   # the session's "session lost" (a rank died as the cell was sent) ends the cell
        return handle

    def run_cell(self, payload: Payload, label: str, on_event=None, heartbeat: Optional[float] = None,
                 log_dir: str = "", excerpt=None, timeout: Optional[float] = None,
                 control: Optional[RunControl] = None) -> RunResult:
        """Run one cell on the session's ranks; its result, or the error that
        tells its story (with whether the session lives on)."""
        emit = on_event or (lambda event: None)
        with self._busy, RunLog(log_dir):
            self._idle.clear()
            log.info("session %s: cell %s", self.id, label)
            self.completed = None
            try:
                return self._run_cell_now(payload, label, emit, heartbeat=heartbeat, log_dir=log_dir,
                                          excerpt=excerpt, timeout=timeout, control=control)
            except KeyboardInterrupt as exc:
                # Past the reading: a press while the cell's results are brought back.
                if self.completed is None or isinstance(exc, ReportedError):
                    raise
                raise CompletedBeforeTheStop(self.completed) from None
            finally:
                self._idle.set()

    def _run_cell_now(self, payload, label, emit, *, heartbeat, log_dir, excerpt, timeout, control) -> RunResult:
        """run_cell's work, with the session held for this cell."""
        self.check()
        started = time.time()
        run_id = uuid.uuid4().hex[:12]
        cfg = dataclasses.replace(self.cfg, timeout=timeout)   # the cell's own --timeout (its error says it)
        handle = self._handle(run_id, timeout)
        # Marked current only once there is a handle to close: ``finally`` unmarks it.
        self.current, self.current_control = label, control
        try:
            outcome = self._send_and_collect(handle, {"op": "cell", "run_id": run_id, "payload": payload,
                                                      "timeout": timeout, "log_dir": log_dir, "excerpt": excerpt},
                                             cfg, emit, heartbeat, control)
            if outcome.completed:   # from here a press is after the cell's end (see run_cell)
                self.completed = label
            with sigint_deferred() as held:   # the session's books are kept whole
                self.cells_run += 1
                for name in outcome.deleted:
                    self.owned.pop(name, None)
                for name in outcome.assigned:
                    self.owned[name] = label
                for name in outcome.deleted:
                    self.kinds.pop(name, None)
                self.kinds.update(outcome.kinds)
                # A press now, or one the reading took after every rank had completed (the
                # outcome is the cell's, not the press's): the cell says it completed.
                pressed = held.release() or outcome.pressed
            if pressed and outcome.completed:
                raise CompletedBeforeTheStop(label)
            if outcome.session == "lost":
                self.lost = outcome.lost or "its ranks could not go on"
                try:
                    conclude(outcome, cfg, 0, started)
                except BaseException as exc:
                    cause = exc
                else:
                    cause = None
                self._wait_gone(handle)
                self._forget()
                raise SessionLostError(self.lost, cause) from None
            try:
                result = conclude(outcome, cfg, 0, started)
            except (DistributedRunError, RunInterrupted, DistributedTimeoutError, DistributedStallError) as exc:
                stopped = isinstance(exc, (RunInterrupted, DistributedTimeoutError))
                exc.after = ALIVE_NOTE + (apart_note(outcome, len(self.pids)) if stopped else "")
                raise
            self._learn(result.new_modules)
            return result
        finally:
            handle.close()
            payload.release()
            self.current = self.current_control = None

    def _send_and_collect(self, handle: RunHandle, cell: dict, cfg: LaunchConfig, emit, heartbeat,
                          control: Optional[RunControl]):
        """Send the cell, then read it to its end (its :class:`Outcome`).

        A press from the moment the cell is on its way is held until the
        reading has begun, and taken there as the cell's stop: raised in
        between, it left the cell running with nobody reading or stopping it.
        """
        with sigint_deferred() as held:
            try:
                self._send("cell", cell)
            except LauncherError as exc:   # it ended since the check: its last word says why, if it said one
                why = self._said_lost(GONE_DRAIN)
                self.lost = why or str(exc)
                self._forget()
                raise SessionLostError(why or "its supervisor ended before the cell reached it",
                                       None if why else exc) from None
            if control is not None:
                control.attach(handle)
            try:
                return collect(handle, cfg, 0, emit, heartbeat, held=held)
            except LauncherError as exc:
                self.lost = str(exc)
                self._forget()
                self._ended_under(exc)
                raise SessionLostError("its supervisor ended during the cell", exc) from None

    def _ended_under(self, exc: LauncherError) -> None:
        """What held the session's ranks ended under a cell (``exc`` says
        what): the placement's part, after the session is forgotten (nothing
        here: the launcher serves the next run)."""

    def push_names(self, names: list[str]) -> None:
        """The kernel's values of ``names`` replace the session's (see the module doc)."""
        for name in names:
            self.owned.pop(name, None)
            self.kinds.pop(name, None)
            self.told.discard(name)

    # -- status ------------------------------------------------------------------------
    def status(self) -> list[dict]:
        """Per rank: pid, process state, RSS, GPU memory (where NVML can tell), the cell it runs."""
        nvml = GpuMemory()
        gpu = nvml.used()
        nvml.close()
        rows = []
        for rank, pid in sorted(self.pids.items()):
            state, rss = _proc_state(pid)
            rows.append({"rank": rank, "pid": pid, "state": state, "rss": rss, "gpu": gpu.get(pid),
                         "cell": self.current if state not in ("gone", "zombie") else None})
        return rows


_PAGE = os.sysconf("SC_PAGE_SIZE")
_STATES = {"R": "running", "S": "sleeping", "D": "in I/O", "T": "stopped", "t": "traced", "Z": "zombie"}


def _proc_state(pid: int) -> tuple[str, Optional[int]]:
    fields = stat_fields(pid)
    if fields is None:
        return "gone", None
    return _STATES.get(fields[0], fields[0]), int(fields[21]) * _PAGE


__all__ = ["DistributedSession", "SessionGone", "SessionLostError", "ReportedError"]
