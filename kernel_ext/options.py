"""The launch options: one table that the parser, the config form,
``%distributed_config``, the help, the engine's ``LaunchConfig`` and the
Slurm and session checks are all built from.

Each :class:`Option` says its flag, type, choices, built-in default (and how
the help words it), its label in the config form, and what it is to a
session (fixed when the session starts) and to ``--launcher slurm`` (refused
there, and why).  A new option is one row here; nothing else writes a
default down.  No IPython here: the engine and the views read it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")
#: A multi-node run's port when none is given (torchrun's).
DEFAULT_MULTINODE_PORT = 29500


@dataclass(frozen=True)
class Option:
    name: str
    type: type = str
    default: object = None            # the built-in value; None: none (or computed: see default_text)
    help: str = ""
    default_text: str = ""            # how the help words a computed default ("one per local GPU, ...")
    short: tuple = ()                 # more flags ("-n")
    choices: Optional[tuple] = None
    metavar: Optional[str] = None
    label: str = ""                   # the config form's field ("" for none)
    session_fixed: bool = False       # a session's, fixed when it starts: refused on its cells
    not_on_slurm: str = ""            # why --launcher slurm refuses it ("" : allowed)
    # Choices found when asked (the placements' registry): name -> what it is ("" : said in help), for the help;
    # the parser takes any value, and the magics refuse an unknown one, saying which there are.
    found: Optional[Callable[[], dict]] = None

    def choice_names(self) -> Optional[tuple]:
        """The values it takes (None: any): ``choices``, or those ``found`` now."""
        return tuple(self.found()) if self.found is not None else self.choices

    @property
    def is_flag(self) -> bool:
        """Given with no value (``--oversubscribe``)."""
        return self.type is bool

    @property
    def flags(self) -> tuple:
        return (*self.short, f"--{self.name}")

    def help_text(self) -> str:
        """The help, with the default said once, from this row."""
        if self.found is not None:   # those there are now, each plug-in with what it is
            listed = ", ".join(f"{name} ({what})" if what else name for name, what in self.found().items())
            return f"{self.help} Installed: {listed}. Default: {self.default}."
        if self.default_text:
            return f"{self.help} Default: {self.default_text}."
        if self.default is None or self.is_flag:
            return self.help
        value = f"{self.default:g}" if isinstance(self.default, float) else self.default
        return f"{self.help} Default: {value}." if self.help.endswith(".") else f"{self.help} (default {value})."


def _placements() -> dict:
    """The placements ``--launcher`` takes: name -> what it is (kernel/placement.py's registry)."""
    from .kernel.placement import placement_descriptions

    return placement_descriptions()


OPTIONS: tuple[Option, ...] = (
    Option("num_processes", int, None, "Processes (ranks) on this node (with --launcher slurm: on each node).",
           default_text="one per local GPU, or 2 on a CPU-only machine", short=("-n",), label="processes / node",
           session_fixed=True),
    Option("num_nodes", int, 1, "Nodes taking part (with --launcher slurm, the allocation's when not given)",
           label="nodes", session_fixed=True),
    Option("node_rank", int, 0, "This node's rank, 0 .. num_nodes-1", label="this node's rank", session_fixed=True,
           not_on_slurm="each node's rank is its place in the allocation"),
    Option("master_addr", str, "127.0.0.1", "Address of node 0, where the rendezvous runs", label="master address",
           session_fixed=True, not_on_slurm="node 0 of the allocation hosts the rendezvous"),
    Option("master_port", int, None, "Rendezvous port.",
           default_text=f"a fresh free port per run ({DEFAULT_MULTINODE_PORT} for multi-node)", label="master port",
           session_fixed=True),
    Option("max_restarts", int, 0, "Re-run the whole group up to this many times after a rank fails",
           label="max restarts", session_fixed=True),
    Option("mixed_precision", str, None, "Passed to Accelerate as ACCELERATE_MIXED_PRECISION.",
           choices=MIXED_PRECISION_CHOICES, label="mixed precision", session_fixed=True),
    Option("output", str, "auto", "How the run is shown: a live widget, or [rank N] text lines; auto: the widget "
           "in a notebook", choices=("auto", "widget", "text"), label="output"),
    Option("timeout", float, None, "Stop the run after this many seconds and show where each rank was (each "
           "attempt's own limit with --max_restarts; a timeout is not restarted).",
           label="timeout (s)"),
    Option("rendezvous_timeout", float, 300.0, "Multi-node: how long the nodes wait for each other before giving up",
           label="rendezvous timeout (s)", session_fixed=True),
    Option("rendezvous_key", str, None, "Kernel per node: a secret every node's cell is given (the same on each), "
           "that signs the failures a node tells the others through node 0's store: a failure that is not signed "
           "with it (any process that reaches the store's port can write one) is said to be unverified, and is "
           "never taken over a failure seen on this node. Shown as set, never written out.",
           metavar="SECRET", session_fixed=True,
           not_on_slurm="the kernel reads every node's failures itself, over the agents' authenticated channel"),
    Option("config_file", str, None, "An Accelerate config file (`accelerate config`), or `default` for "
           "Accelerate's default one: the ranks get the environment `accelerate launch --config_file` would give "
           "them (mixed precision, FSDP, DeepSpeed, dynamo...), and its processes/machines unless given here.",
           metavar="PATH", label="Accelerate config", session_fixed=True, not_on_slurm="give its options as flags"),
    Option("launcher", str, "local", "Where the ranks run, a placement: local: ranks on this machine (one kernel "
           "per node for several); slurm: on every node of the Slurm allocation this kernel runs in (its "
           "SLURM_JOB_ID): --num_processes per node, --num_nodes defaults to the allocation's node count. More come "
           "as plug-ins (see accel_magics.placements).", metavar="NAME", label="launcher", found=_placements),
    Option("slurm_args", str, None, "--launcher slurm: extra srun arguments for the node agents' step, quoted "
           "(e.g. \"--gres=gpu:4 --cpus-per-task=8\").", metavar="ARGS", session_fixed=True),
    Option("stall_timeout", float, 30.0, "When a rank, after another rank finished the cell, uses no CPU and "
           "prints nothing for this many seconds: stop the run if it is stuck where nothing can move it (its "
           "interpreter blocked, a collective the finished rank will never join) and show where; a rank that "
           "only waits (a sleep, a subprocess, a socket) is named, not stopped; 0: never look",
           label="stall check (s)", session_fixed=True),
    # No percent sign in a help (argparse formats it): the magics are named without theirs.
    Option("debug_hold", float, 300.0, "After a rank fails, keep it as it failed (its frames, "
           "its memory, GPU memory included) for this many seconds, so that the distributed_debug magic can open "
           "a post-mortem (pdb) in its failing frame; the next distributed cell lets it go at once; nothing is "
           "kept where no rank failed; 0: a failed rank ends at once"),
    # A flag (no value): a default too, so a CPU machine's 8-rank notebook sets it once.
    Option("oversubscribe", bool, False, "Allow more processes than GPUs (or than 4x the CPU cores on a CPU-only "
           "machine).", label="oversubscribe", session_fixed=True),
)

BY_NAME = {option.name: option for option in OPTIONS}
NAMES = tuple(BY_NAME)
#: The built-in defaults that are plain values (the others are computed or none).
DEFAULTS = {option.name: option.default for option in OPTIONS if option.default is not None}
SESSION_FIXED = tuple(option.name for option in OPTIONS if option.session_fixed)
NOT_ON_SLURM = {option.name: option.not_on_slurm for option in OPTIONS if option.not_on_slurm}


def value(values: dict, name: str):
    """``values[name]``, else the built-in default (0 is a value, None is not)."""
    given = values.get(name)
    return DEFAULTS.get(name) if given is None else given


__all__ = ["Option", "OPTIONS", "BY_NAME", "NAMES", "DEFAULTS", "SESSION_FIXED", "NOT_ON_SLURM", "value",
           "MIXED_PRECISION_CHOICES", "DEFAULT_MULTINODE_PORT"]
