"""A supervisor's looks at its ranks while they run: their CPU and memory
(the view's rows), and, with ``--stall_timeout``, whether a quiet rank is
stuck (then the run is stopped) or only waits (then the user is told).
"""
from __future__ import annotations

import logging
from typing import Optional

from . import native_stacks
from .rank_process import RankProcess
from .rank_set import RankSet
from .resources import ResourceSampler
from ..timing import NATIVE_WAIT, RESOURCE_SAMPLE, STALL_CHECK

log = logging.getLogger("accel_magics.supervisor")
STALL_CPU = 0.05          # CPU seconds a rank must use in a look to count as moving


class StallWatch:
    """The looks of one supervisor (see the module doc); ``run`` is the
    supervisor: its spec, its channel (``send``), its stop."""

    def __init__(self, run, rank_set: RankSet) -> None:
        self.run = run
        self.rank_set = rank_set
        self.stall_check: Optional[float] = None
        self.resource_check: Optional[float] = None   # the next sample of the ranks' CPU and memory
        self.sampler = ResourceSampler()
        self.stall_judged = float("-inf")   # when quiet ranks were last judged (see check_stall)
        self.said_quiet: set[int] = set()   # ranks the user was told wait (once each)

    def begin(self, now: float, stall: bool) -> None:
        """A run or a cell starts: its own looks, its own quiet ranks."""
        self.stall_check = now + STALL_CHECK if stall else None
        self.resource_check = now + RESOURCE_SAMPLE
        self.stall_judged, self.said_quiet = float("-inf"), set()

    def end(self) -> None:
        self.stall_check = self.resource_check = None

    def on_time(self, now: float) -> None:
        if self.stall_check is not None and now >= self.stall_check:
            self.check_stall(now)
        if self.resource_check is not None and now >= self.resource_check:
            self.sample_resources(now)

    def check_stall(self, now: float) -> None:
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
        if self.run.stopping is not None:
            self.stall_check = None
            return
        if self.run.input.paused():   # a rank at a breakpoint: its peers wait for it, as under a terminal
            self.stall_judged = now
            return
        quiet = self._quiet_ranks(now)
        if quiet is None:
            return
        finished, running, seconds = quiet
        limit = self.run.spec["stall_timeout"]
        blocked = {r.rank: r.python_silent_for(now) for r in running}   # read at every check (see its doc)
        if seconds < limit or now < self.stall_judged + limit:
            return
        self.stall_judged = now
        # One dump for every rank whose interpreter still runs (py-spy runs them side by side).
        native = native_stacks.dump([r.pid for r in running if blocked[r.rank] < limit], NATIVE_WAIT)
        why = {r.rank: self._stuck(r, blocked[r.rank], limit, native) for r in running}
        if all(why.values()):
            self.run.send({"kind": "stalled", "ranks": [r.rank for r in running], "seconds": limit,
                           "finished": [r.rank for r in finished], "why": why})
            self.run.stop("stalled", stacks=True)
            return
        self._say_waiting([r for r in running if not why[r.rank]], finished, seconds)
        for r in running:
            r.native = ""   # a later verdict looks again; the stop's dump is taken then

    def sample_resources(self, now: float) -> None:
        """Each rank still in the cell: its CPU and memory, for its row in the view."""
        working = {r.rank: r.pid for r in self.rank_set.working()}
        if self.run.stopping is not None or not working:
            self.resource_check = None if self.run.stopping is not None else now + RESOURCE_SAMPLE
            return
        self.resource_check = now + RESOURCE_SAMPLE
        self.run.send({"kind": "resources", "ranks": self.sampler.sample(working)})

    def _quiet_ranks(self, now: float) -> Optional[tuple]:
        """(finished ranks, ranks still in the cell, how long the least quiet
        of these has used no CPU and printed nothing since a rank finished),
        or None while no rank finished, none runs, or one just exited."""
        finished = [r for r in self.rank_set.ranks if r.done]
        running = [r for r in self.rank_set.ranks if r.status is None and not r.done]
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
                    self.run.spec.get("run_id"), [r.rank for r in waiting], seconds,
                    [r.rank for r in finished], where)
        self.run.send({"kind": "quiet", "ranks": [r.rank for r in waiting], "seconds": round(seconds, 1),
                       "finished": [r.rank for r in finished], "where": where})

    def _stuck(self, r: RankProcess, blocked_for: float, limit: float, native: dict) -> Optional[str]:
        """Why nothing can move this quiet rank, or None if something may
        (``native``: the native stacks taken for this verdict, by pid)."""
        if blocked_for >= limit:
            return (f"its interpreter has not run Python for {blocked_for:.0f}s: a thread holds the GIL "
                    "in native code and does not return (a deadlock)")
        r.native = native.get(r.pid, "")
        return native_stacks.stuck_in(r.native)
