"""Which code runs a ``%%distributed`` cell.

A placement that is a :class:`LocalPlacement` (its ranks forked by the
kernel's launcher) runs in ``magics.py``.  A mode other than a run of its
own has its cells in :data:`CELL_MODES`: ``"session"`` (``--session`` cells,
the running session's ranks wherever they are placed, ``session_magic``).  A
placement that is not a LocalPlacement has its cells in
:data:`PLACEMENT_CELLS`, by its name: ``"slurm"`` (every node of the
allocation, ``slurm_magic``).  The modules that run them fill these in;
``magics.py`` imports neither (no cycle).
"""
from __future__ import annotations

from IPython.core.error import UsageError

from accel_magics.kernel_ext.kernel.local_placement import LocalPlacement
from accel_magics.kernel_ext.kernel.placement import PlacementNotFound, find_placement

#: mode name -> function(magics, args, line, cell, started) that runs such a cell.
CELL_MODES: dict = {}
#: placement name (not a LocalPlacement) -> function(magics, args, line, cell, started).
PLACEMENT_CELLS: dict = {}


def placement_class(name: str, nothing: str = "Nothing was launched.") -> type:
    """The placement class ``name`` (see kernel_ext/kernel/placement.py), or a
    UsageError that lists the known ones and says how to add one."""
    try:
        cls = find_placement(name)
    except PlacementNotFound as exc:
        raise UsageError(f"--launcher {name}: {exc}\n{nothing}") from None
    if not issubclass(cls, LocalPlacement) and name not in PLACEMENT_CELLS:
        raise UsageError(f"--launcher {name}: {cls.__module__}.{cls.__qualname__} is not a LocalPlacement, and "
                         f"only LocalPlacement subclasses and slurm can run cells for now. {nothing}")
    return cls
