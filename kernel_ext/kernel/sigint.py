"""Kernel side: hold the kernel's interrupt (SIGINT) back for a short critical
section, so a control frame or a received message is never cut in half."""
from __future__ import annotations

import _signal   # the C functions: signal.signal wraps each call in enum conversions
import contextlib
import os
import signal
import threading


@contextlib.contextmanager
def sigint_deferred():
    """SIGINT is held inside the block and delivered right after it.

    Why not ``pthread_sigmask``: it blocks the signal on the calling thread
    only.  A kernel has other threads (ipykernel's iopub, heartbeat, control),
    so the interrupt went to one of them, whose C handler flagged it, and the
    main thread raised KeyboardInterrupt at its next bytecode, inside the
    block: between a run's spec and its key, the launcher then read the next
    cell's frame as the key (``KeyError: 'key'``).  Python runs signal handlers
    on the main thread whichever thread the signal reached, so the handler
    itself is swapped for one that only remembers; the old one gets the
    signal when the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    # About twenty blocks a cell (each received message): the C calls, not
    # signal.signal, whose enum conversions cost the kernel 0.4 ms a cell.
    previous = _signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[-1])   # ipykernel's: raises KeyboardInterrupt here
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)   # what it would have done
