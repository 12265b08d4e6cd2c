"""Finding and killing processes by the tree they form, from /proc.

Used by every process that must leave nothing behind: the supervisor (a
subreaper, it kills what its ranks leave), the launcher process (a subreaper
too, for what a killed supervisor leaves) and the kernel (for what outlived
the launcher itself: every process of a launcher carries its marker in its
environment).  No signal is sent to a process that is not ours: children,
their descendants, or processes carrying this launcher's own marker.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

MARKER = "ACCEL_MAGICS_LAUNCHER"   # environment variable: which launcher a process descends from


def kill_orphans(keep: set[int]) -> int:
    """SIGKILL this process's children that are not in ``keep`` (the ranks, or
    the supervisors), with everything below them: the orphans of exited ranks,
    reparented here because this process is a subreaper.  Returns how many."""
    found = children() - keep
    for pid in found:
        for victim in [pid, *descendants(pid)]:
            for kill in (os.kill, os.killpg):
                try:
                    kill(victim, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    return len(found)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children of any of their threads), by /proc."""
    found, frontier = [], [pid]
    while frontier and len(found) < 100_000:
        parent = frontier.pop()
        for child in children(parent):
            if child not in found:
                found.append(child)
                frontier.append(child)
    return found


_CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")   # CONFIG_PROC_CHILDREN


def children(pid: Optional[int] = None) -> set[int]:
    """The live children of ``pid`` (default: this process): from the kernel's
    per-thread lists, or by scanning /proc where the kernel keeps none."""
    me = os.getpid() if pid is None else pid
    if not _CHILDREN_FILES:
        return _children_by_scan(me)
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:   # gone
        return set()
    kids: set[int] = set()
    for task in tasks:
        try:
            with open(f"/proc/{me}/task/{task}/children") as f:
                kids.update(int(p) for p in f.read().split())
        except OSError:   # the thread ended meanwhile
            continue
    return kids


def _children_by_scan(me: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def marked_processes(token: str) -> list[int]:
    """Processes (other than this one) whose environment carries ``MARKER=token``.

    Every process forked from the launcher inherits its environment block,
    and every program started from one of them inherits the variable, so this
    finds the launcher's descendants even after they left its tree (setsid,
    double fork) or it died.
    """
    needle = f"{MARKER}={token}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def kill_marked(token: str) -> int:
    """SIGKILL every process that carries this launcher's marker; how many."""
    victims = marked_processes(token)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(victims)


def stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold
    spaces and parentheses): ``[0]`` the state letter, ``[11]``/``[12]`` user
    and system ticks, ``[13]``/``[14]`` those of reaped children, ``[21]``
    resident pages.  None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, a process that just died, does not)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")
