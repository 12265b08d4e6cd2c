"""Kernel side: hold the kernel's interrupt (SIGINT) back for a short critical
section, so a control frame or a received message is never cut in half."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def sigint_deferred():
    """SIGINT is blocked inside the block and delivered right after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
