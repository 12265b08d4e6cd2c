"""The kernel's interrupt (SIGINT) held back for a short critical section, so
a control frame or a received message is never cut in half, and a descriptor
just opened is always somebody's to close."""
from __future__ import annotations

import _signal   # the C functions: signal.signal wraps each call in enum conversions
import os
import signal
import threading


class Deferred:
    """SIGINT held from ``__enter__`` to ``__exit__`` (see :func:`sigint_deferred`).

    :meth:`deliver` is a safe point inside a long block (a loop over
    chunks): an interrupt that came meanwhile is raised there, not at the
    block's end.  A class, not a ``contextlib`` generator: about twenty
    blocks a cell, each would make and finish a generator.
    """

    __slots__ = ("caught", "previous")

    def __init__(self) -> None:
        self.caught: list = []       # the frames the signal arrived in
        self.previous = None         # the handler the block replaced (None: no swap, or delivered)

    def __enter__(self) -> "Deferred":
        if threading.current_thread() is threading.main_thread():
            # About twenty blocks a cell (each received message): the C calls, not
            # signal.signal, whose enum conversions cost the kernel 0.4 ms a cell.
            self.previous = _signal.signal(signal.SIGINT, self._record)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:   # not delivered at a safe point already
            self.deliver(always_restore=True)

    def _record(self, signum, frame) -> None:
        self.caught.append(frame)

    def release(self) -> bool:
        """End the hold without raising: the old handler is back; whether a
        press came meanwhile (the caller says what it meant)."""
        pressed = bool(self.caught)
        self.caught.clear()
        if self.previous is not None:
            previous, self.previous = self.previous, None
            _signal.signal(signal.SIGINT, previous)
        return pressed

    def deliver(self, always_restore: bool = False) -> None:
        """Raise the held interrupt now, if one came (the block is over for it)."""
        if self.previous is None or not (self.caught or always_restore):
            return
        previous, self.previous = self.previous, None
        _signal.signal(signal.SIGINT, previous)
        if self.caught:
            # The last frame the signal came in, none kept here: held frames
            # would make a cycle (the block's frame holds this object).
            frame = self.caught[-1]
            self.caught.clear()
            if callable(previous):
                previous(signal.SIGINT, frame)   # ipykernel's: raises KeyboardInterrupt here
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)   # what it would have done


def sigint_deferred() -> Deferred:
    """SIGINT is held inside the ``with`` block and delivered right after it
    (or at the block's own safe points: ``with sigint_deferred() as held:
    ... held.deliver()``); outside the main thread the block is plain.

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
    return Deferred()
