"""The text view of a run: rank-tagged lines on the cell's stdout.

A consumer of engine events (``kernel_ext.events``), used for
``--output text``, in terminals and wherever widgets are unavailable.  Lines
appear as ``[rank N] ...``; carriage-return progress (tqdm) is throttled to
one state per rank per ``progress_interval`` seconds, so a progress bar does
not become thousands of lines; its final state arrives as a normal line.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from kernel_ext import events as ev


class TextView:
    def __init__(self, stream: Optional[TextIO] = None, progress_interval: float = 1.0) -> None:
        self.stream = stream
        self.progress_interval = progress_interval
        self._progress_at: dict[int, float] = {}
        self.world_size = 0

    @property
    def out(self) -> TextIO:
        return self.stream or sys.stdout

    def __call__(self, event) -> None:
        handler = getattr(self, "on_" + type(event).__name__, None)
        if handler is not None:
            handler(event)

    def on_RunStarted(self, e: ev.RunStarted) -> None:
        self.world_size = e.world_size
        if e.attempt:
            cause = getattr(self, "_last_cause", None)
            why = f"rank {cause.rank} failed: {cause.summary}; " if cause is not None else ""
            self.out.write(
                f"[accel_magics] {why}restarting the whole group: attempt {e.attempt + 1} of {e.max_restarts + 1}\n"
            )

    def on_Output(self, e: ev.Output) -> None:
        prefix = f"[rank {e.rank}] "
        self.out.write("".join(prefix + line + "\n" for line in e.lines))
        self._progress_at.pop(e.rank, None)

    def on_ProgressLine(self, e: ev.ProgressLine) -> None:
        now = time.monotonic()
        last = self._progress_at.get(e.rank)
        if last is None or now - last >= self.progress_interval:
            self._progress_at[e.rank] = now
            self.out.write(f"[rank {e.rank}] {e.text.strip()}\n")

    def on_Progress(self, e: ev.Progress) -> None:
        now = time.monotonic()
        last = self._progress_at.get(e.rank)
        done = e.total is not None and e.n >= e.total
        if done or last is None or now - last >= self.progress_interval:
            self._progress_at[e.rank] = now
            total = f"/{e.total:g}" if e.total is not None else ""
            desc = f"{e.desc}: " if e.desc else ""
            self.out.write(f"[rank {e.rank}] {desc}{e.n:g}{total}\n")

    def on_RankExited(self, e: ev.RankExited) -> None:
        if e.failure is not None and e.failure.kind in ("signal", "exit"):
            self.out.write(f"[rank {e.rank}] {e.failure.summary}\n")

    def on_RunFinished(self, e: ev.RunFinished) -> None:
        self._last_cause = e.root_cause
        try:
            self.out.flush()
        except (AttributeError, ValueError):
            pass
