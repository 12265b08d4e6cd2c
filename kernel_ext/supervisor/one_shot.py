"""A one-shot run's supervisor: the policy of a ``%%distributed`` cell's run.

Every rank runs the cell once and exits.  A rank's failure (its report, or
an exit that is not 0) stops the others: stacks first when the stop was
asked for (the stop button, ``--timeout``, a stall), then the ranks' stop
ladder (SIGTERM, the grace, SIGKILL: :meth:`RankSet.ladder`).  Each rank's
exit is reported once all it wrote is read; "finished" goes once every rank
is reported, and the parked ranks are let go after it.

A failed rank of a run with a hold (``--debug_hold``) says it is held
(rank/held.py) instead of ending: it is left out of the stop and of "every
rank reported", the kernel is told (``held``: the rank, the seconds, the
input socket's address) and, after "finished", it is served on its own
(:meth:`OneShotSupervisor._serve_held`) until it exits: ``%distributed_debug``
asks for its post-mortem (``{"op": "debug"}``), reads its output and answers
its questions under the run's id; the next cell lets it go
(``{"op": "release"}``, or the launcher's SIGTERM, which kills it), and so
does the end of its hold when no post-mortem was opened.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

from . import error_file
from .. import wire
from ..process_tree import kill_orphans
from ..wire.messages import failure_summary
from .output_batch import bound_text
from .rank_process import RankProcess
from .run_state import RunState, tell
from .supervisor import Supervisor, log
# The ladders' order: see timing.py.
from ..timing import DRAIN_WAIT, NATIVE_WAIT, REAP_WAIT, RELEASE_DELAY, REMOTE_CHECK, STACK_WAIT
from . import native_stacks


class OneShotSupervisor(Supervisor):
    """The supervisor of one run (see the module doc)."""

    finished_sent = False   # "finished" is out: a held rank's exit is its own story (held_end)

    def _run(self) -> None:
        """A one-shot run: until every rank is reported, then "finished" (a
        session's supervisor runs cell after cell instead: SessionSupervisor)."""
        together = self.spec.get("dispatched_together")
        remote = self.spec["num_nodes"] > 1 and self.stopping is None and not together
        if remote:
            self.nodes.remote_check = time.monotonic() + REMOTE_CHECK
        self.stall.begin(time.monotonic(), stall=not remote and bool(self.spec.get("stall_timeout")))
        self._serve_until(self._all_told)
        if not together:
            self.nodes.finish()
        self.logs.close()   # complete on disk before the kernel hears "finished"
        self.send({"kind": "finished", "reason": self.stopping,
                   "elapsed": time.time() - self.started})
        self.finished_sent = True
        # Then the launcher, which forks the next run's spare while the kernel
        # shows this result: told first, its fork competed with the delivery
        # of "finished" and the kernel's reply for the cores.
        # One node only: with several, the cell ends with the last node, and
        # a spare forked on an early one competes with the late ones where
        # nodes share cores.
        if self.spec["num_nodes"] == 1:
            tell(self.status_fd, RunState.FINISHED)
        log.info("run %s node %s attempt %s: finished (%s) in %.3fs", self.spec.get("run_id"),
                 self.spec.get("node_rank"), self.spec.get("attempt", 0), self.stopping or "all ranks ended",
                 time.time() - self.started)
        if together and self.spec["node_rank"] == 0:
            self.nodes.keep_store_for_peers()
        self.nodes.close()   # stop listening (joins the store's thread: after "finished")
        self._reap_rest()
        if self.rank_set.all_gone():
            tell(self.status_fd, RunState.RANKS_GONE)   # else the launcher waits for this process's exit

    def _all_told(self) -> bool:
        """Every rank is reported, or held for a post-mortem (its exit comes after "finished")."""
        return all(r.reported or r.held_until is not None for r in self.ranks)

    def _reap_rest(self) -> None:
        """After "finished": let the parked ranks go, wait (bounded) for every
        rank to exit, then kill whatever is left of them and their children.

        Ranks that succeeded are parked (worker._park): their teardown would
        slow the kernel while it shows the result, so they are let go a
        moment after "finished" (signals are still served meanwhile).
        """
        deadline = time.monotonic() + RELEASE_DELAY
        while time.monotonic() < deadline and self.stopping not in ("interrupt", "terminated"):
            self.poll(deadline - time.monotonic())
        self.rank_set.release_all(spare_held=True)
        self._end_ranks(REAP_WAIT, terminate=False, spare_held=True)
        self._sweep_orphans()
        if self.rank_set.held():
            self._serve_held()
            self._end_ranks(REAP_WAIT, terminate=False)   # whatever is left of them
            self._sweep_orphans()

    # -- a failed rank held for a post-mortem (see the module doc) ----------------------
    def _on_held(self, r: RankProcess, event: dict) -> None:
        """``r`` failed and waits, its frames alive: held, if this run's stop
        is its failure's (not the button's, --timeout's) and the kernel can
        reach this supervisor; else let go at once (it ends as a script that raised)."""
        seconds = float(event.get("seconds") or 0)
        if seconds <= 0 or not r.failed or r.signalled or self.stopping not in (None, "failed") \
                or r.status is not None or not self.input.open():
            r.release()
            return
        r.held_until = time.monotonic() + seconds
        self.logs.note(r.rank, f"--- held for a post-mortem (%distributed_debug), at most {seconds:g} s ---")
        self.send({"kind": "held", "rank": r.rank, "seconds": seconds, "reply_to": self.input.address})

    def on_op(self, content: dict) -> None:
        """The kernel's word about the held ranks (``rank``: one, None: all):
        ``debug`` opens a post-mortem, ``release`` lets the rank go."""
        op, rank = content.get("op"), content.get("rank")
        held = [r for r in self.rank_set.held() if (rank is None or r.rank == rank) and r.let_go_at is None]
        if op == "release":
            for r in held:
                self._let_go(r, "the kernel let it go")
        elif op == "debug" and not any([self._open_post_mortem(r) for r in held]):
            self.send({"kind": "held_end", "rank": rank, "gone": True})   # nothing to debug: the kernel stops waiting

    def _open_post_mortem(self, r: RankProcess) -> bool:
        """Tell a held rank to open its post-mortem (rank/held.py); False: it cannot."""
        if not r.debugging:
            if r.go is None:
                return False
            try:
                wire.write_frame(r.go, {"debug": True})
            except OSError:   # gone: its exit says so
                return False
            r.debugging = True
            self.logs.note(r.rank, "--- post-mortem opened (%distributed_debug) ---")
        return True

    def _let_go(self, r: RankProcess, why: str) -> None:
        """EOF at its go pipe: a held rank ends as a script that raised (a
        post-mortem reads end of input); SIGKILL if it is still there a grace later."""
        self.logs.note(r.rank, f"--- let go: {why} ---")
        log.info("%s: held rank %s let go: %s", self._what(), r.rank, why)
        r.release()
        r.let_go_at = time.monotonic() + self.grace

    def _serve_held(self) -> None:
        """After "finished": the held ranks, until each has exited.  Their
        output and questions go to the kernel under the run's id; one whose
        hold ends with no post-mortem open is let go; a post-mortem lasts
        until the user ends it (or the kernel lets it go)."""
        while self.rank_set.held():
            now = time.monotonic()
            due = [d for d in [self.pump.due, *(self._held_due(r, now) for r in self.rank_set.held())]
                   if d is not None]
            self.poll(max(0.0, min(due) - now) if due else None)
            self.pump.on_time(time.monotonic())

    def _held_due(self, r: RankProcess, now: float) -> Optional[float]:
        """What is due for a held rank now (let go, killed), and when it is next (None: nothing)."""
        if r.let_go_at is None and not r.debugging and now >= r.held_until:
            self._let_go(r, "its hold (--debug_hold) ended")
        if r.let_go_at is not None and now >= r.let_go_at:
            log.info("%s: held rank %s did not end after it was let go: SIGKILL", self._what(), r.rank)
            r.signal_group(signal.SIGKILL)
            r.let_go_at = now + REAP_WAIT   # reaped before then (else killed again)
        if r.let_go_at is not None:
            return r.let_go_at
        return None if r.debugging else r.held_until

    def _held_exit(self, r: RankProcess, status: int) -> None:
        """A held rank exited after "finished": what it printed, then ``held_end``."""
        self._read_events(r)
        self.pump.drain(r)
        r.output.end()
        self.pump.flush()
        self.rank_set.close_pipes(r)
        r.reported = True
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        self.send({"kind": "held_end", "rank": r.rank, "exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status)
                   else None, "signal": signal.Signals(sig).name if sig else None})

    def _stack_waiters(self) -> list:
        """The ranks whose stacks a stop waits for."""
        return self.rank_set.working()

    def _after_stacks(self) -> None:
        """The stacks are in (or their wait is over): the stop itself."""
        self._terminate()

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
            self.pump.drain(r)
            self._report_exit(r)

    def _on_rank_exit(self, r: RankProcess, status: int) -> None:
        """A one-shot run's rank exited: a failure stops the run."""
        kill_orphans({r.pid for r in self.ranks})
        if r.held_until is not None:
            if self.finished_sent:
                self._held_exit(r, status)
                return
            r.held_until = None   # gone before the run finished: reported as any rank
        if r.reported:
            return
        self._read_events(r)
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
            self.stop("failed", stacks=False)

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

    def _on_rank_event(self, r: RankProcess, event: dict) -> None:
        self.pump.catch_up(r)
        if event.get("kind") == "held":
            self._on_held(r, event)
            return
        if event.get("kind") == "failed":
            self._note_failed_event(r, event)
        if event.get("kind") == "result":
            self.nodes.report_departed(r.rank, event)   # a kernel per node: the others' folds judge (must_stop)
            r.done_time = time.monotonic()
            # The rank's last event: stop reading its event and stack pipes
            # now, a process the cell started may hold them open for long.
            r.done = True
            for kind in ("ev", "st"):
                self.rank_set.close_pipe(r, kind)
        self.send({"kind": "rank_event", "rank": r.rank, "event": event})
        if event.get("kind") == "failed" and self.stopping is None:
            self.stop("failed", stacks=False)

    def stop(self, reason: str, stacks: bool) -> None:
        if self.stopping is not None:
            return
        self.stopping = reason
        log.info("run %s node %s: stopping its ranks (%s)", self.spec.get("run_id"), self.spec.get("node_rank"),
                 reason)
        live = self.rank_set.working()
        if stacks and live and reason in ("timeout", "stalled"):
            self._native_stacks(live)
        if stacks and live:
            now = time.monotonic()
            for r in live:
                r.ask_stacks(now)
            self.stack_deadline = now + STACK_WAIT
        else:
            self._terminate()
        self.nodes.tell_others(reason, self.first_failure)

    def _native_stacks(self, live: list) -> None:
        """A diagnosis was asked for: native frames too (a rank stuck in a
        destructor or a collective shows one line of Python otherwise)."""
        missing = [r.pid for r in live if not r.native]   # the stall check's verdict dumped some
        native = native_stacks.dump(missing, NATIVE_WAIT) if missing else {}
        for r in live:
            r.native = r.native or native.get(r.pid, "")

    def _terminate(self) -> None:
        """The ranks' stop ladder: SIGTERM to every rank still running, but
        those that failed (they end by themselves, as a script that raised),
        then SIGKILL after the grace (see RankSet.terminate)."""
        self.rank_ladder = self.rank_set.ladder(self._what(), self.grace, log, terminate=True, then_wait=0,
                                                spare_held=True)
        self.rank_ladder.start()

    def _report_exit(self, r: RankProcess) -> None:
        self.rank_set.close_pipes(r)   # give up on pipes a stray process holds
        r.output.end()
        self.pump.flush()
        if r.stack or r.native:
            self.pump.send_stack(r, self._sources(), "the run was stopped")
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
        self.send({
            "kind": "exit",
            "rank": r.rank,
            "exitcode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": signal.Signals(sig).name if sig else None,
            "stopped": stopped,
            "timestamp": time.time() - (time.monotonic() - r.exit_time),
            **({"recorded": recorded} if recorded is not None else {}),
        })
        r.reported = True

