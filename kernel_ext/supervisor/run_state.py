"""What a one-shot run's supervisor tells the launcher about its run.

The kernel hears a run's story over ZMQ.  The launcher (the zygote) needs
one fact, for the next run: this run's ranks are gone, so nothing of it holds
memory, ports or a GPU and the next run's ranks may start, while the
supervisor's own exit (the teardown of a torch-sized process) overlaps that
run.  It is one byte on the supervisor's status pipe; the pipe's EOF (the
supervisor exited, by any path) means it too.
"""
from __future__ import annotations

import enum
import os


class RunState(enum.Enum):
    RANKS_GONE = b"g"


def tell(fd: int, state: RunState) -> None:
    """Write ``state`` to the launcher; it may be gone (then nobody waits)."""
    if fd < 0:
        return
    try:
        os.write(fd, state.value)
    except OSError:
        pass
