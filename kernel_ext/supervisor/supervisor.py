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

import errno
import logging
import os
import pickle
import selectors
import signal
import socket
import time
from typing import NoReturn, Optional

from . import error_file, native_stacks
from .. import wire
from ..wire import transport
from ..wire.messages import failure_summary
from .output_batch import Excerpt, bound_text, shorten_lines, strip_escapes
from .rank_logs import RankLogs
from ..process_tree import kill_orphans
from .rank_process import RankProcess, stacks_message
from .resources import ResourceSampler
from . import node_notes, rendezvous
from .node_liveness import NodeLiveness
from .rendezvous import CHECKED, FINISHED, NodeRendezvous, RendezvousTimeout
from .run_state import RunState, tell
# The ladders' order: see timing.py.
from ..timing import (
    REAP_WAIT, REMOTE_CHECK, FINISH_WAIT, REMOTE_WAIT, FLUSH_INTERVAL, STACK_WAIT, STACK_QUIET,
    DRAIN_WAIT, RELEASE_DELAY, STALL_CHECK, NATIVE_WAIT, RDZV_POLL, RESOURCE_SAMPLE, STARTED_NOTE,
    NODE_STORE_WAIT, RANK_GRACE, RANKS_GONE_POLL, ORPHAN_SWEEP_WAIT, ORPHAN_SWEEP_POLL, RDZV_NOTE_EVERY,
    RDZV_NOTE_QUIET,
)

log = logging.getLogger("accel_magics.supervisor")
PR_SET_CHILD_SUBREAPER = 36
SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGHUP}
MAX_BATCH_BYTES = 256 * 1024
READ_BYTES = 1 << 20
STALL_CPU = 0.05          # CPU seconds a rank must use in a look to count as moving


class Supervisor:
    """One run's supervisor; forked ahead of time as the zygote's spare.

    Life cycle: as a :class:`spare.Spare` it forked idle ranks (each waits on
    its own "go" pipe) while there was no run yet, connected the run channel
    (ZMQ starts its I/O thread only after the last fork) and got the run's
    spec; built from that spare, :meth:`serve` drops ranks the run does not
    need, hands every rank the spec and supervises to the end (:meth:`_run`;
    a session's supervisor overrides it).  Forking ahead takes the fork cost
    off the critical path of the next cell.
    """

    def __init__(self, spare) -> None:
        """The run's supervisor, from the spare it was (:class:`spare.Spare`):
        its idle ranks, selector, signal wake-up pipe and channel are handed
        over by name, the spare is not used again."""
        self.idle: list[RankProcess] = spare.idle   # forked ahead, pipes registered; numbered at the run
        self.sel = spare.sel
        self._fds: list[int] = spare.fds          # every fd a rank must not inherit
        self.wakeup_r, self.wakeup_w = spare.wakeup_r, spare.wakeup_w
        self.ctx, self.sock, self.session, self.events_addr = spare.ctx, spare.sock, spare.session, spare.events_addr
        self.events_keys = spare.events_keys
        self.status_fd = spare.status_fd   # to the launcher (run_state)
        self._discarded: set[int] = spare.discarded
        self.ranks: list[RankProcess] = []
        self.stopping: Optional[str] = None   # None, "failed", "interrupt", "timeout"
        self.stack_deadline: Optional[float] = None
        self.kill_deadline: Optional[float] = None
        self.timeout_deadline: Optional[float] = None
        self.flush_due: Optional[float] = None
        self.rdzv = None
        self.spec: dict = {}
        self.said_started = False
        self.started_due: Optional[float] = None
        self.peers_done = False   # runs dispatched together: the kernel said every node is done
        self.remote_check: Optional[float] = None
        self.departures_seen = 0   # several nodes: other nodes' ranks that left, relayed so far
        self.liveness: Optional[NodeLiveness] = None   # a kernel per node: is every other node still there?
        self.stall_check: Optional[float] = None
        self.resource_check: Optional[float] = None   # the next sample of the ranks' CPU and memory
        self.sampler = ResourceSampler()
        self.stall_judged = float("-inf")   # when quiet ranks were last judged (see _check_stall)
        self.said_quiet: set[int] = set()   # ranks the user was told wait (once each)
        self.recorded: dict[int, Optional[dict]] = {}   # rank -> what @record wrote (error_file), once read
        self.first_failure: Optional[tuple] = None   # (secondary, time, rank, summary)
        self.logs = RankLogs("")
        # The one event loop's tables (a session's supervisor adds to them):
        # what a ready selector key of each kind means (a rank's pipes aside),
        # and what each signal means.
        self.sources = {"signal": lambda key: self._on_signals(), "store": lambda key: self._host_store(key.fd)}
        self.on_signal = {signal.SIGCHLD: lambda signum: self._reap(),
                          signal.SIGUSR1: lambda signum: self._stop("interrupt", stacks=True),
                          signal.SIGHUP: lambda signum: self._peers_ended(),
                          signal.SIGUSR2: self._stop_now, signal.SIGTERM: self._stop_now}

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
            self._kill_all(signal.SIGKILL)
            self._discard_idle(len(self.idle))
            try:
                kill_orphans(set())
            except BaseException:
                pass
            try:
                import traceback
                self._send({"kind": "supervisor_error", "traceback": traceback.format_exc(),
                            "message": f"{type(exc).__name__}: {exc}"})
            except BaseException:
                pass
        finally:
            self.logs.close()
            error_file.remove(self.spec)
            try:
                self.sock.close(linger=2000)
                self.ctx.term()
            except BaseException:
                pass
            os._exit(code)

    def _run(self) -> None:
        """A one-shot run: until every rank is reported, then "finished" (a
        session's supervisor runs cell after cell instead: SessionSupervisor)."""
        together = self.spec.get("dispatched_together")
        if self.spec["num_nodes"] > 1 and self.stopping is None and not together:
            self.remote_check = time.monotonic() + REMOTE_CHECK
        elif self.spec.get("stall_timeout"):
            self.stall_check = time.monotonic() + STALL_CHECK
        self.resource_check = time.monotonic() + RESOURCE_SAMPLE
        self._loop()
        if not together:
            self._finish_nodes()
        self.logs.close()   # complete on disk before the kernel hears "finished"
        self._send({"kind": "finished", "reason": self.stopping,
                    "elapsed": time.time() - self.started})
        # Then the launcher, which forks the next run's spare while the kernel
        # shows this result: told first, its fork competed with the delivery
        # of "finished" and the kernel's reply for the cores.
        # One node only: with several, the cell ends with the last node, and
        # a spare forked on an early one competes with the late ones where
        # nodes share cores (8 nodes of the test cluster: 106 ms a cell with
        # it, 59 ms without).
        if self.spec["num_nodes"] == 1:
            tell(self.status_fd, RunState.FINISHED)
        log.info("run %s node %s attempt %s: finished (%s) in %.3fs", self.spec.get("run_id"),
                 self.spec.get("node_rank"), self.spec.get("attempt", 0), self.stopping or "all ranks ended",
                 time.time() - self.started)
        if together and self.spec["node_rank"] == 0:
            self._keep_store_for_peers()
        if self.rdzv is not None:
            self.rdzv.close()   # stop listening (joins the store's thread: after "finished")
        self._reap_rest()
        if all(r.status is not None for r in self.ranks):
            tell(self.status_fd, RunState.RANKS_GONE)   # else the launcher waits for this process's exit

    def _reap_rest(self) -> None:
        """After "finished": let the parked ranks go, wait (bounded) for every
        rank to exit, then kill whatever is left of them and their children.

        Ranks that succeeded are parked (worker._park): their teardown would
        slow the kernel while it shows the result, so they are let go a
        moment after "finished" (signals are still served meanwhile).
        """
        deadline = time.monotonic() + RELEASE_DELAY
        while time.monotonic() < deadline and self.stopping not in ("interrupt", "terminated"):
            self._poll(deadline - time.monotonic())
        self._release_all()
        self._wait_ranks_gone(REAP_WAIT)
        self._sweep_orphans()

    def _wait_ranks_gone(self, wait: float) -> None:
        """Wait up to ``wait`` seconds for every rank to exit, then SIGKILL what
        is left (and its children) and wait up to REAP_WAIT for that."""
        deadline = time.monotonic() + wait
        while any(r.status is None for r in self.ranks) and time.monotonic() < deadline:
            self._poll(RANKS_GONE_POLL)
        for r in self.ranks:
            if r.status is None:
                r.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + REAP_WAIT
        while any(r.status is None for r in self.ranks) and time.monotonic() < deadline:
            self._poll(RANKS_GONE_POLL)

    def _sweep_orphans(self, wait: float = ORPHAN_SWEEP_WAIT) -> None:
        """Kill what the ranks left behind until nothing is left: a chain of
        daemons reaches this subreaper one process at a time, as each parent dies."""
        deadline = time.monotonic() + wait
        ranks = {r.pid for r in self.ranks if r.status is None}
        while kill_orphans(ranks) and time.monotonic() < deadline:
            self._poll(ORPHAN_SWEEP_POLL)   # reaps them (SIGCHLD); the next generation is reparented here

    def _release_all(self) -> None:
        for r in self.ranks:
            r.release()

    def _discard_idle(self, n: int) -> None:
        """Drop the last ``n`` idle ranks (the run needs fewer)."""
        for _ in range(n):
            rank = self.idle.pop()
            self._close_pipes(rank)
            rank.release()   # EOF on the go pipe: the idle rank exits by itself
            self._discarded.add(rank.pid)

    def _start(self, key: bytes, spec: dict, spec_bytes: bytes) -> None:
        self.spec = spec
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
        need = spec["num_processes"]
        if len(self.idle) < need:  # the zygote forks a big enough spare: never here
            raise RuntimeError(f"spare supervisor has {len(self.idle)} ranks, the run needs {need}")
        self._discard_idle(len(self.idle) - need)
        self.ranks, self.idle = self.idle, []
        self.logs = RankLogs(spec.get("log_dir", ""))
        error_file.prepare(spec)   # as torchrun's agent, before the ranks start
        excerpt = spec.get("excerpt")
        for rank in self.ranks:
            rank.rank = spec["ranks"][rank.local]
            if excerpt:
                rank.excerpt = Excerpt(*excerpt)
            if spec.get("attempt"):
                self.logs.note(rank.rank, f"--- attempt {spec['attempt'] + 1} of {spec['max_restarts'] + 1} ---")
        # One node: the ranks get the spec first, and "started" goes with
        # their first message (STARTED_NOTE); several: first, the view says
        # who waits for the other nodes.  Either way "started" is the run's
        # first message (see _send).
        if spec["num_nodes"] > 1:
            self._say_started()
        self._rendezvous(spec)
        if spec["num_nodes"] > 1 and self.stopping is None:
            self._send({"kind": "released"})   # the kernel's rendezvous backstop ends here
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
        if self.stopping is not None:
            self._say_started()
        elif not self.said_started:   # one node: with the first other message, or soon (see STARTED_NOTE)
            self.started_due = time.monotonic() + STARTED_NOTE

    def _say_started(self) -> None:
        """The run's first message, once (before any other: see _send)."""
        self.started_due = None
        if not self.said_started:
            self.said_started = True
            self._send({"kind": "started", "pids": {r.rank: r.pid for r in self.ranks}, "supervisor": os.getpid()})

    # -- rendezvous -------------------------------------------------------------
    def _poll(self, timeout: Optional[float]) -> None:
        for key, _ in self.sel.select(timeout):
            kind, rank = key.data
            source = self.sources.get(kind)
            if source is not None:
                source(key)
            elif rank.fds.get(kind) == key.fd:   # not closed earlier in this same batch
                self._on_readable(kind, rank, key.fd)

    def _rendezvous(self, spec: dict) -> None:
        """Host (node 0) or reach the run's store; with several nodes, wait for all.

        Interruptible, bounded by the rendezvous timeout; progress goes to the
        kernel once a second ("waiting for 1 of 2 nodes at 10.1.2.3:29500").
        """
        nodes = spec["num_nodes"]
        self.rdzv = NodeRendezvous(spec["master_addr"], spec["master_port"], nodes, spec["node_rank"],
                                   spec["rdzv_timeout"], attempt=spec.get("attempt", 0))
        try:
            if nodes == 1 or (spec.get("dispatched_together") and spec["node_rank"] == 0):
                if not rendezvous.prebound:   # the store hook is off here: the store now, as torchrun's agent
                    self.rdzv.host_store()
                    return
                fd = self.rdzv.listen()
                self.sel.register(fd, selectors.EVENT_READ, ("store", None))
                return
            if spec.get("dispatched_together"):
                self._wait_for_nodes(self._node0_listening, quiet_for=RDZV_NOTE_QUIET)
                return
            if spec["node_rank"] == 0:
                self.rdzv.host_store()
            self._wait_for_nodes(self._count_in, quiet_for=0.0)
        except RendezvousTimeout as exc:
            self._rendezvous_failed(str(exc))
        except Exception as exc:   # e.g. node 0 could not listen on the port
            if nodes > 1 and spec["node_rank"] == 0 and any(
                    word in str(exc).lower() for word in ("address already in use", "eaddrinuse")):
                found = self.rdzv.whose_port(spec.get("rendezvous_key"))   # another node 0? it is told too
                self._rendezvous_failed(node_notes.second_node0_message(self.rdzv.address, self.rdzv.port,
                                                                        nodes, found))
                return
            self._rendezvous_failed(f"could not {'host' if spec['node_rank'] == 0 else 'reach'} the "
                                    f"rendezvous at {self.rdzv.address}: {type(exc).__name__}: {exc}")

    def _wait_for_nodes(self, joined_now, quiet_for: float) -> None:
        """Until ``joined_now()`` counts every node in, or the run is stopped;
        bounded by the rendezvous timeout.  Progress goes to the kernel once a
        second, the first time after ``quiet_for`` seconds."""
        nodes = self.spec["num_nodes"]
        last_note = time.monotonic() - RDZV_NOTE_EVERY + quiet_for
        while self.stopping is None:
            joined = joined_now()
            if joined >= nodes:
                return
            if time.monotonic() - last_note >= RDZV_NOTE_EVERY:
                last_note = time.monotonic()
                self._send({"kind": "waiting", "joined": joined, "expected": nodes, "address": self.rdzv.address,
                            "problem": self.rdzv.problem(self.spec.get("rendezvous_key"))})
            self.rdzv.check_deadline(joined)
            self._poll(RDZV_POLL)

    def _count_in(self) -> int:
        """One kernel per node: count this node in on node 0's store; how many are in."""
        if self.rdzv.store is not None or self.rdzv.try_connect():
            return self.rdzv.join_step(self.spec.get("rendezvous_key"))
        return 1   # this node; node 0 not reached yet (rdzv.reach says why)

    def _node0_listening(self) -> int:
        """Nodes handed the run at once by one kernel (``--launcher slurm``).

        The kernel started every node's part in the same moment and watches
        them all, so the one-kernel-per-node count-in before the ranks start
        (for a person who has not run the other node's cell yet), and the
        store client each node keeps for it, only cost the run time: the
        kernel stops the other nodes when one fails, and tells node 0 when
        every node is done (SIGHUP both, see :meth:`_peers_ended`).  Node 0
        listens at once and hosts its store on the first connection, as on
        one node; the other nodes start their ranks as soon as node 0's port
        accepts (a rank's connection then waits in its backlog, never in
        torch's retry back-off, which costs about half a second): every
        node counts as in then, only this one until.
        """
        return self.spec["num_nodes"] if self.rdzv.probe() else 1

    def _peers_ended(self) -> None:
        """SIGHUP, from the kernel through this node's agent (runs dispatched
        together): while the run goes on, a rank failed on another node, so
        this node stops (its ranks would wait for the lost one); once this
        node has finished, every node has, so node 0 may close its store."""
        if not self.spec or not self.spec.get("dispatched_together"):
            return
        if self.ranks and not all(r.reported for r in self.ranks):
            self._stop("remote_failed", stacks=False)
        self.peers_done = True

    def _keep_store_for_peers(self) -> None:
        """Node 0, after its "finished": ranks of other nodes may still be
        starting or use the store it hosts; keep listening until the kernel
        says every node is done (or the launcher ends this run)."""
        self._release_all()   # done here: no parked ranks meanwhile (their memory, their GPUs)
        while not self.peers_done and self.stopping not in ("interrupt", "terminated"):
            self._poll(None)

    def _host_store(self, fd: int) -> None:
        """A rank is connecting to the store for the first time: start it now."""
        self.sel.unregister(fd)
        try:
            self.rdzv.host_store()
        except Exception as exc:
            if self.stopping is None:
                self._rendezvous_failed(f"could not host the store at {self.rdzv.address}: "
                                        f"{type(exc).__name__}: {exc}")

    def _rendezvous_failed(self, message: str) -> None:
        self._send({"kind": "rendezvous_failed", "message": message})
        self.stopping = "rendezvous"
        self.kill_deadline = time.monotonic() + self.grace

    def _check_stall(self, now: float) -> None:
        """One node: stop a run that nothing can move, and only that.

        A rank still in the cell after another finished it, with no CPU time
        and no output for ``stall_timeout`` seconds, is *quiet*.  Quiet is not
        stuck: rank 0 may sleep, wait for a subprocess or for an upload while
        its peers are done.  So each quiet rank is judged (:meth:`_stuck`):
        stuck when its interpreter cannot run Python any more (a thread holds
        the GIL in native code: the teardown deadlock), or when its native
        stack is in a torch.distributed collective, which the finished rank
        will never join.  The run is stopped, with every rank's native stack,
        only when every quiet rank is stuck (one that can move may be what the
        others wait for); otherwise the user is told once which rank waits
        where, and the run goes on (``--timeout`` bounds a cell)."""
        self.stall_check = now + STALL_CHECK
        if self.stopping is not None:
            self.stall_check = None
            return
        quiet = self._quiet_ranks(now)
        if quiet is None:
            return
        finished, running, seconds = quiet
        limit = self.spec["stall_timeout"]
        blocked = {r.rank: r.python_silent_for(now) for r in running}   # read at every check (see its doc)
        if seconds < limit or now < self.stall_judged + limit:
            return
        self.stall_judged = now
        # One dump for every rank whose interpreter still runs (py-spy runs them side by side).
        native = native_stacks.dump([r.pid for r in running if blocked[r.rank] < limit], NATIVE_WAIT)
        why = {r.rank: self._stuck(r, blocked[r.rank], limit, native) for r in running}
        if all(why.values()):
            self._send({"kind": "stalled", "ranks": [r.rank for r in running], "seconds": limit,
                        "finished": [r.rank for r in finished], "why": why})
            self._stop("stalled", stacks=True)
            return
        self._say_waiting([r for r in running if not why[r.rank]], finished, seconds)
        for r in running:
            r.native = ""   # a later verdict looks again; the stop's dump is taken then

    def _sample_resources(self, now: float) -> None:
        """Each rank still in the cell: its CPU and memory, for its row in the view."""
        working = {r.rank: r.pid for r in self._working()}
        if self.stopping is not None or not working:
            self.resource_check = None if self.stopping is not None else now + RESOURCE_SAMPLE
            return
        self.resource_check = now + RESOURCE_SAMPLE
        self._send({"kind": "resources", "ranks": self.sampler.sample(working)})

    def _quiet_ranks(self, now: float) -> Optional[tuple]:
        """(finished ranks, ranks still in the cell, how long the least quiet
        of these has used no CPU and printed nothing since a rank finished),
        or None while no rank finished, none runs, or one just exited."""
        finished = [r for r in self.ranks if r.done]
        running = [r for r in self.ranks if r.status is None and not r.done]
        if not finished or not running:
            return None
        since_finish = min(r.done_time for r in finished)
        for r in running:
            cpu = native_stacks.cpu_seconds(r.pid)
            if cpu is None:
                return None
            if r.cpu_seen is None or cpu - r.cpu_seen > STALL_CPU or native_stacks.state(r.pid) == "D":
                r.cpu_seen, r.cpu_since = cpu, now
        return finished, running, min(now - max(r.cpu_since, r.last_output, since_finish) for r in running)

    def _say_waiting(self, waiting: list, finished: list, seconds: float) -> None:
        """Quiet ranks that may move: said once each (the view shows where), never stopped."""
        waiting = [r for r in waiting if r.rank not in self.said_quiet]
        if not waiting:
            return
        self.said_quiet.update(r.rank for r in waiting)
        where = {r.rank: native_stacks.where(r.native) for r in waiting}
        log.warning("run %s: rank(s) %s quiet for %.0fs after rank(s) %s finished; not stuck (%s)",
                    self.spec.get("run_id"), [r.rank for r in waiting], seconds, [r.rank for r in finished], where)
        self._send({"kind": "quiet", "ranks": [r.rank for r in waiting], "seconds": round(seconds, 1),
                    "finished": [r.rank for r in finished], "where": where})

    def _stuck(self, r: RankProcess, blocked_for: float, limit: float, native: dict) -> Optional[str]:
        """Why nothing can move this quiet rank, or None if something may
        (``native``: the native stacks taken for this verdict, by pid)."""
        if blocked_for >= limit:
            return (f"its interpreter has not run Python for {blocked_for:.0f}s: a thread holds the GIL "
                    "in native code and does not return (a deadlock)")
        r.native = native.get(r.pid, "")
        return native_stacks.stuck_in(r.native)

    def _check_remote(self) -> None:
        """Several nodes: stop when another node reports a failure; report ours.
        Ranks of other nodes that left without joining the world go to the
        kernel too (its fold sees whether one of ours waits for them)."""
        self.remote_check = time.monotonic() + REMOTE_CHECK
        self._liveness().beat()
        self.departures_seen, departed = self.rdzv.departed_elsewhere(self.departures_seen)
        for d in departed:
            self._send({"kind": "remote_departed", **d})
        remote = self.rdzv.remote_failure(self.spec.get("rendezvous_key"))
        if remote is not None and self.stopping is None:
            self._send({"kind": "remote_failure", **remote})
            self._stop("remote_failed", stacks=False)

    def _liveness(self) -> NodeLiveness:
        """A kernel per node: the other nodes' beats (made at the first look)."""
        if self.liveness is None:
            self.liveness = NodeLiveness(self.rdzv, self.spec)
        return self.liveness

    def _finish_nodes(self) -> None:
        """Several nodes: node 0 keeps the store up until every node is done.

        If this node only saw consequences (its ranks lost their peers), the
        root cause is on another node: give its report a moment to arrive.
        """
        if self.spec["num_nodes"] == 1 or self.rdzv is None or self.rdzv.store is None:
            return
        self._release_all()   # waiting for other nodes can take long: no parked ranks meanwhile
        if self.stopping == "failed" and self.first_failure is not None and self.first_failure[0]:
            deadline = time.monotonic() + REMOTE_WAIT
            while time.monotonic() < deadline:
                remote = self.rdzv.remote_failure(self.spec.get("rendezvous_key"))
                if remote is not None:
                    self._send({"kind": "remote_failure", **remote})
                    break
                gone = self._liveness().gone_message()   # no word from it: did a node go away?
                if gone is not None:
                    self._send(gone)
                    break
                self._poll(REMOTE_CHECK)
        self.rdzv.finish()
        if self.spec.get("attempt", 0) < self.spec.get("max_restarts", 0):
            self._agree_on_outcome()
            return
        if self.spec["node_rank"] != 0:
            return
        self._wait_all(FINISHED)

    def _wait_all(self, name: str) -> None:
        """Until every node counted itself in ``name`` (bounded; a stop ends the wait)."""
        deadline = time.monotonic() + FINISH_WAIT
        while self.rdzv.finished(name) < self.spec["num_nodes"] and time.monotonic() < deadline:
            self._poll(RDZV_POLL)
            if self.stopping in ("interrupt", "terminated"):
                return
            gone = self._liveness().gone()
            if gone is not None:   # it never will
                log.warning("run %s: node %d went away (silent for %.1fs); not waiting for it",
                            self.spec.get("run_id"), *gone)
                return

    def _agree_on_outcome(self) -> None:
        """Kernel per node, with a restart to come if this attempt failed: every
        node must come to the same verdict, or one node's kernel starts the next
        attempt while another's says done.  So every node waits until all are
        done, then looks for a failure elsewhere (it fails this attempt too), and
        node 0 keeps the store up until every node has looked (``CHECKED``)."""
        self._wait_all(FINISHED)
        if self.stopping is None:
            remote = self.rdzv.remote_failure(self.spec.get("rendezvous_key"))
            if remote is not None:
                self._send({"kind": "remote_failure", **remote})
                self.stopping = "remote_failed"
        self.rdzv.finish(CHECKED)
        if self.spec["node_rank"] == 0:
            self._wait_all(CHECKED)

    def _send(self, content: dict) -> None:
        if not self.said_started:
            self._say_started()
        content["run_id"] = self.spec["run_id"]
        content["node_rank"] = self.spec["node_rank"]   # several nodes may report to one reader
        self.session.send(self.sock, "run_event", content)

    # -- event loop -------------------------------------------------------
    def _serve_until(self, done) -> None:
        """The one event loop of every supervisor: wait for what comes or is due,
        then act on the time, until ``done()`` (a one-shot run: every rank is
        reported; a session: it ended)."""
        while not done():
            self._poll(self._next_timeout())
            self._on_time()

    def _loop(self) -> None:
        self._serve_until(lambda: all(r.reported for r in self.ranks))

    def _deadlines(self) -> list:
        """Every deadline the loop must wake up for (None: not set)."""
        return [self.started_due, self.flush_due, self.stack_deadline, self.kill_deadline, self.timeout_deadline,
                self.remote_check, self.stall_check, self.resource_check]

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
        if self.remote_check is not None and now >= self.remote_check:
            self._check_remote()
        if self.stall_check is not None and now >= self.stall_check:
            self._check_stall(now)
        if self.resource_check is not None and now >= self.resource_check:
            self._sample_resources(now)
        if self.timeout_deadline is not None and now >= self.timeout_deadline:
            self.timeout_deadline = None
            self._stop("timeout", stacks=True)
        for r in self.ranks:
            r.check_ask(now)
        if self.stack_deadline is not None:
            live = self._stack_waiters()
            dumped = all(r.dumped() and now - r.stack_time >= STACK_QUIET for r in live)
            if dumped or now >= self.stack_deadline:
                self.stack_deadline = None
                self._after_stacks()
        self._on_policy_time(now)
        if self.kill_deadline is not None and now >= self.kill_deadline:
            self.kill_deadline = None
            self._kill_all(signal.SIGKILL)
        for r in self.ranks:
            if not r.reported:
                self._settle(r, now)
        if self.flush_due is not None and now >= self.flush_due:
            self._flush()

    # -- the hooks of the ladder (a one-shot run's; SessionSupervisor has its own) --
    def _stack_waiters(self) -> list:
        """The ranks whose stacks a stop waits for."""
        return self._working()

    def _after_stacks(self) -> None:
        """The stacks are in (or their wait is over): the stop itself."""
        self._terminate()

    def _on_policy_time(self, now: float) -> None:
        """Deadlines of a kind of run of its own (none for a one-shot run)."""

    def _settle(self, r: RankProcess, now: float) -> None:
        """Report a rank's exit once all it wrote is read."""
        if r.status is not None and (not r.fds or now >= r.exit_time + DRAIN_WAIT):
            self._report_exit(r)
        elif r.status is None and r.done and "ev" not in r.fds:
            # It delivered its result and closed its outputs (the event
            # pipe last), so all it wrote is in its pipes: its exit (0) is
            # a formality.  Report now; it is parked until "finished".
            # Its stdout may still be held open by a process it started:
            # that process is killed when the rank exits, not waited for.
            self._drain(r)
            self._report_exit(r)

    def _on_signals(self) -> None:
        try:
            data = os.read(self.wakeup_r, 512)
        except BlockingIOError:
            return
        for signum in data:
            handler = self.on_signal.get(signum)
            if handler is not None:
                handler(signum)

    def _stop_now(self, signum: int) -> None:
        """SIGUSR2: the kernel's "stop now".  SIGTERM comes from elsewhere (a
        rank, the system, the launcher ending): the run says so."""
        first = self.stopping is None
        if first:
            self.stopping = "interrupt" if signum == signal.SIGUSR2 else "terminated"
        self.stack_deadline = None
        self._kill_all(signal.SIGKILL)
        if first:
            self._tell_other_nodes(self.stopping)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            r = next((r for r in self.ranks if r.pid == pid), None)
            if r is None:
                continue   # a discarded idle rank, or a rank's orphan we killed
            r.status, r.exit_time = status, time.monotonic()
            r.release()
            # Anything the rank started dies with it: no orphans.
            r.signal_group(signal.SIGKILL)
            self._on_rank_exit(r, status)

    def _on_rank_exit(self, r: RankProcess, status: int) -> None:
        """A one-shot run's rank exited: a failure stops the run."""
        kill_orphans({r.pid for r in self.ranks})
        if r.reported:
            return
        # Its failure report (if any) is already in its event pipe:
        # read it first, so the exit is not taken for the cause.
        while "ev" in r.fds and self._on_readable("ev", r, r.fds["ev"]):
            pass
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and self.stopping is None:
            if not r.failed:
                what = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                recorded = self._recorded(r)
                if recorded is not None:
                    self._note_failure(recorded["secondary"], recorded["timestamp"], r.rank,
                                       f"{failure_summary(recorded)} (recorded by @record; it then {what})")
                else:
                    self._note_failure(False, time.time(), r.rank, what)
            self._stop("failed", stacks=False)

    def _recorded(self, r: RankProcess) -> Optional[dict]:
        """What ``@record`` wrote for a rank that failed without reporting an
        exception (read once; see error_file), bounded as a failure's text."""
        if r.rank not in self.recorded:
            found = error_file.recorded(error_file.path_of(self.spec, r.local))
            if found is not None:
                self.logs.note(r.rank, f"--- recorded by @record in {error_file.VARIABLE}: "
                                       f"{failure_summary(found)} ---\n{found['traceback']}")
                found["message"] = bound_text(found["message"], head=20, tail=20)
                found["traceback"] = bound_text(found["traceback"])
            self.recorded[r.rank] = found
        return self.recorded[r.rank]

    def _on_readable(self, kind: str, r: RankProcess, fd: int) -> bool:
        """Read what is there; False once nothing more is (EAGAIN or EOF)."""
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            data = b""
        if not data:
            self.sel.unregister(fd)
            os.close(fd)
            del r.fds[kind]
            if kind == "out":
                r.output.end()
            return False
        if kind == "out":
            self._on_output(r, data)
        elif kind == "ev":
            for frame in r.frames.feed(data):
                self._on_rank_event(r, pickle.loads(frame))
        else:
            r.add_stack(data)
            r.stack_time = time.monotonic()
        return True

    # -- output -------------------------------------------------------------
    def _on_output(self, r: RankProcess, data: bytes) -> None:
        r.output.feed(data)
        r.last_output = time.monotonic()
        if self.flush_due is None:
            self.flush_due = time.monotonic() + FLUSH_INTERVAL
        if r.output.bytes > MAX_BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Every byte to the rank's log; to the kernel, what it shows (bounded lines)."""
        self.flush_due = None
        for r in self.ranks:
            block, progress = r.output.take()
            logged = r.output.take_log()
            if logged:
                self.logs.write(r.rank, logged)
            if block is None and progress is None:
                continue
            parts = r.excerpt.select(block) if block is not None and r.excerpt is not None else [(0, block)]
            for i, (omitted, part) in enumerate(parts):
                self._send({"kind": "output", "rank": r.rank, "omitted": omitted,
                            "text": strip_escapes(shorten_lines(part)).decode("utf-8", "replace")
                            if part is not None else None,
                            "progress": progress if i == len(parts) - 1 else None})

    # -- rank events, stopping, exits ----------------------------------------
    def _note_failure(self, secondary: bool, when: float, rank: int, summary: str) -> None:
        candidate = (secondary, when, rank, summary)
        if self.first_failure is None or candidate < self.first_failure:
            self.first_failure = candidate

    def _catch_up(self, r: RankProcess) -> None:
        """What the rank printed before it sent an event is in its output pipe
        already: read it (bounded) and send it first, so prints and events (a
        bar that closes after a print) reach the kernel in the rank's order."""
        drained = 0
        while "out" in r.fds and drained < 64 and self._on_readable("out", r, r.fds["out"]):
            drained += 1
        self._flush()

    def _on_rank_event(self, r: RankProcess, event: dict) -> None:
        self._catch_up(r)
        if event.get("kind") == "failed":
            r.failed = True
            summary = failure_summary(event)
            self.logs.note(r.rank, f"--- {summary} ---\n{event.get('traceback', '')}")
            # The log has it all; the kernel gets bounded text (a rank can raise a 20 MB message).
            event["message"] = bound_text(str(event.get("message", "")), head=20, tail=20)
            event["traceback"] = bound_text(str(event.get("traceback", "")))
            summary = bound_text(summary, head=20, tail=20)
            self._note_failure(event.get("secondary", False), event.get("timestamp", time.time()), r.rank, summary)
        if event.get("kind") == "result":
            if self.remote_check is not None:   # a kernel per node: the others' folds judge (must_stop)
                self.rdzv.report_departed(self.spec["node_rank"], r.rank,
                                          "sys.exit(0)" if event.get("exited") else "returned",
                                          event.get("rounds", 1 if event.get("in_world") else 0))
            r.done_time = time.monotonic()
            # The rank's last event: stop reading its event and stack pipes
            # now, a process the cell started may hold them open for long.
            r.done = True
            for kind in ("ev", "st"):
                self._close_pipe(r, kind)
        self._send({"kind": "rank_event", "rank": r.rank, "event": event})
        if event.get("kind") == "failed" and self.stopping is None:
            self._stop("failed", stacks=False)

    def _stop(self, reason: str, stacks: bool) -> None:
        if self.stopping is not None:
            return
        self.stopping = reason
        log.info("run %s node %s: stopping its ranks (%s)", self.spec.get("run_id"), self.spec.get("node_rank"),
                 reason)
        live = self._working()
        if stacks and live and reason in ("timeout", "stalled"):
            # A diagnosis was asked for: native frames too (a rank stuck in a
            # destructor or a collective shows one line of Python otherwise).
            missing = [r.pid for r in live if not r.native]   # the stall check's verdict dumped some
            native = native_stacks.dump(missing, NATIVE_WAIT) if missing else {}
            for r in live:
                r.native = r.native or native.get(r.pid, "")
        if stacks and live:
            now = time.monotonic()
            for r in live:
                r.ask_stacks(now)
            self.stack_deadline = now + STACK_WAIT
        else:
            self._terminate()
        self._tell_other_nodes(reason)

    def _tell_other_nodes(self, reason: str) -> None:
        """Several nodes: why this node stops, in node 0's store, when it is
        news to them: its own root cause, or that it left with none (its
        kernel stopped it or went away, its --timeout): their ranks only see
        lost connections.  A consequence of another node's failure is not."""
        if self.remote_check is None or self.rdzv is None or reason == "remote_failed":
            return
        key = self.spec.get("rendezvous_key")
        if reason == "failed":
            if self.first_failure is not None and not self.first_failure[0]:
                _, _, rank, summary = self.first_failure
                self.rdzv.report_failure(self.spec["node_rank"], rank, summary, key)
            return
        node = self.spec["node_rank"]
        self.rdzv.quick(NODE_STORE_WAIT)   # node 0's machine may be gone: never hold this node's stop
        self.rdzv.report_failure(node, node * self.spec["num_processes"],
                                 node_notes.left_summary(node, socket.gethostname(), reason), key, left=True)

    def _working(self) -> list:
        """Ranks still running the cell: not exited, not finished (parked)."""
        return [r for r in self.ranks if r.status is None and not r.reported]

    def _terminate(self) -> None:
        """SIGTERM to every rank still running, but those that failed: they end
        by themselves, as a script that raised (their threads, their atexit
        handlers, worker._execute), within the same grace before SIGKILL."""
        for r in self.ranks:
            if r.status is None and not r.failed:
                r.signal_group(signal.SIGTERM)
        self.kill_deadline = time.monotonic() + self.grace

    def _kill_all(self, sig: int) -> None:
        for r in self.ranks:
            if r.status is None:
                r.signal_group(sig)

    def _drain(self, r: RankProcess) -> None:
        """Read what a rank's output and stack pipes hold now (until EAGAIN or EOF;
        bounded, in case a process the rank started keeps writing)."""
        for kind in ("out", "st"):
            for _ in range(64):
                if kind not in r.fds or not self._on_readable(kind, r, r.fds[kind]):
                    break

    def _close_pipes(self, r: RankProcess) -> None:
        for kind in list(r.fds):
            self._close_pipe(r, kind)

    def _sources(self) -> dict:
        """The cell's source and the notebook cells' it reaches, by filename (for stacks)."""
        payload = self.spec.get("payload")
        if payload is None:
            return {}
        return {payload.filename: payload.source, **getattr(payload, "sources", {})}

    def _close_pipe(self, r: RankProcess, kind: str) -> None:
        fd = r.fds.pop(kind, None)
        if fd is not None:
            self.sel.unregister(fd)
            os.close(fd)

    def _report_exit(self, r: RankProcess) -> None:
        self._close_pipes(r)   # give up on pipes a stray process holds
        r.output.end()
        self._flush()
        if r.stack or r.native:
            msg = stacks_message(r, self._sources())
            self.logs.note(r.rank, "--- stack when the run was stopped ---\n" + msg["text"])
            self._send({**msg, "text": bound_text(msg["text"])})
        status = r.status if r.status is not None else 0
        if r.status is None:
            r.exit_time = time.monotonic()
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        stopped = r.stopped_by_us(sig)
        recorded = None
        if not r.failed and not stopped and (sig or os.WEXITSTATUS(status)):
            how = f"killed by {signal.Signals(sig).name}" if sig else f"exited with code {os.WEXITSTATUS(status)}"
            self.logs.note(r.rank, f"--- {how} ---")
            recorded = self._recorded(r)   # the failure torchrun would show for it
        self._send({
            "kind": "exit",
            "rank": r.rank,
            "exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": signal.Signals(sig).name if sig else None,
            "stopped": stopped,
            "timestamp": time.time() - (time.monotonic() - r.exit_time),
            **({"recorded": recorded} if recorded is not None else {}),
        })
        r.reported = True
