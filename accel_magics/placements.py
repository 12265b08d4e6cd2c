"""Placements: where the ranks of a ``%%distributed`` run run.

``--launcher NAME`` picks one.  Built in: ``local`` (ranks forked on this
machine by the kernel's launcher process) and ``slurm`` (every node of the
Slurm allocation the kernel runs in).  More come as plug-ins: an installed
package declares a :class:`Placement` subclass as an entry point of the
group ``accel_magics.placements``, under the class's ``name``.  A plug-in is
imported when its name is looked up or the names are listed (``--launcher``'s
help, the config form); one that cannot be imported is left out with a
one-line warning that names it, and the built-ins go on working.

The smallest plug-in, a package ``myplug`` with::

    # myplug.py
    from accel_magics.placements import LocalPlacement

    class MinePlacement(LocalPlacement):
        name = "mine"

and in its ``pyproject.toml``::

    [project.entry-points."accel_magics.placements"]
    mine = "myplug:MinePlacement"

Once installed, ``%%distributed --launcher mine`` runs on it, in every mode:
one-shot, ``--background``, ``--max_restarts`` and sessions
(``%distributed_session start --launcher mine``).  A :class:`LocalPlacement`
subclass is constructed with the kernel's launcher (``self.launcher``); its
:meth:`~LocalPlacement.launch` starts each attempt (a session's start too),
so overriding it (``super().launch(...)`` with another ``cfg``) changes how
every mode starts its ranks.  A placement of ranks elsewhere subclasses
:class:`Placement` and :class:`Attempt`, and for sessions
:class:`SessionAttempt` (see their docs; ``slurm`` is one);
the magics run only ``LocalPlacement`` subclasses and ``slurm`` for now.

Looking placements up: :func:`find_placement` (the class of a name, or
:class:`PlacementNotFound`, whose message lists the known names and says how
to add one) and :func:`placement_names` (what ``--launcher`` takes).
"""
from accel_magics.kernel_ext.kernel.local_placement import LocalPlacement
from accel_magics.kernel_ext.kernel.placement import (GROUP, Attempt, Placement, PlacementNotFound, SessionAttempt,
                                                      PlacementRegistry, find_placement, placement_descriptions,
                                                      placement_names)

__all__ = ["Placement", "Attempt", "SessionAttempt", "LocalPlacement", "PlacementNotFound", "PlacementRegistry", "find_placement",
           "placement_names", "placement_descriptions", "GROUP"]
