"""A native stack dump (py-spy's, as :func:`native_stacks.trim` leaves it) as a
person reads it: as the interrupt's stacks read (``rank_process.user_stack``).

py-spy lists each thread innermost frame first, native frames among the
Python ones, so the cell's own line came last of eight under ``pause
(libc.so.6)``, ``ffi_call``, ``_ctypes_callproc`` and the like.  Here each
thread leads with its Python frames (the cell's code, ``Cell In[N]``, with
its source line; most recent call first, as a faulthandler dump), and its
native frames follow, folded into one line that names the innermost one and
any torch.distributed wait among them.  The cell's thread (the rank's main
thread) comes first; threads with no Python frame are counted in one line.
"""
from __future__ import annotations

import linecache
import re
from typing import Optional

#: ``func (file.py:12)``, ``<module> (Cell In[3]:4)``, ``f (<string>:1)``: a Python frame.
_PY = re.compile(r"^(?P<func>.*) \((?P<file>.*(?:\.py|\]|>)):(?P<line>\d+)\)$")
_THREAD = re.compile(r'^Thread (?P<id>\S+)(?: \((?P<state>[^)]*)\))?(?::\s*"(?P<name>.*)")?')
#: Native frames worth naming in the fold: what a rank waits in.
_NOTABLE = re.compile(r"c10d::|gloo::|nccl|TCPStore", re.IGNORECASE)


def _threads(text: str) -> list[tuple[str, list[str]]]:
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("Thread "):
            threads.append((line.strip(), []))
        elif threads:
            threads[-1][1].append(line.strip())
        else:
            threads.append(("", [line.strip()]))
    return threads


def _fold(native: list[str]) -> str:
    """``... 6 native frames (innermost: pause in libc.so.6)``."""
    if not native:
        return ""

    def name(frame: str) -> str:
        symbol, sep, module = frame.rpartition(" (")
        return f"{symbol} in {module.rstrip(')')}" if sep else frame

    said = [f"innermost: {name(native[0])}"]
    notable = next((f for f in native[1:] if _NOTABLE.search(f)), None)
    if notable and not _NOTABLE.search(native[0]):
        said.append(f"waiting in {name(notable)}")
    count = f"{len(native)} native frame{'s' if len(native) != 1 else ''}"
    return f"  ... {count} ({'; '.join(said)})"


def readable(text: str, sources: Optional[dict] = None) -> str:
    """``text``: a trimmed py-spy dump; ``sources``: the cells' source by
    file label (``Cell In[3]``) for the line each frame is at."""
    sources = sources or {}
    threads = _threads(text)
    if not any(_PY.match(f) for _, frames in threads for f in frames):
        return text   # no Python frame to lead with (gdb's dump, an empty one): as it came
    main = next((t for t in threads if _is_main(t[0])), threads[0])
    out = ["the cell's thread:"] + _render(main[1], sources)
    out += _other_threads([t for t in threads if t is not main], sources)
    return "\n".join(out) + "\n"


def _source_line(sources: dict, file: str, line: int) -> str:
    if file in sources:
        lines = sources[file].splitlines()
        return lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return linecache.getline(file, line).strip() if file.startswith("/") else ""


def _render(frames: list[str], sources: dict) -> list[str]:
    out, native = [], []
    for frame in frames:
        m = _PY.match(frame)
        if not m:
            native.append(frame)
            continue
        out.append(f'  File "{m["file"]}", line {m["line"]}, in {m["func"]}')
        code = _source_line(sources, m["file"], int(m["line"]))
        if code:
            out.append(f"    {code}")
    fold = _fold(native)
    return out + ([fold] if fold else [])


def _is_main(title: str) -> bool:
    found = _THREAD.match(title)
    return bool(found) and found["name"] == "MainThread"


def _other_threads(others: list, sources: dict) -> list[str]:
    """The threads but the cell's: those in a notebook cell whole; a library's
    and native-only ones counted in one line each."""
    out: list[str] = []
    native_only, elsewhere = [], []
    for title, frames in others:
        python = [_PY.match(f) for f in frames if _PY.match(f)]
        if not python:
            native_only.append(frames)
            continue
        if not any(m["file"].startswith(("Cell In[", "<")) for m in python):
            # A thread of a library (a DataLoader's pin thread, tqdm's monitor): one
            # line for all, as the stop button's stacks say it.
            elsewhere.append(f"{_short_file(python[0]['file'])} {python[0]['func']}")
            continue
        found = _THREAD.match(title)
        out.append(f'thread "{found["name"]}":' if found and found["name"] else title.replace("Thread", "thread", 1))
        out.extend(_render(frames, sources))
    if elsewhere:
        n = len(elsewhere)
        out.append(f"(+ {n} other thread{'s' if n != 1 else ''} in no notebook cell: {', '.join(sorted(set(elsewhere)))})")
    if native_only:
        n = len(native_only)
        out.append(f"(+ {n} other thread{'s' if n != 1 else ''} in native code only)")
    return out


def _short_file(file: str) -> str:
    """``torch/utils/data/_utils/pin_memory.py`` -> ``_utils/pin_memory.py``."""
    return "/".join(file.split("/")[-2:])
