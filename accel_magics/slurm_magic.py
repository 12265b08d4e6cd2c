"""``%%distributed --launcher slurm``: one cell on every node of the allocation.

The engine side is ``kernel_ext.kernel.slurm`` (agents started once per allocation
with srun, one run per node, merged); this module checks the flags against
the allocation before anything starts and adapts the run to IPython.
"""
from __future__ import annotations

from IPython.core.error import UsageError

from accel_magics.kernel_ext.environment import ConfigError, LaunchConfig, validate
from accel_magics.kernel_ext.kernel.errors import LauncherError, RunInterrupted
from accel_magics.kernel_ext.kernel.slurm import AgentGone, SlurmAgents, SlurmError, allocation, run_slurm

from .magics import LAUNCH_OPTION_NAMES, _return_names


def slurm_cell(magics, args, line: str, cell: str, started: float):
    explicit = {**magics.defaults,
                **{name: getattr(args, name) for name in LAUNCH_OPTION_NAMES if getattr(args, name) is not None}}
    if args.session or args.background:
        raise UsageError(f"--{'session' if args.session else 'background'} does not work with --launcher slurm "
                         "yet: run the cell in the foreground. Nothing was launched.")
    try:
        alloc = allocation()
    except SlurmError as exc:
        raise UsageError(f"{exc}\nNothing was launched.") from None
    for name, why in (("node_rank", "each node's rank is its place in the allocation"),
                      ("master_addr", "node 0 of the allocation hosts the rendezvous"),
                      ("config_file", "give its options as flags")):
        if explicit.get(name) is not None:
            raise UsageError(f"--{name} cannot be given with --launcher slurm ({why}). Nothing was launched.")
    if explicit.get("max_restarts"):
        raise UsageError("--max_restarts is not supported with --launcher slurm yet: restarts are not "
                         "coordinated across nodes. Nothing was launched.")
    num_nodes = explicit.get("num_nodes") or alloc["count"]
    if num_nodes > alloc["count"]:
        raise UsageError(f"--num_nodes {num_nodes}: the allocation (job {alloc['job']}, nodes "
                         f"{alloc['nodelist'] or '?'}) has only {alloc['count']} node(s). Ask for more "
                         f"(`salloc -N {num_nodes}`) or use fewer. Nothing was launched.")
    slurm_args = explicit.get("slurm_args") or ""
    return_names = _return_names(args.return_names)
    source = magics._source(line, cell)
    payload = magics._payload(source, return_names, share=False)
    agents = magics._slurm
    reuse = agents is not None and agents.matches(num_nodes, slurm_args)
    note = "" if reuse else (f"starting an agent on each of {num_nodes} node(s) of job {alloc['job']} "
                             "(srun; once per allocation, each imports torch)")
    presenter = magics._presenter(args, started, note=note)
    try:
        if not reuse:
            agents = _start_agents(magics, num_nodes, slurm_args)
        gpus = agents.nodes[min(agents.nodes)].get("gpu_count", 0)
        cfg = LaunchConfig(
            num_processes=explicit.get("num_processes") or gpus or 2, num_nodes=num_nodes, node_rank=0,
            master_addr="127.0.0.1", master_port=explicit.get("master_port"),
            mixed_precision=explicit.get("mixed_precision"), timeout=explicit.get("timeout"),
            rendezvous_timeout=explicit.get("rendezvous_timeout") or 300.0, stall_timeout=0)
        validate(cfg, gpu_count=gpus, allow_oversubscribe=args.oversubscribe, check_port=False)
    except (SlurmError, ConfigError) as exc:
        presenter.discard()
        payload.release()
        raise UsageError(f"{exc}\nNothing was launched.") from None
    except BaseException:
        presenter.discard()
        payload.release()
        raise
    try:
        try:
            result = run_slurm(agents, cfg, payload, on_event=presenter, heartbeat=0.25,
                               log_dir=presenter.log_dir, excerpt=presenter.excerpt)
        except AgentGone:
            # The check before this cell found every agent connected, but one's
            # connection was already going (an agent killed just before: the
            # kernel's side of the socket notices a moment later on a busy
            # machine). Nothing ran (the payload is not shared, so it is whole):
            # start the agents again, once, as a first cell would.
            agents = _start_agents(magics, num_nodes, slurm_args)
            result = run_slurm(agents, cfg, payload, on_event=presenter, heartbeat=0.25,
                               log_dir=presenter.log_dir, excerpt=presenter.excerpt)
    except LauncherError:
        agents.close()   # the agents (or srun) are gone: the next cell starts fresh ones
        magics._slurm = None
        raise
    finally:
        presenter.finish()
    return magics._deliver(result)


def _start_agents(magics, num_nodes: int, slurm_args: str) -> SlurmAgents:
    """Fresh agents for the allocation (any old ones closed), kept on the magics
    for the next cells.  The stop button while they start: nothing ran."""
    if magics._slurm is not None:
        magics._slurm.close()
    magics._slurm = None
    agents = SlurmAgents(num_nodes, slurm_args)
    try:
        agents.start()
    except KeyboardInterrupt:   # the stop button: start() already stopped srun and every agent
        raise RunInterrupted({}, [], note=" (the node agents were still starting: srun, then torch "
                             "on each node; nothing ran, and nothing is left on any node. Run the cell "
                             "again to start them)") from None
    magics._slurm = agents
    return agents


def describe_allocation() -> str:
    """One line for %distributed_config: the allocation this kernel is in, if any."""
    try:
        alloc = allocation()
    except SlurmError:
        return ""
    return (f"Slurm allocation: job {alloc['job']}, {alloc['count']} node(s): {alloc['nodelist']} "
            "(--launcher slurm runs on all of them)")


__all__ = ["slurm_cell", "describe_allocation"]
