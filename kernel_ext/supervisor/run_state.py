"""What a one-shot run's supervisor tells the launcher about its run.

The kernel hears a run's story over ZMQ.  The launcher (the zygote) needs
two facts, for the next run, each one byte on the supervisor's status pipe:

* FINISHED: a one-node run is over (its ranks parked or ending), so the
  launcher forks the next run's spare now, while the kernel shows the
  result: a cell sent as soon as this one ended ("Run All") finds it
  forked, its ranks too.
* RANKS_GONE: this run's ranks are gone, so nothing of it holds memory,
  ports or a GPU and the next run's ranks may start, while the supervisor's
  own exit (the teardown of a torch-sized process) overlaps that run.  The
  pipe's EOF (the supervisor exited, by any path) means it too.
"""
from __future__ import annotations

import enum
import os


class RunState(enum.Enum):
    FINISHED = b"f"
    RANKS_GONE = b"g"


def tell(fd: int, state: RunState) -> None:
    """Write ``state`` to the launcher; it may be gone (then nobody waits)."""
    if fd < 0:
        return
    try:
        os.write(fd, state.value)
    except OSError:
        pass
