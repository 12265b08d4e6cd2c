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
import sys
import threading
import weakref
from typing import Optional

from .. import hooks

from ..timing import THREADS_NOTE_AFTER

log = logging.getLogger("accel_magics.rank")


#: The ``script_end`` hook is in place in this rank (see :func:`begin`).
on = False


def unsupported() -> Optional[str]:
    """The ``script_end`` hook's guard: the interpreter internals it calls."""
    for module, name in ((atexit, "_clear"), (atexit, "_run_exitfuncs"), (threading, "_shutdown"),
                         (weakref.finalize, "_registry"), (weakref.finalize, "_registered_with_atexit")):
        if not hasattr(module, name):
            return f"{getattr(module, '__name__', module)}.{name} is missing"
    return None


def begin() -> None:
    """At the rank's start, before the cell: nothing inherited runs at its end
    (the ``script_end`` hook; off, the rank ends with ``os._exit`` after the
    cell, as before it existed: no thread waited for, no handler run)."""
    global on
    on = hooks.install("script_end", _begin, guard=unsupported)


def _begin() -> None:
    atexit._clear()
    for inherited in list(weakref.finalize._registry):
        inherited.atexit = False   # the launcher's objects: not this rank's to finalize
    # ``finalize`` registers its exit hook once per process: again for the cell's own.
    weakref.finalize._registered_with_atexit = False


def _waited_for() -> list:
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def _say_waiting() -> None:
    names = ", ".join(repr(t.name) for t in _waited_for())
    if names:   # a cell that seems to hang after its last line says why
        print(f"accel_magics: the cell's code is done; this rank waits for its thread(s) {names} to end, as a "
              "Python script does at its end (threads started with daemon=True are not waited for)",
              file=sys.stderr, flush=True)


def end() -> None:
    """After a cell that succeeded, before its result is reported: wait for
    its non-daemon threads, then run its ``atexit`` handlers (an exception in
    one is printed and the others still run, as at a script's end)."""
    if not on:
        return
    note = None
    if _waited_for():
        note = threading.Timer(THREADS_NOTE_AFTER, _say_waiting)
        note.daemon = True   # not one of the threads waited for
        note.start()
    try:
        threading._shutdown()
    except Exception:   # pragma: no cover - a Python whose shutdown differs: the handlers still run
        log.exception("rank: waiting for the cell's threads failed")
    finally:
        if note is not None:
            note.cancel()
    atexit._run_exitfuncs()
