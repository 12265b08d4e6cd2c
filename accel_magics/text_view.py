"""The text view of a run: rank-tagged lines, live.

A consumer of engine events (``kernel_ext.kernel.events``), used for
``--output text``, in terminals and wherever widgets are unavailable.  Lines
read ``[rank N] ...``; carriage-return progress (tqdm) is throttled to one
state per rank per ``progress_interval`` seconds, so a progress bar does not
become thousands of lines; its final state arrives as a normal line.

Where the lines go is the ``live`` sink's business:

* :class:`StreamLive` prints them (terminal IPython, scripts).
* :class:`DisplayLive` (a Jupyter kernel) shows the latest lines in one
  display that it updates a few times per second, and empties when the run
  ends, because the magic then prints the run's grouped record
  (:mod:`accel_magics.record`).  The notebook shows the output once, and what
  it keeps is deterministic text (nbval ignores display updates).
"""
from __future__ import annotations

import sys
import time
from collections import deque
from typing import Optional, TextIO

from accel_magics.kernel_ext.kernel import events as ev
from accel_magics.kernel_ext.timing import TEXT_PROGRESS_EVERY, TEXT_REFRESH


class StreamLive:
    """Lines straight onto a text stream."""

    keeps_record = False

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self.stream = stream

    def write(self, lines: list[str]) -> None:
        out = self.stream or sys.stdout
        out.write("".join(line + "\n" for line in lines))

    def refresh(self) -> None:
        try:
            (self.stream or sys.stdout).flush()
        except (AttributeError, ValueError):
            pass

    def close(self) -> None:
        self.refresh()


class DisplayLive:
    """The latest lines in one updatable display (Jupyter), throttled.

    The display is created at the first line (empty, then updated), so a
    quiet cell costs no frontend message at all.
    """

    keeps_record = True

    def __init__(self, max_lines: int = 40, interval: float = TEXT_REFRESH, extra: Optional[dict] = None) -> None:
        self.max_lines = max_lines
        self.extra = dict(extra or {})   # more of the display's bundle, beside its text
        self.tail: deque = deque(maxlen=max_lines)
        self.interval = interval
        self.dirty = False
        self.last = 0.0
        self.handle = None

    def _data(self, text: str) -> dict:
        return {**self.extra, "text/plain": text}

    def write(self, lines: list[str]) -> None:
        self.tail.extend(lines)
        self.dirty = True
        if time.monotonic() - self.last >= self.interval:
            self.refresh()

    def refresh(self) -> None:
        if self.dirty:
            self.dirty = False
            self.last = time.monotonic()
            if self.handle is None:
                from IPython.display import display

                # Created empty, then updated: the output a notebook keeps (and
                # nbval compares, it ignores updates) does not depend on timing.
                self.handle = display(self._data(""), raw=True, display_id=True)
            self.handle.update(self._data("\n".join(self.tail)), raw=True)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update(self._data(""), raw=True)

    def open(self) -> None:
        """Make the display now (a background run: later, other cells run)."""
        if self.handle is None:
            from IPython.display import display

            self.handle = display(self._data(""), raw=True, display_id=True)

    def replace(self, text: str) -> None:
        """The display's final text (a background run's record)."""
        self.open()
        self.handle.update(self._data(text.rstrip("\n")), raw=True)


class TextView:
    def __init__(self, live=None, progress_interval: float = TEXT_PROGRESS_EVERY) -> None:
        self.live = live or StreamLive()
        self.progress_interval = progress_interval
        self._progress_at: dict[int, float] = {}
        self._last_cause = None

    def __call__(self, event) -> None:
        handler = getattr(self, "on_" + type(event).__name__, None)
        if handler is not None:
            handler(event)

    def on_RunStarted(self, e: ev.RunStarted) -> None:
        if e.attempt:
            cause = self._last_cause
            why = f"rank {cause.rank} failed: {cause.summary}; " if cause is not None else ""
            self.live.write([
                f"[accel_magics] {why}restarting the whole group: attempt {e.attempt + 1} of {e.max_restarts + 1}"
            ])

    def on_Phase(self, e: ev.Phase) -> None:
        """What a quiet rank is busy with ("importing accelerate"), once per
        change; only in a live display the record replaces (a terminal's or a
        script's output keeps what the ranks printed, nothing timing-dependent)."""
        if e.text and self.live.keeps_record:
            self.live.write([f"[rank {e.rank}] ({e.text})"])

    def on_Output(self, e: ev.Output) -> None:
        prefix = f"[rank {e.rank}] "
        keep = getattr(self.live, "max_lines", None)   # a display shows only its last lines
        lines = e.last_lines(keep) if keep else e.lines
        self.live.write([prefix + line for line in lines])
        self._progress_at.pop(e.rank, None)

    def _throttled(self, rank: int, force: bool = False) -> bool:
        now = time.monotonic()
        last = self._progress_at.get(rank)
        if force or last is None or now - last >= self.progress_interval:
            self._progress_at[rank] = now
            return True
        return False

    def on_ProgressLine(self, e: ev.ProgressLine) -> None:
        if self._throttled(e.rank):
            self.live.write([f"[rank {e.rank}] {e.text.strip()}"])

    def on_Progress(self, e: ev.Progress) -> None:
        if self._throttled(e.rank, force=e.total is not None and e.n >= e.total):
            total = f"/{e.total:g}" if e.total is not None else ""
            desc = f"{e.desc}: " if e.desc else ""
            self.live.write([f"[rank {e.rank}] {desc}{e.n:g}{total}"])

    def on_Bar(self, e: ev.Bar) -> None:
        """A tqdm bar: its state once per ``progress_interval`` per rank.  A closed
        bar: nothing here (one left on screen writes its final line into the
        rank's output itself)."""
        if e.closed:
            return
        if self._throttled(e.rank):
            self.live.write([f"[rank {e.rank}] {e.terminal_line}"])

    def on_InputRequested(self, e: ev.InputRequested) -> None:
        """A rank waits at its prompt: its lines so far are shown now (pdb's
        ``> file(line)`` among them), before the kernel waits in the input box."""
        self.live.refresh()

    def on_InputAnswered(self, e: ev.InputAnswered) -> None:
        """The debugger session's transcript: the prompt and what was typed."""
        self.live.write([e.text()])

    def on_RankExited(self, e: ev.RankExited) -> None:
        if e.failure is not None and e.failure.kind in ("signal", "exit"):
            self.live.write([f"[rank {e.rank}] {e.failure.summary}"])

    def on_Quiet(self, e: ev.Quiet) -> None:
        self.live.write([f"[accel_magics] {e.text()}"])

    def on_Waiting(self, e: ev.Waiting) -> None:
        if (e.joined, e.problem) != getattr(self, "_joined", None):
            self._joined = (e.joined, e.problem)
            self.live.write([f"[accel_magics] {e.text()}"])

    def on_Heartbeat(self, e: ev.Heartbeat) -> None:
        self.live.refresh()

    def on_RunFinished(self, e: ev.RunFinished) -> None:
        self._last_cause = e.root_cause
        self.live.refresh()
