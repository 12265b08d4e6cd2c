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

import re
from typing import Optional

from ..clip import clip

MAX_LINE_BYTES = 64 * 1024   # an unfinished line longer than this is cut: memory stays bounded
VIEW_LINE_BYTES = 4096        # the kernel is sent at most this much of any one line


def shorten_lines(block: bytes, limit: int = VIEW_LINE_BYTES) -> bytes:
    """``block`` with every line longer than ``limit`` bytes cut to ``limit``
    and a note of what was cut (the full line is in the rank's log).

    Linear in ``block``; a block no longer than ``limit`` is returned as is.
    """
    if len(block) <= limit:
        return block
    lines = block.split(b"\n")
    if max(map(len, lines)) <= limit:
        return block
    return b"\n".join(cut_line(line, 0, limit) if len(line) > limit else line for line in lines)


# Terminal control sequences: CSI (colours, cursor moves, erase), OSC (titles,
# links), and two-byte escapes.  No nested quantifiers: linear in the text.
_ESCAPES = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")


def strip_escapes(block: bytes) -> bytes:
    """What the notebook shows of a rank's output: its text without terminal
    control sequences (the rank's log keeps them).  Ranks get ``TERM=dumb``, so
    well-behaved libraries send none; colours forced anyway would otherwise
    show as boxes in the view and as garbage in the saved record."""
    return _ESCAPES.sub(b"", block) if b"\x1b" in block else block


def cut_line(line: bytes, extra: int = 0, limit: int = VIEW_LINE_BYTES) -> bytes:
    """At most ``limit`` bytes: the line's start (cut at a UTF-8 character
    boundary) and a note of how many bytes were left out (``extra`` more
    were never kept).  A cut line is not cut again by :func:`shorten_lines`."""
    if len(line) <= limit and not extra:
        return line
    end = min(limit - _NOTE_ROOM, len(line))
    while 0 < end < len(line) and (line[end] & 0xC0) == 0x80:   # do not split a character
        end -= 1
    return line[:end] + b"... [%d more bytes of this line are in the rank's log]" % (len(line) - end + extra)


_NOTE_ROOM = 64   # bytes cut_line leaves for its note


def bound_text(text: str, line_chars: int = VIEW_LINE_BYTES, head: int = 100, tail: int = 200) -> str:
    """A rank's traceback, message or stack as the kernel gets it: every line at
    most ``line_chars`` long, at most ``head`` + ``tail`` lines (the rank's log
    has the whole text).  Linear in ``text``."""
    if len(text) <= line_chars and text.count("\n") < head + tail:
        return text
    lines = text.split("\n")
    if len(lines) > head + tail:
        lines = lines[:head] + [f"... [{len(lines) - head - tail} more lines are in the rank's log] ..."] + lines[-tail:]
    def cut(line: str) -> str:
        head = clip(line, line_chars)
        return f"{head} [{len(line) - len(head) + 1} more characters are in the rank's log]"
    return "\n".join(line if len(line) <= line_chars else cut(line) for line in lines)


class OutputBatch:
    def __init__(self) -> None:
        self.pending = bytearray()   # the unfinished line (only its head once it is cut)
        self.cut = 0                 # bytes of the unfinished line beyond ``pending`` (logged already)
        self.blocks: list[bytes] = []   # complete lines (newline-joined blocks) not yet taken
        self.log: list[bytes] = []   # the exact bytes for the rank's log, in order
        self.bytes = 0
        self._progress_sent = b""

    def feed(self, data: bytes) -> None:
        end = data.rfind(b"\n")
        if end < 0:
            self._grow(data)
            return
        if self.cut:   # the end of a line that was too long to keep: the log has its start
            first = data.find(b"\n")
            self.log.append(data[:first + 1])
            self.blocks.append(cut_line(bytes(self.pending), self.cut + first))
            self.bytes += VIEW_LINE_BYTES
            self.pending.clear()
            self.cut = 0
            if first < end:
                self._complete(data[first + 1:end])
        else:
            self._complete(bytes(self.pending) + data[:end] if self.pending else data[:end])
            self.pending.clear()
        self._grow(data[end + 1:])

    def _grow(self, data: bytes) -> None:
        """More of the unfinished line; past MAX_LINE_BYTES it goes to the log only."""
        if not data:
            return
        if self.cut:
            self.log.append(data)
            self.cut += len(data)
            return
        self.pending += data
        if b"\r" in data:
            # A terminal shows only what follows the last carriage return (a
            # trailing one included, as in print(i, end="\r")): drop the rest.
            body = len(self.pending) - (len(self.pending) - len(self.pending.rstrip(b"\r")))
            cr = self.pending.rfind(b"\r", 0, body)
            if cr > 0:
                del self.pending[:cr]
        if len(self.pending) > MAX_LINE_BYTES:
            self.log.append(bytes(self.pending))
            self.cut = len(self.pending) - VIEW_LINE_BYTES
            del self.pending[VIEW_LINE_BYTES:]

    def _complete(self, block: bytes) -> None:
        """Complete lines (newline-joined, the final newline stripped)."""
        if b"\r" in block:   # carriage returns: resolve line by line, as a terminal shows them
            start = len(self.blocks)
            for line in block.split(b"\n"):
                self._add_line(line)
            self.log.append(b"\n".join(self.blocks[start:]))
        else:                 # the common case: the whole block at once
            self.log.append(block)
            self.blocks.append(block)
            self.bytes += len(block)
            self._progress_sent = b""
        self.log.append(b"\n")

    def end(self) -> None:
        """The pipe is closed: an unfinished last line is a line."""
        if self.cut:
            self.blocks.append(cut_line(bytes(self.pending), self.cut))
            self.log.append(b"\n")
        elif self.pending:
            self._add_line(bytes(self.pending))
            self.log.append(self.blocks[-1] + b"\n")
        self.pending.clear()
        self.cut = 0

    def _add_line(self, line: bytes) -> None:
        # A terminal shows only what follows the last carriage return.
        line = line.rstrip(b"\r")
        if b"\r" in line:
            line = line.rsplit(b"\r", 1)[1]
        self.blocks.append(line)
        self.bytes += len(line)
        self._progress_sent = b""

    def take_unfinished(self) -> bytes:
        """The unfinished last line, taken out of what is shown (a prompt:
        the rank reads its stdin after it); the log keeps it when a newline ends it."""
        if self.cut:
            return b""
        line = bytes(self.pending)
        self.log.append(line)
        self.pending.clear()
        return line

    def take_log(self) -> bytes:
        """The bytes for the rank's log since the last call (exact: every byte the
        rank wrote, in order, but the progress states that a newline did not end)."""
        data = b"".join(self.log)
        self.log.clear()
        return data

    def take(self) -> tuple[Optional[bytes], Optional[str]]:
        """(complete lines joined by newlines, new progress state); None where nothing new.

        A carriage return makes the unfinished line a progress state; other
        unfinished text waits for its newline, as on a terminal.
        """
        state = b""
        if not self.cut and b"\r" in self.pending:
            state = bytes(self.pending).rstrip(b"\r").rsplit(b"\r", 1)[-1][-VIEW_LINE_BYTES:]
        progress = None
        if state and state != self._progress_sent:
            progress = strip_escapes(state).decode("utf-8", "replace")
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
