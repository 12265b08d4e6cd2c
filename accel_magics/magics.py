"""The ``%%distributed`` cell magic: options, checks, launch, results.

Everything that can go wrong before launch is checked here first (flags,
topology, GPU runtime in the kernel, syntax, names, picklability) and
reported as a :class:`~IPython.core.error.UsageError` that says what to do;
nothing is started for a cell that cannot run.  The run itself belongs to the
engine (``kernel_ext.kernel.run.execute``); this module only adapts it to IPython.
"""
from __future__ import annotations

import re
import sys
import time
import traceback
from typing import Callable, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from traitlets import TraitError

from accel_magics.kernel_ext.kernel import preflight
from accel_magics.kernel_ext.kernel.errors import DistributedRunError, ReportedError, RunInterrupted
from accel_magics.kernel_ext import options
from accel_magics.kernel_ext.environment import LaunchConfig
from accel_magics.kernel_ext.kernel.launcher import Launcher
from accel_magics.kernel_ext.kernel.local_placement import LocalPlacement
from accel_magics.kernel_ext.kernel.slurm import describe_allocation
from accel_magics.kernel_ext.wire.payload import SHARED, PayloadError, build_payload
from accel_magics.kernel_ext.kernel.run import RemoteRepr, execute
from accel_magics.kernel_ext.timing import CELL_HEARTBEAT

from .background_stop import BackgroundStops
from .cell_modes import CELL_MODES, PLACEMENT_CELLS, placement_class
from .cell_names import CellNames
from .config_display import ConfigFormDisplays
from .defaults import LaunchDefaults, LaunchOptionTraits, flags_of
from .node_lines import other_node_lines
from .presenter import Presenter, expected_ranks
from . import rank_prompt
from .state import MagicsState

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# IPython's history variables (_, __, _5, _i5, _ih, ...): the frontend's, never shipped.
_HISTORY_NAME = re.compile(r"^_(_{0,2}|\d+|i{1,3}|i\d+|[iod]h)$")


class PreflightError(ReportedError, UsageError):
    """A GPU runtime is already initialised in the kernel; nothing was launched."""


class ReturnNameError(ReportedError, NameError):
    """A ``--return`` name that rank 0 did not define; the run itself succeeded."""


class ReturnValueError(ReportedError, ValueError):
    """A ``--return`` value that could not travel to the kernel; the run itself succeeded."""


#: The launch options, in the order of the help (the table: kernel_ext/options.py).
LAUNCH_OPTION_NAMES = options.NAMES


def launch_options(func):
    """The launch options shared by %%distributed, %distributed_config and
    %distributed_session, declared from the options table (flags, types,
    choices, the help with its default)."""
    for option in reversed(options.OPTIONS):
        if option.is_flag:   # None when not given: a default set before still holds
            func = argument(*option.flags, action="store_const", const=True, default=None,
                            help=option.help_text())(func)
            continue
        func = argument(*option.flags, type=option.type, default=None, choices=option.choices,
                        metavar=option.metavar, help=option.help_text())(func)
    return func


def parse_options(magic, line: str):
    """parse_argstring, with a malformed line (an unbalanced quote) as a UsageError."""
    try:
        return parse_argstring(magic, line)
    except ValueError as exc:   # shlex: "No closing quotation"
        raise UsageError(f"cannot read the options {line!r}: {exc}. Check the quotes.\n"
                         "Nothing was launched.") from None


def config_summary(values: dict) -> str:
    """The defaults as the equivalent command line (and, for several nodes, each other node's line)."""
    return "defaults for %%distributed: " + describe_nodes(values)


def describe_nodes(values: dict) -> str:
    """The command line, then the line each other node runs (one per line)."""
    import socket

    return "\n".join([command_line(values), *other_node_lines(values, command_line, socket.gethostname())])


def command_line(values: dict) -> str:
    """The flags that differ from the built-in defaults, as a cell's first line."""
    parts = ["%%distributed"]
    for name in LAUNCH_OPTION_NAMES:
        value = values.get(name)
        if value is None or options.DEFAULTS.get(name, object()) == value:
            continue
        if options.BY_NAME[name].is_flag:
            parts.append(f"--{name}")
            continue
        if name == "rendezvous_key":   # a secret: said to be set, never shown
            parts.append(f"--{name} <set>")
            continue
        parts.append(f"--{name} {value:g}" if isinstance(value, float) else f"--{name} {value}")
    return " ".join(parts)


def return_names_of(values: Optional[list[str]]) -> list[str]:
    names = []
    for value in values or []:
        for name in value.replace(",", " ").split():
            if not _IDENTIFIER.match(name):
                raise UsageError(f"--return expects variable names, got {name!r}.")
            names.append(name)
    return names


@magics_class
class DistributedMagics(LaunchOptionTraits, Magics):
    """Run a cell on N ranks with the torchrun environment set.

    Its traits are the launch options' defaults (see ``defaults.py``):
    ``%config DistributedMagics.num_processes = 4``, or in ``ipython_config.py``
    ``c.DistributedMagics.num_processes = 4``; ``%distributed_config`` wins over them.
    """

    def __init__(self, shell, launcher: Optional[Launcher] = None, state: Optional[MagicsState] = None) -> None:
        self.state = state or MagicsState(launcher)   # shared with the other magics of the kernel
        try:
            super().__init__(shell)   # loads the traits from the IPython config
        except TraitError as exc:
            if shell is not None and self in getattr(shell, "configurables", []):
                shell.configurables.remove(self)   # Magics put it there first: %config must not find it
            raise UsageError(f"accel_magics was not loaded: the IPython config (ipython_config.py, "
                             f"ipython_kernel_config.py or the command line) gives a value it refuses: {exc} "
                             "Correct it, then load the extension again.") from None
        self.names = CellNames(shell)
        self.launch_defaults = LaunchDefaults(self, self.state)
        self.tracker = preflight.InitSiteTracker(user_frame=self.names.is_cell_file)
        self.risks = preflight.LaunchRisks()   # the machine's, once per kernel (warn_machine)
        self.stops = BackgroundStops()   # the stop button during a --background cell (background_stop)
        self.form = ConfigFormDisplays(self.launch_defaults, config_summary, describe_nodes)   # one per kernel

    def update_config(self, config) -> None:
        """``%config DistributedMagics.NAME = VALUE``: a value its trait refuses
        is said here, on stderr, and nothing is changed.  (``%config`` would
        hand the error to ``logging.error``, which gives the kernel's root
        logger a handler: every INFO line of the engine would then show.)"""
        try:
            super().update_config(config)
        except TraitError as exc:
            print(f"accel_magics: {exc} Nothing was changed.", file=sys.stderr)
        finally:   # a config that names a trait with the value it has changes no trait, yet counts as given
            defaults = getattr(self, "launch_defaults", None)
            if defaults is not None:
                defaults.forget()

    # -- GPU-runtime pre-flight -------------------------------------------
    def post_run_cell(self, result) -> None:
        """Catch initialisations the wrappers missed: at least name the cell.
        Let the shared copies of big arrays the notebook dropped go."""
        SHARED.forget_unreferenced(self.shell.user_ns)
        for runtime in preflight.initialised_runtimes():
            if runtime not in self.tracker.sites:
                count = getattr(result, "execution_count", None) or self.shell.execution_count
                self.tracker.sites[runtime] = preflight.InitSite(runtime, [], f"In[{count}]")

    def cell_number(self) -> int:
        """N of the running cell's In[N] prompt."""
        return self.names.cell_number()

    def preflight_check(self) -> None:
        problems = preflight.check(self.tracker)
        if problems:
            raise PreflightError(
                "\n\n".join(p.message(self.names.describe_site) for p in problems)
                + "\n\nNothing was launched."
            )

    def warn_machine(self, cfg: LaunchConfig) -> None:
        """Once per kernel, before its first run: what here can make runs fail
        (a small /dev/shm, ulimit -n, a CPU quota, no ptrace), one line each
        with its fix.  Never stops the run (see kernel_ext/doctor)."""
        if self.risks.checked is not None:   # checked already: the defaults are not worked out again
            return
        info = self.state.launcher.info or {}
        for warning in self.risks.once(cfg.num_processes, info.get("gpu_count", 0), info.get("native_stacks"),
                                       self.effective_defaults()["num_processes"]):
            print(warning, file=sys.stderr)

    # -- the magics -------------------------------------------------------
    @magic_arguments()
    @launch_options
    @argument("--return", dest="return_names", nargs="+", default=None, metavar="NAMES",
              help="Variables whose values on rank 0 are assigned in the notebook after the run "
                   "(tensors moved to the CPU). Space or comma separated.")
    @argument("--session", action="store_true",
              help="Run the cell on the running session's ranks (`%%distributed_session start`): what "
                   "earlier session cells made is still there. Launch options belong to the session.")
    @argument("--background", action="store_true",
              help="Return at once with a handle (the cell's value: `h = _`): h.done(), h.wait() (the result, "
                   "the --return names, or the run's error), h.stop(), h.status. The view keeps updating.")
    @cell_magic
    def distributed(self, line: str, cell: str):
        """Run this cell on N worker processes (ranks), like torchrun.

        Each rank runs the whole cell in a fresh process with RANK, LOCAL_RANK,
        WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, so ``Accelerator()``,
        ``torch.distributed.init_process_group()`` and DDP work unchanged.
        Functions, classes and values the cell uses from the notebook are sent
        along; nothing the ranks create comes back except rank 0's last
        expression and the ``--return`` variables.  Options not given come
        from ``%distributed_config``.

        Example::

            %%distributed --num_processes 2 --return acc
            import torch.distributed as dist
            dist.init_process_group("gloo")
            acc = train(model_fn, data)
        """
        started = time.monotonic()
        self.stops.begin()   # a background cell: a press as the cell began (before this ran) means nothing ran
        args = None
        try:
            args = parse_options(self.distributed, line)   # a press can land in argparse too
            return self._distributed(args, line, cell, started)
        except KeyboardInterrupt as exc:
            background = args.background if args is not None else "--background" in line.split()
            if not background or isinstance(exc, ReportedError):
                raise
            # Before its run exists (from then on start_background takes the stop): nothing ran.
            raise RunInterrupted.before_start("the stop came while the background run was being prepared") \
                from None

    def _distributed(self, args, line: str, cell: str, started: float):
        self.state.release_held()   # a failed rank kept for %distributed_debug holds memory a new run may need
        if args.session:   # on the running session, wherever it is placed
            return CELL_MODES["session"](self, args, line, cell, started)
        name = self.placement_name(args.launcher)
        cls = self.placement_class(name)
        if not issubclass(cls, LocalPlacement):   # its ranks are elsewhere: its own cell mode (slurm)
            return PLACEMENT_CELLS[name](self, args, line, cell, started)
        placement = cls(self.state.launcher)
        presenter = self.presenter(args, started, background=args.background)
        if args.background and not self.state.launcher.info:
            return self._background_while_the_launcher_starts(args, line, cell, presenter, placement)
        try:
            with self.state.launcher.waiting(presenter.tick):   # the first cell waits for torch's import
                cfg = self.launch_config(args)
            if not self.takes_input():   # nobody could type at a post-mortem (nbclient): a failed rank ends at once
                cfg.debug_hold = 0
            return_names = return_names_of(args.return_names)
            self.preflight_check()
            self.warn_machine(cfg)
            source = self.cell_source(line, cell)
            payload = self.make_payload(source, return_names)
        except BaseException:
            presenter.discard()   # nothing was launched: no view is left behind
            raise
        if args.background:
            return self.start_background(presenter, lambda control: self._execute_background(
                placement, cfg, payload, presenter, control), label=f"In[{self.cell_number()}]",
                release=payload.release)
        try:
            try:
                result = execute(placement, cfg, payload, on_event=presenter, heartbeat=CELL_HEARTBEAT,
                                 log_dir=presenter.log_dir, excerpt=presenter.excerpt, ask=rank_prompt.ask)
            except DistributedRunError as exc:
                self.state.keep_failed(exc.held)   # for %distributed_debug
                raise
            finally:
                presenter.finish()
        finally:
            payload.release()   # also when interrupted before the run started
        return self.deliver(result)

    def takes_input(self) -> bool:
        """Whether this cell's frontend answers input() (not nbconvert, papermill, nbval: allow_stdin off)."""
        kernel = getattr(self.shell, "kernel", None)
        return kernel is None or bool(getattr(kernel, "_allow_stdin", True))

    def placement_name(self, given) -> str:
        """The placement a cell runs on: ``--launcher``, else the default set, else the built-in one."""
        return self.launch_defaults.placement_name(given)

    @staticmethod
    def placement_class(name: str, nothing: str = "Nothing was launched.") -> type:
        """The placement class ``name``, or a UsageError that lists the known ones (cell_modes.py)."""
        return placement_class(name, nothing)

    def _background_while_the_launcher_starts(self, args, line: str, cell: str, presenter, placement):
        """A ``--background`` cell before the launcher is up (the first cell of
        a kernel: it imports torch, seconds): the handle at once.  What can be
        checked without the launcher is checked now (a UsageError, nothing
        launched); the wait for it, and the checks that need the GPUs it
        counts, happen in the run's thread: their error is the run's (its view
        and ``h.wait()``)."""
        payload = None
        try:
            self.launch_config(args, wait=False)
            return_names = return_names_of(args.return_names)
            self.preflight_check()
            payload = self.make_payload(self.cell_source(line, cell), return_names)
            self.state.launcher.start()
        except BaseException:
            if payload is not None:
                payload.release()   # its shared memory (and its lock on it) now, not at a collection
            presenter.discard()
            raise

        def target(control):
            try:
                with self.state.launcher.waiting(presenter.tick):
                    cfg = self.launch_config(args)
                if control.stop_requested:
                    raise RunInterrupted.before_start("stopped while the launcher was starting")
            except BaseException as exc:
                payload.release()
                presenter.not_started(exc)
                raise
            return self._execute_background(placement, cfg, payload, presenter, control)
        return self.start_background(presenter, target, label=f"In[{self.cell_number()}]", release=payload.release)

    def presenter(self, args, started: float, background: bool = False, note: str = "",
                  context: str = "") -> Presenter:
        in_kernel = getattr(self.shell, "kernel", None) is not None
        defaults = self.launch_defaults.given()
        mode = args.output or defaults.get("output", "auto")
        # A frontend that takes input() is a person's (JupyterLab, Notebook, VS Code); headless
        # executors (nbconvert, papermill, nbclient) say they take none: they get the text view,
        # since they save the state of every widget ever opened, closed or not.
        interactive = bool(getattr(self.shell.kernel, "_allow_stdin", True)) if in_kernel else False
        try:
            given = {**defaults, **{k: v for k, v in vars(args).items() if v is not None}}
            return Presenter(mode, in_kernel, label=f"In{self.cell_number()}", started=started,
                             launcher_ready=bool(self.state.launcher.info), interactive=interactive,
                             background=background, note=note, context=context,
                             expected=expected_ranks(*(given.get(k) for k in (
                                 "num_processes", "num_nodes", "node_rank", "config_file"))))
        except KeyboardInterrupt:   # the first widget cell of a kernel imports ipywidgets
            if mode == "text":
                raise RunInterrupted.before_start("the stop came while the cell's view was being made") from None
            raise RunInterrupted.before_start("the live view was still loading (ipywidgets, once per "
                                              "kernel)") from None

    def _execute_background(self, placement, cfg, payload, presenter, control):
        """In a background run's thread: the run, on a socket of its own."""
        import zmq

        events = None
        try:
            events = self.state.launcher.channel(zmq.PULL, f"bg{time.monotonic_ns()}")
            return execute(placement, cfg, payload, on_event=presenter, heartbeat=CELL_HEARTBEAT,
                           log_dir=presenter.log_dir, excerpt=presenter.excerpt, control=control, events=events,
                           ask=control.questions.ask)   # answered by the handle's debug()
        except DistributedRunError as exc:
            if exc.held is not None:   # its socket stays open for the held ranks' post-mortem (h.debug())
                if getattr(exc.held.reach, "channel", None) is not None:   # its own socket: the reach closes it
                    exc.held.reach.channel = events
                    events = None
                self.state.keep_failed(exc.held)
            raise
        finally:
            payload.release()
            if events is not None:
                events[0].close(linger=0)
            presenter.finish()

    def start_background(self, presenter, target, label: str, where: str = "", owner: object = None,
                         release: Optional[Callable[[], None]] = None):
        """Start ``target(control)`` in its own thread; the handle the cell returns.
        ``owner``: the session whose ranks it runs on (stopping that session stops
        it, and no other background run).  ``release``: what ``target`` frees
        when it ends (its payload's shared memory of big globals).

        Nothing is left over if this fails: a run that never started (no
        thread to be had) has ``release`` called here and its view taken
        away.  The stop button pressed from here on is held back until the
        cell ends (see background_stop), then stops that run (it ends by
        itself, as after ``h.stop()``, and frees its payload) and is the
        cell's error, one line.
        """
        from accel_magics.kernel_ext.kernel.background import BackgroundRun
        from accel_magics.kernel_ext.sigint import sigint_deferred

        from .background_handle import BackgroundCell

        run = None
        # From here a press is the run's stop, held until the cell's end
        # (see background_stop): one line, whenever it lands.
        held = sigint_deferred().__enter__()
        try:
            run = BackgroundRun(target, name=label, on_done=lambda run: self.state.background_runs.discard(run),
                                owner=owner, started=presenter.started)
            self.state.background_runs.add(run)
            handle = BackgroundCell(run, label, self.deliver, where)
        except BaseException as exc:
            pressed = held.release()
            if run is None:
                if release is not None:
                    release()
                presenter.discard()
            else:
                run.stop()
            if isinstance(exc, KeyboardInterrupt) or pressed:
                raise RunInterrupted.before_start("the stop came as the background run started") from None
            raise
        self.stops.hold_to_cell_end(held, run, label)
        return handle

    def deliver(self, result):
        """A finished run's outcome in the notebook: the --return names
        assigned, rank 0's last expression returned (errors for what could not come)."""
        user_ns = self.shell.user_ns
        user_ns.update(result.returns)
        if result.missing:
            raise ReturnNameError(
                f"--return: rank 0 did not define {', '.join(repr(n) for n in result.missing)} "
                "(the run itself succeeded; its output is above)."
            )
        if result.unloadable:
            raise ReturnValueError(
                "--return: " + "; ".join(f"{name!r} could not be brought back ({value.error}); rank 0 had "
                                         f"{value!r}" for name, value in result.unloadable.items())
                + ". It was not assigned. The run itself succeeded; the other names were assigned. Return "
                "plain data (numbers, tensors, arrays, dicts), or save the object to a file in the cell."
            )
        if result.has_value:
            if isinstance(result.value, RemoteRepr):
                print(f"accel_magics: rank 0's result could not be brought back ({result.value.error}); "
                      "shown is its repr.", file=sys.stderr)
            return result.value
        return None

    @magic_arguments()
    @launch_options
    @argument("--reset", action="store_true", help="Forget every default set before.")
    @line_magic
    def distributed_config(self, line: str):
        """Set the defaults of later ``%%distributed`` cells.

        With no arguments (in a notebook), shows a form for them, validated as
        you type, with the equivalent command line.  With arguments, sets those
        defaults (scriptable) and prints them.  Flags in a cell still win.

        Example, on node 1 of 2::

            %distributed_config --num_nodes 2 --node_rank 1 --master_addr 10.0.0.5 --master_port 29500
        """
        args = parse_options(self.distributed_config, line)
        if args.reset:
            self.state.defaults = {}
        given = flags_of(args)
        if not given and not args.reset:
            kernel = getattr(self.shell, "kernel", None)
            if kernel is not None and getattr(kernel, "_allow_stdin", True):
                self.form.show()
                return None   # headless executors (no input(), no person) get the text below
        candidate = {**self.state.defaults, **given}
        problem = self.launch_defaults.check(candidate)
        if problem:
            raise UsageError(f"{problem}\nThe defaults were not changed.")
        self.state.defaults = candidate
        self.form.follow()
        print(config_summary(self.effective_defaults()))
        if describe_allocation():
            print(describe_allocation())
        return None

    # -- defaults (defaults.py) ------------------------------------------
    def effective_defaults(self) -> dict:
        """Every default as a cell gets it: built-in, the traits, then %distributed_config's."""
        return self.launch_defaults.effective()

    def launch_config(self, args, wait: bool = True) -> LaunchConfig:
        """The run's configuration from the cell's flags and the defaults (see LaunchDefaults.launch_config)."""
        return self.launch_defaults.launch_config(args, wait)

    # -- steps ------------------------------------------------------------
    def cell_source(self, line: str, cell: str) -> str:
        """The cell as the ranks compile it: line numbers match the notebook's."""
        body = self.shell.transform_cell(cell)
        if "get_ipython()" in body and "get_ipython()" not in cell:
            raise UsageError(
                "IPython magics and shell escapes (lines starting with % or !) are not available inside a "
                "%%distributed cell: the ranks run plain Python. Run them in an ordinary cell.\n"
                "Nothing was launched."
            )
        return f"# %%distributed {line}\n{body}"

    def make_payload(self, source: str, return_names: list[str], defined: frozenset | set = frozenset(),
                 share: bool = True):
        count = self.cell_number()
        exclude = set(self.shell.user_ns_hidden) | {"In", "Out", "get_ipython", "exit", "quit"}
        exclude |= {name for name in self.shell.user_ns if _HISTORY_NAME.match(name)}
        try:
            return build_payload(
                source, self.shell.user_ns, filename=f"Cell In[{count}]",   # as IPython names a cell: one label in tracebacks and stacks
                exclude=exclude, return_names=return_names, code_label=self.names.cell_label, defined=defined,
                share=share,
            )
        except PayloadError as exc:
            raise UsageError(f"{exc}\nNothing was launched.") from None
        except SyntaxError as exc:
            # Shown like IPython shows a syntax error in an ordinary cell; the
            # line numbers are the notebook cell's (line 1 is the magic).
            text = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
            hint = ""
            if "'await' outside" in str(exc.msg) or "asynchronous comprehension outside" in str(exc.msg):
                hint = ("\nTop-level await does not work in a %%distributed cell (each rank runs the cell as a "
                        "script): put the code in an async function and call asyncio.run(main()).")
            raise UsageError(f"the cell has a syntax error:\n{text}{hint}\nNothing was launched.") from None

    def close(self) -> None:
        self.tracker.uninstall()
        self.state.close()
        SHARED.clear()   # the big globals kept in shared memory for the next cells: nobody will send them
