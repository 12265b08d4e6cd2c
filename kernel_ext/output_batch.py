"""One rank's output, from raw pipe bytes to batches of lines and progress.

The supervisor feeds :class:`OutputBatch` whatever a read returned; it keeps
the unfinished line, resolves carriage returns the way a terminal does (only
what follows the last ``\\r`` stays), cuts absurdly long lines into bounded
pieces, and hands out one batch at a time: the complete lines as one
newline-joined block of bytes (cheap to log and to send, whatever the line
count) plus the latest state of a carriage-return line (a tqdm bar) if it
changed.

:class:`Excerpt` picks what of those batches the kernel needs when it keeps
only the first and the last lines of a rank (the notebook's views and
record): every byte still goes to the rank's log file, but a rank printing a
million lines does not make the kernel receive, verify and store them.
"""
from __future__ import annotations

from typing import Optional

MAX_LINE_BYTES = 64 * 1024   # a longer line is cut into pieces: memory stays bounded


class OutputBatch:
    def __init__(self) -> None:
        self.pending = bytearray()   # the unfinished line
        self.blocks: list[bytes] = []   # complete lines (newline-joined blocks) not yet taken
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
                self.blocks.append(block)
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
        self.blocks.append(line)
        self.bytes += len(line)
        self._progress_sent = b""

    def take(self) -> tuple[Optional[bytes], Optional[str]]:
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
        block = b"\n".join(self.blocks) if self.blocks else None
        self.blocks, self.bytes = [], 0
        return block, progress


class Excerpt:
    """The lines of one rank the kernel is sent: its first ``head`` lines,
    then at most the last ``tail`` lines of each batch.

    ``select`` returns ``(omitted, lines)`` pairs: ``omitted`` lines of the
    batch were left out just before ``lines`` (they are in the log file).
    Since the kernel keeps a rank's first ``head`` and last ``tail`` lines,
    what it shows is the same as if it had been sent everything.
    """

    def __init__(self, head: int, tail: int) -> None:
        self.head_left = head
        self.tail = max(1, tail)

    def select(self, block: bytes) -> list[tuple[int, bytes]]:
        count = block.count(b"\n") + 1
        parts = []
        if self.head_left:
            if count <= self.head_left:
                self.head_left -= count
                return [(0, block)]
            pieces = block.split(b"\n", self.head_left)
            parts.append((0, b"\n".join(pieces[:-1])))
            block, count, self.head_left = pieces[-1], count - self.head_left, 0
        if count > self.tail:
            kept = block.rsplit(b"\n", self.tail)
            parts.append((count - self.tail, b"\n".join(kept[1:])))
        else:
            parts.append((0, block))
        return parts
