"""In a rank: what its cell is busy with before it prints, in a few words.

The first cell of a kernel imports what the launcher has not preloaded
(accelerate, transformers: seconds), builds ``Accelerator()`` and waits in
``init_process_group`` for its peers; the view showed "running" and an empty
pane meanwhile.  The rank's heartbeat thread (liveness.py) looks at the main
thread's frames once a beat (it holds the GIL then, so they hold still) and
says the phase when it changes: ``importing accelerate``, ``in Accelerator()``,
``in init_process_group``.  It reads code names, file names and a module's
``__name__`` (its globals), never a frame's locals.  :func:`phase_of` is a
plain function of those frames, unit-tested on recorded ones.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

_IMPORTLIB = "<frozen importlib._bootstrap"
#: (file ends with, function) -> what the rank is in
_CALLS = {
    ("accelerate/accelerator.py", "__init__"): "in Accelerator()",
    ("accelerate/accelerator.py", "prepare"): "in accelerator.prepare()",
    ("torch/distributed/distributed_c10d.py", "init_process_group"): "in init_process_group",
    ("torch/nn/parallel/distributed.py", "__init__"): "in DistributedDataParallel()",
}


def phase_of(frames: list[tuple[str, str, str]]) -> str:
    """``frames``: (file, function, module name) outermost first.  The
    phases found, outer to inner: an import (the package the cell imports)
    or one of :data:`_CALLS`; '' when none (the cell's own code runs)."""
    found: list[str] = []
    importing = False
    for file, func, module in frames:
        if file.startswith(_IMPORTLIB):
            importing = True
            continue
        if importing and func == "<module>":
            label = f"importing {module.split('.')[0]}"
            if label not in found:
                found.append(label)
            break   # what that import does inside is its own business
        label = next((said for (tail, name), said in _CALLS.items() if func == name and file.endswith(tail)), None)
        if label and label not in found:
            found.append(label)
    return ", ".join(found)


def _frames(ident: int) -> list[tuple[str, str, str]]:
    frame = sys._current_frames().get(ident)
    out = []
    while frame is not None:
        code = frame.f_code
        out.append((code.co_filename, code.co_name, str(frame.f_globals.get("__name__", ""))))
        frame = frame.f_back
    return out[::-1]


class Watcher:
    """Called once a beat (``liveness.on_beat``): emits ``phase`` when the main
    thread's phase changed."""

    def __init__(self, emit: Callable[[dict], bool], main_ident: int) -> None:
        self.emit, self.main_ident = emit, main_ident
        self.said: Optional[str] = None

    def __call__(self) -> None:
        phase = phase_of(_frames(self.main_ident))
        if phase != self.said and (phase or self.said):
            self.said = phase
            self.emit({"kind": "phase", "text": phase})
