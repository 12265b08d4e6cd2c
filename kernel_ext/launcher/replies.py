"""The launcher's replies to the kernel, in order and never blocking (see :mod:`.zygote`)."""
from __future__ import annotations

import os
import selectors

from .. import wire


class Replies:
    """Frames for the kernel on ``reply_fd`` (non-blocking).  They wait in
    :attr:`outbox` while the kernel's pipe is full: the kernel reads a
    preload's reply (every file it imported: 676 modules after an FSDP cell,
    over a pipe's 64 KB) only at its next cell, and a launcher blocked in that
    write reaped nothing, so every ended run's process stayed a zombie until
    then.  ``sel``: the launcher's selector, which watches ``reply_fd`` while
    frames wait."""

    def __init__(self, reply_fd: int, sel: selectors.BaseSelector) -> None:
        self.reply_fd = reply_fd
        self.sel = sel
        self.outbox = bytearray()

    def say_phase(self, text: str) -> None:
        """Before ready: what this process does now, for the first cell's view.
        A kernel gone meanwhile is found at the ready reply, not here."""
        try:
            self.send({"kind": "phase", "text": text})
        except OSError:
            self.outbox = bytearray()   # nothing more goes to a kernel that is gone

    def send(self, obj) -> None:
        """Send ``obj`` to the kernel, in order, never blocking (see outbox)."""
        self.outbox += wire.frame(obj)
        self.flush()

    def flush(self) -> None:
        """Write what the pipe takes now; the rest when it is writable again
        (the main loop watches it).  OSError: the kernel is gone."""
        while self.outbox:
            try:
                written = os.write(self.reply_fd, self.outbox)
            except BlockingIOError:
                break
            del self.outbox[:written]
        watching = self.reply_fd in self.sel.get_map()
        if self.outbox and not watching:
            self.sel.register(self.reply_fd, selectors.EVENT_WRITE, "reply")
        elif not self.outbox and watching:
            self.sel.unregister(self.reply_fd)
