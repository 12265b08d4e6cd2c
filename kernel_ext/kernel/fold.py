"""Fold one attempt's messages into its outcome: a plain function of the sequence.

Whatever the placement (local ranks, kernel per node, every node of a Slurm
allocation) and whatever the mode (one-shot, session cell, background,
restarts), the kernel ends up with the same thing: an ordered sequence of
messages of the one schema (:mod:`..wire.messages`).  :class:`RunFold` turns
that sequence into the views' events and the attempt's :class:`Outcome`, with
one handler per message kind (a table keyed by :class:`Kind`, as ipykernel's
``kernelbase`` dispatches shell messages).  It starts no process and reads no
socket, so unit tests feed it recorded sequences; the end-to-end tests only
check the wiring.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import events as ev
from .errors import LauncherError, root_cause
from ..wire.messages import Kind, RankEvent, Status, StopReason, failure_summary

log = logging.getLogger("accel_magics.kernel.fold")

EventSink = Callable[[object], None]


@dataclass
class Outcome:
    """What one attempt came to, for :func:`run.conclude` (which words it)."""
    finished: ev.RunFinished
    result: Optional[dict] = None
    others: dict = field(default_factory=dict)       # rank -> what happened to it ("stopped (SIGTERM)")
    unfinished: list = field(default_factory=list)
    rendezvous_error: Optional[str] = None
    departed: dict = field(default_factory=dict)     # rank -> (how it finished, when)
    forced: Optional[str] = None     # the kernel killed the run itself: why
    stalled: Optional[dict] = None   # the supervisor's "stalled" report
    session: Optional[str] = None    # a session cell: "alive" or "lost" after it
    lost: Optional[str] = None       # why the session was lost
    assigned: set = field(default_factory=set)   # a session cell: names it bound (on any rank)
    deleted: set = field(default_factory=set)
    terminated_on: list = field(default_factory=list)   # several nodes: those whose supervisor got SIGTERM
    master_port: int = 0


def failure_of_exception(rank: int, event: dict) -> ev.RankFailure:
    """The one failure record of a rank that raised (its ``failed`` report)."""
    return ev.RankFailure(rank=rank, kind="exception", summary=failure_summary(event), traceback=event.get("traceback", ""),
                          timestamp=event.get("timestamp", time.time()), secondary=event.get("secondary", False))


def failure_of_exit(rank: int, msg: dict) -> Optional[ev.RankFailure]:
    """The one failure record of a rank that ended without reporting one (a
    signal, ``os._exit``, a crash in native code); None for a clean exit."""
    if msg.get("signal"):
        return ev.RankFailure(rank, "signal", f"killed by {msg['signal']}", timestamp=msg["timestamp"])
    if msg.get("exitcode"):
        return ev.RankFailure(rank, "exit", f"exited with code {msg['exitcode']} without an exception "
                              "(os._exit() or a crash in native code)", timestamp=msg["timestamp"])
    return None


class RunFold:
    """One attempt's messages in, events out (to ``emit``), an :class:`Outcome` at the end.

    ``ranks``: every global rank the kernel watches (this node's, or every
    node's for a run placed on all of them), rank 0's value comes from the
    first; ``node_of``: rank -> node name, where ranks run on several nodes
    (failures then say where); ``clock``: ``time.time``, or a test's."""

    def __init__(self, run_id: str, ranks: list[int], *, attempt: int = 0, max_restarts: int = 0,
                 world_size: int = 0, num_nodes: int = 1, node_rank: int = 0, master_addr: str = "",
                 master_port: int = 0, node_of: Optional[dict] = None, session_cell: bool = False,
                 emit: Optional[EventSink] = None, clock: Callable[[], float] = time.time) -> None:
        self.run_id, self.ranks, self.attempt = run_id, list(ranks), attempt
        self.max_restarts, self.world_size = max_restarts, world_size or len(ranks)
        self.num_nodes, self.node_rank = num_nodes, node_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.node_of = dict(node_of or {})
        self.session_cell = session_cell
        self.emit = emit or (lambda event: None)
        self.clock = clock
        self.started = clock()
        self.failures: dict[int, ev.RankFailure] = {}
        self.stacks: dict[int, str] = {}
        self.others: dict[int, str] = {}
        self.departed: dict[int, tuple[str, float]] = {}
        self.unfinished: list[int] = []
        self.exited: set[int] = set()
        self.result: Optional[dict] = None
        self.reason: Optional[str] = None
        self.forced: Optional[str] = None
        self.stalled: Optional[dict] = None
        self.rendezvous_error: Optional[str] = None
        self.remote: Optional[ev.RankFailure] = None
        self.session = self.lost = None
        self.terminated_on: list = []
        self.assigned: set = set()
        self.deleted: set = set()
        self.interrupted = False   # the stop button was pressed during the attempt
        self.handlers = {
            Kind.HEARTBEAT: self._heartbeat, Kind.STARTED: self._started, Kind.OUTPUT: self._output,
            Kind.RANK_EVENT: self._rank_event, Kind.STACKS: self._stacks, Kind.EXIT: self._exit,
            Kind.WAITING: self._waiting, Kind.RENDEZVOUS_FAILED: self._rendezvous_failed,
            Kind.STALLED: self._stalled, Kind.REMOTE_FAILURE: self._remote_failure,
            Kind.SUPERVISOR_ERROR: self._supervisor_error, Kind.FINISHED: self._finished,
        }
        self.rank_handlers = {
            RankEvent.FAILED: self._rank_failed, RankEvent.RESULT: self._rank_result,
            RankEvent.PROGRESS: self._rank_progress, RankEvent.NAMES: self._rank_names,
            RankEvent.BAR: self._rank_bar,
        }

    @classmethod
    def replay(cls, messages, **kw) -> tuple[list, Outcome]:
        """Fold a whole recorded sequence: the events it gives and its outcome."""
        events: list = []
        fold = cls(emit=events.append, **kw)
        for msg in messages:
            fold.feed(msg)
        return events, fold.outcome()

    # -- the handler table ------------------------------------------------------------
    def feed(self, msg: dict) -> None:
        kind = Kind.parse(msg.get("kind"))
        handler = self.handlers.get(kind)
        if handler is None:   # released, ready, ...: no part of the outcome; an unknown kind: logged
            if kind is None:
                log.debug("run %s: a message of unknown kind %r ignored", self.run_id, msg.get("kind"))
            return
        handler(msg)

    def _heartbeat(self, msg: dict) -> None:
        self.emit(ev.Heartbeat())

    def _started(self, msg: dict) -> None:
        self.node_of.update(msg.get("nodes", {}))
        self.emit(ev.RunStarted(
            run_id=self.run_id, attempt=self.attempt, max_restarts=self.max_restarts,
            world_size=self.world_size, num_nodes=self.num_nodes, node_rank=self.node_rank,
            ranks=self.ranks, master_addr=msg.get("master_addr", self.master_addr),
            master_port=self.master_port, pids=msg["pids"], nodes=msg.get("nodes", {})))

    def _output(self, msg: dict) -> None:
        if msg["text"] is not None:
            self.emit(ev.Output(msg["rank"], msg["text"], msg.get("omitted", 0)))
        if msg.get("progress") is not None:
            self.emit(ev.ProgressLine(msg["rank"], msg["progress"]))

    def _rank_event(self, msg: dict) -> None:
        handler = self.rank_handlers.get(RankEvent.parse(msg["event"].get("kind")))
        if handler is not None:
            handler(msg["rank"], msg["event"])

    def _rank_failed(self, rank: int, event: dict) -> None:
        self.failures[rank] = failure_of_exception(rank, event)

    def _rank_result(self, rank: int, event: dict) -> None:
        self.departed[rank] = ("sys.exit(0)" if event.get("exited") else "returned",
                               event.get("timestamp", self.clock()))
        # Each node's local rank 0 reports values; the run's are global rank 0's.
        if ("value" in event or "returns" in event) and rank == self.ranks[0]:
            self.result = event

    def _rank_progress(self, rank: int, event: dict) -> None:
        self.emit(ev.Progress(rank, event["n"], event.get("total"), event.get("desc", "")))

    def _rank_names(self, rank: int, event: dict) -> None:
        self.assigned.update(event.get("assigned", ()))
        self.deleted.update(event.get("deleted", ()))

    def _rank_bar(self, rank: int, event: dict) -> None:
        self.emit(ev.Bar(rank, event["id"], event["pos"], event["desc"], event["n"], event["total"],
                         event["stats"], event["leave"], event["closed"]))

    def _stacks(self, msg: dict) -> None:
        self.stacks[msg["rank"]] = msg["text"]
        self.emit(ev.RankStacks(msg["rank"], msg["text"]))

    def _exit(self, msg: dict) -> None:
        rank = msg["rank"]
        self.exited.add(rank)
        failure = self.failures.get(rank)
        if msg["stopped"] and failure is None:
            self.others[rank] = ("stopped (KeyboardInterrupt), back at its prompt" if msg.get("prompt") else
                                 f"stopped ({msg['signal'] or 'exit code %s' % msg['exitcode']})")
            self.unfinished.append(rank)
        elif failure is None:
            failure = failure_of_exit(rank, msg)
            if failure is not None:
                self.failures[rank] = failure
        self.emit(ev.RankExited(rank, msg["exitcode"], msg["signal"], msg["stopped"], failure))

    def _waiting(self, msg: dict) -> None:
        self.emit(ev.Waiting(msg["joined"], msg["expected"], msg["address"]))

    def _rendezvous_failed(self, msg: dict) -> None:
        self.rendezvous_error = msg["message"]

    def _stalled(self, msg: dict) -> None:
        self.stalled = msg

    def _remote_failure(self, msg: dict) -> None:
        self.remote = ev.RankFailure(msg["rank"], "remote", f"{msg['summary']} (on node {msg['node']})",
                                     timestamp=0.0)

    def _supervisor_error(self, msg: dict) -> None:
        raise LauncherError("the run's supervisor failed:\n" + msg["traceback"])

    def _finished(self, msg: dict) -> None:
        self.reason = msg["reason"]
        self.forced = msg.get("forced")
        self.session, self.lost = msg.get("session"), msg.get("lost")
        self.terminated_on = msg.get("terminated_on", [])

    # -- the outcome --------------------------------------------------------------------
    def outcome(self) -> Outcome:
        """The attempt's outcome (emitted as :class:`events.RunFinished` too)."""
        reason = StopReason.INTERRUPT if self.interrupted else self.reason
        unfinished = self.unfinished
        if self.forced:
            unfinished = sorted(set(unfinished) | (set(self.ranks) - self.exited))
        failure_list = sorted(self.failures.values(), key=lambda f: f.rank)
        for failure in failure_list:   # several nodes: each failure says where
            node = self.node_of.get(failure.rank)
            if node and "(on node" not in failure.summary:
                failure.summary += f" (on node {node})"
        if self.remote is not None:   # another node failed first: its cause is the root cause
            failure_list = [self.remote] + [f for f in failure_list if f.rank != self.remote.rank]
            for f in failure_list[1:]:
                f.secondary = True
        cause = self.remote if self.remote is not None else root_cause(failure_list)
        status = Status.of(reason, cause is not None)
        finished = ev.RunFinished(self.run_id, status, self.clock() - self.started, cause, failure_list,
                                  self.stacks)
        self.emit(finished)
        session, lost = self.session, self.lost
        if session is None and self.session_cell:   # the kernel had to end it: its ranks went with it
            session = "lost"
            lost = lost or (self.forced and f"its supervisor did not respond ({self.forced}), so the kernel killed it")
        log.info("run %s attempt %d: %s%s", self.run_id, self.attempt, status,
                 f" (root cause: rank {cause.rank}: {cause.summary})" if cause is not None else "")
        return Outcome(finished, self.result, self.others, sorted(unfinished), self.rendezvous_error,
                       self.departed, self.forced, self.stalled, session, lost, self.assigned - self.deleted,
                       self.deleted, self.terminated_on, self.master_port)
