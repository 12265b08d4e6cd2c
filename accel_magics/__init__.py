"""accel_magics: run distributed PyTorch from a Jupyter cell.

In a notebook::

    %load_ext accel_magics

    %%distributed --num_processes 2
    import torch.distributed as dist
    dist.init_process_group("gloo")
    ...

Loading the extension registers the magics, starts the launcher process in
the background (it imports torch while you work) and starts recording where
CUDA/XPU get initialised in the kernel, so the pre-flight check can point at
the cell that did it.
"""
from __future__ import annotations

from typing import Optional

__version__ = "0.1.0"
__all__ = ["load_ipython_extension", "unload_ipython_extension", "progress"]

_magics = None
_registered: list = []   # the Magics instances registered with IPython (unload takes their names back)


def load_ipython_extension(ip) -> None:
    global _magics
    from .kernel_ext import hooks
    from .magics import DistributedMagics
    from . import slurm_magic  # noqa: F401  (its cells: cell_modes.PLACEMENT_CELLS["slurm"])
    from .debug_magic import DebugMagics
    from .doctor_magic import DoctorMagics
    from .session_magic import SessionMagics
    from .state import MagicsState

    if _magics is not None:
        return
    state = MagicsState()   # what the magics share: the launcher, the defaults set, the session, the Slurm agents
    magics = DistributedMagics(ip, state=state)   # its traits: the IPython config's defaults
    _registered[:] = [magics, SessionMagics(ip, magics, state), DoctorMagics(ip, magics, state),
                      DebugMagics(ip, state)]
    for instance in _registered:
        ip.register_magics(instance)
    ip.events.register("post_run_cell", magics.post_run_cell)
    ip.events.register("pre_run_cell", magics.stops.pre_run_cell)
    ip.events.register("post_run_cell", magics.stops.post_run_cell)
    hooks.install("cuda_watch", magics.tracker.install, guard=magics.tracker.unsupported)
    _magics = magics
    try:
        state.launcher.start()   # torch loads in the background meanwhile
    except Exception as exc:      # the first cell tries again, and says why if it fails
        import warnings

        warnings.warn(f"accel_magics: {exc}", RuntimeWarning, stacklevel=2)


def unload_ipython_extension(ip) -> None:
    global _magics
    if _magics is None:
        return
    for event, callback in (("post_run_cell", _magics.post_run_cell),
                            ("pre_run_cell", _magics.stops.pre_run_cell),
                            ("post_run_cell", _magics.stops.post_run_cell)):
        try:
            ip.events.unregister(event, callback)
        except ValueError:
            pass
    _magics.close()
    _magics = None
    _unregister_magics(ip)


def _unregister_magics(ip) -> None:
    """Take our magics' names back: IPython has no call for it, and a
    ``%%distributed`` after ``%unload_ext`` would otherwise reach an extension
    that has shut down.  Then it is IPython's plain "not found", and
    ``%load_ext`` registers them again."""
    manager = ip.magics_manager
    for instance in _registered:
        if instance in getattr(ip, "configurables", []):   # %config would still set (and list) it
            ip.configurables.remove(instance)
        for kind, names in instance.magics.items():
            table = manager.magics.get(kind, {})
            for name in names:
                if getattr(table.get(name), "__self__", None) is instance:
                    del table[name]
        if manager.registry.get(type(instance).__name__) is instance:
            del manager.registry[type(instance).__name__]
    _registered.clear()
_registered: list = []   # the Magics instances registered with IPython (unload takes their names back)


def progress(n: float, total: Optional[float] = None, desc: str = "") -> None:
    """Report progress from inside a rank (for loops without tqdm).

    Outside a ``%%distributed`` cell it does nothing, so code that calls it
    runs unchanged anywhere.
    """
    from accel_magics.kernel_ext.rank import worker

    worker.emit({"kind": "progress", "n": n, "total": total, "desc": desc})
