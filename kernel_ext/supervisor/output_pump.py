"""A supervisor's output pump: the ranks' output pipes to their logs and to the kernel.

Each rank's bytes go into its :class:`output_batch.OutputBatch`; a flush
(every ``FLUSH_INTERVAL``, or sooner when a batch grows past
``MAX_BATCH_BYTES``, or before an event of the rank so prints and events keep
the rank's order) writes every byte to the rank's log (:class:`RankLogs`) and
sends the kernel what it shows: bounded lines, without terminal escapes, an
excerpt's head and tail only where the run asked for one.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .output_batch import Excerpt, bound_text, shorten_lines, strip_escapes
from .rank_logs import RankLogs
from .rank_process import RankProcess, stacks_message
from .rank_set import RankSet
from ..timing import FLUSH_INTERVAL

MAX_BATCH_BYTES = 256 * 1024
CATCH_UP_READS = 64      # at most this many reads of one pipe at a time (a process the rank started may keep writing)


class OutputPump:
    """Output of every rank of a :class:`RankSet`, batched (see the module doc)."""

    def __init__(self, rank_set: RankSet, send: Callable[[dict], None]) -> None:
        self.rank_set = rank_set
        self.send = send
        self.logs = RankLogs("")
        self.due: Optional[float] = None   # the next flush

    def open_logs(self, log_dir: str) -> None:
        self.logs = RankLogs(log_dir)

    def set_excerpts(self, excerpt: Optional[tuple]) -> None:
        for r in self.rank_set.ranks:
            r.excerpt = Excerpt(*excerpt) if excerpt else None

    # -- reading ----------------------------------------------------------------------
    def read(self, r: RankProcess, kind: str, fd: int) -> bool:
        """Read one of the rank's output or stack pipes; False once nothing
        more is there (EAGAIN or EOF)."""
        data = self.rank_set.read(r, kind, fd)
        if not data:
            return False
        if kind == "out":
            self.feed(r, data)
        else:
            r.add_stack(data)
            r.stack_time = time.monotonic()
        return True

    def feed(self, r: RankProcess, data: bytes) -> None:
        r.output.feed(data)
        r.last_output = time.monotonic()
        if self.due is None:
            self.due = time.monotonic() + FLUSH_INTERVAL
        if r.output.bytes > MAX_BATCH_BYTES:
            self.flush()

    def drain(self, r: RankProcess) -> None:
        """Read what a rank's output and stack pipes hold now (until EAGAIN or EOF;
        bounded, in case a process the rank started keeps writing)."""
        for kind in ("out", "st"):
            for _ in range(CATCH_UP_READS):
                if kind not in r.fds or not self.read(r, kind, r.fds[kind]):
                    break

    def catch_up(self, r: RankProcess) -> None:
        """What the rank printed before it sent an event is in its output pipe
        already: read it (bounded) and send it first, so prints and events (a
        bar that closes after a print) reach the kernel in the rank's order."""
        drained = 0
        while "out" in r.fds and drained < CATCH_UP_READS and self.read(r, "out", r.fds["out"]):
            drained += 1
        self.flush()

    def drain_all(self) -> None:
        """Every rank's pipes read, its unfinished last line ended, all sent."""
        for r in self.rank_set.ranks:
            self.drain(r)
            r.output.end()
        self.flush()

    # -- sending ------------------------------------------------------------------------
    def flush(self) -> None:
        """Every byte to the rank's log; to the kernel, what it shows (bounded lines)."""
        self.due = None
        for r in self.rank_set.ranks:
            block, progress = r.output.take()
            logged = r.output.take_log()
            if logged:
                self.logs.write(r.rank, logged)
            if block is None and progress is None:
                continue
            parts = r.excerpt.select(block) if block is not None and r.excerpt is not None else [(0, block)]
            for i, (omitted, part) in enumerate(parts):
                self.send({"kind": "output", "rank": r.rank, "omitted": omitted,
                           "text": strip_escapes(shorten_lines(part)).decode("utf-8", "replace")
                           if part is not None else None,
                           "progress": progress if i == len(parts) - 1 else None})

    def on_time(self, now: float) -> None:
        if self.due is not None and now >= self.due:
            self.flush()

    def send_stack(self, r: RankProcess, sources: dict, when: str) -> None:
        """A rank's stacks (``when``: "the run was stopped", "the cell was
        stopped"): all of them to its log, bounded to the kernel."""
        msg = stacks_message(r, sources)
        self.logs.note(r.rank, f"--- stack when {when} ---\n" + msg["text"])
        self.send({**msg, "text": bound_text(msg["text"])})

    def note_failure(self, r: RankProcess, event: dict, summary: str) -> str:
        """A rank's failure: all of it to its log; ``event``'s texts bounded
        for the kernel (a rank can raise a 20 MB message); the bounded summary."""
        self.logs.note(r.rank, f"--- {summary} ---\n{event.get('traceback', '')}")
        event["message"] = bound_text(str(event.get("message", "")), head=20, tail=20)
        event["traceback"] = bound_text(str(event.get("traceback", "")))
        return bound_text(summary, head=20, tail=20)
