"""Run a payload to the end: attempts, events, root cause, results.

:func:`execute` is the engine's one entry point for a cell: it launches the
run on a placement (again, up to ``max_restarts`` times, each on a fresh
rendezvous), folds each attempt's messages (:mod:`fold`) into :mod:`events`
for the caller's ``on_event`` consumer, and returns rank 0's result or raises the error that
names the root cause.  The kernel's interrupt (``KeyboardInterrupt`` in the
caller's thread) stops every rank and is re-raised as :class:`RunInterrupted`.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import events as ev, post_mortem
from ..environment import LaunchConfig
from .errors import (DistributedRunError, DistributedStallError, DistributedTimeoutError, RendezvousError,
                     RunInterrupted, RunTerminated, forced_note, ranks_text)
from .fold import EventSink, Outcome, RunFold
from .launcher import Launcher
from .local_placement import LocalPlacement
from .placement import Attempt, Placement
from ..logs import RunLog
from ..sigint import Deferred, sigint_deferred
from ..rank.worker import loads_value
from ..wire.messages import Status
from ..wire.payload import Payload

log = logging.getLogger("accel_magics.kernel.run")


@dataclass
class RunResult:
    value: Any = None                  # rank 0's last expression (None if none)
    has_value: bool = False
    returns: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)  # --return names rank 0 did not define
    unloadable: dict = field(default_factory=dict)  # --return name -> RemoteRepr (its value could not travel)
    new_modules: list = field(default_factory=list)  # imported by rank 0, not preloaded
    attempts: int = 1
    elapsed: float = 0.0
    finished: Optional[ev.RunFinished] = None


#: How the kernel answers a rank that reads its stdin: ``ask(rank, prompt)``
#: returns the line typed, or raises EOFError (its message says why) for end of input.
Ask = Callable[[int, str], str]


def collect(handle, cfg: LaunchConfig, attempt: int, emit: EventSink, heartbeat: Optional[float],
            held: Optional[Deferred] = None, ask: Optional[Ask] = None) -> Outcome:
    """Drive one attempt to its end: its messages folded (:class:`fold.RunFold`)
    into events and its outcome.  The stop button (``KeyboardInterrupt`` here)
    stops every rank (stacks first), and reading goes on until the placement
    reports them all gone.  ``held``: the interrupt held since the run was
    sent (see :func:`sigint_deferred`), raised here, where it stops the run.
    ``ask``: answers the ranks' questions (their stdin), one at a time, in
    the order they came; None answers end of input."""
    fold = RunFold(handle.run_id, handle.ranks, attempt=attempt, max_restarts=cfg.max_restarts,
                   world_size=cfg.world_size, num_nodes=cfg.num_nodes, node_rank=cfg.node_rank,
                   master_addr=cfg.master_addr, master_port=handle.master_port, node_of=handle.node_of,
                   session_cell=handle.session_cell, emit=emit)
    messages = handle.messages(heartbeat)
    try:
        while True:
            try:
                if held is not None:   # from here a press is the run's stop
                    held, deferred = None, held
                    deferred.deliver(always_restore=True)
                for msg in messages:
                    fold.feed(msg)
                    if msg.get("kind") == "input_request":
                        answer(handle, msg, ask, emit)
                    if fold.must_stop():   # it cannot end by itself: stopped as by the button
                        handle.interrupt()
                break
            except KeyboardInterrupt:
                fold.interrupted = True
                press(handle)
                messages.close()
                messages = handle.messages(heartbeat)
    finally:
        fold.flush_early()   # a restart's lines from before its "started" reach the view, however it ends
        messages.close()
        handle.close()
    return fold.outcome()


def answer(handle, request: dict, ask: Optional[Ask], emit: EventSink) -> None:
    """A rank's question, asked with ``ask`` and answered through ``handle``;
    the exchange goes to the views (the debugger session's transcript).  A
    press while asking propagates: it is the run's stop."""
    rank, prompt = request.get("rank"), request.get("prompt", "")
    began = time.monotonic()
    line: Optional[str] = None
    why = ""
    if ask is None:
        why = "this run's ranks take no input where it is read"
    else:
        try:
            line = ask(rank, prompt)
        except EOFError as exc:
            why = str(exc) or "end of input"
    emit(ev.InputAnswered(rank, prompt, line, why))
    handle.answer(request, line, why, time.monotonic() - began)


def press(handle) -> None:
    """``handle.interrupt()``, once more for each press that lands while it
    runs (each is the next rung): none escapes the reading loop, which would
    leave the run going with nobody reading or stopping it."""
    while True:
        try:
            handle.interrupt()
            return
        except KeyboardInterrupt:
            continue


class Questions:
    """A background run's ranks' questions (their stdin), held for the
    notebook: the run's thread asks (:meth:`ask`, the engine's ``ask``) and
    waits; a cell answers (:meth:`next`, :meth:`reply`: the handle's
    ``debug()``).  Closed when the run ends or is stopped: every question
    waiting, and every later one, gets end of input."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[list] = []   # [rank, prompt, answer or None, answered]
        self._closed = ""

    def ask(self, rank: int, prompt: str) -> str:
        question = [rank, prompt, None, False]
        with self._cond:
            if self._closed:
                raise EOFError(self._closed)
            self._waiting.append(question)
            self._cond.notify_all()
            while not question[3] and not self._closed:
                self._cond.wait()
            if question in self._waiting:
                self._waiting.remove(question)
            if not question[3] or question[2] is None:
                raise EOFError(self._closed or "end of input, typed in h.debug()")
            return question[2]

    def next(self, timeout: Optional[float]) -> Optional[list]:
        """The oldest question not answered yet, waiting up to ``timeout``
        seconds (None: until one comes or the run ends); None if none."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or any(not q[3] for q in self._waiting), timeout)
            return next((q for q in self._waiting if not q[3]), None)

    def reply(self, question: list, line: Optional[str]) -> None:
        with self._cond:
            question[2], question[3] = line, True
            self._cond.notify_all()

    def pending(self) -> list:
        """(rank, prompt) of each question waiting now."""
        with self._cond:
            return [(q[0], q[1]) for q in self._waiting if not q[3]]

    def close(self, why: str) -> None:
        with self._cond:
            self._closed = why
            self._cond.notify_all()


class RunControl:
    """Stops a run from another thread (a background run's handle): the run
    in flight is interrupted as by the stop button; no further attempt starts.
    ``questions``: its ranks' questions, for the notebook to answer."""

    def __init__(self) -> None:
        self.questions = Questions()
        self.handle: Optional[Attempt] = None
        self.stop_requested = False
        self._unsent = 0   # stops asked before there was a handle: attach() sends them
        # attach() runs in the run's thread, stop() in another: each stop must
        # reach the handle exactly once.  Unlocked, a stop between attach()'s
        # two steps was sent by both, and a second press kills the ranks (a
        # session's cell: the session).  Found reading the code; not seen.
        self._lock = threading.Lock()

    def attach(self, handle: Attempt) -> None:
        with self._lock:
            self.handle = handle
            unsent, self._unsent = self._unsent, 0
        for _ in range(unsent):
            handle.interrupt()

    def detach(self, handle: Attempt) -> None:
        """``handle``'s attempt is over: a stop from now on waits for the next
        attempt's :meth:`attach` (a restart's), or finds that none starts."""
        with self._lock:
            if self.handle is handle:
                self.handle = None

    def stop(self) -> None:
        """First call: stacks, then the ranks are stopped; later calls escalate (see ``Attempt.interrupt``)."""
        self.questions.close("the run was stopped")
        with self._lock:
            self.stop_requested = True
            handle = self.handle
            if handle is None:
                self._unsent += 1
                return
        if not handle.finished:
            handle.interrupt()


def execute(placement, cfg: LaunchConfig, payload: Payload,
            on_event: Optional[EventSink] = None, heartbeat: Optional[float] = None,
            log_dir: str = "", excerpt: Optional[tuple[int, int]] = None,
            control: Optional[RunControl] = None, events=None, ask: Optional[Ask] = None) -> RunResult:
    """Run ``payload`` with ``cfg`` on ``placement`` (a :class:`placement.Placement`,
    or a :class:`Launcher`: this machine); see the module doc.

    The modes are this one loop on every placement: one-shot (here, in the
    kernel's thread), background (here, in a thread of its own, with
    ``control`` and ``events``), restarts (up to ``cfg.max_restarts`` more
    attempts, each on a fresh rendezvous on every node the placement covers).

    ``heartbeat``: emit :class:`events.Heartbeat` after that many idle seconds.
    ``log_dir``: where the supervisor writes every rank's complete output
    (``rank<N>.log``; made at the first line; "" for none).
    ``excerpt``: ``(head, tail)`` to be sent only a rank's first ``head``
    lines and at most the last ``tail`` lines of each batch (what a view that
    keeps a head and a tail needs; the log has everything); None for every line.
    ``control``: lets another thread stop the run; ``events``: the run's own
    socket (see ``Launcher.channel``), for a run read outside the main thread.
    ``ask``: answers a rank that reads its stdin (see :func:`collect`).
    """
    if isinstance(placement, Launcher):
        placement = LocalPlacement(placement)
    try:
        with RunLog(log_dir):
            return _attempts(placement, cfg, payload, on_event or (lambda event: None), heartbeat, log_dir,
                             excerpt, control, events, ask)
    finally:
        payload.release()


def _attempts(placement: Placement, cfg, payload, emit, heartbeat, log_dir, excerpt, control, events,
              ask: Optional[Ask] = None) -> RunResult:
    started = time.time()
    for attempt in range(cfg.max_restarts + 1):
        if control is not None and control.stop_requested:
            raise RunInterrupted({}, [], message=f"interrupted before attempt {attempt + 1} started" if attempt
                                 else "interrupted: nothing ran (stopped before the run started)")
        try:
            handle = placement.launch(cfg, payload, attempt=attempt, log_dir=log_dir, excerpt=excerpt, events=events)
        except KeyboardInterrupt:
            raise RunInterrupted({}, [], message="interrupted while the run was starting; no rank was "
                                 "still running") from None
        # A press once the run is started is its stop, read as one: held until the reading begins.
        with sigint_deferred() as held:
            if control is not None:
                control.attach(handle)
            try:
                outcome = collect(handle, cfg, attempt, emit, heartbeat, held=held, ask=ask)
            finally:
                if control is not None:
                    control.detach(handle)
                placement.done(handle)
        # A failed rank may be held for %distributed_debug (a background run's: its handle's .debug()).
        with post_mortem.noted(handle, outcome, background=control is not None):
            res = conclude(outcome, cfg, attempt, started, last=attempt >= cfg.max_restarts)
        if res is not None:
            placement.learn_modules(res.new_modules)
            return res
        log.info("run %s: attempt %d of %d failed (%s); the next starts on a fresh rendezvous", handle.run_id,
                 attempt + 1, cfg.max_restarts + 1, outcome.finished.root_cause.summary)
    raise AssertionError("unreachable")  # pragma: no cover


def conclude(outcome: Outcome, cfg: LaunchConfig, attempt: int, started: float,
             last: bool = True) -> Optional[RunResult]:
    """The run's result, or the error that tells its story; None: a rank
    failed and another attempt may start (``last`` False).  A plain function
    of the outcome: one wording per :class:`Status`."""
    finished = outcome.finished
    if finished.status == Status.FAILED:
        if not last:
            return None
        root = finished.root_cause
        raise DistributedRunError(root, finished.failures, outcome.others,
                                  attempts=attempt + 1, departed=_departed_before(outcome),
                                  in_setup=root is not None and root.rank in outcome.failed_joining)
    error = _STOPPED.get(Status.parse(finished.status))
    if error is not None:
        raise error(outcome, cfg, forced_note(outcome.forced) if outcome.forced else "") from None
    return _result(outcome, attempt, started)


def _interrupted(outcome: Outcome, cfg: LaunchConfig, note: str) -> Exception:
    return RunInterrupted(outcome.finished.stacks, outcome.unfinished, note)


def _rendezvous_failed(outcome: Outcome, cfg: LaunchConfig, note: str) -> Exception:
    return RendezvousError(outcome.rendezvous_error or (
        f"the rendezvous at {cfg.master_addr}:{outcome.master_port} did not complete within "
        f"--rendezvous_timeout {cfg.rendezvous_timeout:g}s" + note))


def _stalled(outcome: Outcome, cfg: LaunchConfig, note: str) -> Exception:
    info = outcome.stalled or {}
    return DistributedStallError(info.get("ranks", outcome.unfinished), info.get("finished", []),
                                 info.get("seconds", cfg.stall_timeout), outcome.finished.stacks,
                                 left=info.get("left"),
                                 why={int(rank): text for rank, text in (info.get("why") or {}).items()})


def _terminated(outcome: Outcome, cfg: LaunchConfig, note: str) -> Exception:
    where = f" on node {', '.join(outcome.terminated_on)}" if outcome.terminated_on else ""
    return RunTerminated(
        f"the run's supervisor{where} was sent SIGTERM by another process (a rank's os.kill, "
        f"the system, a job scheduler), so every rank was stopped"
        + (f": {ranks_text(outcome.unfinished, '')} had not finished." if outcome.unfinished else "."))


def _timed_out(outcome: Outcome, cfg: LaunchConfig, note: str) -> Exception:
    return DistributedTimeoutError(cfg.timeout or 0, outcome.finished.stacks, outcome.unfinished, note)


_STOPPED = {Status.INTERRUPTED: _interrupted, Status.RENDEZVOUS_FAILED: _rendezvous_failed,
            Status.STALLED: _stalled, Status.TERMINATED: _terminated, Status.TIMEOUT: _timed_out}


def _result(outcome: Outcome, attempt: int, started: float) -> RunResult:
    """A run that succeeded: rank 0's value and --return names, unpacked."""
    finished = outcome.finished
    res = RunResult(attempts=attempt + 1, elapsed=time.time() - started, finished=finished)
    event = outcome.result or {}
    for name, packed_value in event.get("returns", {}).items():
        value = _unpack(packed_value)
        if isinstance(value, RemoteRepr):   # never a silent stand-in: the caller says so
            res.unloadable[name] = value
        else:
            res.returns[name] = value
    packed = event.get("value")
    if packed is not None:
        res.has_value = True
        same = packed.get("same_as")   # the value is that --return name's object (sent once)
        res.value = _unpack(packed) if same is None else res.returns.get(same, res.unloadable.get(same))
    res.missing = list(event.get("missing", []))
    res.new_modules = list(event.get("new_modules", []))
    return res


def _departed_before(outcome: Outcome) -> dict:
    """Ranks that had finished the cell before the root cause failed: when the
    root cause is a lost connection, they are why (they left a collective)."""
    cause = outcome.finished.root_cause
    if cause is None or not cause.secondary:
        return {}
    return {rank: how for rank, (how, when) in outcome.departed.items() if when <= cause.timestamp}


class RemoteRepr:
    """Stands in for a rank's value that could not travel (pickled in the rank,
    or unpickled in the kernel): shows its repr, says why in ``error``."""

    def __init__(self, text: str, error: str) -> None:
        self.text, self.error = text, error

    def __repr__(self) -> str:
        return self.text


def _unpack(packed: dict):
    try:
        return loads_value(packed)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:   # SystemExit too: a value's __reduce__ may call anything
        text = packed.get("repr") or f"<{packed.get('type', 'a value')} object that could not be loaded>"
        return RemoteRepr(text, f"{type(exc).__name__}: {exc}" if "blob" in packed else str(exc))
