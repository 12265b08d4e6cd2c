"""One stop, as a ladder: a signal, a bounded wait, the next signal, ..., the kill.

Every stop of the package has that shape (torch elastic's
``SubprocessContext._close`` is the model: SIGTERM, a bounded wait, SIGKILL,
each step logged).  A :class:`StopLadder` is its rungs, each an action and
how long the stop then gets to finish by itself before the next rung; the
times come from :mod:`kernel_ext.timing`, where ``check_order`` holds the
ladders' order.

A ladder is driven in one of two ways:

* by an event loop that has other work (a supervisor, the kernel reading a
  run's messages): :meth:`start` climbs the first rung, :attr:`due` is when
  the next one is, and :meth:`on_time` climbs what is due, unless the stop
  is already over (``done``);
* by a caller that only waits for the stop (:meth:`run`): each rung, then
  ``wait`` until the stop is over or the rung's time is up.

A rung without an action (``act=None``) is a plain wait: the stop may end by
itself (ranks told to end at their prompt).  Rungs that act are logged.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple, Optional, Sequence


class Rung(NamedTuple):
    """One step of a stop: ``act`` (None: nothing, only the wait), then up to
    ``wait`` seconds for the stop to be over before the next rung."""
    name: str
    act: Optional[Callable[[], None]]
    wait: float = 0.0


class StopLadder:
    """A stop's rungs, climbed in order (see the module doc)."""

    def __init__(self, what: str, rungs: Sequence[Rung], done: Callable[[], bool],
                 log: Optional[logging.Logger] = None) -> None:
        """``what``: the stop, as its log lines name it; ``done()``: the stop is
        over (every process it stops has exited), no further rung is needed."""
        self.what = what
        self.rungs = list(rungs)
        self.done = done
        self.log = log or logging.getLogger("accel_magics.stop_ladder")
        self.climbed = 0                   # how many rungs were climbed
        self.due: Optional[float] = None   # when the next rung is (None: not started, over or cancelled)
        # One climb at a time: a stop asked from another thread (the stop button
        # while the reading thread's loop climbs what is due) never climbs a
        # rung twice nor passes over one's wait.
        self._lock = threading.RLock()

    @property
    def started(self) -> bool:
        return self.climbed > 0

    @property
    def at_top(self) -> bool:
        """Every rung was climbed (the top one's wait may still run)."""
        return self.climbed >= len(self.rungs)

    def start(self, now: Optional[float] = None) -> None:
        """The first rung, unless the ladder was started already."""
        with self._lock:
            if not self.started:
                self.climb(now)

    def climb(self, now: Optional[float] = None) -> bool:
        """The next rung now, whatever its time (a stop asked again climbs
        sooner); False at the top."""
        with self._lock:
            if self.at_top:
                self.due = None
                return False
            now = time.monotonic() if now is None else now   # the wait counts from the rung, not from its action's end
            rung = self.rungs[self.climbed]
            self.climbed += 1
            last = self.at_top and not rung.wait   # a top rung with no wait: nothing more is due
            self.due = None if last else now + rung.wait   # set first: an action that raises still leaves its wait
            if rung.act is not None:
                self.log.info("%s: %s", self.what, rung.name)
                rung.act()
            return True

    def skip_to(self, index: int, now: Optional[float] = None) -> bool:
        """Rung ``index`` now, the rungs below it passed over (a stop that
        must be quick: the kernel's kill at --timeout); False, and nothing
        done, once the ladder is past that rung (or it has no such rung)."""
        with self._lock:
            if self.climbed > index or index >= len(self.rungs):
                return False
            self.climbed = index
            return self.climb(now)

    def on_time(self, now: float) -> None:
        """Climb the rung that is due, unless the stop is over (then no more are);
        the top rung's wait over, nothing is due any more."""
        with self._lock:
            if self.due is None or now < self.due:
                return
            if self.done():
                self.due = None
                return
            self.climb(now)

    def cancel(self) -> None:
        """No further rung (what it stopped is gone, or the stop is void)."""
        self.due = None

    def run(self, wait: Callable[[float], None]) -> bool:
        """Every rung until the stop is over, each followed by its wait;
        ``wait(seconds)`` waits at most that long for something to happen (a
        child's exit) and may return sooner.  True once the stop is over,
        False if it is not when the top rung's wait is."""
        while not self.done():
            if not self.climb():
                return False
            while self.due is not None and not self.done():
                left = self.due - time.monotonic()
                if left <= 0:
                    break
                wait(left)
        self.due = None
        return True
