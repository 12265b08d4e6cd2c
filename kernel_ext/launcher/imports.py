"""What the launcher process imports for runs (see :mod:`.zygote`).

It imports torch and the modules payloads use once, so a fork has them
(an import after the fork costs each run milliseconds), then freezes the
heap; the kernel learns which files were imported and which environment
variables the imports read, and replaces the launcher when one changes.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import sys
import tempfile
from typing import Callable, Optional

from .. import hooks
from ..environment import EnvironmentReads, make_dirs_below
from ..rank import pg_guard, worker
from ..supervisor import spare as spare_supervisor
from .hugepages import Collapser

log = logging.getLogger("accel_magics.launcher")


class Imports:
    """The modules this launcher imported for runs, and how.

    ``env``: what records the environment's lookups (the zygote's, started
    before its first import); ``collapser``: the heap's move to huge pages,
    planned again after each preload; ``say``: tells the kernel a phase."""

    def __init__(self, env: EnvironmentReads, collapser: Collapser, say: Callable[[str], None]) -> None:
        self.env = env
        self.collapser = collapser
        self.say = say
        self.private_dir: Optional[str] = None   # the launcher's (see own_temp_dir)
        self.preloaded: list[str] = []
        self.failed_preload: dict[str, str] = {}

    def preload(self, modules, phases: bool = False) -> dict:
        """Import ``modules``; returns {file: (mtime_ns, size)} of every module
        this imported, so the kernel can tell when one changed on disk.
        ``phases``: say each import to the kernel first (the first cell's view
        shows what it waits for)."""
        self.env.start()   # on already for the first preload: until ready (see env_reads)
        before = set(sys.modules)
        with self.own_temp_dir():
            for name in modules:
                if name in sys.modules or name in self.failed_preload:
                    continue
                if phases:
                    self.say(f"importing {name}")
                try:
                    importlib.import_module(name)
                    self.preloaded.append(name)
                except BaseException as exc:  # a module that fails here may work in a rank
                    self.failed_preload[name] = f"{type(exc).__name__}: {exc}"
        pg_guard.install()   # inherited by every rank (see pg_guard)
        self.preview_rank_hooks()
        worker.note_launcher_modules()
        spare_supervisor.make_session_ahead()
        gc.collect()
        gc.freeze()
        self.collapser.plan()   # the heap changed: its pages move to huge pages while idle
        files = {}
        for name in set(sys.modules) - before:
            path = getattr(sys.modules.get(name), "__file__", None)
            if path:
                try:
                    st = os.stat(path)
                    files[path] = (st.st_mtime_ns, st.st_size)
                except OSError:
                    pass
        return files

    def env_reads(self) -> list[str]:
        """Stop recording (forks get the plain ``os.environ``): the names
        looked up since the last call, for the kernel."""
        self.env.stop()
        names, scans = self.env.take()
        if scans:   # not lookups of each variable (see EnvironmentReads): for the log
            log.info("the environment was scanned whole at import by %s", ", ".join(sorted(scans)))
        return sorted(names)

    @contextlib.contextmanager
    def own_temp_dir(self):
        """While modules import here, the temp directory is one inside the
        launcher's private directory: what a module makes there at import
        (torch 2.4's ``torch.distributed.nn.jit`` a TemporaryDirectory) is this
        process's for its life, and goes with the private directory, never
        left in the user's temp directory.  Afterwards ``tempfile`` forgets
        it, so a rank finds its temp directory in its own environment (the
        kernel's TMPDIR), as a new process does."""
        root = self.private_dir or tempfile.gettempdir()
        path = os.path.join(root, "tmp")
        if not make_dirs_below(root, path):   # the kernel removed the directory: it is closing us
            yield
            return
        saved = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = path
        tempfile.tempdir = None
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved
            tempfile.tempdir = None

    @staticmethod
    def preview_rank_hooks() -> None:
        """The hooks every rank installs, decided and logged once here."""
        from ..rank import liveness, script_end

        hooks.preview("tqdm", detail="in each rank: bars become progress events")
        hooks.preview("script_end", script_end.unsupported, "in each rank: a cell ends as a script ends")
        hooks.preview("heartbeat", liveness.unsupported, "in each rank: a thread beats, dumps stacks when asked")
        hooks.preview("step_stop", worker.step_hook_unsupported, "in each session rank")
