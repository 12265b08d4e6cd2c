"""A rank's standard input: the notebook's input box, as a terminal's stdin is a torchrun rank's.

Under torchrun every rank inherits the terminal's stdin, so ``input()``,
``breakpoint()`` and ``pdb.set_trace()`` read what the user types.  Here a
rank's ``sys.stdin`` is :class:`RankStdin`: reading a line flushes the
rank's output, sends the supervisor an ``input_request`` event (the
unfinished last line of the output is the prompt: ``(Pdb) ``, ``name? ``)
and waits for the answer on the rank's go pipe, the pipe its spec came on.
The supervisor relays the request to the kernel, which asks in the cell's
input box (the Jupyter stdin channel) and sends the line back, signed with
the run's key.  An answer of None is end of file: ``input()`` raises
``EOFError`` and pdb quits, as at a terminal's Ctrl-D.

Nothing here runs unless the cell reads its stdin: pdb, breakpoint() and
input() are Python's own, untouched (``PYTHONBREAKPOINT=0`` disables
``breakpoint()`` as it does anywhere).  File descriptor 0 stays
``/dev/null``: native code that reads the fd sees end of file.
"""
from __future__ import annotations

import io
import logging
import sys
import threading
from typing import Callable, Optional

from .. import wire

log = logging.getLogger("accel_magics.rank.stdin")


class RankStdin(io.TextIOBase):
    """``sys.stdin`` of a rank (see the module doc).

    ``emit``: sends the rank's event to its supervisor (False: it could not);
    ``fd``: the read end of the rank's go pipe, where answers come as frames
    ``{"input": seq, "line": str or None, "why": str}``.
    """

    def __init__(self, emit: Callable[[dict], bool], fd: Optional[int]) -> None:
        super().__init__()
        self._emit = emit
        self._fd = fd
        self._seq = 0
        self._lock = threading.Lock()   # one question at a time, whichever thread asks

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 0   # /dev/null underneath, for code that reads the fd directly

    @property
    def encoding(self) -> str:
        return "utf-8"

    def readline(self, size: Optional[int] = -1) -> str:
        with self._lock:
            line = self._ask()
        if size is not None and size >= 0:
            return line[:size]
        return line

    def read(self, size: Optional[int] = -1) -> str:
        """A terminal's read() returns what was typed up to end of file; here
        one answer is one line, so a read is a line (EOF: "")."""
        return self.readline(size)

    def readlines(self, hint: int = -1) -> list:
        lines = []
        while True:
            line = self.readline()
            if not line:
                return lines
            lines.append(line)

    def _ask(self) -> str:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        # Not the rank (a process the cell started), or its supervisor cannot be asked: end of file.
        if self._fd is None:
            return ""
        self._seq += 1
        if not self._emit({"kind": "input_request", "seq": self._seq}):
            return ""
        while True:
            answer = wire.read_frame(self._fd)
            if answer is None:   # the run is ending: end of file, as when a terminal goes away
                return ""
            if not isinstance(answer, dict) or answer.get("input") != self._seq:
                log.debug("an answer to an earlier question dropped: %r", answer)
                continue
            line = answer.get("line")
            if line is None:   # end of input (the supervisor's log and the kernel say why)
                return ""
            return line if line.endswith("\n") else line + "\n"
