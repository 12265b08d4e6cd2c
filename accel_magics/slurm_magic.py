"""``%%distributed --launcher slurm``: one cell on every node of the allocation.

The engine side is ``kernel_ext.kernel.slurm`` (agents started once per allocation
with srun; the placement of every node); this module checks the flags against
the allocation before anything starts and adapts the run to IPython, through
the public API of :class:`magics.DistributedMagics`.
"""
from __future__ import annotations

from IPython.core.error import UsageError

from accel_magics.kernel_ext import options
from accel_magics.kernel_ext.environment import ConfigError, LaunchConfig, validate
from accel_magics.kernel_ext.kernel.errors import DistributedRunError, LauncherError, RunInterrupted
from accel_magics.kernel_ext.kernel.run import execute
from accel_magics.kernel_ext.kernel.session import DistributedSession
from accel_magics.kernel_ext.timing import CELL_HEARTBEAT
from accel_magics.kernel_ext.kernel.slurm import (AgentGone, SlurmAgents, SlurmError, SlurmPlacement, allocation,
                                                  describe_allocation, job_ended)

from . import rank_prompt
from .defaults import flags_of
from .magics import PLACEMENT_CELLS, return_names_of


def slurm_cell(magics, args, line: str, cell: str, started: float):
    """A ``--launcher slurm`` cell, in the foreground or (``--background``) in a
    thread of its own, with ``--max_restarts``: the modes of ``run.execute``
    on the allocation's placement (``kernel_ext.kernel.slurm.SlurmPlacement``).
    Sessions on the allocation: :func:`start_session` (``%distributed_session
    start --launcher slurm``); their cells go to ``session_magic.session_cell``."""
    state = magics.state
    explicit = {**magics.launch_defaults.given(), **flags_of(args)}
    if not magics.takes_input():   # nobody could type at a post-mortem (nbclient): a failed rank ends at once
        explicit["debug_hold"] = 0
    alloc, num_nodes = _check_flags(state, explicit)
    slurm_args = explicit.get("slurm_args") or ""
    return_names = return_names_of(args.return_names)
    source = magics.cell_source(line, cell)
    payload = magics.make_payload(source, return_names, share=False)
    agents = state.slurm_agents
    reuse = agents is not None and agents.matches(num_nodes, slurm_args)
    _keep_session(state, reuse)
    note = "" if reuse else (f"starting an agent on each of {num_nodes} node(s) of job {alloc['job']} "
                             "(srun; once per allocation, each imports torch)")
    presenter = magics.presenter(args, started, note=note, background=args.background)
    if args.background:
        label = f"In[{magics.cell_number()}]"
        handle = magics.start_background(presenter, lambda control: _run(
            state, explicit, payload, presenter, num_nodes, slurm_args, reuse, control), label=label,
            where=f"on Slurm job {alloc['job']}", release=payload.release)
        state.agents_used_by(handle)
        return handle
    return magics.deliver(_run(state, explicit, payload, presenter, num_nodes, slurm_args, reuse))


def _check_flags(state, explicit: dict) -> tuple[dict, int]:
    """The allocation and the node count, once the flags fit it and its agents are free."""
    try:
        alloc = allocation()
    except SlurmError as exc:
        raise UsageError(f"{exc}\nNothing was launched.") from None
    for name, why in options.NOT_ON_SLURM.items():
        if explicit.get(name) is not None:
            raise UsageError(f"--{name} cannot be given with --launcher slurm ({why}). Nothing was launched.")
    num_nodes = explicit.get("num_nodes") or alloc["count"]
    if num_nodes > alloc["count"]:
        raise UsageError(f"--num_nodes {num_nodes}: the allocation (job {alloc['job']}, nodes "
                         f"{alloc['nodelist'] or '?'}) has only {alloc['count']} node(s). Ask for more "
                         f"(`salloc -N {num_nodes}`) or use fewer. Nothing was launched.")
    check_agents_free(state)
    return alloc, num_nodes


def check_agents_free(state) -> None:
    """One reader of the agents at a time: a background cell (one-shot or a
    session's) that uses them makes another Slurm cell a UsageError."""
    busy = state.slurm_busy
    if busy is not None and not busy.done():
        raise UsageError(f"the allocation's node agents are running {busy.label} in the background: wait for "
                         f"it (h.wait()) or stop it (h.stop()) first. Nothing was launched.")


def _keep_session(state, reuse: bool) -> None:
    """A cell that needs other agents (another --num_nodes or --slurm_args) would
    end the session that runs on these: refused, saying how to go on."""
    session = state.session
    placed = getattr(session, "placement", None)
    if not reuse and isinstance(placed, SlurmPlacement) and session.alive and placed.agents.alive:
        agents = placed.agents
        raise UsageError(f"a session runs on the allocation's node agents ({agents.num_nodes} node(s)"
                         f"{', --slurm_args ' + repr(agents.slurm_args) if agents.slurm_args else ''}"
                         "): this cell needs other ones, which would end it. Use the session's --num_nodes "
                         "and --slurm_args, or `%distributed_session stop` first. Nothing was launched.")


def start_session(magics, given: dict) -> DistributedSession:
    """``%distributed_session start --launcher slurm``: the session's ranks on
    every node of the allocation, through its agents (started if need be)."""
    state = magics.state
    # restart reuses what was asked: the defaults apply anew
    asked, given = given, {**magics.launch_defaults.given(), **given}
    alloc, num_nodes = _check_flags(state, given)
    slurm_args = given.get("slurm_args") or ""
    agents = state.slurm_agents
    if agents is None or not agents.matches(num_nodes, slurm_args):
        print(f"accel_magics: starting an agent on each of {num_nodes} node(s) of job {alloc['job']} "
              "(srun; once per allocation, each imports torch)")
        try:
            agents = _start_agents(state, num_nodes, slurm_args)
        except SlurmError as exc:
            raise UsageError(f"{exc}\nNothing was started.") from None
    try:
        cfg = _config(agents, {**given, "max_restarts": asked.get("max_restarts")}, num_nodes)
    except ConfigError as exc:
        raise UsageError(f"{exc}\nNothing was started.") from None
    session = DistributedSession(SlurmPlacement(agents), cfg, options=asked)
    try:
        session.start()
    except LauncherError:
        agents.close()   # the agents (or srun) are gone: the next cell starts fresh ones
        state.forget_agents()
        raise
    return session


def _run(state, explicit: dict, payload, presenter, num_nodes: int, slurm_args: str, reuse: bool, control=None):
    """The run itself (in the kernel's thread, or a background run's): agents
    started if need be, the config checked against them, then ``execute``."""
    try:
        try:
            agents = state.slurm_agents if reuse else _start_agents(state, num_nodes, slurm_args)
            cfg = _config(agents, explicit, num_nodes)
        except (SlurmError, ConfigError) as exc:
            presenter.discard()
            raise UsageError(f"{exc}\nNothing was launched.") from None
        except BaseException:
            presenter.discard()
            raise
        try:
            try:
                return _execute(agents, cfg, payload, presenter, control)
            except DistributedRunError as exc:
                state.keep_failed(exc.held)   # %distributed_debug, or the background handle's .debug()
                raise
            except AgentGone:
                # The check before this cell found every agent connected, but one's
                # connection was already going (an agent killed just before: the
                # kernel's side of the socket notices a moment later on a busy
                # machine). Nothing ran (the payload is not shared, so it is whole):
                # start the agents again, once, as a first cell would.
                agents = _start_agents(state, num_nodes, slurm_args)
                return _execute(agents, cfg, payload, presenter, control)
        except LauncherError:
            agents.close()   # the agents (or srun) are gone: the next cell starts fresh ones
            state.forget_agents()
            raise
        finally:
            presenter.finish()
    finally:
        payload.release()


def _execute(agents, cfg, payload, presenter, control):
    return execute(SlurmPlacement(agents), cfg, payload, on_event=presenter, heartbeat=CELL_HEARTBEAT,
                   log_dir=presenter.log_dir, excerpt=presenter.excerpt, control=control,
                   ask=rank_prompt.ask if control is None else control.questions.ask)   # background: h.debug()


def _config(agents, explicit: dict, num_nodes: int) -> LaunchConfig:
    """The run's config on these agents' nodes (node 0's GPUs set the default
    count per node); raises ConfigError for one that cannot run."""
    gpus = agents.nodes[min(agents.nodes)].get("gpu_count", 0)
    cfg = LaunchConfig(
        num_processes=explicit.get("num_processes") or gpus or 2, num_nodes=num_nodes, node_rank=0,
        master_port=explicit.get("master_port"), max_restarts=options.value(explicit, "max_restarts"),
        mixed_precision=explicit.get("mixed_precision"), timeout=explicit.get("timeout"),
        rendezvous_timeout=options.value(explicit, "rendezvous_timeout"),
        stall_timeout=0,   # each node sees only its ranks; the kernel sees them all (fold.must_stop)
        debug_hold=options.value(explicit, "debug_hold"))
    validate(cfg, gpu_count=gpus, allow_oversubscribe=bool(explicit.get("oversubscribe")), check_port=False)
    return cfg


def _start_agents(state, num_nodes: int, slurm_args: str) -> SlurmAgents:
    """Fresh agents for the allocation (any old ones closed), kept in the state
    for the next cells.  The stop button while they start: nothing ran."""
    state.drop_agents()
    job = allocation()["job"]
    how = job_ended(job)   # asked only when agents start: a warm cell costs no squeue
    if how is not None:
        raise SlurmError(f"the allocation (job {job}) is gone: it {how}. Start a new allocation (salloc -N ...) "
                         "and a kernel inside it; this kernel's other work is unaffected.")
    agents = SlurmAgents(num_nodes, slurm_args)
    try:
        agents.start()
    except KeyboardInterrupt:   # the stop button: start() already stopped srun and every agent
        raise RunInterrupted.before_start("the node agents were still starting (srun, then torch on "
                                          "each node); nothing is left on any node") from None
    state.keep_agents(agents)
    return agents


PLACEMENT_CELLS["slurm"] = slurm_cell


__all__ = ["slurm_cell", "describe_allocation", "start_session", "check_agents_free"]
