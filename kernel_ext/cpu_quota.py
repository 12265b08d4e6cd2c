"""How many CPUs this process may really use: its affinity and its cgroup's CPU quota.

``os.cpu_count()`` is the host's cores.  A container (Docker ``--cpus``,
Kubernetes ``resources.limits.cpu``) is limited by a CFS quota instead: with
``--cpus 1`` on a 64-core host, 64 threads per rank share one core's time.
The effective count is ``min(len(sched_getaffinity), ceil(quota / period))``
over the cgroup and its ancestors (a parent's limit binds its children), as
the JVM (JDK-8146115) and Go 1.25's runtime count it.  cgroup v2 keeps
``cpu.max`` ("max 100000" or "QUOTA PERIOD"); v1 ``cpu.cfs_quota_us`` (-1: none)
and ``cpu.cfs_period_us``.  Plain reads of /proc and /sys, a few files,
no process started; the roots are parameters so tests feed recorded trees.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Optional

from .timing import CPU_QUOTA_FRESH


@dataclass(frozen=True)
class CpuQuota:
    cores: float      # quota / period: 1.0 is one core's time
    source: str       # the file that set it ("/sys/fs/cgroup/cpu/x/cpu.cfs_quota_us")

    @property
    def whole(self) -> int:
        return max(1, math.ceil(self.cores - 1e-9))


#: This process's open quota files (see :func:`_read`): path -> fd, or None
#: where it could not be opened; ``_kept_pid``: the process they belong to
#: (a forked child opens its own: /proc/self was its parent's).
_kept: dict = {}
_kept_pid = 0


def _read(path: str, keep: bool = False) -> Optional[str]:
    """The file's text, stripped; None where it cannot be read.  Plain
    os.open/os.read: a cell reads up to five of these files, and Python's
    text files cost ~0.1 ms more for them when cold (between paced cells).

    ``keep``: the file stays open, and each later read is one ``pread`` at
    offset 0 (a cgroup or /proc file is generated afresh by each read from
    its start), not an open, two reads and a close; a file that could not
    be opened is not tried again until :func:`_forget_kept`."""
    if keep:
        return _read_kept(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return os.fsdecode(b"".join(chunks)).strip()


def _read_kept(path: str) -> Optional[str]:
    global _kept_pid
    if _kept_pid != os.getpid():   # a forked child: its copies of the parent's files are closed (/proc/self differs)
        _forget_kept()
        _kept_pid = os.getpid()
    if path not in _kept:
        try:
            _kept[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            _kept[path] = None
    fd = _kept[path]
    if fd is None:
        return None
    try:
        data = os.pread(fd, 65536, 0)
    except OSError:
        data = None
    if data is None or len(data) == 65536:   # gone (its cgroup was removed), or too long for one read
        _forget_kept()
        return _read(path)
    return os.fsdecode(data).strip()


def _forget_kept(but: str = "") -> None:
    """Close the kept files, all but ``but`` (its cgroups changed: other files, or the same ones made again)."""
    for path in [p for p in _kept if p != but]:
        fd = _kept.pop(path)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _v2_limit(directory: str, keep: bool = False) -> Optional[float]:
    text = _read(os.path.join(directory, "cpu.max"), keep)
    if not text:
        return None
    parts = text.split()
    if parts[0] == "max" or len(parts) < 2:
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(directory: str, keep: bool = False) -> Optional[float]:
    quota = _read(os.path.join(directory, "cpu.cfs_quota_us"), keep)
    period = _read(os.path.join(directory, "cpu.cfs_period_us"), keep)
    try:
        q, p = int(quota or -1), int(period or 0)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(fstype, options, root, mount point) of every cgroup mount."""
    found = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((tail[0], tail[2], fields[3], fields[4]))
    return found


def quota_from(proc_cgroup: str, mountinfo: str, root: str = "") -> Optional[CpuQuota]:
    """The tightest CPU quota over this process's cgroup and its ancestors;
    None where there is none.  ``proc_cgroup``: /proc/self/cgroup's text,
    ``mountinfo``: /proc/self/mountinfo's, ``root``: a prefix for the paths
    read (a recorded tree in tests)."""
    return _tightest(_limit_dirs(proc_cgroup, mountinfo, root), root)


def _tightest(limit_dirs: tuple, root: str = "", keep: bool = False) -> Optional[CpuQuota]:
    """The tightest quota the files in ``limit_dirs`` (see :func:`_limit_dirs`) set now; None: none.
    ``keep``: the files stay open for the next read (see :func:`_read`)."""
    best: Optional[CpuQuota] = None
    for v2, directories in limit_dirs:
        limit = _v2_limit if v2 else _v1_limit
        for directory in directories:
            cores = limit(directory, keep)
            if cores is not None and (best is None or cores < best.cores):
                best = CpuQuota(cores, os.path.join(directory[len(root):] or "/",
                                                    "cpu.max" if v2 else "cpu.cfs_quota_us"))
    return best


def _limit_dirs(proc_cgroup: str, mountinfo: str, root: str) -> tuple[tuple[bool, tuple[str, ...]], ...]:
    """Where the limits are: (cgroup v2?, the cgroup's directory and its
    ancestors up to the mount point) for each CPU hierarchy (:func:`cpu_quota`
    keeps this process's until its cgroups change)."""
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        v2 = controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        for fstype, options, mount_root, mount_point in _mounts(mountinfo):
            if v2 != (fstype == "cgroup2") or (not v2 and "cpu" not in options.split(",")):
                continue
            # In a container the mount's root is the container's own cgroup: the
            # path /proc gives is relative to the host's hierarchy.
            rel = path[len(mount_root):] if mount_root != "/" and path.startswith(mount_root) else path
            if mount_root != "/" and not path.startswith(mount_root):
                rel = "/"
            directory = os.path.normpath(root + mount_point + "/" + rel.lstrip("/"))
            top = os.path.normpath(root + mount_point)
            if not os.path.isdir(directory):
                directory = top
            chain = [directory]
            while directory != top and len(directory) > len(top):
                directory = os.path.dirname(directory)
                chain.append(directory)
            found.append((v2, tuple(chain)))
    return tuple(found)


_found_dirs: tuple = ("", ())   # (/proc/self/cgroup's text, the limit directories it gave)


def cpu_quota() -> Optional[CpuQuota]:
    """This process's CPU quota, or None (no limit, or not Linux).  The quota
    files are read each time (``docker update`` changes them); the mount
    table only when the process's cgroups differ from the last read (it
    moved), since the directories come from both.  The files read each time
    stay open (one ``pread`` each: a cell reads them once, on its way to
    its ranks' start)."""
    global _found_dirs
    cgroup = _read("/proc/self/cgroup", keep=True)
    if not cgroup:
        return None
    if cgroup != _found_dirs[0]:
        _forget_kept(but="/proc/self/cgroup")
        mountinfo = _read("/proc/self/mountinfo")
        if not mountinfo:
            return None
        _found_dirs = (cgroup, _limit_dirs(cgroup, mountinfo, ""))
    return _tightest(_found_dirs[1], keep=True)


def affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


_READ = object()


_last_read: tuple = (-float("inf"), 0)   # (when, the count): this process's last read


def effective_cpus(quota=_READ, affinity: Optional[int] = None) -> int:
    """The CPUs this process may use: its affinity, capped by the quota
    (read here unless given; None: no quota).  A count read from this
    process's files is reused for ``CPU_QUOTA_FRESH`` seconds (a cell asks
    several times; a quota changed by ``docker update`` is seen by the next
    cell)."""
    global _last_read
    read_here = quota is _READ and affinity is None
    if read_here and time.monotonic() - _last_read[0] < CPU_QUOTA_FRESH:
        return _last_read[1]
    affinity = affinity_count() if affinity is None else affinity
    quota = cpu_quota() if quota is _READ else quota
    count = max(1, min(affinity, quota.whole) if quota is not None else affinity)
    if read_here:
        _last_read = (time.monotonic(), count)
    return count
