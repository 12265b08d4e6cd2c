"""The one stop type (kernel_ext/stop_ladder.py), on real child processes:
a signal, a bounded wait, the next signal, the kill, each rung logged."""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from accel_magics.kernel_ext.stop_ladder import Rung, StopLadder

pytestmark = pytest.mark.timeout(60)

IGNORES_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
ENDS_ON_TERM = "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))"
BODY = "; print('ready', flush=True)\nwhile True: signal.pause()"


class Child:
    """A real child process, ready once it has set its SIGTERM handling."""

    def __init__(self, setup: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", setup + BODY], stdout=subprocess.PIPE)
        assert self.proc.stdout.readline() == b"ready\n"   # its handler is in place: the ladder may start
        self.pidfd = os.pidfd_open(self.proc.pid)

    def gone(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, seconds: float) -> None:
        """Until it exits, or ``seconds`` pass (its pidfd becomes readable at its exit)."""
        select.select([self.pidfd], [], [], seconds)

    def signal(self, sig: int):
        return lambda: self.proc.send_signal(sig)

    def close(self) -> None:
        if not self.gone():
            self.proc.kill()
            self.proc.wait()
        os.close(self.pidfd)
        self.proc.stdout.close()


@pytest.fixture
def child(request):
    made = []

    def make(setup: str) -> Child:
        made.append(Child(setup))
        return made[-1]

    yield make
    for c in made:
        c.close()


def said(caplog) -> list[str]:
    """What the ladder logged (other loggers of the process may log meanwhile)."""
    return [r.getMessage() for r in caplog.records if r.name == "test.stop_ladder"]


def term_then_kill(c: Child, grace: float) -> StopLadder:
    return StopLadder("test child", [Rung("SIGTERM", c.signal(signal.SIGTERM), grace),
                                     Rung("SIGKILL", c.signal(signal.SIGKILL), 10.0)], done=c.gone,
                      log=logging.getLogger("test.stop_ladder"))


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(child, caplog):
    c = child(IGNORES_TERM)
    caplog.set_level(logging.INFO, "test.stop_ladder")
    start = time.monotonic()
    assert term_then_kill(c, grace=0.5).run(c.wait)
    assert c.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - start >= 0.5   # the grace was given in full
    assert said(caplog) == ["test child: SIGTERM", "test child: SIGKILL"]


def test_a_child_that_ends_on_sigterm_is_never_killed_and_not_waited_for(child, caplog):
    c = child(ENDS_ON_TERM)
    caplog.set_level(logging.INFO, "test.stop_ladder")
    ladder = term_then_kill(c, grace=30.0)
    start = time.monotonic()
    assert ladder.run(c.wait)
    assert c.proc.returncode == 7 and ladder.climbed == 1
    assert time.monotonic() - start < 15.0   # its exit ended the wait, not the grace
    assert said(caplog) == ["test child: SIGTERM"]


def test_a_ladder_driven_by_a_loop_climbs_only_when_due(child):
    c = child(IGNORES_TERM)
    ladder = term_then_kill(c, grace=0.3)
    ladder.start()
    first_due = ladder.due
    ladder.on_time(first_due - 0.2)   # not due yet: nothing happens
    assert ladder.climbed == 1 and not c.gone()
    while not c.gone():
        c.wait(max(0.0, ladder.due - time.monotonic()) if ladder.due is not None else None)
        ladder.on_time(time.monotonic())
    assert ladder.climbed == 2 and c.proc.returncode == -signal.SIGKILL
    ladder.on_time(ladder.due)   # the kill's wait over: the stop is over, nothing more is due
    assert ladder.due is None and ladder.at_top


def test_asked_again_the_ladder_climbs_at_once(child):
    """The stop button's second press: the next rung now, not at its time."""
    c = child(IGNORES_TERM)
    ladder = term_then_kill(c, grace=60.0)
    ladder.start()
    assert not c.gone()
    assert ladder.climb()
    c.wait(30.0)
    assert c.gone() and c.proc.returncode == -signal.SIGKILL
    assert not ladder.climb()   # at the top: nothing more to climb


def test_a_stop_that_is_over_climbs_no_further(child):
    c = child(IGNORES_TERM)
    ladder = term_then_kill(c, grace=0.1)
    ladder.start()
    c.proc.kill()   # it ends by other means before the next rung is due
    c.proc.wait()
    ladder.on_time(ladder.due)
    assert ladder.climbed == 1 and ladder.due is None


def test_the_wait_is_bounded_when_the_stop_never_ends(child):
    """A ladder whose rungs do not end the process gives up at its top rung's
    wait and says so (the caller then knows something is left)."""
    c = child(IGNORES_TERM)
    ladder = StopLadder("test child", [Rung("SIGTERM", c.signal(signal.SIGTERM), 0.2),
                                       Rung("SIGTERM again", c.signal(signal.SIGTERM), 0.2)], done=c.gone)
    start = time.monotonic()
    assert not ladder.run(c.wait)
    assert 0.4 <= time.monotonic() - start < 15.0 and not c.gone()


def test_a_rung_without_an_action_only_waits_and_is_not_logged(child, caplog):
    c = child(ENDS_ON_TERM)
    caplog.set_level(logging.INFO, "test.stop_ladder")
    told = []

    def wait(seconds: float) -> None:
        """The first rung's wait: the child is told to end by itself only now,
        once the ladder has climbed it (told before, it could be gone before
        the ladder started, and no rung would be climbed)."""
        if not told:
            told.append(ladder.climbed)
            c.proc.send_signal(signal.SIGTERM)
        c.wait(seconds)

    ladder = StopLadder("test child", [Rung("ends by itself", None, 30.0),
                                       Rung("SIGKILL", c.signal(signal.SIGKILL))],
                        done=c.gone, log=logging.getLogger("test.stop_ladder"))
    assert ladder.run(wait) and told == [1]
    assert c.proc.returncode == 7 and ladder.climbed == 1 and not said(caplog)


def test_skipping_to_a_rung_passes_over_the_ones_below_and_never_goes_back(child, caplog):
    """The kernel's kill at --timeout: straight to the second rung, no stop first."""
    c = child(IGNORES_TERM)
    caplog.set_level(logging.INFO, "test.stop_ladder")
    stopped = []
    ladder = StopLadder("test child", [Rung("the stop", lambda: stopped.append(True), 60.0),
                                       Rung("SIGKILL", c.signal(signal.SIGKILL), 10.0)],
                        done=c.gone, log=logging.getLogger("test.stop_ladder"))
    assert ladder.skip_to(1)
    c.wait(30.0)
    assert c.gone() and c.proc.returncode == -signal.SIGKILL and not stopped
    assert not ladder.skip_to(0) and not ladder.skip_to(1) and ladder.climbed == 2
    assert said(caplog) == ["test child: SIGKILL"]


def test_skipping_to_a_rung_the_ladder_has_not_does_nothing():
    acted = []
    ladder = StopLadder("test", [Rung("one", lambda: acted.append(1), 5.0)], done=lambda: False)
    assert not ladder.skip_to(3) and ladder.climbed == 0 and ladder.due is None and not acted
    assert ladder.skip_to(0) and acted == [1]


def test_a_rung_whose_action_raises_still_keeps_its_wait():
    def fails():
        raise OSError("no such process")

    acted = []
    ladder = StopLadder("test", [Rung("fails", fails, 60.0), Rung("next", lambda: acted.append(1))],
                        done=lambda: False)
    with pytest.raises(OSError):
        ladder.start(now=100.0)
    assert ladder.climbed == 1 and ladder.due == 160.0
    ladder.on_time(130.0)
    assert not acted   # the next rung waits for the failed one's time
    ladder.on_time(160.0)
    assert acted == [1]


def test_a_rung_due_while_another_thread_climbs_waits_for_that_climbs_time():
    """The stop button (another thread) climbs while the reading thread's loop
    looks at what is due: the loop sees the new rung's time, never the old one."""
    import threading

    entered, release, acted = threading.Event(), threading.Event(), []

    def slow_stop():   # an in-band stop being sent
        entered.set()
        release.wait(30)

    ladder = StopLadder("test", [Rung("a plain wait", None, 0.0), Rung("the stop", slow_stop, 60.0),
                                 Rung("SIGKILL", lambda: acted.append("SIGKILL"))], done=lambda: False)
    ladder.start()                     # the first rung's wait (none) is over at once
    pressing = threading.Thread(target=ladder.climb)
    pressing.start()
    assert entered.wait(30)
    looking = threading.Thread(target=lambda: ladder.on_time(time.monotonic()))
    looking.start()
    looking.join(0.5)                  # without the ladder's lock it climbed to SIGKILL by now
    release.set()
    pressing.join(30)
    looking.join(30)
    assert not acted and ladder.climbed == 2 and ladder.due > time.monotonic() + 50
