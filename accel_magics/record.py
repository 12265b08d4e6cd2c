"""The plain-text record of a run: what stays in the notebook afterwards.

A consumer of engine events.  It keeps, per rank, the first and the last lines
(bounded memory however much a rank prints) and renders them grouped by rank,
``[rank N] ...``, followed by the final state of the tqdm bars left on
screen (``leave=True``; inner ``leave=False`` bars leave nothing, as in a
terminal), so the text is the same from run to run (live output
interleaves ranks in arrival order; the record does not).  Saved, reopened,
nbconvert-, papermill- and nbval-executed notebooks all show this text.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from accel_magics.kernel_ext.kernel import events as ev

HEAD_LINES = 200
TAIL_LINES = 800


@dataclass
class _RankLog:
    head: list = field(default_factory=list)
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    count: int = 0

    def add(self, line: str) -> None:
        self.add_block(line, 1)

    def add_block(self, text: str, count: int) -> None:
        """Lines joined by newlines, the last of ``count`` lines the rank wrote
        (the others were not sent: only the log has them, and the head was
        full already); only the ones kept are split out."""
        self.count += count
        room = HEAD_LINES - len(self.head)
        if room > 0:
            parts = text.split("\n", room)
            if len(parts) <= room:
                self.head.extend(parts)
                return
            self.head.extend(parts[:room])
            text = parts[room]
        self.tail.extend(text.rsplit("\n", TAIL_LINES)[-TAIL_LINES:])

    def lines(self) -> tuple[list, int]:
        omitted = self.count - len(self.head) - len(self.tail)
        return self.head + list(self.tail), omitted


class RunRecord:
    def __init__(self, log_path: str = "") -> None:
        self.logs: dict[int, _RankLog] = {}
        self.bars: dict[int, dict] = {}    # rank -> bar id -> its latest state, bars left on screen
        self.bar_lines: dict[int, set] = {}   # rank -> final lines of its finished bars (kept in its output)
        self.notes: list[str] = []
        self.failed_attempts: list = []   # the root cause of each attempt that failed
        self.log_path = log_path

    def __call__(self, event) -> None:
        if isinstance(event, ev.Output):
            self.logs.setdefault(event.rank, _RankLog()).add_block(event.text, event.count)
        elif isinstance(event, ev.RunStarted):
            for rank in event.ranks:
                self.logs.setdefault(rank, _RankLog())
            if event.nodes and not event.attempt:   # one kernel driving every node: which rank ran where
                self.notes.append(f"[accel_magics] {len(event.ranks)} ranks on {event.num_nodes} nodes: "
                                  f"{event.placement()}")
            if event.attempt:
                self.logs = {rank: _RankLog() for rank in event.ranks}
                self.bars = {}
                cause = self.failed_attempts[-1] if self.failed_attempts else None
                why = f" (attempt {event.attempt}: rank {cause.rank} failed: {cause.summary})" if cause else ""
                self.notes.append(f"[accel_magics] attempt {event.attempt + 1} of {event.max_restarts + 1}{why}: "
                                  "the output below is this attempt's")
        elif isinstance(event, ev.RunFinished):
            if event.root_cause is not None:
                self.failed_attempts.append(event.root_cause)
        elif isinstance(event, ev.Bar):
            kept = self.bars.setdefault(event.rank, {})
            if event.closed:
                # Gone, or left on screen: then the rank wrote its final line
                # into its output, in order with its prints (rank_bars).
                kept.pop(event.id, None)
                if event.leave:
                    self.bar_lines.setdefault(event.rank, set()).add(event.terminal_line)
            else:
                kept[event.id] = event     # open: its latest state, shown below the lines
        elif isinstance(event, ev.InputAnswered):   # the debugger session's transcript, in order with the output
            self.logs.setdefault(event.rank, _RankLog()).add(event.transcript())
        elif isinstance(event, ev.Quiet):   # a colleague reading the record learns it too
            self.notes.append(f"[accel_magics] {event.text()}")
        elif isinstance(event, ev.RankExited) and event.failure is not None:
            if event.failure.kind in ("signal", "exit"):
                self.logs.setdefault(event.rank, _RankLog()).add(event.failure.summary)

    def render(self) -> str:
        """The notes, then each rank's lines.  More than ``COMPACT_RANKS``
        ranks: ranks whose lines are the same are written once
        (``[ranks 1-7] ...``, the first one's lines; a finished bar's line is
        compared without its times), as the HTML record folds them."""
        out = list(self.notes)
        blocks: dict[tuple, list[int]] = {}
        for rank in sorted(self.logs):
            lines, omitted = self.logs[rank].lines()
            bars = tuple(bar.text for bar in sorted(self.bars.get(rank, {}).values(), key=lambda b: b.pos))
            finished = self.bar_lines.get(rank, set())
            same = tuple(ev.without_times(line) if line in finished else line for line in lines)
            key = (same, omitted, bars) if len(self.logs) > ev.COMPACT_RANKS else (rank,)
            blocks.setdefault(key, []).append(rank)
        for ranks in blocks.values():
            lines, omitted = self.logs[ranks[0]].lines()
            prefix = f"[{ev.ranks_label(ranks)}] "
            head = lines[:HEAD_LINES]
            out.extend(prefix + line for line in head)
            if omitted:
                where = f"; the full log is in {self.log_path}" if self.log_path else ""
                out.append(f"{prefix}... {omitted} lines omitted{where} ...")
            out.extend(prefix + line for line in lines[HEAD_LINES:])
            # Bars still open at the end, in their last state, below the lines (as a terminal ends).
            out.extend(prefix + bar.terminal_line
                       for bar in sorted(self.bars.get(ranks[0], {}).values(), key=lambda b: b.pos))
        return "\n".join(out) + ("\n" if out else "")
