"""The rank's re-asked interrupt, in a real forked process with its heartbeat
thread (rank/liveness.py) and the rank's own hook (rank/worker.py).

A KeyboardInterrupt that Python drops (raised in a fork handler or a
``__del__``) is asked for again through the heartbeat thread, which runs
the SIGINT handler once the main thread has let go of the GIL.  By then a
session rank may have moved on: the interrupt was dropped in the cell's last
finalizer, the cell ended, and the next cell began.  The interrupt was for
that cell only; carried into the next one it would stop a cell nobody
stopped."""
from __future__ import annotations

import os
import select
import signal
import sys
import time
import types

import pytest

from accel_magics.kernel_ext.rank import liveness, worker

pytestmark = pytest.mark.timeout(30)


def _rank_drops_an_interrupt_then(moves_on: str, report: int) -> None:
    """In the forked child: a session rank in cell "c1" whose KeyboardInterrupt
    was dropped; then it stays, ends the cell, or begins the next one, all
    before the heartbeat thread can take the GIL (a switch interval of 5 s:
    the main thread keeps it until it blocks).  It reports how often its
    SIGINT handler ran once the heartbeat has looked at the ask: two beats
    later (the thread beats at the top of each turn of its loop, so it had
    called ``interrupt_main`` or decided not to before the second one, and
    the handler runs at the main thread's next bytecode after that call)."""
    handled = []
    signal.signal(signal.SIGINT, lambda signum, frame: handled.append(signum))
    counter = liveness.new_counter()
    liveness.start(counter)
    sys.setswitchinterval(5.0)
    worker._cell_id, worker._cell_begun = "c1", True
    worker._unraisable_hook(types.SimpleNamespace(exc_type=KeyboardInterrupt, exc_value=KeyboardInterrupt(),
                                                  exc_traceback=None, err_msg=None, object=None))
    if moves_on == "back at its prompt":
        worker._cell_begun = False
    elif moves_on == "in the next cell":
        worker._cell_id = "c2"
    beats = liveness.read(counter)
    while liveness.read(counter) < beats + 2:   # releases the GIL: the heartbeat takes the ask
        time.sleep(0.001)
    os.write(report, str(len(handled)).encode())


@pytest.mark.parametrize("moves_on,handled", [
    ("still in the cell", 1),
    ("back at its prompt", 0),
    ("in the next cell", 0),
])
def test_a_dropped_interrupt_is_raised_again_only_in_the_cell_it_was_for(moves_on, handled):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _rank_drops_an_interrupt_then(moves_on, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert select.select([r], [], [], 20)[0], "the child never reported"
        assert os.read(r, 16) == str(handled).encode()
    finally:
        os.close(r)
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
