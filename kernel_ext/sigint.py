"""The kernel's interrupt (SIGINT) held back for a short critical section, so
a control frame or a received message is never cut in half, and a descriptor
just opened is always somebody's to close."""
from __future__ import annotations

import _signal   # the C functions: signal.signal wraps each call in enum conversions
import contextlib
import os
import signal
import threading


class Deferred:
    """What :func:`sigint_deferred` yields: :meth:`deliver` is a safe point
    inside a long block (a loop over chunks), where an interrupt that came
    meanwhile is raised now instead of at the block's end."""

    def __init__(self) -> None:
        self.caught: list = []       # the frames the signal arrived in
        self.previous = None         # the handler the block replaced (None: no swap, not the main thread)

    def deliver(self) -> None:
        """Raise the held interrupt now, if one came (the block is over for it)."""
        if self.caught and self.previous is not None:
            _signal.signal(signal.SIGINT, self.previous)
            previous, self.previous = self.previous, None
            _call(previous, self._take())

    def _take(self):
        """The last frame the signal came in, and none kept here: held
        frames would make a cycle (the block's frame holds this object), and
        the cell's values in them would live until a garbage collection."""
        frame = self.caught[-1]
        self.caught.clear()
        return frame


def _call(previous, frame) -> None:
    if callable(previous):
        previous(signal.SIGINT, frame)   # ipykernel's: raises KeyboardInterrupt here
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)   # what it would have done


@contextlib.contextmanager
def sigint_deferred():
    """SIGINT is held inside the block and delivered right after it (or at
    the block's own safe points: ``with sigint_deferred() as held:
    ... held.deliver()``).

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
    held = Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    # About twenty blocks a cell (each received message): the C calls, not
    # signal.signal, whose enum conversions cost the kernel 0.4 ms a cell.
    held.previous = _signal.signal(signal.SIGINT, lambda signum, frame: held.caught.append(frame))
    try:
        yield held
    finally:
        if held.previous is not None:   # not delivered at a safe point already
            previous, held.previous = held.previous, None
            _signal.signal(signal.SIGINT, previous)
            if held.caught:
                _call(previous, held._take())
