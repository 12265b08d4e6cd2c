"""The defaults of the launch options, in layers, and the traits that hold them.

From the bottom, each layer over the one before:

1. the built-in values of the options table (``kernel_ext/options.py``),
   ``num_processes`` counted (one rank per GPU the ranks see, else 2);
2. the traits of ``DistributedMagics``, one per option, made here from the
   table: set in an IPython config file (``c.DistributedMagics.num_processes = 4``
   in ``ipython_config.py``) or with ``%config DistributedMagics.num_processes = 4``;
3. what ``%distributed_config`` (or its form) set;
4. a cell's own flags.

A default is *given* (it wins over an Accelerate config file's value and
over a Slurm allocation's node count, as a flag does) when layer 3 sets it,
or layer 2 sets it (in the config, or to a value other than the built-in one).
"""
from __future__ import annotations

import os
import types
from typing import Optional

from IPython.core.error import UsageError
from traitlets import All, Bool, Enum, Float, HasTraits, Int, TraitError, Unicode, validate

from accel_magics.kernel_ext import hooks, options
from accel_magics.kernel_ext.environment import ConfigError, LaunchConfig, cpu_count, visible_gpus
from accel_magics.kernel_ext.environment import validate as validate_config
from accel_magics.kernel_ext.kernel import accelerate_config
from accel_magics.kernel_ext.kernel.errors import RunInterrupted
from accel_magics.kernel_ext.kernel.placement import PlacementNotFound, find_placement

from .cell_modes import placement_class
from .state import MagicsState


def flags_of(args) -> dict:
    """The launch options given on a magic's line (parsed flags)."""
    return {name: getattr(args, name) for name in options.NAMES if getattr(args, name, None) is not None}


def _given(values: dict, name: str, default):
    """The value of ``name``, or ``default`` only where none was given (0 is a value)."""
    value = values.get(name)
    return default if value is None else value


def launch_config_of(values: dict) -> LaunchConfig:
    """The engine's LaunchConfig from option values (the built-in ones where none is given)."""
    num_nodes = options.value(values, "num_nodes")
    port = values.get("master_port")
    return LaunchConfig(
        num_processes=values["num_processes"],
        num_nodes=num_nodes,
        node_rank=options.value(values, "node_rank"),
        master_addr=options.value(values, "master_addr"),
        master_port=port if port is not None else (options.DEFAULT_MULTINODE_PORT if num_nodes > 1 else None),
        max_restarts=options.value(values, "max_restarts"),
        mixed_precision=values.get("mixed_precision"),
        timeout=values.get("timeout"),
        rendezvous_timeout=options.value(values, "rendezvous_timeout"),
        stall_timeout=options.value(values, "stall_timeout"),
        debug_hold=options.value(values, "debug_hold"),
        rendezvous_key=values.get("rendezvous_key"),
    )


# -- layer 2: the traits ------------------------------------------------------------
def _trait(option: options.Option):
    """The trait of one option: its type, choices, built-in default and help."""
    help_text, none = option.help if option.help.endswith(".") else f"{option.help}.", option.default is None
    if option.default_text:   # the trait's help says its default value itself
        help_text += f" None: {option.default_text}."
    if option.is_flag:
        trait = Bool(option.default, help=help_text)
    elif option.choices is not None:
        trait = Enum(option.choices, default_value=option.default, allow_none=none, help=help_text)
    else:
        kind = {int: Int, float: Float}.get(option.type, Unicode)
        trait = kind(default_value=option.default, allow_none=none, help=help_text)
    return trait.tag(config=True)


def configured(owner: HasTraits) -> dict:
    """The options the IPython config sets on ``owner`` (layer 2): those its
    config names, and those set to a value other than the built-in one."""
    section = type(owner).__name__
    values = {}
    for option in options.OPTIONS:
        value = getattr(owner, option.name)
        if value is not None and (value != option.default or f"{section}.{option.name}" in owner.config):
            values[option.name] = value
    return values


def config_problem(values: dict) -> str:
    """'' if the config's defaults ``values`` pass the checks that hold on any
    machine (how many GPUs or cores this one has, and the Slurm allocation,
    are checked by each cell); else what is wrong with them."""
    merged = {**options.DEFAULTS, "num_processes": 1, **values}
    try:
        find_placement(merged["launcher"])
        if merged.get("config_file") is not None:
            accelerate_config.resolve(merged["config_file"])
        validate_config(launch_config_of(merged), allow_oversubscribe=True, check_port=False,
                        kernel_env=os.environ)
    except PlacementNotFound as exc:
        return f"--launcher {merged['launcher']}: {exc}"
    except ConfigError as exc:
        return str(exc)
    return ""


def _check_config_value(self, proposal):
    """A value the config gives a trait: refused (TraitError) if the config's
    defaults could not launch with it.  Several values set at once (a config
    file) are checked together, once all are set."""
    name, value = proposal["trait"].name, proposal["value"]
    if value is None:
        return value
    problem = config_problem({**configured(self), name: value})
    if problem:
        raise TraitError(f"{type(self).__name__}.{name} = {value!r}: {problem}")
    return value


#: The traits of the launch options (a base of DistributedMagics), one per row of the options table.
LaunchOptionTraits = types.new_class("LaunchOptionTraits", (HasTraits,), exec_body=lambda ns: ns.update(
    {option.name: _trait(option) for option in options.OPTIONS},
    _check_config_value=validate(*options.NAMES)(_check_config_value),
    __doc__="The launch options' defaults as configurable traits (generated from kernel_ext/options.py)."))


# -- the layers together ---------------------------------------------------------
class LaunchDefaults:
    """The defaults of one kernel's cells: the traits of ``owner`` (layer 2)
    under the state's ``%distributed_config`` defaults (layer 3)."""

    def __init__(self, owner: HasTraits, state: MagicsState) -> None:
        self.owner = owner
        self.state = state
        self._configured: Optional[dict] = None   # configured(owner), until a trait or the config changes
        owner.observe(self.forget, names=All)

    def forget(self, change=None) -> None:
        """The traits or the config changed: layer 2 is read again (see :meth:`configured`)."""
        self._configured = None

    def configured(self) -> dict:
        """Layer 2 (:func:`configured`), read once per change of the owner's
        traits or config rather than several times a cell."""
        if self._configured is None:
            self._configured = configured(self.owner)
        return dict(self._configured)

    def given(self) -> dict:
        """The defaults chosen (layers 2 and 3): those that count as given."""
        return {**self.configured(), **self.state.defaults}

    def placement_name(self, given) -> str:
        """The placement a cell runs on: ``--launcher``, else the default set, else the built-in one."""
        return given or self.given().get("launcher") or options.DEFAULTS["launcher"]

    def ensure_known(self) -> None:
        """Wait for the launcher (it counts the GPUs) so defaults are right.
        The stop button meanwhile (the first cell of a kernel waits seconds
        while it imports torch) is a RunInterrupted that says nothing ran; the
        launcher goes on starting, for the next cell."""
        try:
            self.state.launcher.ensure_running()
        except KeyboardInterrupt:
            raise RunInterrupted.before_start("the launcher was still starting (it imports torch, "
                                              "once per kernel)") from None
        except Exception:  # reported by the next run; the form still works
            pass

    def _gpu_count(self) -> int:
        return (self.state.launcher.info or {}).get("gpu_count", 0)

    def effective(self, with_set: bool = True, count: bool = True) -> dict:
        """Every default as a cell gets it; ``with_set=False``: without layer 3.
        ``count=False``: num_processes is given, so the cores are not counted
        for its default (no read of the CPU quota)."""
        values = {option.name: option.default for option in options.OPTIONS if option.label}
        if count:   # one rank per GPU the ranks would see, else a CPU quota of 1 core: 1 rank
            gpus = visible_gpus(self._gpu_count(), LaunchConfig(num_processes=1), os.environ)
            values["num_processes"] = gpus or min(2, cpu_count())
        values.update(self.configured())
        if with_set:
            values.update(self.state.defaults)
        return values

    def check(self, values: dict) -> str:
        """'' if these defaults can launch, else what is wrong with them."""
        merged = {**self.effective(), **values}
        try:
            placement_class(self.placement_name(merged.get("launcher")), nothing="")
        except UsageError as exc:
            return str(exc).strip()
        if merged.get("launcher") == "slurm":
            from accel_magics.kernel_ext.kernel.slurm import SlurmError, allocation

            try:
                alloc = allocation()
            except SlurmError as exc:
                return str(exc)
            if merged.get("num_nodes", 1) > alloc["count"]:
                return f"the allocation has {alloc['count']} node(s); --num_nodes {merged['num_nodes']} needs more."
            return ""   # nodes, ranks and the master address come from the allocation
        if merged.get("config_file") is not None:
            try:
                accelerate_config.resolve(merged["config_file"])
            except ConfigError as exc:
                return str(exc)
        try:
            validate_config(launch_config_of(merged), gpu_count=self._gpu_count(), check_port=False,
                            allow_oversubscribe=bool(merged.get("oversubscribe")), kernel_env=os.environ)
        except ConfigError as exc:
            return str(exc)
        return ""

    def apply_form(self, values: dict) -> None:
        """The config form's values as layer 3: only those that differ from the
        layers under it (or were set before), so a value the user never chose
        does not count as given (it would win over an Accelerate config file's)."""
        saved, baseline = self.state.defaults, self.effective(with_set=False)
        kept = {k: v for k, v in saved.items() if k not in values}   # options the form does not show
        chosen = {k: v for k, v in values.items() if v is not None and (v != baseline.get(k) or k in saved)}
        self.state.defaults = {**kept, **chosen}

    def launch_config(self, args, wait: bool = True) -> LaunchConfig:
        """The run's configuration from the cell's flags and the defaults.
        ``wait=False``: without waiting for the launcher (the GPUs it counts
        are not known yet): only what holds whatever their number is checked."""
        if wait:
            self.ensure_known()
        explicit = {**self.given(), **flags_of(args)}
        values = self.effective(count=explicit.get("num_processes") is None)
        extra_env = {}
        if explicit.get("config_file") is not None:
            from_file, extra_env = self._from_accelerate_config(explicit)
            values.update(from_file)
        values.update(explicit)
        cfg = launch_config_of(values)
        cfg.extra_env = extra_env
        try:
            validate_config(cfg, gpu_count=self._gpu_count(), kernel_env=os.environ,
                            allow_oversubscribe=bool(values.get("oversubscribe")) or not wait)
        except ConfigError as exc:
            raise UsageError(f"{exc}\nNothing was launched.") from None
        try:
            hooks.check_names(os.environ)   # a typo would turn nothing off, silently
        except hooks.UnknownHook as exc:
            raise UsageError(f"{exc}\nNothing was launched.") from None
        return cfg

    @staticmethod
    def _from_accelerate_config(explicit: dict) -> tuple[dict, dict]:
        """The topology and the ranks' environment from ``--config_file``,
        computed by Accelerate's launch code; options given explicitly win."""
        value = explicit["config_file"]
        try:
            plain = accelerate_config.load(value, {})
            nodes = explicit.get("num_nodes") or plain.num_machines
            per_node = explicit.get("num_processes") or plain.processes_per_node
            flags = {"num_machines": nodes, "mixed_precision": explicit.get("mixed_precision")}
            if per_node:
                flags["num_processes"] = per_node * nodes
            if nodes > 1:
                flags["machine_rank"] = _given(explicit, "node_rank", plain.machine_rank)
            launch = accelerate_config.load(value, {k: v for k, v in flags.items() if v is not None})
        except ConfigError as exc:
            raise UsageError(f"{exc}\nNothing was launched.") from None
        topology = {"num_nodes": launch.num_machines, "node_rank": launch.machine_rank}
        if launch.processes_per_node:
            topology["num_processes"] = launch.processes_per_node
        if launch.num_machines > 1:   # a one-node run takes a fresh free port on 127.0.0.1
            topology.update({k: v for k, v in (("master_addr", launch.main_process_ip),
                                                ("master_port", launch.main_process_port)) if v})
        env = dict(launch.env)
        if env.get("ACCELERATE_USE_CPU", "").lower() in ("false", "0", "no"):
            env.pop("ACCELERATE_USE_CPU")   # ours: true on a machine without GPUs, absent with them
        return topology, env
