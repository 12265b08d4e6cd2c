"""Supervisor side: where a rank is, native frames included, and whether it moves.

A rank stuck in native code (a GIL deadlock in a destructor, a collective
that never completes) shows nothing useful in its Python stack: one line of
the cell.  :func:`dump` asks py-spy (``py-spy dump --native``), else gdb, for
every thread's native and Python frames, for several ranks at once, bounded
in time.  The rank allows its supervisor's helpers to attach
(:func:`allow_supervisor_to_trace`, for Yama's ptrace_scope 1).

:func:`cpu_seconds` is how the supervisor tells a stalled rank (no CPU, no
output) from a busy one.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional

from .. import PACKAGE_DIR, hooks
from ..clip import clip
from ..doctor import probes
from ..process_tree import descendants, stat_fields
from ..timing import NATIVE_WAIT

PR_SET_PTRACER = 0x59616D61
_PLAIN_ENV = {**{k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE", "PY_COLORS")},
              "NO_COLOR": "1", "TERM": "dumb"}
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_OWN = (PACKAGE_DIR + os.sep, "kernel_ext/", "<frozen runpy>", "(runpy.py:")


def allow_supervisor_to_trace(supervisor_pid: int) -> None:
    """In a rank: let the supervisor and its children (py-spy) attach to it."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PTRACER, supervisor_pid, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - non-Linux; no Yama: not needed
        pass


#: The ``native_stacks`` hook is in place (decided in the launcher, inherited).
on = False


def unsupported() -> Optional[str]:
    """The ``native_stacks`` hook's guard: a tool, and ptrace allowed to this user."""
    if tool() is None:
        return "neither py-spy nor gdb is installed"
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        scope = 0
    if scope >= 2 and not probes.has_cap_sys_ptrace():
        return (f"ptrace is restricted (kernel.yama.ptrace_scope={scope}): no process may read another's "
                "stacks without CAP_SYS_PTRACE")
    probe, _probe[:] = (_probe or [None])[0], []
    return probes.ptrace_refused(probe)   # a real attach: a missing capability, a seccomp filter (containers)


_probe: list = []   # the launcher's probe, started before it imports torch (start_probe)


def start_probe() -> None:
    """In the launcher, first thing: the ptrace probe runs while torch imports."""
    _probe[:] = [probes.PtraceProbe()]


def install() -> bool:
    """In the launcher: decide :data:`on` for every supervisor it forks."""
    global on

    def take() -> str:
        global on
        on = True
        return " ".join(tool()[:1])

    on = False
    try:
        return hooks.install("native_stacks", take, guard=unsupported)
    finally:
        for probe in _probe:   # not asked (turned off, no tool): still reaped, no zombie is left
            probe.refused()
        _probe.clear()


def tool() -> Optional[list[str]]:
    """The command prefix that dumps a process's native stacks, or None."""
    spy = shutil.which("py-spy") or _beside_python("py-spy")
    if spy:
        return [spy, "dump", "--native", "--pid"]
    gdb = shutil.which("gdb")
    if gdb:
        return [gdb, "-batch", "-nx", "-ex", "set pagination off", "-ex", "thread apply all bt", "-p"]
    return None


def _beside_python(name: str) -> Optional[str]:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else None


def dump(pids: list[int], timeout: float = NATIVE_WAIT) -> dict[int, str]:
    """{pid: native stack text} for each pid that could be dumped within ``timeout``."""
    command = tool() if on else None
    if not command or not pids:
        return {}
    procs = {}
    for pid in pids:
        try:
            procs[pid] = subprocess.Popen(command + [str(pid)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True, env=_PLAIN_ENV)
        except OSError:
            continue
    deadline = time.monotonic() + timeout
    out = {}
    for pid, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            continue
        if proc.returncode == 0 and text:
            out[pid] = trim(text.decode("utf-8", "replace"))
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: The rank's heartbeat thread (rank/liveness.py, started with _thread: py-spy
#: knows no name for it) is known by its loop's frame.
_HEARTBEAT_FRAME = re.compile(r"^\s*(?:[\w.<>]+\.)?_?beat \((?:.*/)?liveness\.py:\d+\)$")
_SYMBOL_CHARS = 160
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+$")


def trim(text: str) -> str:
    """py-spy's dump without its header, colours, accel_magics' own frames and
    the rank's heartbeat thread, with C++ template arguments folded (a
    pybind11 frame is kilobytes long)."""
    blocks: list[list[str]] = [[]]   # one per thread (py-spy starts each with "Thread ")
    for line in _ANSI.sub("", text).splitlines():
        if line.startswith("Thread "):
            blocks.append([])
        blocks[-1].append(line)
    lines = []
    for block in blocks:
        if any(_HEARTBEAT_FRAME.match(line) for line in block):
            continue
        for line in block:
            stripped = line.strip()
            if line.startswith(("Process ", "Python v")) or not stripped or any(own in stripped for own in _OWN):
                continue
            if _ADDRESS.match(stripped.split(" (")[0]):   # an unnamed address (0x7f55...): noise to a person
                continue
            lines.append(_fold_templates(line))
    return "\n".join(lines) + "\n"


def _fold_templates(line: str) -> str:
    """``f<a<b>, c>::g(x, y) (lib.so)`` -> ``f<...>::g(...) (lib.so)``: a
    long C++ symbol's template and parameter lists folded (a pybind11 frame is
    kilobytes long); what is left cut if still long."""
    if len(line) > _SYMBOL_CHARS:
        symbol, sep, module = line.rpartition(" (")   # py-spy: "symbol (module)"
        if not sep:
            symbol, module = line, ""
        for open_, close in (("<", ">"), ("(", ")")):
            out, depth = [], 0
            for ch in symbol:
                if ch == open_:
                    if depth == 0:
                        out.append(open_ + "..." + close)
                    depth += 1
                elif ch == close and depth:
                    depth -= 1
                elif depth == 0:
                    out.append(ch)
            symbol = "".join(out)
        line = symbol + (sep + module if sep else "")
    return clip(line, _SYMBOL_CHARS * 2)


def cpu_seconds(pid: int) -> Optional[float]:
    """CPU time of ``pid``, its live descendants and the children it reaped; None if gone."""
    total = _stat_cpu(pid, children_too=True)
    if total is None:
        return None
    for child in descendants(pid):
        total += _stat_cpu(child) or 0.0
    return total


def state(pid: int) -> str:
    """The process state letter (R, S, D, T, Z), or '' if gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""


def _stat_cpu(pid: int, children_too: bool = False) -> Optional[float]:
    fields = stat_fields(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])          # utime, stime
    if children_too:
        ticks += int(fields[13]) + int(fields[14])     # cutime, cstime: children it waited for
    return ticks / _TICK


# Native frames of a wait that only other ranks can end: torch.distributed's
# collectives (c10d::Work::wait, gloo's pairs, NCCL).  A rank in one after a
# peer finished the cell waits for a rank that will never come.
_COLLECTIVE = re.compile(r"\bc10d::Work::wait|ProcessGroup(Gloo|NCCL)|\bgloo::|nccl", re.IGNORECASE)
# A wait on the store (TCPStore get/wait) is not a collective: another rank or
# a thread of this one may set the key (a Timer, a late peer), so it can end.
_STORE_WAIT = re.compile(r"TCPStore|SocketImpl::waitForInput|c10d::Store|PrefixStore")
_PY_FRAME = re.compile(r"\(.*:\d+\)$")


def stuck_in(text: str) -> Optional[str]:
    """Why a quiet rank's dump (:func:`trim`'s form) says nothing can move it,
    or None when it may be waiting for something that ends (a sleep, a
    subprocess, a socket, a lock another of its threads holds).  A plain
    function of the text, so each verdict is unit-tested on recorded dumps."""
    if _STORE_WAIT.search(text):
        return None
    for line in text.splitlines():
        if line.startswith("Thread "):
            continue
        m = _COLLECTIVE.search(line)
        if m:
            frame = line.strip().split(" (")[0]
            return f"it waits in a torch.distributed collective ({frame}) that a rank which finished will never join"
    return None


def where(text: str) -> str:
    """The cell's thread's wait in a few words: its innermost native frame and
    innermost Python frame, ``clock_nanosleep in <module> (<cell>:4)``."""
    native = python = ""
    for line in text.splitlines():
        if line.startswith("Thread "):
            if native or python:
                break
            continue
        frame = line.strip()
        if _PY_FRAME.search(frame):
            python = python or frame
            break
        symbol = frame.split(" (")[0]
        if not _ADDRESS.match(symbol):   # an unnamed address (0x7f55...) says nothing to a person
            native = native or symbol
    return " in ".join(part for part in (native, python) if part) or "an unknown place (no native stack)"
