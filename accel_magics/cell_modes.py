"""Which code runs a ``%%distributed`` cell.

A placement that is a :class:`LocalPlacement` (its ranks forked by the
kernel's launcher) runs in ``magics.py``; the others have a cell mode of
their own, registered here by name: ``"slurm"`` (every node of the
allocation, ``slurm_magic``).  ``"session"`` is the mode of ``--session``
cells (the running session's ranks, ``session_magic``).  The modules that
run them fill :data:`CELL_MODES` in; ``magics.py`` imports neither (no cycle).
"""
from __future__ import annotations

from IPython.core.error import UsageError

from accel_magics.kernel_ext.kernel.placement import LocalPlacement, PlacementNotFound, find_placement

#: mode or placement name -> function(magics, args, line, cell, started) that runs such a cell.
CELL_MODES: dict = {}


def placement_class(name: str, nothing: str = "Nothing was launched.") -> type:
    """The placement class ``name`` (see kernel_ext/kernel/placement.py), or a
    UsageError that lists the known ones and says how to add one."""
    try:
        cls = find_placement(name)
    except PlacementNotFound as exc:
        raise UsageError(f"--launcher {name}: {exc}\n{nothing}") from None
    if not issubclass(cls, LocalPlacement) and name not in CELL_MODES:
        raise UsageError(f"--launcher {name}: {cls.__module__}.{cls.__qualname__} is not a LocalPlacement, and "
                         f"only LocalPlacement subclasses and slurm can run cells for now. {nothing}")
    return cls
