"""The engine: no IPython, no widgets.  Its folders are the processes a run is made of.

::

    Jupyter kernel            kernel/       the magics' engine: launch, read and stop runs, sessions,
      |                                     background runs, the Slurm agents (kernel/slurm.py)
      +- launcher process     launcher/     one per kernel (or per node): imports torch once, forks
      |    |                                a supervisor per run ahead of time (zygote.py)
      |    +- supervisor      supervisor/   one per run: forks the ranks, streams and logs their
      |         |                           output, stops them, hosts the rendezvous (node 0)
      |         +- rank       rank/         one per rank: runs the cell (worker.py)
      +- srun -> node agent   node_agent/   --launcher slurm: one per node, runs that node's
                                            launcher process for the kernel

``wire/`` holds what travels between them (signed messages, frames, the
cell's payload); ``environment.py`` (the torchrun environment of a rank) and
``process_tree.py`` (finding what a run left) serve several of them.
"""
import os

#: This package's folder: frames of its own code are left out of the stacks users see.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def child_environment(env: dict) -> dict:
    """``env`` for a process this package starts with ``python -m`` (the launcher
    process, a node's agent): able to import this package even when the kernel
    found it through a path of its own (a checkout, an editable install)."""
    parent = os.path.dirname(PACKAGE_DIR)
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (parent, env.get("PYTHONPATH")) if p)}
