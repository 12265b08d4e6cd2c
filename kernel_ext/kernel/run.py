"""Run a payload to the end: attempts, events, root cause, results.

:func:`execute` is the engine's one entry point for a cell: it launches the
run (again, up to ``max_restarts`` times, each on a fresh rendezvous port),
turns the supervisor's messages into :mod:`events` for the caller's
``on_event`` consumer, and returns rank 0's result or raises the error that
names the root cause.  The kernel's interrupt (``KeyboardInterrupt`` in the
caller's thread) stops every rank and is re-raised as :class:`RunInterrupted`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import events as ev
from ..environment import LaunchConfig
from .errors import (DistributedRunError, DistributedStallError, DistributedTimeoutError, LauncherError, RendezvousError,
                     RunInterrupted, RunTerminated, forced_note, root_cause)
from .launcher import Launcher
from .run_handle import RunHandle
from ..wire.payload import Payload
from ..rank.worker import loads_value

EventSink = Callable[[object], None]


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


@dataclass
class _Outcome:
    finished: ev.RunFinished
    result: Optional[dict]
    others: dict
    unfinished: list
    rendezvous_error: Optional[str] = None
    departed: dict = field(default_factory=dict)   # rank -> (how it finished, when)
    forced: Optional[str] = None   # the kernel killed the run itself: why
    stalled: Optional[dict] = None  # the supervisor's "stalled" report
    session: Optional[str] = None   # a session cell: "alive" or "lost" after it
    lost: Optional[str] = None      # why the session was lost
    assigned: set = field(default_factory=set)   # a session cell: names it bound (on any rank)
    deleted: set = field(default_factory=set)
    terminated_on: list = field(default_factory=list)   # a multi-node run: the nodes whose supervisor got SIGTERM


def _failure_from_event(rank: int, event: dict) -> ev.RankFailure:
    summary = f"{event['exc_type']}: {event['message']}" if event.get("message") else event["exc_type"]
    return ev.RankFailure(rank=rank, kind="exception", summary=summary, traceback=event.get("traceback", ""),
                          timestamp=event.get("timestamp", time.time()), secondary=event.get("secondary", False))


def _collect(handle: RunHandle, cfg: LaunchConfig, attempt: int, emit: EventSink,
             heartbeat: Optional[float]) -> _Outcome:
    """Drive one run to its end, emitting events; interrupts stop the run."""
    started = time.time()
    failures: dict[int, ev.RankFailure] = {}
    stacks: dict[int, str] = {}
    others: dict[int, str] = {}
    departed: dict[int, tuple[str, float]] = {}
    unfinished: list[int] = []
    result = None
    reason = None
    forced = None
    stalled = None
    exited: set[int] = set()
    interrupted = False
    rendezvous_error = None
    remote = None
    session = lost = None
    terminated_on: list = []
    assigned: set = set()
    deleted: set = set()
    # A run on every node of an allocation (kernel_ext.kernel.slurm) has every rank here.
    ranks = getattr(handle, "ranks", None) or [cfg.global_rank(i) for i in cfg.local_ranks]
    messages = handle.messages(heartbeat)
    try:
        while True:
            try:
                try:
                    msg = next(messages)
                except StopIteration:
                    break
                kind = msg["kind"]
                if kind == "heartbeat":
                    emit(ev.Heartbeat())
                elif kind == "started":
                    emit(ev.RunStarted(
                        run_id=handle.run_id, attempt=attempt, max_restarts=cfg.max_restarts,
                        world_size=cfg.world_size, num_nodes=cfg.num_nodes, node_rank=cfg.node_rank,
                        ranks=ranks, master_addr=msg.get("master_addr", cfg.master_addr),
                        master_port=handle.master_port, pids=msg["pids"], nodes=msg.get("nodes", {}),
                    ))
                elif kind == "output":
                    if msg["text"] is not None:
                        emit(ev.Output(msg["rank"], msg["text"], msg.get("omitted", 0)))
                    if msg.get("progress") is not None:
                        emit(ev.ProgressLine(msg["rank"], msg["progress"]))
                elif kind == "rank_event":
                    event, rank = msg["event"], msg["rank"]
                    if event["kind"] == "failed":
                        failures[rank] = _failure_from_event(rank, event)
                    elif event["kind"] == "result":
                        departed[rank] = ("sys.exit(0)" if event.get("exited") else "returned",
                                          event.get("timestamp", time.time()))
                        # Each node's local rank 0 reports values; the run's are global rank 0's.
                        if ("value" in event or "returns" in event) and rank == ranks[0]:
                            result = event
                    elif event["kind"] == "progress":
                        emit(ev.Progress(rank, event["n"], event.get("total"), event.get("desc", "")))
                    elif event["kind"] == "names":
                        assigned.update(event.get("assigned", ()))
                        deleted.update(event.get("deleted", ()))
                    elif event["kind"] == "bar":
                        emit(ev.Bar(rank, event["id"], event["pos"], event["desc"], event["n"], event["total"],
                                    event["stats"], event["leave"], event["closed"]))
                elif kind == "stacks":
                    stacks[msg["rank"]] = msg["text"]
                    emit(ev.RankStacks(msg["rank"], msg["text"]))
                elif kind == "exit":
                    rank = msg["rank"]
                    exited.add(rank)
                    failure = failures.get(rank)
                    if msg["stopped"] and failure is None:
                        others[rank] = ("stopped (KeyboardInterrupt), back at its prompt" if msg.get("prompt") else
                                        f"stopped ({msg['signal'] or 'exit code %s' % msg['exitcode']})")
                        unfinished.append(rank)
                    elif failure is None and (msg["exitcode"] or msg["signal"]):
                        if msg["signal"]:
                            failure = ev.RankFailure(rank, "signal", f"killed by {msg['signal']}",
                                                     timestamp=msg["timestamp"])
                        else:
                            failure = ev.RankFailure(
                                rank, "exit", f"exited with code {msg['exitcode']} without an exception "
                                "(os._exit() or a crash in native code)", timestamp=msg["timestamp"])
                        failures[rank] = failure
                    emit(ev.RankExited(rank, msg["exitcode"], msg["signal"], msg["stopped"], failure))
                elif kind == "waiting":
                    emit(ev.Waiting(msg["joined"], msg["expected"], msg["address"]))
                elif kind == "rendezvous_failed":
                    rendezvous_error = msg["message"]
                elif kind == "stalled":
                    stalled = msg
                elif kind == "remote_failure":
                    remote = ev.RankFailure(msg["rank"], "remote", f"{msg['summary']} (on node {msg['node']})",
                                            timestamp=0.0)
                elif kind == "supervisor_error":
                    raise LauncherError("the run's supervisor failed:\n" + msg["traceback"])
                elif kind == "finished":
                    reason = msg["reason"]
                    forced = msg.get("forced")
                    session, lost = msg.get("session"), msg.get("lost")
                    terminated_on = msg.get("terminated_on", [])
            except KeyboardInterrupt:
                # The stop button: stop every rank (stacks first), keep reading
                # until the supervisor reports them all gone.
                interrupted = True
                handle.interrupt()
                messages.close()
                messages = handle.messages(heartbeat)
    finally:
        messages.close()
        handle.close()
    if interrupted:
        reason = "interrupt"
    if forced:
        unfinished = sorted(set(unfinished) | (set(ranks) - exited))
    failure_list = sorted(failures.values(), key=lambda f: f.rank)
    if remote is not None:   # another node failed first: its cause is the root cause
        failure_list = [remote] + [f for f in failure_list if f.rank != remote.rank]
        for f in failure_list[1:]:
            f.secondary = True
    cause = remote if remote is not None else root_cause(failure_list)
    if reason == "interrupt":
        status = "interrupted"
    elif reason == "rendezvous":
        status = "rendezvous_failed"
    elif reason == "timeout":
        status = "timeout"
    elif reason == "terminated":
        status = "terminated"
    elif reason == "stalled":
        status = "stalled"
    elif cause is not None:
        status = "failed"
    else:
        status = "ok"
    finished = ev.RunFinished(handle.run_id, status, time.time() - started, cause, failure_list, stacks)
    emit(finished)
    if session is None and handle.session_cell:   # the kernel had to end it: its ranks went with it
        session = "lost"
        lost = lost or (forced and f"its supervisor did not respond ({forced}), so the kernel killed it")
    return _Outcome(finished, result, others, sorted(unfinished), rendezvous_error, departed, forced, stalled,
                    session, lost, assigned - deleted, deleted, terminated_on)


class RunControl:
    """Stops a run from another thread (a background run's handle): the run
    in flight is interrupted as by the stop button; no further attempt starts."""

    def __init__(self) -> None:
        self.handle: Optional[RunHandle] = None
        self.stop_requested = False

    def attach(self, handle: RunHandle) -> None:
        self.handle = handle
        if self.stop_requested:
            handle.interrupt()

    def stop(self) -> None:
        """First call: stacks, then the ranks are stopped; later calls escalate (see RunHandle)."""
        self.stop_requested = True
        if self.handle is not None and not self.handle.finished:
            self.handle.interrupt()


def execute(launcher: Launcher, cfg: LaunchConfig, payload: Payload,
            on_event: Optional[EventSink] = None, heartbeat: Optional[float] = None,
            log_dir: str = "", excerpt: Optional[tuple[int, int]] = None,
            control: Optional[RunControl] = None, events=None) -> RunResult:
    """Run ``payload`` on ``cfg.num_processes`` local ranks; see module doc.

    ``heartbeat``: emit :class:`events.Heartbeat` after that many idle seconds.
    ``log_dir``: where the supervisor writes every rank's complete output
    (``rank<N>.log``; made at the first line; "" for none).
    ``excerpt``: ``(head, tail)`` to be sent only a rank's first ``head``
    lines and at most the last ``tail`` lines of each batch (what a view that
    keeps a head and a tail needs; the log has everything); None for every line.
    ``control``: lets another thread stop the run; ``events``: the run's own
    socket (see ``Launcher.channel``), for a run read outside the main thread.
    """
    try:
        return _execute(launcher, cfg, payload, on_event, heartbeat, log_dir, excerpt, control, events)
    finally:
        payload.release()


def _execute(launcher, cfg, payload, on_event, heartbeat, log_dir, excerpt, control, events) -> RunResult:
    emit = on_event or (lambda event: None)
    started = time.time()
    for attempt in range(cfg.max_restarts + 1):
        if control is not None and control.stop_requested:
            raise RunInterrupted({}, [], "\n(stopped before this attempt started)")
        try:
            handle = launcher.launch(cfg, payload, attempt=attempt, log_dir=log_dir, excerpt=excerpt, events=events,
                                     persistent=events is not None)
        except KeyboardInterrupt:
            raise RunInterrupted({}, []) from None
        if control is not None:
            control.attach(handle)
        try:
            outcome = _collect(handle, cfg, attempt, emit, heartbeat)
        finally:
            launcher.live.pop(handle.run_id, None)
        res = conclude(outcome, cfg, handle, attempt, started, last=attempt >= cfg.max_restarts)
        if res is not None:
            launcher.learn_modules(res.new_modules)
            return res
    raise AssertionError("unreachable")  # pragma: no cover


def conclude(outcome: _Outcome, cfg: LaunchConfig, handle: RunHandle, attempt: int, started: float,
             last: bool = True) -> Optional[RunResult]:
    """The run's result, or the error that tells its story; None: a rank
    failed and another attempt may start (``last`` False)."""
    finished = outcome.finished
    note = forced_note(outcome.forced) if outcome.forced else ""
    if finished.status == "interrupted":
        raise RunInterrupted(finished.stacks, outcome.unfinished, note) from None
    if finished.status == "rendezvous_failed":
        raise RendezvousError(outcome.rendezvous_error or (
            f"the rendezvous at {cfg.master_addr}:{handle.master_port} did not complete within "
            f"--rendezvous_timeout {cfg.rendezvous_timeout:g}s" + note))
    if finished.status == "stalled":
        info = outcome.stalled or {}
        raise DistributedStallError(info.get("ranks", outcome.unfinished), info.get("finished", []),
                                    info.get("seconds", cfg.stall_timeout), finished.stacks)
    if finished.status == "terminated":
        where = f" on node {', '.join(outcome.terminated_on)}" if outcome.terminated_on else ""
        raise RunTerminated(
            f"the run's supervisor{where} was sent SIGTERM by another process (a rank's os.kill, "
            f"the system, a job scheduler), so every rank was stopped: rank(s) {', '.join(map(str, outcome.unfinished)) or '-'}"
            " had not finished.")
    if finished.status == "timeout":
        raise DistributedTimeoutError(cfg.timeout or 0, finished.stacks, outcome.unfinished, note)
    if finished.status == "failed":
        if not last:
            return None
        raise DistributedRunError(finished.root_cause, finished.failures, outcome.others,
                                  attempts=attempt + 1, departed=_departed_before(outcome))
    res = RunResult(attempts=attempt + 1, elapsed=time.time() - started, finished=finished)
    event = outcome.result or {}
    packed = event.get("value")
    if packed is not None:
        res.has_value = True
        res.value = _unpack(packed)
    for name, packed_value in event.get("returns", {}).items():
        value = _unpack(packed_value)
        if isinstance(value, RemoteRepr):   # never a silent stand-in: the caller says so
            res.unloadable[name] = value
        else:
            res.returns[name] = value
    res.missing = list(event.get("missing", []))
    res.new_modules = list(event.get("new_modules", []))
    return res


def _departed_before(outcome: _Outcome) -> dict:
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
    except Exception as exc:
        text = packed.get("repr") or f"<{packed.get('type', 'a value')} object that could not be loaded>"
        return RemoteRepr(text, f"{type(exc).__name__}: {exc}" if "blob" in packed else str(exc))
