"""``%distributed_doctor``: everything a launch depends on here, in one table.

The checks are the engine's (``kernel_ext.doctor.checks``, no IPython); this
module reads the kernel's side of them (the launcher's GPU count and ptrace
probe, where CUDA was initialised, the defaults) and shows the table.  The
value is a list of records (``check``, ``state``, ``level``, ``fix``) that
shows as the table, text or HTML: ``report = %distributed_doctor`` keeps it.
"""
from __future__ import annotations

import html
import textwrap

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from accel_magics.kernel_ext import options
from accel_magics.kernel_ext.doctor import checks
from accel_magics.kernel_ext.kernel import preflight
from accel_magics.kernel_ext.supervisor import native_stacks

from .magics import parse_options

_MARK = {"ok": "ok", "info": "note", "warn": "WARN", "fail": "FAIL"}
_COLOUR = {"ok": "#1a7f37", "info": "#57606a", "warn": "#9a6700", "fail": "#cf222e"}


class DoctorReport(list):
    """The doctor's records; shown as its table."""

    def text(self, width: int = 110) -> str:
        lines = ["accel_magics doctor: check, state, what to do"]
        for r in self:
            head = f"{_MARK[r['level']]:<5} {r['check']}: "
            lines += textwrap.wrap(r["state"], width, initial_indent=head, subsequent_indent=" " * 6)
            if r["fix"]:
                lines += textwrap.wrap(r["fix"], width, initial_indent="      what to do: ", subsequent_indent=" " * 6)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.text())

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td style='text-align:left'>{html.escape(r['check'])}</td>"
            f"<td style='text-align:left;color:{_COLOUR[r['level']]}'><b>{_MARK[r['level']]}</b> "
            f"{html.escape(r['state'])}</td><td style='text-align:left'>{html.escape(r['fix'])}</td></tr>"
            for r in self)
        return ("<table><thead><tr><th style='text-align:left'>check</th><th style='text-align:left'>state</th>"
                f"<th style='text-align:left'>what to do</th></tr></thead><tbody>{rows}</tbody></table>")


@magics_class
class DoctorMagics(Magics):
    def __init__(self, shell, dist, state) -> None:
        super().__init__(shell)
        self.dist = dist     # the DistributedMagics: its defaults, CUDA watch and cell names
        self.state = state   # the kernel's launcher (state.MagicsState)

    @magic_arguments()
    @argument("-n", "--num_processes", type=int, default=None, metavar="N",
              help="Ranks to check /dev/shm and the CPUs for (default: what %%distributed would start).")
    @line_magic
    def distributed_doctor(self, line: str):
        """Check everything a launch depends on here, in a few seconds, without
        touching the GPU: torch, GPUs and driver, /dev/shm, ulimit -n, the CPU
        quota, ptrace (native stacks), ports and loopback, Slurm, the kernel's
        CUDA, the Jupyter packages.  One table: check, state, what to do.
        ``report = %distributed_doctor`` keeps the records (dicts)."""
        args = parse_options(self.distributed_doctor, line)
        if args.num_processes is not None and args.num_processes < 1:
            raise UsageError(f"--num_processes must be at least 1 (got {args.num_processes}).")
        info = self.state.launcher.info or {}   # never waits for the launcher: GPUs are NVML's too
        defaults = self.dist.effective_defaults()
        ranks = args.num_processes or defaults["num_processes"]
        tool = (native_stacks.tool() or [None])[0]
        initialised = preflight.initialised_runtimes()
        where = ""
        for runtime in initialised:
            site = self.dist.tracker.site(runtime)
            if site is not None:
                where = self.dist.names.describe_site(site)
                break
        found = checks.doctor(ranks, info.get("gpu_count", 0), defaults["num_processes"], tool, initialised,
                              where, port=options.DEFAULT_MULTINODE_PORT)
        return DoctorReport(c.record() for c in found)
