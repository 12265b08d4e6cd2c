"""The stop button during a ``%%distributed --background`` cell: one line, at any moment.

Such a cell takes milliseconds, and a press can land anywhere in it: as the
cell begins (IPython compiles it, before the magic runs), while the run is
prepared (its globals pickled: that must stay stoppable, a big global takes
seconds), as the run's thread starts, or as the handle is shown (the display
hook, after the magic returned).  Each ends in one line, never a traceback
through our frames:

* before the run exists: ``RunInterrupted`` "nothing ran";
* once it exists: the run is stopped (as ``h.stop()`` does) and the cell
  ends with a ``RunInterrupted`` line that says so.

So presses are held (:func:`sigint_deferred`) from the cell's start to the
magic's own start (:meth:`BackgroundStops.begin`), and from the moment the run
exists to the cell's end (``post_run_cell``); in between, the magic's body
takes them as ``KeyboardInterrupt`` and says "nothing ran".  Only a cell
that is the magic itself is held to its end: code that calls the magic and
goes on must stay stoppable.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

from accel_magics.kernel_ext.kernel.errors import RunInterrupted
from accel_magics.kernel_ext.sigint import Deferred, sigint_deferred


def is_background_cell(raw: str) -> bool:
    """Is this cell a ``%%distributed ... --background`` cell (the magic is the whole cell)?"""
    first = (raw or "").lstrip().split("\n", 1)[0].split()
    return bool(first) and first[0] == "%%distributed" and "--background" in first[1:]


class BackgroundStops:
    """The holds of one kernel (see the module doc)."""

    def __init__(self) -> None:
        self.cell = False                    # the running cell is a background magic cell
        self.opening: Optional[Deferred] = None   # held from the cell's start to the magic's
        self.closing: Optional[tuple] = None      # (hold, run, label): held from the run's start to the cell's end

    # -- IPython's events ----------------------------------------------------------
    def pre_run_cell(self, info) -> None:
        self._settle_left_over()
        self.cell = is_background_cell(getattr(info, "raw_cell", ""))
        if self.cell:
            self.opening = sigint_deferred().__enter__()

    def post_run_cell(self, result) -> None:
        """The cell is over: a press held since its run started stops that run,
        and is the cell's error (one line), as if the magic had raised it."""
        if not self.cell:
            return
        try:
            self._settle(result)
        finally:
            self._between_cells()

    def _settle(self, result) -> None:
        self.cell = False
        pressed_opening = self.opening is not None and self.opening.release()
        self.opening = None
        closing, self.closing = self.closing, None
        if closing is None:
            if pressed_opening:   # the magic never ran (an error before it): nothing ran
                self._report(result, RunInterrupted.before_start("the stop came as the cell began"))
            return
        hold, run, label = closing
        if hold.release() or pressed_opening:
            run.stop()
            self._report(result, stopped_as_it_started(label))

    @staticmethod
    def _between_cells() -> None:
        """What ipykernel does with SIGINT between cells (it ignores it), now
        rather than after it has sent the reply: a press that landed in
        ipykernel's own code after the cell (building, sending the reply) was
        "KeyboardInterrupt caught in kernel" and the cell's reply was never
        sent (3 stops in 40 at 5-30 ms into a background cell)."""
        from IPython import get_ipython

        between = getattr(getattr(get_ipython(), "kernel", None), "saved_sigint_handler", None)
        if between is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, between)

    # -- the magic's part ----------------------------------------------------------
    def begin(self) -> None:
        """The magic's body starts: a press since the cell began means nothing ran."""
        opening, self.opening = self.opening, None
        if opening is not None and opening.release():
            raise RunInterrupted.before_start("the stop came as the cell began")

    def hold_to_cell_end(self, hold: Deferred, run, label: str) -> None:
        """The run exists (its handle too): presses held since just before it
        began are settled at the cell's end, or now where this call is not
        the whole cell (then a press stops the run and raises here)."""
        if self.cell and self.closing is None:
            self.closing = (hold, run, label)
            return
        if hold.release():
            run.stop()
            raise stopped_as_it_started(label)

    def _settle_left_over(self) -> None:
        """A cell that never reached post_run_cell (silent cells skip it): let go."""
        if self.opening is not None:
            self.opening.release()
            self.opening = None
        if self.closing is not None:
            hold, run, _ = self.closing
            self.closing = None
            if hold.release():
                run.stop()

    @staticmethod
    def _report(result, exc: RunInterrupted) -> None:
        from IPython import get_ipython

        shell = get_ipython()
        if result is not None and getattr(result, "success", False) and shell is not None:
            shell.showtraceback((type(exc), exc, None))   # its _render_traceback_: the one line
            result.error_in_exec = exc                     # the reply says error: "Run All" stops here
        else:   # the cell failed already (its own error is shown): the stop's line beside it
            print(exc.report().rstrip("\n"), file=sys.stderr)


def stopped_as_it_started(label: str) -> RunInterrupted:
    return RunInterrupted({}, [], message=f"interrupted: the stop came as {label} started in the background, "
                                          "so its run was stopped (as its handle's .stop() does); its view "
                                          "says how it ended")
