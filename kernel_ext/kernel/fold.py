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
    kinds: dict = field(default_factory=dict)    # a session cell: name -> (type, bytes or None) of what it bound
    in_world: bool = False                       # a rank was in the run's process group (this cell or before)
    agreed: set = field(default_factory=set)     # a session cell's stop: ranks that stopped at the agreed step
    failed_joining: set = field(default_factory=set)   # ranks whose init_process_group raised
    # A session cell whose every rank reported its result, no failure: it
    # completed, whatever stop came as it ended (its effect is in the session).
    completed: bool = False
    pressed: bool = False    # the stop button was pressed while the attempt was read
    held: dict = field(default_factory=dict)   # rank -> its "held" message: failed, held for a post-mortem


def failure_of_exception(rank: int, event: dict) -> ev.RankFailure:
    """The one failure record of a rank that raised (its ``failed`` report)."""
    return ev.RankFailure(rank=rank, kind="exception", summary=failure_summary(event), traceback=event.get("traceback", ""),
                          timestamp=event.get("timestamp", time.time()), secondary=event.get("secondary", False))


def failure_of_exit(rank: int, msg: dict) -> Optional[ev.RankFailure]:
    """The one failure record of a rank that ended without reporting one (a
    signal, ``os._exit``, a crash in native code); None for a clean exit.
    Where ``@record`` wrote the rank's exception to its
    ``TORCHELASTIC_ERROR_FILE`` (``recorded``), that exception is the
    failure, as torchrun shows it, with its traceback and when it was written."""
    recorded = msg.get("recorded")
    if recorded and (msg.get("signal") or msg.get("exitcode")):
        then = f"killed by {msg['signal']}" if msg.get("signal") else f"exited with code {msg['exitcode']}"
        return ev.RankFailure(rank, "exception", f"{failure_summary(recorded)} (recorded by @record in its "
                              f"TORCHELASTIC_ERROR_FILE; the rank then {then})",
                              traceback=recorded.get("traceback", ""),
                              timestamp=recorded.get("timestamp", msg["timestamp"]),
                              secondary=bool(recorded.get("secondary")))
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
        # A restart's views start afresh at its RunStarted (they drop the last
        # attempt's lines there): what it says before that waits for it.  On
        # several nodes one node's output can come before every node's
        # "started" does (slurm merges those into one).
        self._early: Optional[list] = [] if attempt else None
        if attempt:
            self._sink, self.emit = self.emit, self._until_started
        self.clock = clock
        self.started = clock()
        self.failures: dict[int, ev.RankFailure] = {}
        self.stacks: dict[int, str] = {}
        self.departed: dict[int, tuple[str, float]] = {}
        self.joining: dict[int, int] = {}  # rank -> the round of init_process_group it waits in now
        self.in_world: set[int] = set()    # got through it (this cell, or an earlier one of a session)
        self.rounds: dict[int, int] = {}   # rank -> how many rounds of the world's init it got through
        self.failed_joining: set[int] = set()   # ranks whose init_process_group raised
        self.kinds: dict[str, tuple] = {}  # a session cell: name -> (type, bytes or None), from rank 0
        self.where: dict[int, str] = {}    # rank -> where it was when stopped ("barrier (In[5] line 3)")
        self.stopped_how: dict[int, tuple] = {}   # rank -> (by what, back at its prompt?)
        self.agreed: set[int] = set()      # session ranks stopped at the optimizer step their peers agreed on
        self.mid_cell: dict[int, float] = {}   # rank -> when it exited with code 0 without its result
        self.stranded: Optional[dict] = None    # ranks waiting in init_process_group for one that left
        self.unfinished: list[int] = []
        self.exited: set[int] = set()
        self.result: Optional[dict] = None
        self.reason: Optional[str] = None
        self.forced: Optional[str] = None
        self.stalled: Optional[dict] = None
        self.rendezvous_error: Optional[str] = None
        self.remote: Optional[ev.RankFailure] = None
        self.remote_verified = True   # its record was signed with the nodes' --rendezvous_key (or came otherwise)
        self.session = self.lost = None
        self.terminated_on: list = []
        self.assigned: set = set()
        self.deleted: set = set()
        self.interrupted = False   # the stop button was pressed during the attempt
        self.results: set[int] = set()   # ranks that reported this cell's result (they completed it)
        self.held: dict[int, dict] = {}  # failed ranks held for a post-mortem: rank -> their "held" message
        self.handlers = {
            Kind.HEARTBEAT: self._heartbeat, Kind.STARTED: self._started, Kind.OUTPUT: self._output,
            Kind.RANK_EVENT: self._rank_event, Kind.STACKS: self._stacks, Kind.EXIT: self._exit,
            Kind.WAITING: self._waiting, Kind.RENDEZVOUS_FAILED: self._rendezvous_failed,
            Kind.STALLED: self._stalled, Kind.QUIET: self._quiet, Kind.REMOTE_FAILURE: self._remote_failure,
            Kind.RESOURCES: self._resources,
            Kind.REMOTE_DEPARTED: self._remote_departed,
            Kind.SUPERVISOR_ERROR: self._supervisor_error, Kind.FINISHED: self._finished,
            Kind.SESSION_LOST: self._session_lost, Kind.INPUT_REQUEST: self._input_request,
            Kind.HELD: self._held,
        }
        self.rank_handlers = {
            RankEvent.FAILED: self._rank_failed, RankEvent.RESULT: self._rank_result,
            RankEvent.PROGRESS: self._rank_progress, RankEvent.NAMES: self._rank_names,
            RankEvent.BAR: self._rank_bar, RankEvent.JOINING: self._rank_joining,
            RankEvent.JOINED: self._rank_joined, RankEvent.PHASE: self._rank_phase,
        }

    def _until_started(self, event) -> None:
        if isinstance(event, ev.Heartbeat):   # the view's clock moves on meanwhile
            self._sink(event)
        elif isinstance(event, ev.RunStarted):
            self._sink(event)
            self.flush_early()
        else:
            self._early.append(event)

    def flush_early(self) -> None:
        """What a restart's attempt said before its "started", now (once)."""
        if self._early is not None:
            early, self._early, self.emit = self._early, None, self._sink
            for event in early:
                self.emit(event)

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

    def _input_request(self, msg: dict) -> None:
        self.emit(ev.InputRequested(msg["rank"], msg.get("prompt", "")))

    def _held(self, msg: dict) -> None:
        self.held[msg["rank"]] = msg
        self.emit(ev.RankHeld(msg["rank"], msg.get("seconds", 0.0), self.failures.get(msg["rank"])))

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
        if event.get("held"):   # a session's rank keeps the cell's frames until its next cell
            self.held[rank] = {"rank": rank, "seconds": None, "reply_to": ""}

    def _rank_result(self, rank: int, event: dict) -> None:
        self.results.add(rank)
        self.departed[rank] = ("sys.exit(0)" if event.get("exited") else "returned",
                               event.get("timestamp", self.clock()))
        if event.get("in_world"):
            self.in_world.add(rank)
        self._count_rounds(rank, event.get("rounds", 1 if event.get("in_world") else 0))
        # Each node's local rank 0 reports values; the run's are global rank 0's.
        if ("value" in event or "returns" in event) and rank == self.ranks[0]:
            self.result = event

    def _rank_joining(self, rank: int, event: dict) -> None:
        self.joining[rank] = event.get("round", 1)
        if self.stranded is not None:   # another one reaches it as the run is stopped
            self.stranded["ranks"] = sorted(set(self.stranded["ranks"]) | {rank})

    def _rank_joined(self, rank: int, event: dict) -> None:
        self.joining.pop(rank, None)
        if event.get("failed"):
            self.failed_joining.add(rank)
        self.in_world.add(rank)
        self._count_rounds(rank, event.get("round", 1))

    def _count_rounds(self, rank: int, rounds: int) -> None:
        self.rounds[rank] = max(self.rounds.get(rank, 0), rounds)

    def must_stop(self) -> bool:
        """True once, when the attempt can no longer end by itself: a rank waits
        in ``init_process_group`` for the run's world while another rank of
        that world finished the cell without ever joining that round of it
        (the world is fixed, so the wait would last until torch's timeout, 30
        minutes).  Rounds count: after ``destroy_process_group`` a rank may
        init again, and a peer that finished after fewer rounds never joins
        this one, although it was in the world before.  A peer that got
        through as many rounds may have met the waiting rank (the two ranks'
        events are not ordered), so it strands no one.  The caller stops the
        attempt; the outcome says who waited for whom."""
        if self.stranded is not None or not self.joining:
            return False
        left = {rank: how for rank, (how, _) in self.departed.items()}
        left.update({rank: "exited with code 0" for rank in self.mid_cell if rank not in left})
        waiting, gone = [], {}
        for rank, round_ in self.joining.items():
            short = {peer: how for peer, how in left.items() if self.rounds.get(peer, 0) < round_}
            if short and rank not in self.exited and rank not in left:
                waiting.append(rank)
                gone.update(short)
        if not waiting:
            return False
        waiting.sort()
        self.stranded = {"ranks": waiting, "finished": sorted(gone), "seconds": 0,
                         "left": {rank: (how, self.node_of.get(rank)) for rank, how in gone.items()}}
        log.info("run %s: rank(s) %s wait in init_process_group for rank(s) %s, which finished the cell",
                 self.run_id, waiting, sorted(gone))
        return True

    def _rank_progress(self, rank: int, event: dict) -> None:
        self.emit(ev.Progress(rank, event["n"], event.get("total"), event.get("desc", "")))

    def _rank_names(self, rank: int, event: dict) -> None:
        self.assigned.update(event.get("assigned", ()))
        self.deleted.update(event.get("deleted", ()))
        self.kinds.update({name: tuple(kind) for name, kind in event.get("kinds", {}).items()})

    def _rank_phase(self, rank: int, event: dict) -> None:
        self.emit(ev.Phase(rank, str(event.get("text", ""))))

    def _rank_bar(self, rank: int, event: dict) -> None:
        self.emit(ev.Bar(rank, event["id"], event["pos"], event["desc"], event["n"], event["total"],
                         event["stats"], event["leave"], event["closed"], event.get("line", "")))

    def _stacks(self, msg: dict) -> None:
        self.stacks[msg["rank"]] = msg["text"]
        if msg.get("where"):
            self.where[msg["rank"]] = msg["where"]
        self.emit(ev.RankStacks(msg["rank"], msg["text"]))

    def _exit(self, msg: dict) -> None:
        rank = msg["rank"]
        self.exited.add(rank)
        if not self.session_cell:   # a one-shot rank ended before the run did: nothing is held
            self.held.pop(rank, None)   # (a session's "exit" is its rank back at its prompt)
        failure = self.failures.get(rank)
        if failure is None and msg["exitcode"] == 0 and not msg["signal"] and rank not in self.departed:
            # os._exit(0), or an exit from native code, mid-cell (also when the stop
            # that followed reached its supervisor before it was reaped).
            self.mid_cell[rank] = msg["timestamp"]
        if msg["stopped"] and failure is None:
            # One that had finished the cell (its result came) was only ended by the run's stop.
            if rank not in self.departed:
                # Worded in outcome(): where it was comes with its stacks, before or after this
                # (a session rank back at its prompt says it in its exit).
                if msg.get("where"):
                    self.where.setdefault(rank, msg["where"])
                if msg.get("agreed"):
                    self.agreed.add(rank)
                if msg.get("in_world"):   # a session rank in the world of an earlier cell
                    self.in_world.add(rank)
                self.stopped_how[rank] = ("KeyboardInterrupt" if msg.get("prompt") else
                                          msg["signal"] or f"exit code {msg['exitcode']}", bool(msg.get("prompt")))
                self.unfinished.append(rank)
        elif failure is None:
            failure = failure_of_exit(rank, msg)
            if failure is not None:
                self.failures[rank] = failure
        self.emit(ev.RankExited(rank, msg["exitcode"], msg["signal"], msg["stopped"], failure))

    def _waiting(self, msg: dict) -> None:
        self.emit(ev.Waiting(msg["joined"], msg["expected"], msg["address"], msg.get("problem", "")))

    def _rendezvous_failed(self, msg: dict) -> None:
        self.rendezvous_error = msg["message"]

    def _stalled(self, msg: dict) -> None:
        self.stalled = msg

    def _quiet(self, msg: dict) -> None:
        self.emit(ev.Quiet(msg["ranks"], msg["seconds"], msg["finished"],
                           {int(rank): where for rank, where in msg["where"].items()}))

    def _resources(self, msg: dict) -> None:
        self.emit(ev.Resources({int(rank): (*sample, None)[:4] for rank, sample in msg["ranks"].items()}))

    def _remote_failure(self, msg: dict) -> None:
        if msg.get("gone"):   # this node's own verdict: a node stopped beating in node 0's store
            self.remote = ev.RankFailure(msg["rank"], "node_gone", msg["summary"], timestamp=0.0)
            self.remote_verified = True
            return
        # A node that left (its kernel stopped it or went away) is named by its summary; a failure is its rank's.
        left = bool(msg.get("left"))
        summary = msg["summary"] if left else f"{msg['summary']} (on node {msg['node']})"
        if not msg.get("verified", True):
            # Anything that reaches node 0's store can write this record: said so, with why.
            summary += (f" [unverified ({msg.get('unverified') or 'it is not signed'}): it came through node 0's "
                        "store, which any process that reaches its port can write; the same --rendezvous_key on "
                        "every node's cell verifies it]")
        self.remote = ev.RankFailure(msg["rank"], "node_gone" if left else "remote", summary, timestamp=0.0)
        self.remote_verified = bool(msg.get("verified", True))

    def _remote_departed(self, msg: dict) -> None:
        """A kernel per node: another node's rank finished the cell without
        joining the world (this node's ranks may wait for it: must_stop)."""
        self.departed[msg["rank"]] = (msg["how"], self.clock())
        self._count_rounds(msg["rank"], msg.get("rounds", 0))
        self.node_of.setdefault(msg["rank"], str(msg["node"]))

    def _supervisor_error(self, msg: dict) -> None:
        raise LauncherError("the run's supervisor failed:\n" + msg["traceback"])

    def _finished(self, msg: dict) -> None:
        self.reason = msg["reason"]
        self.forced = msg.get("forced")
        self.session, self.lost = msg.get("session"), msg.get("lost")
        self.terminated_on = msg.get("terminated_on", [])

    def _session_lost(self, msg: dict) -> None:
        # A session cell only (its handle takes its session's messages too):
        # the session ended by itself (a rank died at its prompt) just as the
        # cell was sent, so its supervisor never began it.  The session's word
        # is the cell's end, not its supervisor's exit that follows.
        self.reason, self.session = "failed", "lost"
        self.lost = msg.get("lost") or "its ranks ended"

    # -- the outcome --------------------------------------------------------------------
    def outcome(self) -> Outcome:
        """The attempt's outcome (emitted as :class:`events.RunFinished` too)."""
        self.flush_early()   # a restart whose ranks never all started: what they said still counts
        completed = completed_cell(self.session_cell, self.ranks, self.results, self.failures, self.unfinished,
                                   self.forced, self.session, self.reason)
        reason = (None if completed else StopReason.INTERRUPT if self.interrupted else
                  StopReason.STALLED if self.stranded is not None else self.reason)
        unfinished = unfinished_ranks(self.unfinished, self.stacks, self.departed, self.forced, self.ranks,
                                      self.exited)
        failure_list = placed(blame_mid_cell_exits(self.failures, self.mid_cell), self.node_of)
        failure_list, cause = weigh_remote(failure_list, self.remote, self.remote_verified)
        session, lost = session_after(self.session, self.lost, self.session_cell, self.forced)
        status = Status.of(reason, cause is not None)
        if status is Status.OK and session == "lost":   # no rank failed in it, but the cell did not run
            status = Status.FAILED
        finished = ev.RunFinished(self.run_id, status, self.clock() - self.started, cause, failure_list,
                                  self.stacks)
        self.emit(finished)
        log.info("run %s attempt %d: %s%s", self.run_id, self.attempt, status,
                 f" (root cause: rank {cause.rank}: {cause.summary})" if cause is not None else "")
        return Outcome(finished, self.result, stopped_others(self.stopped_how, self.where), sorted(unfinished),
                       self.rendezvous_error, self.departed, self.forced, self.stalled or self.stranded, session,
                       lost, self.assigned - self.deleted, self.deleted, self.terminated_on, self.master_port,
                       self.kinds, bool(self.in_world or any(self.rounds.values())), set(self.agreed),
                       set(self.failed_joining), completed=completed, pressed=self.interrupted,
                       held=dict(self.held))


# -- the outcome's parts: plain functions of what the fold recorded -------------------------

def completed_cell(session_cell: bool, ranks: list, results: set, failures: dict, unfinished: list,
                   forced: Optional[str], session: Optional[str], reason: Optional[str]) -> bool:
    """A session cell that every rank completed is a completed cell, whatever
    stop came as it ended (the kernel's press, the supervisor's stop or
    --timeout): reported otherwise, running it again applied it twice."""
    return (session_cell and bool(ranks) and set(ranks) <= results
            and not failures and not unfinished and not forced
            and session != "lost" and reason in (None, StopReason.INTERRUPT, StopReason.TIMEOUT, StopReason.STALLED))


def unfinished_ranks(unfinished: list, stacks: dict, departed: dict, forced: Optional[str], ranks: list,
                     exited: set) -> list:
    """The ranks still in the cell when it ended.  A rank whose stacks were
    taken was still in it, also when its exit is not here (a session rank
    that did not come back is killed after the verdict); after a forced end,
    every rank that did not exit."""
    found = sorted(set(unfinished) | (set(stacks) - set(departed)))
    if forced:
        found = sorted(set(found) | (set(ranks) - exited))
    return found


def blame_mid_cell_exits(failures: dict, mid_cell: dict) -> dict:
    """The failures, and where they are only consequences (lost connections),
    a rank that left mid-cell with code 0 as why.  (Its exit is stamped when
    its supervisor reaped it, which can be after the errors it caused, so it
    is not compared.)"""
    failures = dict(failures)
    if failures and all(f.secondary for f in failures.values()):
        for rank, when in mid_cell.items():
            failures[rank] = ev.RankFailure(
                rank, "exit", "exited with code 0 before the cell ended (os._exit(0), or an exit from "
                "native code), while the other ranks still needed it", timestamp=when)
    return failures


def placed(failures: dict, node_of: dict) -> list:
    """The failures by rank; on several nodes each says where (in place)."""
    failure_list = sorted(failures.values(), key=lambda f: f.rank)
    for failure in failure_list:
        node = node_of.get(failure.rank)
        if node and "(on node" not in failure.summary:
            failure.summary += f" (on node {node})"
    return failure_list


def weigh_remote(failure_list: list, remote: Optional[ev.RankFailure],
                 verified: bool) -> tuple[list, Optional[ev.RankFailure]]:
    """The failures with another node's word among them, and the root cause.
    Another node that failed first holds the root cause (the others become
    secondary, in place); an unverified word from the store never outweighs
    a failure seen here: it is listed, not the cause."""
    if remote is not None and not verified and any(not f.secondary for f in failure_list):
        return sorted(failure_list + [remote], key=lambda f: f.rank), root_cause(failure_list)
    if remote is not None:
        failure_list = [remote] + [f for f in failure_list if f.rank != remote.rank]
        for f in failure_list[1:]:
            f.secondary = True
        return failure_list, remote
    return failure_list, root_cause(failure_list)


def session_after(session: Optional[str], lost: Optional[str], session_cell: bool,
                  forced: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """A session cell's session after it, and why it was lost: a cell the
    kernel had to end took its ranks with it."""
    if session is None and session_cell:
        session = "lost"
        lost = lost or (forced and f"its supervisor did not respond ({forced}), so the kernel killed it")
    return session, lost


def stopped_others(stopped_how: dict, where: dict) -> dict:
    """Rank -> what happened to it: stopped, by what, where."""
    others = {}
    for rank, (how, prompt) in stopped_how.items():
        at = f" in {where[rank]}" if rank in where else ""
        others[rank] = f"stopped ({how}){at}" + (", back at its prompt" if prompt else "")
    return others
