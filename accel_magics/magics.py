"""The ``%%distributed`` cell magic: options, checks, launch, results.

Everything that can go wrong before launch is checked here first (flags,
topology, GPU runtime in the kernel, syntax, names, picklability) and
reported as a :class:`~IPython.core.error.UsageError` that says what to do;
nothing is started for a cell that cannot run.  The run itself belongs to the
engine (``kernel_ext.run.execute``); this module only adapts it to IPython.
"""
from __future__ import annotations

import re
import sys
import traceback
from typing import Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from kernel_ext import preflight
from kernel_ext.environment import MIXED_PRECISION_CHOICES, ConfigError, LaunchConfig, validate
from kernel_ext.launcher import Launcher
from kernel_ext.payload import PayloadError, build_payload
from kernel_ext.run import execute

from .record import RunRecord
from .text_view import DisplayLive, StreamLive, TextView

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# IPython's history variables (_, __, _5, _i5, _ih, ...): the frontend's, never shipped.
_HISTORY_NAME = re.compile(r"^_(_{0,2}|\d+|i{1,3}|i\d+|[iod]h)$")


class _PlainReport:
    """IPython shows the message alone: the magic's own frames are no help to users."""

    def _render_traceback_(self) -> list[str]:
        return f"{type(self).__name__}: {self}".splitlines()


class PreflightError(_PlainReport, UsageError):
    """A GPU runtime is already initialised in the kernel; nothing was launched."""


class ReturnNameError(_PlainReport, NameError):
    """A ``--return`` name that rank 0 did not define; the run itself succeeded."""


def _return_names(values: Optional[list[str]]) -> list[str]:
    names = []
    for value in values or []:
        for name in value.replace(",", " ").split():
            if not _IDENTIFIER.match(name):
                raise UsageError(f"--return expects variable names, got {name!r}.")
            names.append(name)
    return names


@magics_class
class DistributedMagics(Magics):
    """Run a cell on N ranks with the torchrun environment set."""

    def __init__(self, shell, launcher: Optional[Launcher] = None) -> None:
        super().__init__(shell)
        self.launcher = launcher or Launcher()
        self.tracker = preflight.InitSiteTracker(user_frame=self._is_cell_file)
        self.defaults: dict = {}

    # -- GPU-runtime pre-flight -------------------------------------------
    def _is_cell_file(self, filename: str) -> bool:
        return filename in getattr(self.shell.compile, "_filename_map", {})

    def _describe_site(self, site: preflight.InitSite) -> str:
        if site.frames:
            frame = site.frames[-1]
            label = self.shell.compile.format_code_name(frame.filename)
            where = label[1] if label else frame.filename
            code = f": {frame.line.strip()}" if frame.line else ""
            return f"at {where}, line {frame.lineno}{code}"
        if site.cell_label:
            return f"in cell {site.cell_label}"
        return ""

    def post_run_cell(self, result) -> None:
        """Catch initialisations the wrappers missed: at least name the cell."""
        for runtime in preflight.initialised_runtimes():
            if runtime not in self.tracker.sites:
                count = getattr(result, "execution_count", None) or self.shell.execution_count
                self.tracker.sites[runtime] = preflight.InitSite(runtime, [], f"In[{count}]")

    def _preflight(self) -> None:
        problems = preflight.check(self.tracker)
        if problems:
            raise PreflightError(
                "\n\n".join(p.message(self._describe_site) for p in problems)
                + "\n\nNothing was launched."
            )

    # -- the magic --------------------------------------------------------
    @magic_arguments()
    @argument("-n", "--num_processes", type=int, default=None,
              help="Processes (ranks) on this node. Default: one per local GPU, or 2 on a CPU-only machine.")
    @argument("--num_nodes", type=int, default=None, help="Nodes taking part (default 1).")
    @argument("--node_rank", type=int, default=None, help="This node's rank, 0 .. num_nodes-1 (default 0).")
    @argument("--master_addr", default=None,
              help="Address of node 0, where the rendezvous runs (default 127.0.0.1).")
    @argument("--master_port", type=int, default=None,
              help="Rendezvous port. Default: a fresh free port per run (29500 for multi-node).")
    @argument("--max_restarts", type=int, default=None,
              help="Re-run the whole group up to this many times after a rank fails (default 0).")
    @argument("--mixed_precision", default=None, choices=MIXED_PRECISION_CHOICES,
              help="Passed to Accelerate as ACCELERATE_MIXED_PRECISION.")
    @argument("--output", default=None, choices=("auto", "widget", "text"),
              help="How the run is shown: a live widget, or [rank N] text lines (default auto).")
    @argument("--timeout", type=float, default=None,
              help="Stop the run after this many seconds and show where each rank was.")
    @argument("--return", dest="return_names", nargs="+", default=None, metavar="NAMES",
              help="Variables whose values on rank 0 are assigned in the notebook after the run "
                   "(tensors moved to the CPU). Space or comma separated.")
    @argument("--oversubscribe", action="store_true",
              help="Allow more processes than GPUs (or than 4x the CPU cores on a CPU-only machine).")
    @cell_magic
    def distributed(self, line: str, cell: str):
        """Run this cell on N worker processes (ranks), like torchrun.

        Each rank runs the whole cell in a fresh process with RANK, LOCAL_RANK,
        WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, so ``Accelerator()``,
        ``torch.distributed.init_process_group()`` and DDP work unchanged.
        Functions, classes and values the cell uses from the notebook are sent
        along; nothing the ranks create comes back except rank 0's last
        expression and the ``--return`` variables.

        Example::

            %%distributed --num_processes 2 --return acc
            import torch.distributed as dist
            dist.init_process_group("gloo")
            acc = train(model_fn, data)
        """
        args = parse_argstring(self.distributed, line)
        cfg = self._config(args)
        return_names = _return_names(args.return_names)
        self._preflight()

        source = self._source(line, cell)
        payload = self._payload(source, return_names)

        live = DisplayLive() if getattr(self.shell, "kernel", None) is not None else StreamLive()
        view, record = TextView(live), RunRecord()

        def on_event(event) -> None:
            record(event)
            view(event)

        try:
            result = execute(self.launcher, cfg, payload, on_event=on_event, heartbeat=0.25)
        finally:
            live.close()
            if live.keeps_record:
                sys.stdout.write(record.render())
                sys.stdout.flush()

        user_ns = self.shell.user_ns
        user_ns.update(result.returns)
        if result.missing:
            raise ReturnNameError(
                f"--return: rank 0 did not define {', '.join(repr(n) for n in result.missing)} "
                "(the run itself succeeded; its output is above)."
            )
        if result.has_value:
            return result.value
        return None

    # -- steps ------------------------------------------------------------
    def _config(self, args) -> LaunchConfig:
        launcher_info = self.launcher.info or {}
        gpus = launcher_info.get("gpu_count", 0)

        def pick(name, fallback):
            value = getattr(args, name)
            if value is None:
                value = self.defaults.get(name, fallback)
            return value

        num_nodes = pick("num_nodes", 1)
        cfg = LaunchConfig(
            num_processes=pick("num_processes", gpus or 2),
            num_nodes=num_nodes,
            node_rank=pick("node_rank", 0),
            master_addr=pick("master_addr", "127.0.0.1"),
            master_port=pick("master_port", 29500 if num_nodes > 1 else None),
            max_restarts=pick("max_restarts", 0),
            mixed_precision=pick("mixed_precision", None),
            timeout=pick("timeout", None),
        )
        try:
            validate(cfg, gpu_count=gpus, allow_oversubscribe=args.oversubscribe)
        except ConfigError as exc:
            raise UsageError(f"{exc}\nNothing was launched.") from None
        return cfg

    def _source(self, line: str, cell: str) -> str:
        """The cell as the ranks compile it: line numbers match the notebook's."""
        body = self.shell.transform_cell(cell)
        if "get_ipython()" in body and "get_ipython()" not in cell:
            raise UsageError(
                "IPython magics and shell escapes (lines starting with % or !) are not available inside a "
                "%%distributed cell: the ranks run plain Python. Run them in an ordinary cell.\n"
                "Nothing was launched."
            )
        return f"# %%distributed {line}\n{body}"

    def _payload(self, source: str, return_names: list[str]):
        count = self.shell.execution_count
        exclude = set(self.shell.user_ns_hidden) | {"In", "Out", "get_ipython", "exit", "quit"}
        exclude |= {name for name in self.shell.user_ns if _HISTORY_NAME.match(name)}
        try:
            return build_payload(
                source, self.shell.user_ns, filename=f"<%%distributed In[{count}]>",
                exclude=exclude, return_names=return_names,
            )
        except PayloadError as exc:
            raise UsageError(f"{exc}\nNothing was launched.") from None
        except SyntaxError as exc:
            # Shown like IPython shows a syntax error in an ordinary cell; the
            # line numbers are the notebook cell's (line 1 is the magic).
            text = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
            raise UsageError(f"the cell has a syntax error:\n{text}\nNothing was launched.") from None

    def close(self) -> None:
        self.tracker.uninstall()
        self.launcher.close()
