"""Placements: where a run's ranks run, and how a stop reaches them.

A run is a *mode* (one-shot, background, restarts, a session's cell) on a
*placement*.  The modes live in :mod:`run` (and :mod:`session`) and know
nothing of where ranks run; a placement knows nothing of modes.  The seam is
two small interfaces, as torch elastic's ``PContext`` (one API, processes or
subprocesses behind it) and ipyparallel's ``BaseLauncher`` (local, MPI, SSH,
Slurm, found through a registry):

* :class:`Placement` starts one *attempt* of a run: the ranks of every node
  it covers, on a fresh rendezvous (a fresh port, or a new round);
* :class:`Attempt` is the kernel's hold on that attempt: its verified
  messages in the one schema (:mod:`..wire.messages`), a stop routed to every
  node, where each rank runs, and its teardown.

Restarts are then the same loop on every placement (:func:`run.execute`):
a failure on any node ends the attempt on every node (each placement's job),
and the next attempt starts everywhere on a fresh rendezvous.

A new placement (SSH hosts, Kubernetes pods) is one subclass of each, with a
``name``: ``Placement.registry[name]`` finds it.
"""
from __future__ import annotations

import abc
import logging
from typing import ClassVar, Iterator, Optional

log = logging.getLogger("accel_magics.kernel.placement")


class Attempt(abc.ABC):
    """One attempt of a run on some placement, as the kernel sees it.

    ``ranks``: every global rank the kernel watches (rank 0's value comes from
    the first); ``node_of``: rank -> node name where ranks run on several
    nodes the kernel drives ({} otherwise); ``master_port``: the attempt's
    rendezvous port; ``session_cell``: a cell of a session (its ranks outlive it).
    """
    run_id: str
    master_port: int
    ranks: list
    node_of: dict
    finished: bool = False
    session_cell: bool = False
    forced: Optional[str] = None

    @abc.abstractmethod
    def messages(self, heartbeat: Optional[float] = None) -> Iterator[dict]:
        """The attempt's messages, verified, in order, until its ``finished``
        (a ``heartbeat`` message after ``heartbeat`` idle seconds).  When the
        kernel had to end it, the last is a ``finished`` with ``forced`` set.
        ``KeyboardInterrupt`` propagates: the caller interrupts and reads on."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """The stop button (safe from any thread): first call, every rank's
        stacks then a stop; later calls escalate to killing."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop now (SIGKILL if that is not answered)."""

    @abc.abstractmethod
    def close(self) -> None:
        """The attempt is over for the kernel: release what it holds."""


class Placement(abc.ABC):
    """Where ranks run: starts attempts (see the module doc)."""

    name: ClassVar[str] = ""
    registry: ClassVar[dict] = {}

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if cls.name:
            Placement.registry[cls.name] = cls

    @abc.abstractmethod
    def launch(self, cfg, payload, *, attempt: int = 0, log_dir: str = "", excerpt=None,
               events=None) -> Attempt:
        """Start attempt ``attempt`` of a run of ``payload`` with ``cfg``, on a
        fresh rendezvous.  ``events``: a socket of its own to read it on (a run
        read outside the kernel's main thread), where the placement has one."""

    def done(self, attempt: Attempt) -> None:
        """An attempt's messages are all read (bookkeeping; nothing by default)."""

    def learn_modules(self, modules: list) -> None:
        """Modules a run imported that were not preloaded (a placement that
        preloads may preload them next time; nothing by default)."""


class LocalPlacement(Placement):
    """Ranks forked on this machine by the kernel's launcher process; with
    ``--num_nodes`` > 1 it is one node of several, each driven by its own
    kernel (kernel per node), the nodes meeting at node 0's store."""

    name = "local"

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def launch(self, cfg, payload, *, attempt: int = 0, log_dir: str = "", excerpt=None, events=None) -> Attempt:
        handle = self.launcher.launch(cfg, payload, attempt=attempt, log_dir=log_dir, excerpt=excerpt,
                                      events=events, persistent=events is not None)
        log.info("run %s attempt %d: %d rank(s) on node %d of %d (supervisor pid %d, port %d)", handle.run_id,
                 attempt, cfg.num_processes, cfg.node_rank, cfg.num_nodes, handle.supervisor_pid,
                 handle.master_port)
        return handle

    def done(self, attempt: Attempt) -> None:
        self.launcher.live.pop(attempt.run_id, None)

    def learn_modules(self, modules: list) -> None:
        self.launcher.learn_modules(modules)
