"""A run driven by a thread of its own, so the cell that started it returns at once.

The thread runs the same engine call a foreground cell makes (``run.execute``
or ``DistributedSession.run_cell``) in a copy of the starting cell's context:
ipykernel 7 keeps the cell a message belongs to in a context variable, so the
live view's updates and the record still go to the cell that started the run
while other cells execute.  The thread only reads the run's own socket
(``Launcher.channel``); stopping goes through :class:`run.RunControl`, the
same escalation as the stop button.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Callable, Optional

from .run import RunControl, RunResult

log = logging.getLogger(__name__)


class BackgroundRun:
    """``target(control)`` in a daemon thread; its result or its error, once done."""

    def __init__(self, target: Callable[[RunControl], RunResult], name: str = "",
                 on_done: Optional[Callable[["BackgroundRun"], None]] = None, owner: object = None,
                 started: Optional[float] = None) -> None:
        self.control = RunControl()
        self.owner = owner   # whose ranks it runs on (a session), None for ranks of its own
        self.result: Optional[RunResult] = None
        self.error: Optional[BaseException] = None
        # The cell's start when given (its view counts from there too: one clock).
        self.started = started if started is not None else time.monotonic()
        self.ended: Optional[float] = None
        self._done = threading.Event()
        self._target = target
        self._lock = threading.Lock()
        self._callbacks: list[Callable[["BackgroundRun"], None]] = [on_done] if on_done is not None else []
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=context.run, args=(self._main,), daemon=True,
                                       name=f"accel_magics background {name}".strip())
        self.thread.start()

    def _main(self) -> None:
        try:
            self.result = self._target(self.control)
        except BaseException as exc:   # kept for wait(): it raises there, in the notebook
            self.error = exc
        finally:
            self.control.questions.close("the run has ended")
            self.ended = time.monotonic()
            with self._lock:
                self._done.set()
                callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                self._call(callback)

    def add_done_callback(self, fn: Callable[["BackgroundRun"], None]) -> None:
        """``fn(run)`` once the run is over, in the run's thread (at once, here,
        if it is over already), as ``concurrent.futures.Future`` does."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn) -> None:
        try:
            fn(self)
        except Exception:   # a view that could not update never breaks the run's ending
            log.exception("a background run's done callback failed")

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once the run is over (False: ``timeout`` passed first)."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        self.control.stop()
