"""Pre-flight: refuse to launch when the kernel already holds a GPU runtime.

Why: the kernel is a long-lived process; once CUDA (or XPU) is initialised in
it, it holds device memory and a context that the ranks need, and users get
confusing failures later ("Cannot re-initialize CUDA in forked subprocess",
out-of-memory on device 0).  The check must itself never initialise anything:
it only reads ``is_initialized()`` of modules that are *already imported*, and
never imports torch.

The :class:`InitSiteTracker` goes further than the peers: installed when the
extension loads, it wraps the runtimes' lazy-init entry points so that the
first initialisation records *where* it happened (the user's frames), and the
error can name the cell and line.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

RUNTIMES = {"cuda": "CUDA", "xpu": "XPU"}
log = logging.getLogger("accel_magics.preflight")


@dataclass
class InitSite:
    runtime: str                      # "cuda" / "xpu"
    frames: list[traceback.FrameSummary] = field(default_factory=list)
    cell_label: Optional[str] = None  # filled in by the frontend ("In[3]")


def initialised_runtimes() -> list[str]:
    """Runtimes ("cuda", "xpu") that torch reports initialised in this process."""
    found = []
    for name in RUNTIMES:
        module = sys.modules.get(f"torch.{name}")
        is_init = getattr(module, "is_initialized", None)
        if is_init is not None:
            try:
                if is_init():
                    found.append(name)
            except Exception:  # a broken build must not break the check
                pass
    return found


class InitSiteTracker:
    """Records the user frames of the first initialisation of each runtime.

    Wraps ``torch.<rt>._lazy_init`` (what Python and C++ call lazily: tensor
    ``.cuda()``, ``torch.cuda.init()``, ``current_device()``...) and
    ``torch._C._<rt>_init`` when the build has it (every path ends there).
    If torch is not imported yet, a meta-path hook patches the modules right
    after they are first imported, so a cell that imports torch and uses the
    GPU is caught too.  ``user_frame`` decides which frames are the user's.
    """

    def __init__(self, user_frame: Callable[[str], bool] = lambda filename: True) -> None:
        self.user_frame = user_frame
        self.sites: dict[str, InitSite] = {}
        self._finder: Optional[_PatchOnImport] = None
        self._lock = threading.Lock()
        self._patched: set[str] = set()

    @staticmethod
    def unsupported() -> Optional[str]:
        """The ``cuda_watch`` hook's guard: where torch is imported, the
        functions it wraps are there (checked again as each runtime's module
        is imported: a runtime without them is not watched)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        for runtime in RUNTIMES:
            module = sys.modules.get(f"torch.{runtime}")
            if module is not None and not (hasattr(module, "_lazy_init") and hasattr(module, "is_initialized")):
                return f"torch.{runtime} has no _lazy_init/is_initialized"
        return None

    def install(self) -> str:
        for runtime in RUNTIMES:
            if f"torch.{runtime}" in sys.modules:
                self._patch(runtime)
        if len(self._patched) < len(RUNTIMES) and self._finder is None:
            self._finder = _PatchOnImport(self)
            sys.meta_path.insert(0, self._finder)
        return "torch's lazy CUDA/XPU init is watched (where it happens, for the pre-flight message)"

    def uninstall(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None

    def site(self, runtime: str) -> Optional[InitSite]:
        return self.sites.get(runtime)

    def _record(self, runtime: str) -> None:
        if runtime in self.sites:
            return
        stack = traceback.extract_stack()[:-2]
        user = [f for f in stack if self.user_frame(f.filename)]
        self.sites[runtime] = InitSite(runtime, user or stack[-3:])

    def _patch(self, runtime: str) -> None:
        with self._lock:
            if runtime in self._patched:
                return
            module = sys.modules.get(f"torch.{runtime}")
            if module is None:
                return
            self._patched.add(runtime)
        tracker = self

        def wrap(original):
            if getattr(original, "_accel_magics_wrapped", False):
                return original

            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                try:
                    return original(*args, **kwargs)
                finally:
                    try:
                        if module.is_initialized():
                            tracker._record(runtime)
                    except Exception:
                        pass

            wrapper._accel_magics_wrapped = True
            return wrapper

        if hasattr(module, "_lazy_init"):
            module._lazy_init = wrap(module._lazy_init)
        c_module = getattr(sys.modules.get("torch"), "_C", None)
        c_init = f"_{runtime}_init"
        if c_module is not None and hasattr(c_module, c_init):
            setattr(c_module, c_init, wrap(getattr(c_module, c_init)))
        if self._finder is not None and len(self._patched) == len(RUNTIMES):
            self.uninstall()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches torch.cuda / torch.xpu as soon as their modules finish executing."""

    def __init__(self, tracker: InitSiteTracker) -> None:
        self.tracker = tracker

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("torch.") or fullname[6:] not in RUNTIMES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        tracker, runtime = self.tracker, fullname[6:]

        def patched_exec(module, _exec=exec_module):
            _exec(module)
            tracker._patch(runtime)

        try:
            loader.exec_module = patched_exec
        except (AttributeError, TypeError):
            return spec
        return spec


@dataclass
class PreflightProblem:
    runtime: str
    site: Optional[InitSite]

    def message(self, describe_site: Callable[[InitSite], str] | None = None) -> str:
        name = RUNTIMES[self.runtime]
        where = ""
        if self.site is not None and describe_site is not None:
            where = describe_site(self.site)
        lines = [
            f"{name} is already initialised in this kernel{(' ' + where) if where else ''}.",
            f"The kernel must not hold a {name} context: it keeps device memory the ranks need, and "
            f"each rank must initialise {name} itself on its own device.",
            "To recover: restart the kernel, then move the code that touches the GPU "
            f"(.to('{self.runtime}'), torch.{self.runtime}.* calls, model creation on the device) into the "
            "%%distributed cell, so that it runs on the ranks. Code that only defines functions, "
            "classes and CPU data can stay in ordinary cells.",
        ]
        return "\n".join(lines)


def check(tracker: Optional[InitSiteTracker] = None) -> list[PreflightProblem]:
    """Problems that must stop a launch; empty when it is safe to launch."""
    return [
        PreflightProblem(runtime, tracker.site(runtime) if tracker else None)
        for runtime in initialised_runtimes()
    ]


class LaunchRisks:
    """The machine checks that can make a run fail or lose its stacks
    (``/dev/shm``, ``ulimit -n``, the CPU quota, ptrace), once per kernel
    before its first run: one warning line each, naming the fix.  They never
    stop the run.  Cheap: a statvfs, a getrlimit, a few cgroup files; ptrace
    is the launcher's probe (its ``native_stacks`` hook state)."""

    def __init__(self) -> None:
        self.checked: Optional[list] = None
        self.seconds = 0.0

    def once(self, ranks: int, gpus: int, native_state, default_ranks: int) -> list[str]:
        """The warning lines (empty after the first call, or when all is well)."""
        if self.checked is not None:
            return []
        from ..doctor import checks
        from ..supervisor import native_stacks

        started = time.perf_counter()
        state, detail = (list(native_state) + ["", ""])[:2] if native_state else (None, "")
        tool = (native_stacks.tool() or [None])[0]
        refused = detail if state == "stepped aside" and tool is not None else None
        self.checked = checks.launch_risks(ranks, gpus, refused, tool, default_ranks)
        if native_state is None or state == "disabled":   # not known (an old launcher), or turned off by name
            self.checked = self.checked[:-1]
        self.seconds = time.perf_counter() - started
        log.info("pre-run machine checks: %.2f ms", self.seconds * 1000)
        return [c.line() for c in self.checked if c.level in ("warn", "fail")]
