"""Kernel side of a session: ranks that live across cells (``%distributed_session``).

A session is a mode on a placement, as a one-shot run or restarts are
(:mod:`run`): the placement opens the session's ranks
(``Placement.open_session``, a :class:`placement.SessionAttempt`: on this
machine :class:`local_placement.LocalSession`, on every node of an
allocation :class:`slurm_session.SlurmSessionRanks`) and reads and stops each
cell through the same :class:`placement.Attempt` contract as a run's.  A
:class:`DistributedSession` holds only what a session is: its ranks' names,
one cell at a time, whether it lives on or was lost, its status.  It knows
nothing of where its ranks run.

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
from typing import Optional

from ..environment import LaunchConfig
from .errors import (CompletedBeforeTheStop, DistributedRunError, DistributedStallError, DistributedTimeoutError,
                     LauncherError, ReportedError, RunInterrupted, SessionGone, SessionLostError)
from .placement import Attempt, Placement, SessionAttempt, session_lost_why
from ..logs import RunLog
from ..wire import new_id
from ..wire.payload import Payload
from ..gpu_memory import GpuMemory
from ..process_tree import stat_fields
from ..sigint import sigint_deferred
from . import post_mortem
from .run import RunControl, RunResult, collect, conclude
# The ladders' order: see timing.py.
from ..timing import SESSION_END_WAIT as STOP_WAIT, GONE_DRAIN, FORCE_AFTER


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


def _restartable(lost: SessionLostError, control: Optional[RunControl]) -> bool:
    """A loss ``--max_restarts`` restarts: a failure, not the user's stop or the cell's --timeout."""
    stopped = control is not None and control.stop_requested
    return not stopped and not isinstance(lost.cause, (RunInterrupted, DistributedTimeoutError, KeyboardInterrupt))


def _ended_by_itself(msg: dict) -> Optional[str]:
    """What a message of the session's end says ended it before the stop did:
    its supervisor's "session lost", or a rank that died of a signal nobody
    of ours sent (the out-of-memory killer, a kill -9)."""
    why = session_lost_why(msg)
    if why is not None:
        return why
    if msg.get("kind") == "exit" and msg.get("signal") and not msg.get("stopped"):
        return f"rank {msg['rank']} killed by {msg['signal']}"
    return None


class DistributedSession:
    """A session on a placement: ``placement.open_session(cfg)`` holds its
    ranks (wherever they run); this holds what a session is."""

    def __init__(self, placement: Placement, cfg: LaunchConfig, options: Optional[dict] = None) -> None:
        self.placement = placement
        # ``--max_restarts``: the session's own (see run_cell), never its supervisors'.
        self.max_restarts = cfg.max_restarts
        self.cfg = dataclasses.replace(cfg, max_restarts=0)
        self.options = dict(options or {})   # the flags it was started with (restart reuses them)
        self.ranks: Optional[SessionAttempt] = None   # where its ranks are, once started
        self.alive = False
        self.lost: Optional[str] = None
        self.owned: dict[str, str] = {}       # name -> label of the session cell that bound it
        self.held: set[str] = set()           # the names it owned when it was last lost (a restart says them)
        self.kinds: dict[str, tuple] = {}     # name -> (type, bytes or None), as rank 0 last had it
        self.told: set[str] = set()           # names the "session's own ... used" notice named already
        self.current: Optional[str] = None    # label of the cell running now
        self.current_control: Optional[RunControl] = None
        self.cells_run = 0
        self.completed: Optional[str] = None   # the running cell's label once every rank completed it
        self._busy = threading.Lock()         # one cell at a time
        self._idle = threading.Event()        # no cell runs: what a waiting cell waits for (see wait_idle)
        self._idle.set()

    @property
    def id(self) -> str:
        return self.ranks.id if self.ranks is not None else ""

    @property
    def pids(self) -> dict:
        """Global rank -> pid of every rank of the session."""
        return self.ranks.pids if self.ranks is not None else {}

    @property
    def master_port(self) -> int:
        return self.ranks.master_port if self.ranks is not None else 0

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start the ranks; returns once every rank is set up (raises if one could not)."""
        self.ranks = self.placement.open_session(self.cfg)
        try:
            self.ranks.open()
        except BaseException:
            self._forget()
            raise
        self.alive = True
        log.info("session %s: %d rank(s) ready", self.id, len(self.pids))

    def stop(self) -> None:
        """Let every rank end (frees its memory, GPU memory included); returns
        when they are gone (the kernel kills what does not end in time)."""
        if not self.alive:
            self._forget()
            return
        run_id = self.ranks.stop_id()
        handle = self.ranks.cell(run_id, None)
        handle.timeout_at = time.monotonic() + STOP_WAIT
        try:
            why = self.ranks.lost_since()
            if why is not None:   # it ended by itself (a rank died at its prompt): nobody to ask
                self.lost = why
                return            # what is left of it is killed below
            self.ranks.send("stop", {"op": "stop", "run_id": run_id})
            for msg in handle.messages():
                # It may have been ending by itself as the stop came: say what ended it.
                self.lost = self.lost or _ended_by_itself(msg)
        except LauncherError:   # it is gone already: what matters is that nothing is left
            self.lost = self.lost or self.ranks.lost_since() or "its supervisor was gone"
        finally:
            handle.close()
            self.ranks.end(handle)
            self._forget()

    def _forget(self) -> None:
        self.alive = False
        if self.owned:
            self.held = set(self.owned)
        self.owned.clear()
        self.kinds.clear()
        if self.ranks is not None:
            self.ranks.release()

    def check(self) -> None:
        """Raise SessionGone if the session ended by itself since the last cell
        (a rank died at its prompt, the launcher was replaced)."""
        if not self.alive:
            raise SessionGone(self.lost or "the session is not running")
        why = self.ranks.lost_since()
        if why is not None:
            self.lost = why
            self._forget()
            raise SessionGone(f"the session was lost between cells: {why}")

    # -- cells ------------------------------------------------------------------------
    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no cell runs (a background one); the stop button ends the wait."""
        # An Event, not the lock itself: a stop landing just after acquire()
        # returned (before release()) left the lock held, and every later
        # session cell waited for it for ever (CI caught it).
        return self._idle.wait(timeout)

    def run_cell(self, payload: Payload, label: str, on_event=None, heartbeat: Optional[float] = None,
                 log_dir: str = "", excerpt=None, timeout: Optional[float] = None,
                 control: Optional[RunControl] = None, on_restart=None, ask=None, hold: bool = False) -> RunResult:
        """Run one cell on the session's ranks; its result, or the error that
        tells its story (with whether the session lives on).  With
        ``--max_restarts``, a session lost under the cell (a rank died, its
        supervisor ended: not a stop, not a timeout) is restarted and the cell
        run again; ``on_restart(line)`` says so, as it happens."""
        emit = on_event or (lambda event: None)
        with self._busy, RunLog(log_dir):
            self._idle.clear()
            log.info("session %s: cell %s", self.id, label)
            try:
                for attempt in range(self.max_restarts + 1):
                    if attempt and control is not None and control.stop_requested:   # stopped while it restarted
                        raise RunInterrupted({}, [], message=f"interrupted before attempt {attempt + 1} started: "
                                             f"the session was restarted, and {label} did not run again")
                    self.completed = None
                    try:
                        return self._run_cell_now(payload, label, emit, heartbeat=heartbeat, log_dir=log_dir,
                                                  excerpt=excerpt, timeout=timeout, control=control, ask=ask,
                                                  attempt=attempt, hold=hold)
                    except SessionLostError as exc:
                        if attempt >= self.max_restarts or not _restartable(exc, control):
                            raise
                        self._restart(exc, label, attempt, on_restart)
                raise AssertionError("unreachable")  # pragma: no cover
            except KeyboardInterrupt as exc:
                # Past the reading: a press while the cell's results are brought back.
                if self.completed is None or isinstance(exc, ReportedError):
                    raise
                raise CompletedBeforeTheStop(self.completed) from None
            finally:
                self._idle.set()
                payload.release()

    def _restart(self, lost: SessionLostError, label: str, attempt: int, on_restart) -> None:
        """``--max_restarts``: the session was lost under cell ``label``; its
        ranks start afresh on a fresh rendezvous (its state is gone, said so),
        and the cell runs again on them (its "started" says which attempt: see collect)."""
        held = sorted(self.held)
        text = (f"the session was lost in {label} ({lost.why}); restarting it on a fresh rendezvous "
                f"(restart {attempt + 1} of {self.max_restarts}): its state is gone"
                + (f" ({', '.join(held)} with it)" if held else "") + f"; {label} runs again on the fresh ranks.")
        log.info("session %s: %s", self.id, text)
        if on_restart is not None:
            on_restart(text)
        try:
            self.start()
        except (SessionGone, LauncherError) as exc:
            raise SessionLostError(f"{lost.why}; restarting it failed: {exc}", lost.cause) from None
        self.lost = None
        self.told.clear()
        self.held.clear()

    def _run_cell_now(self, payload, label, emit, *, heartbeat, log_dir, excerpt, timeout, control,
                      attempt: int = 0, ask=None, hold: bool = False) -> RunResult:
        """run_cell's work, with the session held for this cell.  ``hold``: a
        rank that fails keeps the cell's frames for a post-mortem until the
        next cell (``%distributed_debug``)."""
        self.check()
        started = time.time()
        run_id = new_id()
        # The cell's own --timeout (its error says it); its attempt of max_restarts + 1 (the views say it).
        cfg = dataclasses.replace(self.cfg, timeout=timeout, max_restarts=self.max_restarts)
        handle = self.ranks.cell(run_id, timeout)
        # Marked current only once there is a handle to close: ``finally`` unmarks it.
        self.current, self.current_control = label, control
        try:
            outcome = self._send_and_collect(handle, {"op": "cell", "run_id": run_id, "payload": payload,
                                                      "timeout": timeout, "log_dir": log_dir, "excerpt": excerpt,
                                                      "debug_hold": hold},
                                             cfg, emit, heartbeat, control, attempt, ask)
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
                    conclude(outcome, cfg, attempt, started)
                except BaseException as exc:
                    cause = exc
                else:
                    cause = None
                self.ranks.end(handle)
                self._forget()
                raise SessionLostError(self.lost, cause) from None
            try:
                result = conclude(outcome, cfg, attempt, started)
            except (DistributedRunError, RunInterrupted, DistributedTimeoutError, DistributedStallError) as exc:
                stopped = isinstance(exc, (RunInterrupted, DistributedTimeoutError))
                exc.after = ALIVE_NOTE + (apart_note(outcome, len(self.pids)) if stopped else "")
                if isinstance(exc, DistributedRunError) and outcome.held:
                    exc.held = post_mortem.held_in_session(self, run_id, outcome, background=control is not None)
                    exc.after += "\n" + exc.held.hint()
                raise
            self.ranks.learn_modules(result.new_modules)
            return result
        finally:
            handle.close()
            self.current = self.current_control = None

    def _send_and_collect(self, handle: Attempt, cell: dict, cfg: LaunchConfig, emit, heartbeat,
                          control: Optional[RunControl], attempt: int = 0, ask=None):
        """Send the cell, then read it to its end (its :class:`Outcome`).

        A press from the moment the cell is on its way is held until the
        reading has begun, and taken there as the cell's stop: raised in
        between, it left the cell running with nobody reading or stopping it.
        """
        with sigint_deferred() as held:
            try:
                self.ranks.send("cell", cell)
            except LauncherError as exc:   # it ended since the check: its last word says why, if it said one
                why = self.ranks.said_lost(GONE_DRAIN)
                self.lost = why or str(exc)
                self._forget()
                raise SessionLostError(why or "its supervisor ended before the cell reached it",
                                       None if why else exc) from None
            if control is not None:
                control.attach(handle)
            try:
                return collect(handle, cfg, attempt, emit, heartbeat, held=held, ask=ask)
            except LauncherError as exc:
                self.lost = str(exc)
                self._forget()
                self.ranks.ended_under(exc)
                raise SessionLostError("its supervisor ended during the cell", exc) from None
            finally:
                if control is not None:
                    control.detach(handle)

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
        return self.ranks.locate(rows, self.current) if self.ranks is not None else rows


_PAGE = os.sysconf("SC_PAGE_SIZE")
_STATES = {"R": "running", "S": "sleeping", "D": "in I/O", "T": "stopped", "t": "traced", "Z": "zombie"}


def _proc_state(pid: int) -> tuple[str, Optional[int]]:
    fields = stat_fields(pid)
    if fields is None:
        return "gone", None
    return _STATES.get(fields[0], fields[0]), int(fields[21]) * _PAGE


__all__ = ["DistributedSession", "SessionGone", "SessionLostError", "ReportedError"]
