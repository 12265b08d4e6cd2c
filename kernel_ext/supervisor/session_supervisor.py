"""A session's supervisor: persistent ranks that run cell after cell.

Runs in the supervisor process of a ``%distributed_session`` (forked by the
launcher like any run's: the spare becomes this supervisor when its spec
says "session", see :mod:`spare`; :meth:`Supervisor.serve` then runs
:meth:`SessionSupervisor._run`).  The
ranks stay alive between cells, each with its own namespace
(``worker._serve_session``); this process keeps reading their pipes and is,
as for a one-shot run, the only sender on the channel to the kernel.

Cells come from the kernel over a second ZMQ socket (PULL, ``ipc://`` in the
launcher's private directory), every message HMAC-signed with the session's
key and checked before it is unpickled, exactly like the messages that go
the other way.

A cell ends when every rank is back at its prompt.  When a cell must stop
(a rank failed, the stop button, ``--timeout``, a stall) the ranks still in
it are *recalled*: stacks first (each rank's heartbeat thread writes them,
also inside a collective: see rank/liveness.py),
then SIGINT, which is KeyboardInterrupt in the cell's code.  Ranks that come
back within ``RECALL_WAIT`` keep the session alive with its state; a rank
that does not (blocked in C, in a collective whose peer has left it) cannot
be brought back, so the session is lost: every rank is stopped and the
kernel is told where the stuck ranks were.  A rank that dies ends the
session too (its peers' process group cannot go on without it).
"""
from __future__ import annotations

import os
import pickle
import selectors
import signal
import time
from typing import Optional

from . import native_stacks
from .. import wire
from .rank_logs import RankLogs
from .rank_process import NO_STACK, RankProcess, where_blocked
from .nodes import SessionBeats
from .supervisor import Supervisor, log
from ..stop_ladder import Rung, StopLadder
# The ladders' order: see timing.py.
from ..timing import (DRAIN_WAIT, FORCE_AFTER, NATIVE_WAIT,
                      READY_WAIT, RECALL_WAIT, READY_POLL, REAP_WAIT, STACK_ASK_WAIT, STACK_QUIET, STACK_WAIT)


class SessionSupervisor(Supervisor):
    """The supervisor of a session: see the module doc.  Life cycle:
    ranks set up (``session_ready``) -> "ready" to the kernel -> cells, one at
    a time -> "stop" from the kernel (or the session is lost) -> ranks end."""

    # -- life cycle -----------------------------------------------------------
    def _run(self) -> None:
        """The session, after its spec: ranks set up, then cells until stopped or lost."""
        import zmq

        self.session_id = self.spec["run_id"]
        self.cell: Optional[dict] = None       # the cell running now
        self.ending: Optional[str] = None      # "stop" (asked), "lost" (see lost)
        self.lost: Optional[str] = None        # why the session cannot go on
        self.stop_id: Optional[str] = None
        self.recall: Optional[StopLadder] = None   # the recall's rungs after the stacks (see _recall_ladder)
        self.beats = SessionBeats(self.nodes, self._lose)   # several nodes: is every node's part still there?
        self.cell_sources: dict = {}           # every cell's source by filename (stacks show them)
        self.verifier = wire.signed_session(self.session.key)
        self.cells = self.ctx.socket(zmq.PULL)
        self.cells.setsockopt(zmq.LINGER, 0)
        self.cells.connect(self.spec["cells_addr"])
        self.sel.register(self.cells.getsockopt(zmq.FD), selectors.EVENT_READ, ("cells", None))
        # The one loop's tables, for a session: cells come in; the stop button
        # recalls a cell's ranks; a kill or SIGTERM loses the session.
        self.sources["cells"] = lambda key: self._take_cells()
        self.on_signal.update({signal.SIGUSR1: self._on_stop_button, signal.SIGUSR2: self._on_kill,
                               signal.SIGTERM: self._on_kill})
        self.on_signal.pop(signal.SIGHUP)   # the nodes of a session finish together: nothing to do
        self.pump.logs.close()
        self.timeout_deadline = None   # --timeout is a cell's
        if self.stopping is None:
            self._wait_ready()
        if self.stopping is not None and self.ending is None:   # the rendezvous failed, a rank died
            self._lose(self.lost or "the session's ranks could not start")
        # A kernel per node: nothing else tells one node's part that another's is
        # gone.  (Nodes dispatched together, on Slurm, have the kernel for that.)
        self.beats.begin()
        self._serve_until(lambda: self.ending is not None)
        self._end()

    def _wait_ready(self) -> None:
        """Until every rank has set up (its environment, torch): then "ready"."""
        for r in self.ranks:
            r.back = False
        deadline = time.monotonic() + READY_WAIT
        while not all(r.ready for r in self.ranks) and self.stopping is None and self.ending is None:
            if time.monotonic() > deadline:
                self.lost = f"the ranks did not set up within {READY_WAIT:g}s"
                self.stopping = "failed"
                return
            self.poll(READY_POLL)
            self._on_time()
        for r in self.ranks:
            r.back = True
        if self.stopping is None and self.ending is None:
            self.send({"kind": "ready"})

    def _end(self) -> None:
        """Stop every rank (asked: let them end; lost: terminate), then tell the kernel."""
        if self.ending == "stop":
            self.rank_set.release_all()   # EOF at their prompt: each rank exits by itself
            self._end_ranks(REAP_WAIT, terminate=False)
        else:
            self._end_ranks(self.grace, terminate=True)
        self.pump.drain_all()
        self._sweep_orphans()
        self.pump.logs.close()
        if self.ending == "stop":
            self.spec["run_id"] = self.stop_id or self.session_id
            # ``lost``: a rank had died by itself (an out-of-memory kill) as the stop came.
            self.send({"kind": "finished", "reason": None, "session": "stopped", "elapsed": 0.0,
                        **({"lost": self.lost} if self.lost else {})})
        elif self.cell is not None:
            self._send_stacks()
            self.send({"kind": "finished", "reason": self.stopping or "failed", "session": "lost",
                        "lost": self.lost, "elapsed": time.time() - self.started})
        else:
            self.spec["run_id"] = self.session_id
            self.send({"kind": "session_lost", "lost": self.lost})
        self.nodes.close()
        self.cells.close()

    # -- cells from the kernel ------------------------------------------------------
    def _take_cells(self) -> None:
        """Every message waiting on the cells socket, verified before it is
        unpickled (wire.verified_waiting: signed with the session's key)."""
        for content in wire.verified_waiting(self.cells, self.verifier):
            if content.get("op") == "cell":
                self._start_cell(content)
            elif content.get("op") == "interrupt":
                # The stop of one cell, after that cell on this socket (the kernel, or a Slurm node's agent,
                # sends it so: a signal could overtake the cell and find none); another
                # cell's (it ended) is not this one's to stop.
                if self.cell is not None and self.cell["run_id"] == content.get("run_id"):
                    self._recall("interrupt")
            elif content.get("op") in ("debug", "release"):   # a failed cell's rank, at its prompt (held.py)
                self._post_mortem_op(content)
            elif content.get("op") == "stop":
                self.stop_id = content.get("run_id")
                if self.cell is None:
                    self.ending = "stop"
                else:   # the kernel stops a running cell first; if not, the stop wins
                    self._lose("the session was stopped while a cell was running")

    def _post_mortem_op(self, content: dict) -> None:
        """``debug``: a rank at its prompt opens the post-mortem of the cell that
        failed on it (it kept the cell's frames); ``release``: its post-mortem
        is stopped; ``release`` of no rank: every rank lets its kept frames go now."""
        rank = content.get("rank")
        r = next((r for r in self.ranks if r.rank == rank), None)
        if content["op"] == "debug":
            self._open_post_mortem(r, rank)
        elif rank is None:
            self._drop_kept()
        elif r is not None and r.debugging:
            self._stop_post_mortem(r)

    def _drop_kept(self) -> None:
        """Every rank at its prompt lets the frames it kept go now (their memory back)."""
        if self.cell is None:
            for r in self.ranks:
                if not r.debugging and r.go is not None:
                    wire.write_frame(r.go, {"drop": True})

    def _open_post_mortem(self, r: Optional[RankProcess], rank) -> None:
        if r is None:   # another node's rank (a session on several nodes: each node is told)
            return
        if self.cell is not None or r.debugging or r.go is None:
            self.send({"kind": "held_end", "rank": rank, "gone": True})   # nothing to open: the kernel stops waiting
            return
        wire.write_frame(r.go, {"debug": True})
        r.debugging = True
        self.logs.note(r.rank, "--- post-mortem opened (%distributed_debug) ---")

    def _stop_post_mortem(self, r: RankProcess) -> None:
        """Its questions get end of input; a command typed at its prompt and
        still running is interrupted (SIGINT), as at a terminal."""
        asking = r.rank in self.input.waiting
        self.input.refuse(r, "the post-mortem was stopped")
        if not asking:
            try:
                os.kill(r.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def _start_cell(self, content: dict) -> None:
        if self.cell is not None or self.ending is not None:
            self.spec["run_id"] = content["run_id"]
            if self.cell is None and self.ending == "lost":
                # The session was lost (a rank died at its prompt) just before
                # the cell came: that is the cell's end, and its story.
                self.send({"kind": "finished", "reason": "failed", "session": "lost", "lost": self.lost,
                            "elapsed": 0.0})
            elif self.cell is None:
                self.send({"kind": "supervisor_error", "message": "the session is ending",
                            "traceback": "a cell was sent after the session's stop"})
            else:
                self.send({"kind": "supervisor_error", "message": "the session is busy",
                            "traceback": "a cell was sent while another one ran"})
            self.spec["run_id"] = self.cell["run_id"] if self.cell is not None else self.session_id
            return
        self.cell = content
        self.input.reset()
        self.spec["run_id"] = content["run_id"]
        self.spec["payload"] = content["payload"]
        self.cell_sources[content["payload"].filename] = content["payload"].source
        self.cell_sources.update(getattr(content["payload"], "sources", {}) or {})
        self.started = time.time()
        self.stopping = None
        self.first_failure = None
        self.stack_deadline = self.rank_ladder = self.recall = None
        self.timeout_deadline = time.monotonic() + content["timeout"] if content.get("timeout") else None
        # each cell judges its own quiet ranks
        self.stall.begin(time.monotonic(), stall=bool(self.spec.get("stall_timeout")))
        self.pump.open_logs(content.get("log_dir", ""))
        for r in self.ranks:
            r.back = r.failed = r.stopped = r.signalled = r.done = r.in_cell = False
            r.stack, r.native, r.done_time, r.cpu_seen, r.asked_at = bytearray(), "", 0.0, None, None
            r.last_output = time.monotonic()
        self.pump.set_excerpts(content.get("excerpt"))
        frame = pickle.dumps({"run_id": content["run_id"], "payload": content["payload"],
                              "debug_hold": bool(content.get("debug_hold"))}, protocol=pickle.HIGHEST_PROTOCOL)
        for r in self.ranks:
            try:
                wire.write_frame(r.go, frame)
            except (BrokenPipeError, TypeError):   # TypeError: its go pipe is closed (None)
                r.back = True   # it died at its prompt: its exit ends the session (see _reap)
        # The ranks have the cell first; the kernel hears while they run (as a one-shot run's _start).
        self.said_started = False
        self._say_started()

    def _sources(self) -> dict:
        return self.cell_sources

    # -- signals and exits ------------------------------------------------------------
    def _on_stop_button(self, signum: int) -> None:
        if self.cell is not None:
            self._recall("interrupt")

    def _on_kill(self, signum: int) -> None:
        if self.stopping is None:
            self.stopping = "interrupt" if signum == signal.SIGUSR2 else "terminated"
        self._lose("the stop did not bring every rank back in time, so the kernel ended the session"
                   if signum == signal.SIGUSR2 else "the session's supervisor was sent SIGTERM by another process")

    def _on_rank_exit(self, r: RankProcess, status: int) -> None:
        """A session's rank exited: the session cannot go on without it."""
        self._read_events(r)
        code = os.waitstatus_to_exitcode(status)
        what = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        if self.ending is not None:   # stopping anyway; a death of its own is still said (see _end)
            if code < 0 and not r.stopped_by_us(-code) and self.lost is None:
                self.lost = f"rank {r.rank} {what}"
            return
        self.logs.note(r.rank, f"--- {what} ---")
        if self.cell is not None:
            self.pump.drain(r)
            r.output.end()
            self.pump.flush()
            if not r.failed:
                self._note_failure(False, time.time(), r.rank, what)
            self.send({"kind": "exit", "rank": r.rank,
                       "exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                       "signal": signal.Signals(-code).name if code < 0 else None,
                       "stopped": False, "timestamp": time.time()})
            r.back = True
            if self.stopping is None:
                self.stopping = "failed"
        self._lose(f"rank {r.rank} {what}; a session cannot go on without one of its ranks")

    # -- rank events --------------------------------------------------------------------
    def _on_rank_event(self, r: RankProcess, event: dict) -> None:
        self.pump.catch_up(r)
        kind = event.get("kind")
        if kind in ("session_ready", "cell_started", "held_end"):
            self._on_prompt_event(r, event)
            return
        if kind not in ("failed", "result"):
            self.send({"kind": "rank_event", "rank": r.rank, "event": event})
            return
        if self.cell is None or event.get("cell") != self.cell["run_id"] or r.back:
            return
        r.back, r.done, r.done_time = True, True, time.monotonic()
        r.output.end()   # an unfinished last line is the cell's
        self.pump.flush()
        names = {"kind": "names", "assigned": event.pop("assigned", []), "deleted": event.pop("deleted", []),
                 "kinds": event.pop("kinds", {})}
        self.send({"kind": "rank_event", "rank": r.rank, "event": names})
        if kind == "failed" and event.get("exc_type") == "KeyboardInterrupt" and r.signalled \
                and self.stopping is not None:
            self._on_recalled(r, event)
            return
        if kind == "failed":
            self._note_failed_event(r, event)
        self.send({"kind": "rank_event", "rank": r.rank, "event": event})
        self._send_exit(r, stopped=False, code=1 if kind == "failed" else 0)
        if kind == "failed" and self.stopping is None:
            self._recall("failed")

    def _on_prompt_event(self, r: RankProcess, event: dict) -> None:
        """A rank set up (``session_ready``), began the cell (``cell_started``:
        one recalled before it began is recalled now), or ended a post-mortem
        (``held_end``)."""
        if event.get("kind") == "session_ready":
            r.ready = True
            return
        if event.get("kind") == "held_end":   # its post-mortem is over: back at its prompt
            r.debugging = False
            self.input.refused.discard(r.rank)
            self.send({"kind": "held_end", "rank": r.rank, "gone": bool(event.get("gone"))})
            return
        if self.cell is None or event.get("cell") != self.cell["run_id"]:
            return
        r.in_cell = True
        if self.stopping is not None:
            if self.stack_deadline is not None:
                r.ask_stacks(time.monotonic())
            else:
                self._sigint(r)

    def _on_recalled(self, r: RankProcess, event: dict) -> None:
        """A rank brought back by the recall (KeyboardInterrupt): stopped, not failed."""
        r.stopped = True
        if not r.dumped():
            r.stack = bytearray(str(event.get("traceback", "")).encode())
        where = where_blocked(r.stack.decode("utf-8", "replace"))
        self._send_exit(r, stopped=True, where="" if where == NO_STACK else where,
                        agreed=event.get("agreed_step") is not None, in_world=bool(event.get("in_world")))

    def _send_exit(self, r: RankProcess, stopped: bool, code: int = 0, where: str = "", **flags: bool) -> None:
        """A session rank back at its prompt.  ``flags`` of a stopped one, sent
        when true: ``agreed`` (it stopped after the optimizer step its peers
        agreed on), ``in_world`` (it is in the process group)."""
        self.send({"kind": "exit", "rank": r.rank, "exitcode": code, "signal": None, "stopped": stopped,
                    "prompt": True, "timestamp": time.time(), **({"where": where} if where else {}),
                    **{name: True for name, value in flags.items() if value}})

    # -- recalling the ranks of a cell -----------------------------------------------
    def _out(self) -> list[RankProcess]:
        """Ranks still in the cell."""
        return [r for r in self.ranks if not r.back and r.status is None]

    def _recall(self, reason: str) -> None:
        """Bring every rank still in the cell back to its prompt: stacks, then SIGINT."""
        if self.stopping is not None and reason != "failed":
            return
        live = self._out()
        if not live and reason != "failed":
            return   # every rank is back: the cell is over, it has nothing left to stop
        self.stopping = self.stopping or reason
        if not live:
            return
        if reason in ("timeout", "stalled"):
            native = native_stacks.dump([r.pid for r in live], NATIVE_WAIT)
            for r in live:
                r.native = native.get(r.pid, "")
        now = time.monotonic()
        for r in live:
            if r.in_cell:
                r.ask_stacks(now)
        self.stack_deadline = now + STACK_WAIT

    def _interrupt_cell(self) -> None:
        """The recall's rungs after the stacks: SIGINT to the ranks that began
        the cell (one that has not yet gets it when it says it began,
        ``cell_started``: before that, a SIGINT could not be told from a late
        one meant for its previous cell); a second SIGINT at FORCE_AFTER to
        those still out; at RECALL_WAIT a fresh look at where they are; the
        verdict: the session is lost."""
        self.recall = StopLadder(
            f"session {self.session_id} cell {self.spec.get('run_id')}",
            [Rung("SIGINT to its ranks in the cell", self._sigint_out, FORCE_AFTER),
             Rung("a second SIGINT to its ranks still out", self._sigint_out, RECALL_WAIT - FORCE_AFTER),
             Rung("the stacks of its ranks still out", self._ask_again, STACK_ASK_WAIT + 3 * STACK_QUIET),
             Rung("the session is lost: ranks did not come back", lambda: self._lose(self._describe_stuck()))],
            done=lambda: not self._out(), log=log)
        self.recall.start()

    def _sigint_out(self) -> None:
        for r in self._out():
            if r.in_cell:
                self._sigint(r)

    def _ask_again(self) -> None:
        """Where the ranks still out are now (not at the stop): a fresh dump for the verdict."""
        now = time.monotonic()
        for r in self._out():
            if r.in_cell:
                self.pump.drain(r)   # the rest of the stop's dump is not this ask's
                r.forget_stack()
                r.ask_stacks(now)

    def _sigint(self, r: RankProcess) -> None:
        r.signalled = True
        try:
            os.kill(r.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def _deadlines(self) -> list:
        return super()._deadlines() + [self.recall.due if self.recall is not None else None, self.beats.node_check]

    def _on_time(self) -> None:
        self._take_cells()   # its socket's fd is edge-triggered: drained at every turn of the loop
        super()._on_time()
        if self.ending is None:
            self.beats.on_time(time.monotonic())
        if self.cell is not None and self.ending is None and all(r.back for r in self.ranks) \
                and self.beats.seen_after_failure(self.first_failure is not None or self.stopping is not None):
            self._finish_cell()

    def _stack_waiters(self) -> list:
        return [r for r in self._out() if r.in_cell]

    def _after_stacks(self) -> None:
        self._interrupt_cell()

    def _on_policy_time(self, now: float) -> None:
        """The recall's rungs: a second SIGINT, a fresh look at those still out, the verdict."""
        if self.recall is not None:
            self.recall.on_time(now)

    def _settle(self, r: RankProcess, now: float) -> None:
        """A rank that died: done with once its pipes are drained (see _on_rank_exit)."""
        if r.status is not None and (not r.fds or now >= r.exit_time + DRAIN_WAIT):
            self.rank_set.close_pipes(r)
            r.reported = True

    def stop(self, reason: str, stacks: bool) -> None:
        """A stop (the stall check, --timeout): here, a recall."""
        self._recall(reason)

    def _describe_stuck(self) -> str:
        """Why the session is lost: where each stuck rank was, and what it waited for."""
        stuck = self._out()
        for r in stuck:
            self.pump.drain(r)   # a dump still in its pipe
        failed = self.first_failure[2] if self.stopping == "failed" and self.first_failure is not None else None
        return stuck_story(stuck, self.stopping, failed)

    def _lose(self, why: str) -> None:
        if self.ending is None:
            self.ending = "lost"
            self.lost = why

    def _send_stacks(self) -> None:
        for r in self.ranks:
            if (r.stack or r.native) and not r.reported_stack:
                self._send_stack(r)

    def _send_stack(self, r: RankProcess) -> None:
        r.reported_stack = True
        self.pump.send_stack(r, self._sources(), "the cell was stopped")

    def _finish_cell(self) -> None:
        """Every rank is back at its prompt: the cell is over, the session goes on."""
        self.pump.drain_all()
        if self.stopping in ("interrupt", "timeout", "stalled") and all(r.done and not r.failed and not r.stopped
                                                                       for r in self.ranks):
            self.stopping = None   # the stop came as the last rank finished: the cell completed, stopped nowhere
        if self.stopping in ("interrupt", "timeout", "stalled"):
            self._send_stacks()
        self.pump.logs.close()
        self.pump.logs = RankLogs("")   # what a thread of a rank prints between cells goes nowhere
        self.send({"kind": "finished", "reason": self.stopping, "session": "alive",
                    "elapsed": time.time() - self.started})
        self.cell = None
        self.beats.back_at = None
        self.spec["run_id"] = self.session_id
        self.spec["payload"] = None
        self.stopping = None
        self.timeout_deadline = self.stack_deadline = self.recall = None
        self.stall.end()
        for r in self.ranks:
            r.stack, r.native, r.reported_stack, r.asked_at = bytearray(), "", False, None


def stuck_story(stuck: list, stopping: Optional[str], failed: Optional[int]) -> str:
    """Where each stuck rank was, and what it waited for (``failed``: the rank
    whose failure the recall was for)."""
    places = "; ".join(where_stuck(r) for r in stuck)
    if failed is not None:
        return (f"{places} waiting for rank {failed}, which failed, and could not be brought back "
                f"within {RECALL_WAIT:g}s")
    what = {"interrupt": "the stop", "timeout": "the --timeout stop", "stalled": "the stall stop"}
    return (f"{places} and did not come back from {what.get(stopping, 'the stop')} within "
            f"{RECALL_WAIT:g}s (a rank blocked in a collective or in native code cannot be interrupted)")


def where_stuck(r: RankProcess) -> str:
    if native_stacks.state(r.pid) in ("T", "t"):   # no stack comes from a stopped process
        return f"rank {r.rank} was stopped (SIGSTOP, or a debugger: process state T)"
    return f"rank {r.rank} was in {where_blocked(r.stack.decode('utf-8', 'replace'))}"
