"""One rank's output, from raw pipe bytes to batches of lines and progress.

The supervisor feeds it whatever a read returned; it keeps the unfinished
line, resolves carriage returns the way a terminal does (only what follows
the last ``\\r`` stays), cuts absurdly long lines into bounded pieces, and
hands out one batch at a time: the complete lines as one newline-joined
string (cheap to send, whatever the line count) plus the latest state of a
carriage-return line (a tqdm bar) if it changed.
"""
from __future__ import annotations

from typing import Optional

MAX_LINE_BYTES = 64 * 1024   # a longer line is cut into pieces: memory stays bounded


class OutputBatch:
    def __init__(self) -> None:
        self.pending = bytearray()   # the unfinished line
        self.lines: list[str] = []   # complete lines (or newline-joined blocks) not yet sent
        self.bytes = 0
        self._progress_sent = b""

    def feed(self, data: bytes) -> None:
        self.pending += data
        end = self.pending.rfind(b"\n")
        if end >= 0:
            block = bytes(self.pending[:end])
            del self.pending[:end + 1]
            if b"\r" in block:   # carriage returns: resolve line by line
                for line in block.split(b"\n"):
                    self._add_line(line)
            else:                 # the common case: the whole block at once
                self.lines.append(block.decode("utf-8", "replace"))
                self.bytes += len(block)
                self._progress_sent = b""
        while len(self.pending) > MAX_LINE_BYTES:
            self._add_line(bytes(self.pending[:MAX_LINE_BYTES]))
            del self.pending[:MAX_LINE_BYTES]

    def end(self) -> None:
        """The pipe is closed: an unfinished last line is a line."""
        if self.pending:
            self._add_line(bytes(self.pending))
            self.pending.clear()

    def _add_line(self, line: bytes) -> None:
        # A terminal shows only what follows the last carriage return.
        line = line.rstrip(b"\r")
        if b"\r" in line:
            line = line.rsplit(b"\r", 1)[1]
        self.lines.append(line.decode("utf-8", "replace"))
        self.bytes += len(line)
        self._progress_sent = b""

    def take(self) -> tuple[Optional[str], Optional[str]]:
        """(complete lines joined by newlines, new progress state); None where nothing new.

        A carriage return makes the unfinished line a progress state; other
        unfinished text waits for its newline, as on a terminal.
        """
        state = b""
        if b"\r" in self.pending:
            state = bytes(self.pending).rstrip(b"\r").rsplit(b"\r", 1)[-1]
        progress = None
        if state and state != self._progress_sent:
            progress = state.decode("utf-8", "replace")
            self._progress_sent = state
        text = "\n".join(self.lines) if self.lines else None
        self.lines, self.bytes = [], 0
        return text, progress
