"""A rank's failure that a machine limit explains, told beside its root cause.

:func:`explain` is a plain function of the failure's text (its summary and
traceback) and of the ``/dev/shm`` size measured here; the patterns are the
messages torch, its DataLoader and NCCL print (recorded in
tests/test_doctor.py).
"""
from __future__ import annotations

import re
from typing import Optional

from .checks import SHM_FIX, size_text
from .probes import ShmUsage, shm_usage

_SHM = re.compile(
    r"unable to allocate shared memory\(shm\)"
    r"|unable to (?:write to|open|mmap|create) .*?</?(?:dev/shm/)?torch_[^>]*>.*?"
    r"(?:No space left on device|Cannot allocate memory|Bus error)"
    r"|Unexpected bus error encountered in worker"
    r"|DataLoader worker \(pid[^)]*\) is killed by signal: Bus error"
    r"|No space left on device[^\n]*/dev/shm|/dev/shm[^\n]*No space left on device",
    re.IGNORECASE)
_NCCL_SHM = re.compile(
    r"Error while (?:creating|attaching to) shared memory segment"
    r"|failed to extend /dev/shm/nccl"
    r"|NCCL WARN[^\n]*(?:/dev/shm|shm|posix_fallocate)",
    re.IGNORECASE)
_SIGBUS = re.compile(r"killed by (?:signal: )?(?:SIGBUS|Bus error)", re.IGNORECASE)
_FDS = re.compile(r"Too many open files|received 0 items of ancdata", re.IGNORECASE)


def _shm_text(shm: Optional[ShmUsage]) -> str:
    if shm is None or not shm.size:
        return "/dev/shm"
    return f"/dev/shm ({size_text(shm.size)}, {size_text(shm.free)} free now)"


def explain(text: str, shm: Optional[ShmUsage] = None) -> Optional[str]:
    """Why this failure happened, in one line with its fix, or None."""
    where = _shm_text(shm)
    if _NCCL_SHM.search(text):
        return (f"NCCL could not make its shared-memory buffers in {where}: the container's /dev/shm is too small "
                f"for NCCL (it asks for 1 GB). Fix: {SHM_FIX}; or NCCL_SHM_DISABLE=1 (slower).")
    if _SHM.search(text):
        return (f"{where} is full: DataLoader workers pass every batch to their rank through shared memory there, "
                f"and a container's default /dev/shm is 64 MB. Fix: {SHM_FIX}.")
    if _SIGBUS.search(text):
        return (f"a bus error (SIGBUS) is most often {where} running out under shared memory a process mapped "
                f"(DataLoader workers' batches, NCCL, multiprocessing.shared_memory). Fix: {SHM_FIX}.")
    if _FDS.search(text):
        return ("the process ran out of file descriptors (`ulimit -n`): torch shares tensors between processes "
                "through them. Fix: raise the limit in a cell (`import resource; resource.setrlimit("
                "resource.RLIMIT_NOFILE, (65536, 65536))`, within the hard limit), `docker run --ulimit "
                "nofile=65536:65536`, or torch.multiprocessing.set_sharing_strategy('file_system') in the cell.")
    return None


def explain_here(text: str) -> Optional[str]:
    """:func:`explain` with this machine's /dev/shm (the ranks' on one node)."""
    return explain(text, shm_usage())
