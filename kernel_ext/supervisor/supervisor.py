"""The per-run supervisor: forks the ranks, streams them, stops them, reports.

One supervisor process exists per run, forked from the launcher process
(zygote).  It forks one worker per local rank *before* it creates any thread
(ZMQ's I/O thread), so workers are forked from a single-threaded process.  It
is the only sender on the run channel, which gives a single order per rank:
a rank's exit is reported only after everything the rank wrote was read.

Its event loop (one thread, ``selectors``) watches, per rank, the merged
stdout/stderr pipe, the event pipe and the stack pipe (``rank_process``
forks a rank with them), plus a signal wake-up pipe (SIGCHLD for exits,
SIGUSR1 = interrupt, SIGUSR2 = the kernel's "stop now", SIGTERM = terminated
from outside: the run fails saying so).

Stopping follows torchrun: stacks first (asked of each rank's heartbeat
thread, which dumps them under the GIL, so also inside a blocked collective;
faulthandler's SIGUSR1 only for a rank whose GIL is held in native code, see
rank/liveness.py), then SIGTERM to each rank's process group, then
SIGKILL after a grace period.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import time
from typing import NoReturn, Optional

from . import error_file
from .. import wire
from ..wire import transport
from ..wire.messages import failure_summary
from .outbox import Outbox
from .output_pump import OutputPump
from ..process_tree import kill_orphans
from .nodes import Nodes
from .rank_input import RankInput
from .rank_process import RankProcess
from .rank_set import RankSet
from .stall_watch import StallWatch
from ..stop_ladder import StopLadder
# The ladders' order: see timing.py.
from ..timing import (
    REAP_WAIT, STACK_QUIET, DRAIN_WAIT, STARTED_NOTE, RANK_GRACE, RANKS_GONE_POLL, ORPHAN_SWEEP_WAIT,
    ORPHAN_SWEEP_POLL,
)
from ..timing import NATIVE_WAIT, STACK_WAIT  # noqa: F401  (the stop's first rungs, taken by the policies)

log = logging.getLogger("accel_magics.supervisor")
PR_SET_CHILD_SUBREAPER = 36
SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGHUP}


class Supervisor:
    """One run's supervisor; forked ahead of time as the zygote's spare.

    Life cycle: as a :class:`spare.Spare` it forked idle ranks (each waits on
    its own "go" pipe) while there was no run yet, connected the run channel
    (ZMQ starts its I/O thread only after the last fork) and got the run's
    spec; built from that spare, :meth:`serve` drops ranks the run does not
    need, hands every rank the spec and supervises to the end (:meth:`_run`,
    the policy's).  Forking ahead takes the fork cost
    off the critical path of the next cell.

    Its parts: the ranks (:class:`RankSet`: their processes, pipes, exits and
    stop ladders), their output (:class:`OutputPump`), the other nodes
    (:class:`Nodes`) and the looks at running ranks (:class:`StallWatch`).
    What is left here is the run's event loop and the hooks of its policy:
    what a rank's event, a rank's exit and a stop mean
    (:class:`one_shot.OneShotSupervisor` for a run, :class:`SessionSupervisor`
    for a session).
    """

    def __init__(self, spare) -> None:
        """The run's supervisor, from the spare it was (:class:`spare.Spare`):
        its idle ranks, selector, signal wake-up pipe and channel are handed
        over by name, the spare is not used again."""
        self.rank_set: RankSet = spare.rank_set
        self.sel = spare.sel
        self.wakeup_r, self.wakeup_w = spare.wakeup_r, spare.wakeup_w
        self.ctx, self.sock, self.session, self.events_addr = spare.ctx, spare.sock, spare.session, spare.events_addr
        self.events_keys = spare.events_keys
        self.status_fd = spare.status_fd   # to the launcher (run_state)
        self.errors_ahead = spare.errors_ahead
        self.stopping: Optional[str] = None   # None, "failed", "interrupt", "timeout"
        self.stack_deadline: Optional[float] = None
        self.rank_ladder: Optional[StopLadder] = None   # the ranks' stop: SIGTERM, the grace, SIGKILL
        self.timeout_deadline: Optional[float] = None
        self.spec: dict = {}
        self.said_started = False
        self.started_due: Optional[float] = None
        self.outbox = Outbox(self._send_packed)   # what the loop says, sent as one when it waits (outbox.py)
        self.recorded: dict[int, Optional[dict]] = {}   # rank -> what @record wrote (error_file), once read
        self.first_failure: Optional[tuple] = None   # (secondary, time, rank, summary)
        self.pump = OutputPump(self.rank_set, self.send)
        self.nodes = Nodes(self)
        self.stall = StallWatch(self, self.rank_set)
        self.input = RankInput(self)   # the ranks' stdin, from the notebook's input box
        # The one event loop's tables (a session's supervisor adds to them):
        # what a ready selector key of each kind means (a rank's pipes aside),
        # and what each signal means.
        self.sources = {"signal": lambda key: self._on_signals(), "store": lambda key: self.nodes.host_store(key.fd)}
        self.on_signal = {signal.SIGCHLD: lambda signum: self._reap(),
                          signal.SIGUSR1: lambda signum: self.stop("interrupt", stacks=True),
                          signal.SIGHUP: lambda signum: self._peers_ended(),
                          signal.SIGUSR2: self._stop_now, signal.SIGTERM: self._stop_now}

    @property
    def ranks(self) -> list[RankProcess]:
        return self.rank_set.ranks

    @property
    def rdzv(self):
        return self.nodes.rdzv

    @property
    def logs(self):
        return self.pump.logs

    # -- life cycle -------------------------------------------------------
    def serve(self, key: bytes, spec: dict, spec_bytes: bytes) -> NoReturn:
        """The run, from its spec to the end of the process (never returns):
        whatever goes wrong is reported, and no rank is left behind."""
        code = 0
        try:
            self._start(key, spec, spec_bytes)
            self._run()
        except BaseException as exc:  # report, never leave ranks behind
            code = 1
            self.rank_set.kill_all(signal.SIGKILL)
            self.rank_set.discard_idle(len(self.rank_set.idle))
            try:
                kill_orphans(set())
            except BaseException:
                pass
            try:
                import traceback
                self.send({"kind": "supervisor_error", "traceback": traceback.format_exc(),
                           "message": f"{type(exc).__name__}: {exc}"})
            except BaseException:
                pass
        finally:
            self.logs.close()
            self.input.close()
            error_file.remove(self.spec)
            try:
                self.outbox.flush()
            except BaseException:
                pass
            try:
                self.sock.close(linger=2000)
                self.ctx.term()
            except BaseException:
                pass
            os._exit(code)

    def _end_ranks(self, wait: float, terminate: bool, spare_held: bool = False) -> None:
        """The ranks' end, waited for: SIGTERM first (``terminate``; else they
        were told to end by themselves), up to ``wait`` seconds for every rank
        to exit, then SIGKILL what is left (and its children) and up to
        REAP_WAIT for that.  ``spare_held``: but a rank held for a post-mortem."""
        ladder = self.rank_set.ladder(self._what(), wait, log, terminate=terminate, then_wait=REAP_WAIT,
                                      spare_held=spare_held)
        ladder.run(lambda left: self.poll(min(left, RANKS_GONE_POLL)))

    def _what(self) -> str:
        """This run's stop, as the log names it."""
        return f"run {self.spec.get('run_id')} node {self.spec.get('node_rank')}"

    def _sweep_orphans(self, wait: float = ORPHAN_SWEEP_WAIT) -> None:
        """Kill what the ranks left behind until nothing is left: a chain of
        daemons reaches this subreaper one process at a time, as each parent dies."""
        deadline = time.monotonic() + wait
        ranks = {r.pid for r in self.rank_set.alive()}
        while kill_orphans(ranks) and time.monotonic() < deadline:
            self.poll(ORPHAN_SWEEP_POLL)   # reaps them (SIGCHLD); the next generation is reparented here

    def _start(self, key: bytes, spec: dict, spec_bytes: bytes) -> None:
        self.spec = spec
        self.outbox = Outbox.of(spec, self._send_packed)
        if spec.get("events_addr", self.events_addr) != self.events_addr:
            # A run the kernel reads on a socket of its own (a session, a background run):
            # a socket of its own here too, whose transport fits that address.
            self.sock.close(linger=0)   # nothing was sent on it yet
            self.events_addr = spec["events_addr"]
            self.sock = transport.events_socket(self.ctx, self.events_addr, self.events_keys)
        self.started = time.time()
        self.grace = spec.get("grace", RANK_GRACE)
        if spec.get("timeout"):
            self.timeout_deadline = time.monotonic() + spec["timeout"]
        self.session.key = key
        self.rank_set.take(spec["num_processes"])
        self.pump.open_logs(spec.get("log_dir", ""))
        error_file.prepare(spec, self.errors_ahead)   # as torchrun's agent, before the ranks start
        self.pump.set_excerpts(spec.get("excerpt"))
        for rank in self.ranks:
            rank.rank = spec["ranks"][rank.local]
            if spec.get("attempt"):
                self.logs.note(rank.rank, f"--- attempt {spec['attempt'] + 1} of {spec['max_restarts'] + 1} ---")
        # One node: the ranks get the spec first, and "started" goes with
        # their first message (STARTED_NOTE); several: first, the view says
        # who waits for the other nodes.  Either way "started" is the run's
        # first message (see send).
        if spec["num_nodes"] > 1:
            self._say_started()
            self.outbox.flush()   # the rendezvous may wait before its loop does
        self.nodes.rendezvous(spec)
        if spec["num_nodes"] > 1 and self.stopping is None:
            self.send({"kind": "released"})   # the kernel's rendezvous backstop ends here
        self._hand_out(spec_bytes)
        if self.stopping is not None:
            self._say_started()
        elif not self.said_started:   # one node: with the first other message, or soon (see STARTED_NOTE)
            self.started_due = time.monotonic() + STARTED_NOTE

    def _hand_out(self, spec_bytes: bytes) -> None:
        """Every rank gets the spec (and runs), or, the run stopped already, EOF (and ends)."""
        for r in self.ranks:
            if self.stopping is None:
                try:
                    wire.write_frame(r.go, spec_bytes)   # kept open: see _reap_rest
                    continue
                except BrokenPipeError:
                    pass   # it died idle: its exit status is reported like any rank's
            else:
                r.signalled = True   # never released: EOF ends it
            r.release()

    def _say_started(self) -> None:
        """The run's first message, once (before any other: see send)."""
        self.started_due = None
        if not self.said_started:
            self.said_started = True
            self.send({"kind": "started", "pids": {r.rank: r.pid for r in self.ranks}, "supervisor": os.getpid()})

    def send(self, content: dict) -> None:
        if not self.said_started:
            self._say_started()
        content["run_id"] = self.spec["run_id"]
        content["node_rank"] = self.spec["node_rank"]   # several nodes may report to one reader
        self.outbox.add(content)

    def _send_packed(self, content: dict) -> None:
        """The outbox's message (one, or a batch), its frames in one when small (wire.packed)."""
        frames = self.session.serialize(self.session.msg("run_event", content))
        self.sock.send_multipart(wire.packed(frames), copy=False)

    # -- the nodes' signals -------------------------------------------------------
    def _peers_ended(self) -> None:
        """SIGHUP, from the kernel through this node's agent (runs dispatched
        together): while the run goes on, a rank failed on another node, so
        this node stops (its ranks would wait for the lost one); once this
        node has finished, every node has, so node 0 may close its store."""
        if not self.spec or not self.spec.get("dispatched_together"):
            return
        if self.ranks and not self.rank_set.all_reported():
            self.stop("remote_failed", stacks=False)
        self.nodes.peers_done = True

    def rendezvous_failed(self, message: str) -> None:
        """The ranks never get the spec (EOF ends them); SIGKILL after the grace."""
        self.send({"kind": "rendezvous_failed", "message": message})
        self.stopping = "rendezvous"
        self.rank_ladder = self.rank_set.ladder(self._what(), self.grace, log, terminate=False, then_wait=0)
        self.rank_ladder.start()

    # -- event loop -------------------------------------------------------
    def poll(self, timeout: Optional[float]) -> None:
        held = self.outbox.wait()
        if held is not None and (timeout is None or held < timeout):
            timeout = held
        for key, _ in self.sel.select(timeout):
            kind, rank = key.data
            source = self.sources.get(kind)
            if source is not None:
                source(key)
            elif rank.fds.get(kind) == key.fd:   # not closed earlier in this same batch
                self._on_readable(kind, rank, key.fd)
        self.outbox.turn_ended()

    def _serve_until(self, done) -> None:
        """The one event loop of every supervisor: wait for what comes or is due,
        then act on the time, until ``done()`` (a one-shot run: every rank is
        reported; a session: it ended)."""
        while not done():
            self.poll(self._next_timeout())
            self._on_time()

    def _deadlines(self) -> list:
        """Every deadline the loop must wake up for (None: not set)."""
        return [self.started_due, self.pump.due, self.stack_deadline,
                self.rank_ladder.due if self.rank_ladder is not None else None, self.timeout_deadline,
                self.nodes.remote_check, self.stall.stall_check, self.stall.resource_check]

    def _next_timeout(self) -> Optional[float]:
        now = time.monotonic()
        due = [d for d in self._deadlines() if d is not None]
        due += [r.exit_time + DRAIN_WAIT for r in self.ranks if r.status is not None and not r.reported]
        due += [r.ask_due() for r in self.ranks if r.asked_at is not None]
        if self.stack_deadline is not None:
            due.append(now + STACK_QUIET)
        return max(0.0, min(due) - now) if due else None

    def _on_time(self) -> None:
        """What is due now: the one escalation ladder (stall check, --timeout,
        stacks then the stop, the kill), whatever the kind of run; the hooks
        below are where a session's supervisor differs."""
        now = time.monotonic()
        if self.started_due is not None and now >= self.started_due:
            self._say_started()
        self.nodes.on_time(now)
        if self.input.paused() or self.input.pause_total:   # a rank's pause at its prompt is not the run's time
            paused = self.input.take_pause()
            if self.timeout_deadline is not None:
                self.timeout_deadline += paused
        self.stall.on_time(now)
        if self.timeout_deadline is not None and now >= self.timeout_deadline:
            self.timeout_deadline = None
            self.stop("timeout", stacks=True)
        self._on_stacks_time(now)
        self._on_policy_time(now)
        if self.rank_ladder is not None:
            self.rank_ladder.on_time(now)
        for r in self.ranks:
            if not r.reported:
                self._settle(r, now)
        self.pump.on_time(now)

    def _on_stacks_time(self, now: float) -> None:
        """The stop's first rung: every rank's stacks, until dumped or STACK_WAIT."""
        for r in self.ranks:
            r.check_ask(now)
        if self.stack_deadline is not None:
            live = self._stack_waiters()
            dumped = all(r.dumped() and now - r.stack_time >= STACK_QUIET for r in live)
            if dumped or now >= self.stack_deadline:
                self.stack_deadline = None
                self._after_stacks()

    def _on_signals(self) -> None:
        try:
            data = os.read(self.wakeup_r, 512)
        except BlockingIOError:
            return
        for signum in data:
            handler = self.on_signal.get(signum)
            if handler is not None:
                handler(signum)

    def _on_readable(self, kind: str, r: RankProcess, fd: int) -> bool:
        """Read what is there; False once nothing more is (EAGAIN or EOF)."""
        if kind != "ev":
            return self.pump.read(r, kind, fd)
        data = self.rank_set.read(r, kind, fd)
        if not data:
            return False
        for frame in r.frames.feed(data):
            event = pickle.loads(frame)
            if event.get("kind") == "input_request":   # whatever the policy: the kernel is asked
                self.input.ask(r, event)
                continue
            if event.get("kind") in ("result", "failed"):   # its cell ended: no question of it is open
                self.input.forget(r)
            self._on_rank_event(r, event)
        return True

    def _reap(self) -> None:
        for r, status in self.rank_set.reaped():
            self.input.forget(r)
            self._on_rank_exit(r, status)

    def _read_events(self, r: RankProcess) -> None:
        """A rank exited: its last report (a failure) is already in its event
        pipe; read it first, so the exit is not taken for the cause."""
        while "ev" in r.fds and self._on_readable("ev", r, r.fds["ev"]):
            pass

    # -- the policy: what a kind of run does (OneShotSupervisor, SessionSupervisor) --
    def _run(self) -> None:
        """After the spec and the rendezvous: the run, to its end."""
        raise NotImplementedError

    def _on_rank_event(self, r: RankProcess, event: dict) -> None:
        """A rank's event (its failure, its result, its progress)."""
        raise NotImplementedError

    def _on_rank_exit(self, r: RankProcess, status: int) -> None:
        """A rank exited (reaped: ``status`` is its wait status)."""
        raise NotImplementedError

    def _settle(self, r: RankProcess, now: float) -> None:
        """A rank not reported yet, at each turn of the loop: is it done with?"""
        raise NotImplementedError

    def stop(self, reason: str, stacks: bool) -> None:
        """Stop what runs (``stacks``: each rank's stacks first)."""
        raise NotImplementedError

    def _stack_waiters(self) -> list:
        """The ranks whose stacks a stop waits for."""
        raise NotImplementedError

    def _after_stacks(self) -> None:
        """The stacks are in (or their wait is over): the stop's next rung."""
        raise NotImplementedError

    def _on_policy_time(self, now: float) -> None:
        """Deadlines of a kind of run of its own (none by default)."""

    def on_op(self, content: dict) -> None:
        """The kernel's word about the run on the input socket (verified):
        a held rank's post-mortem, one-shot runs only (none by default)."""
        log.info("%s: %r is not for this kind of run", self._what(), content.get("op"))

    def _sources(self) -> dict:
        """The cell's source and the notebook cells' it reaches, by filename (for stacks)."""
        payload = self.spec.get("payload")
        if payload is None:
            return {}
        return {payload.filename: payload.source, **getattr(payload, "sources", {})}

    # -- shared by the policies ---------------------------------------------------------
    def _stop_now(self, signum: int) -> None:
        """SIGUSR2: the kernel's "stop now".  SIGTERM comes from elsewhere (a
        rank, the system, the launcher ending): the run says so."""
        first = self.stopping is None
        if first:
            self.stopping = "interrupt" if signum == signal.SIGUSR2 else "terminated"
        self.stack_deadline = None
        log.info("%s: SIGKILL to its ranks (%s)", self._what(), signal.Signals(signum).name)
        self.rank_set.kill_all(signal.SIGKILL)
        if first:
            self.nodes.tell_others(self.stopping, self.first_failure)

    def _note_failure(self, secondary: bool, when: float, rank: int, summary: str) -> None:
        candidate = (secondary, when, rank, summary)
        if self.first_failure is None or candidate < self.first_failure:
            self.first_failure = candidate

    def _note_failed_event(self, r: RankProcess, event: dict) -> None:
        """A rank reported its failure: noted (the first one is the run's cause)."""
        r.failed = True
        summary = self.pump.note_failure(r, event, failure_summary(event))
        self._note_failure(event.get("secondary", False), event.get("timestamp", time.time()), r.rank, summary)
