"""Runs in a rank: the end of a one-shot cell is the end of a Python script.

Why: under torchrun the cell's code is a script, and a script's end waits
for the threads it started (non-daemon ones: an async checkpoint writer, an
upload) and then runs its ``atexit`` handlers (``wandb.finish``, a
``TemporaryDirectory`` cleanup, a logger's flush).  A rank ended with
``os._exit`` right after the cell, so those threads were killed mid-write
and the handlers never ran: files silently missing.  ``notebook_launcher``
(multiprocessing) waits for the threads too, as :func:`end` does, with
``threading._shutdown``: what multiprocessing's own process bootstrap calls,
which first lets ``concurrent.futures`` executors left open wind down (their
idle workers would otherwise be waited for for ever).

The handlers registered in the launcher before the fork (torch's, logging's)
are the launcher's, not the cell's: :func:`begin` drops them in the rank,
so only what the cell (or a module it imported) registered runs at the end.
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref

log = logging.getLogger("accel_magics.rank")


def begin() -> None:
    """At the rank's start, before the cell: nothing inherited runs at its end."""
    atexit._clear()
    for inherited in list(weakref.finalize._registry):
        inherited.atexit = False   # the launcher's objects: not this rank's to finalize
    # ``finalize`` registers its exit hook once per process: again for the cell's own.
    weakref.finalize._registered_with_atexit = False


def end() -> None:
    """After a cell that succeeded, before its result is reported: wait for
    its non-daemon threads, then run its ``atexit`` handlers (an exception in
    one is printed and the others still run, as at a script's end)."""
    try:
        threading._shutdown()
    except Exception:   # pragma: no cover - a Python whose shutdown differs: the handlers still run
        log.exception("rank: waiting for the cell's threads failed")
    atexit._run_exitfuncs()
