"""The kernel's critical sections against its interrupt (issue 24 item 8: once, a
stop 5 ms into a cell made the next cell fail with ``KeyError: 'key'``).

The launcher's control frames (a run's spec, then its key) are written inside
``sigint_deferred``.  It blocked SIGINT on the main thread only; ipykernel's
process has other threads, so the kernel delivered the interrupt to one of
them, whose C handler flagged it, and the main thread raised KeyboardInterrupt
at its next bytecode, between the two frames: the launcher read the next
cell's frame as the key.  These tests make the interrupt land exactly there."""
from __future__ import annotations

import os
import select
import signal
import threading

import pytest

from accel_magics.kernel_ext.sigint import sigint_deferred

pytestmark = pytest.mark.timeout(30)


def _interrupt_from_another_thread_and_wait_for_its_c_handler():
    """Send the process a SIGINT (process-directed, as `kill` and Jupyter do) and
    return once its C-level handler ran (it writes to the wake-up fd)."""
    os.kill(os.getpid(), signal.SIGINT)
    return select.select([_WAKE[0]], [], [], 10)[0]


_WAKE = []


@pytest.fixture
def threaded_process(sigint_raises):
    """A second thread, as in a kernel, and a wake-up fd to see the C handler run."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    _WAKE[:] = [r]
    old_fd = signal.set_wakeup_fd(w)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        yield
    finally:
        stop.set()
        other.join()
        signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)


def test_an_interrupt_inside_the_block_waits_until_its_end(threaded_process):
    written = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            written.append("run frame")
            assert _interrupt_from_another_thread_and_wait_for_its_c_handler(), "the SIGINT never arrived"
            for _ in range(1000):      # bytecodes: where Python runs a pending signal's handler
                pass
            written.append("key frame")
    assert written == ["run frame", "key frame"]


def test_no_interrupt_no_exception_and_the_handler_is_restored(threaded_process):
    with sigint_deferred():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_outside_the_main_thread_it_is_a_plain_block():
    done = []

    def body():
        with sigint_deferred():
            done.append(True)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert done == [True]


def test_a_safe_point_raises_the_held_interrupt_there_and_the_block_end_does_not_again(threaded_process):
    """``held.deliver()``: a long block (the first write of a 1 GB global)
    lets the stop through between two chunks instead of at its end."""
    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred() as held:
            held.deliver()                      # nothing held yet: nothing happens
            done.append("chunk 1")
            assert _interrupt_from_another_thread_and_wait_for_its_c_handler(), "the SIGINT never arrived"
            for _ in range(1000):
                pass
            done.append("chunk 2")              # still held
            held.deliver()                      # raised here
            done.append("chunk 3")
    assert done == ["chunk 1", "chunk 2"]
    assert held.caught == [], "a frame kept by the handler (a cycle holding the cell's values)"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
