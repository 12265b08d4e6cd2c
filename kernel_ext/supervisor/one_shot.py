"""A one-shot run's supervisor: the policy of a ``%%distributed`` cell's run.

Every rank runs the cell once and exits.  A rank's failure (its report, or
an exit that is not 0) stops the others: stacks first when the stop was
asked for (the stop button, ``--timeout``, a stall), then the ranks' stop
ladder (SIGTERM, the grace, SIGKILL: :meth:`RankSet.ladder`).  Each rank's
exit is reported once all it wrote is read; "finished" goes once every rank
is reported, and the parked ranks are let go after it.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

from . import error_file
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

    def _run(self) -> None:
        """A one-shot run: until every rank is reported, then "finished" (a
        session's supervisor runs cell after cell instead: SessionSupervisor)."""
        together = self.spec.get("dispatched_together")
        remote = self.spec["num_nodes"] > 1 and self.stopping is None and not together
        if remote:
            self.nodes.remote_check = time.monotonic() + REMOTE_CHECK
        self.stall.begin(time.monotonic(), stall=not remote and bool(self.spec.get("stall_timeout")))
        self._serve_until(self.rank_set.all_reported)
        if not together:
            self.nodes.finish()
        self.logs.close()   # complete on disk before the kernel hears "finished"
        self.send({"kind": "finished", "reason": self.stopping,
                   "elapsed": time.time() - self.started})
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
        self.rank_set.release_all()
        self._end_ranks(REAP_WAIT, terminate=False)
        self._sweep_orphans()

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
        self.rank_ladder = self.rank_set.ladder(self._what(), self.grace, log, terminate=True, then_wait=0)
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

