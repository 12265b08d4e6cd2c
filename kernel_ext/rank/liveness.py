"""Runs in a rank: a heartbeat that says the rank's interpreter can still run Python.

Why: the supervisor's stall check must tell a rank that merely waits from one
that nothing can move.  A rank that sleeps, waits for a subprocess or for a
socket has released the GIL, so this thread goes on counting; a rank where a
thread holds the GIL and blocks in native code (the deadlocked destructor of
pytorch#56297) stops it, because the count needs the GIL.  The count lives in
a page of shared memory the supervisor mapped before it forked the rank
(:func:`new_counter`), so reading it costs the supervisor nothing and the
rank no system call.
"""
from __future__ import annotations

import _thread
import mmap
import struct
import time

from ..timing import BEAT_INTERVAL

_FORMAT = "<Q"


def new_counter() -> mmap.mmap:
    """A shared anonymous page (MAP_SHARED): mapped before the fork, it is the
    same memory in the supervisor and the rank."""
    return mmap.mmap(-1, struct.calcsize(_FORMAT))


def read(counter: mmap.mmap) -> int:
    return struct.unpack_from(_FORMAT, counter)[0]


def start(counter) -> None:
    """In the rank, once its run is known: count while the interpreter runs.
    A thread of ``_thread``'s, not ``threading``'s: it is not the user's, so
    it is not in ``threading.enumerate()`` (code that joins every thread but
    its own would wait for it for ever); it never keeps the rank from
    exiting, and a process the rank forks (a DataLoader worker) has no copy
    of it.  The stacks the user reads leave it out by its frame (``_beat``)."""
    if counter is None:
        return
    struct.pack_into(_FORMAT, counter, 0, 1)   # the first beat before the thread runs: 0 means "not started"
    _thread.start_new_thread(_beat, (counter,))


def _beat(counter) -> None:
    n = 1
    while True:
        time.sleep(BEAT_INTERVAL)
        n += 1
        struct.pack_into(_FORMAT, counter, 0, n)
