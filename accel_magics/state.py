"""What the magics of one kernel share: :class:`MagicsState`.

One object holds it all (the kernel's launcher, the defaults set by
``%distributed_config``, the running session, the Slurm allocation's node
agents and the background runs), made once when the extension loads and
given to each Magics class that needs it.  The modules that run a kind of
cell (``session_magic``, ``slurm_magic``) read and change it through this
object, never through attributes of a Magics instance.
"""
from __future__ import annotations

import threading
from typing import Optional

from accel_magics.kernel_ext.kernel import post_mortem
from accel_magics.kernel_ext.kernel.launcher import Launcher
from accel_magics.kernel_ext.timing import BACKGROUND_END_WAIT


class MagicsState:
    """The kernel's run state, shared by ``%%distributed``, ``%distributed_config``,
    ``%distributed_session`` and ``%distributed_doctor``."""

    def __init__(self, launcher: Optional[Launcher] = None) -> None:
        self.launcher = launcher or Launcher()   # the kernel's launcher process (it forks every local rank)
        self.defaults: dict = {}   # set by %distributed_config or its form: on top of the DistributedMagics traits
        self.session = None        # the %distributed_session (kernel_ext.kernel.session.DistributedSession)
        self.slurm_agents = None   # the node agents of --launcher slurm (kernel_ext.kernel.slurm.SlurmAgents)
        self.slurm_busy = None     # the background cell that uses them now (their sockets are its thread's)
        self.background_runs: set = set()
        self.returned: dict = {}   # name -> id() of the value a session cell's --return assigned
        self.held = None           # the last failed run's ranks held for %distributed_debug (post_mortem.HeldRun)
        self.held_background: list = []   # failed background runs' held ranks (their handles' debug())
        self._held_lock = threading.Lock()   # a background run's thread adds to them

    # -- a failed run's held ranks ----------------------------------------------------
    def release_held(self) -> None:
        """Let the ranks held for a post-mortem go (the next cell: they hold memory, GPU memory too)."""
        with self._held_lock:
            held = [self.held, *self.held_background]
            self.held, self.held_background = None, []
        for one in held:
            post_mortem.release(one)

    def keep_held(self, held) -> None:
        """A background run's held ranks, let go with the others."""
        with self._held_lock:
            self.held_background.append(held)

    def keep_failed(self, held) -> None:
        """The ranks a failed cell's run holds (post_mortem.HeldRun; None:
        none): a foreground cell's for ``%distributed_debug``, a background
        run's for its handle's ``.debug()`` (both let go by the next cell)."""
        if held is not None and held.background:
            self.keep_held(held)
        elif held is not None:
            self.held = held

    # -- the Slurm allocation's node agents ------------------------------------
    def keep_agents(self, agents) -> None:
        """``agents`` serve the next Slurm cells."""
        self.slurm_agents = agents

    def drop_agents(self) -> None:
        """Close the agents (if any): the next Slurm cell starts fresh ones."""
        if self.slurm_agents is not None:
            self.slurm_agents.close()
        self.forget_agents()

    def forget_agents(self) -> None:
        """The agents are closed (they or srun had gone): the next Slurm cell starts fresh ones."""
        self.slurm_agents = None

    def agents_used_by(self, handle) -> None:
        """A background cell now reads the agents' sockets (one reader at a time)."""
        self.slurm_busy = handle

    # -- the session's names ------------------------------------------------------
    def note_returned(self, names, user_ns: dict) -> None:
        """The values a session cell's ``--return`` assigned in the notebook (by identity)."""
        for name in names:
            self.returned[name] = id(user_ns.get(name))

    def close(self) -> None:
        """Stop the background runs, forget the session, close the agents and the launcher."""
        runs = list(self.background_runs)
        for run in runs:
            run.stop()
        if self.slurm_agents is not None:
            for run in runs:   # their threads may hold the Slurm agents' sockets: done before those close
                run.wait(BACKGROUND_END_WAIT)
        self.session = None
        if self.slurm_agents is not None:
            self.slurm_agents.close()
        self.release_held()
        self.launcher.close()
