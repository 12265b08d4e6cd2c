"""A failed rank held for a post-mortem: its frames alive, for at most ``--debug_hold`` seconds.

After a one-shot rank has reported its failure, it does not end at once
when its run asks for a hold (``spec["debug_hold"]``): it says so (the event
``{"kind": "held", "seconds": s}``) and waits on its go pipe, the pipe its
spec came on, with the exception's traceback (and so every frame in it)
still referenced.  The supervisor writes ``{"debug": True}`` there when the
user opens ``%distributed_debug``: pdb's post-mortem then runs in the
failing frame, reading the notebook's input box through the rank's stdin
(rank_stdin.py), as IPython's ``%debug`` does after an ordinary cell.  ``q``
(or any other end of the post-mortem) lets the rank end as a script that
raised.  The pipe's end (EOF: the next cell, the supervisor's end) or the
hold's own limit lets it end the same way.

Waiting is one blocked read: no CPU, nothing sent.  A rank that quit its
debugger (BdbQuit), was interrupted or called sys.exit() is not held:
there is nothing to look at that the user did not just see.
"""
from __future__ import annotations

import select
import sys
import time
from typing import Callable, Optional

from .. import wire
from ..timing import RANK_GRACE

#: Failures a post-mortem would not help with (see the module doc).
NOT_HELD = ("BdbQuit", "KeyboardInterrupt", "SystemExit")


def hold(exc: Optional[BaseException], seconds: float, go_fd: Optional[int], emit: Callable[[dict], bool]) -> None:
    """Hold the failed rank (see the module doc); returns once it may end."""
    tb = held_traceback(exc) if seconds and seconds > 0 and go_fd is not None else None
    if tb is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if not emit({"kind": "held", "seconds": seconds}):
        return
    if wanted(go_fd, time.monotonic() + seconds + RANK_GRACE):   # the supervisor's word first: it keeps the time
        post_mortem(tb)


def held_traceback(exc: Optional[BaseException]):
    """The cell's frames of ``exc`` (not the harness's), or None: nothing to hold."""
    if exc is None or type(exc).__name__ in NOT_HELD or exc.__traceback__ is None:
        return None
    return exc.__traceback__.tb_next


def wanted(go_fd: int, deadline: float) -> bool:
    """Wait for the supervisor's word: True for a post-mortem, False for the end (EOF, or the deadline)."""
    poller = select.poll()   # not select(): the fd may be past FD_SETSIZE in a rank that opened many files
    poller.register(go_fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return False
        frame = wire.read_frame(go_fd)
        if frame is None:
            return False
        if isinstance(frame, dict) and frame.get("debug"):
            return True
        # anything else (an answer to a question of the cell, late): not for the hold


def post_mortem(tb) -> None:
    """pdb's post-mortem at the bottom of ``tb`` (where the exception was
    raised), reading sys.stdin (the notebook's input box)."""
    import pdb

    class CellPdb(pdb.Pdb):
        def canonic(self, filename: str) -> str:
            """A notebook cell's code is named as the notebook names it
            (``Cell In[3]``, its lines in linecache), not made a path."""
            return filename if filename.startswith("Cell In[") else super().canonic(filename)

    debugger = CellPdb()
    debugger.reset()
    try:
        debugger.interaction(None, tb)
    except Exception as exc:   # the debugger's own failure must not hide the rank's
        print(f"accel_magics: the post-mortem ended: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
