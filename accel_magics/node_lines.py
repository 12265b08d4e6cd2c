"""The line each other node runs, from this kernel's defaults (``%distributed_config``).

With one kernel per node, every node's cell is the same but for its
``--node_rank``; the line shown for a node is the whole of it (its rank, the
rendezvous port spelled out), so that it can be copied to that machine as it
is.  A plain function of the defaults and of how a line is written (the
magic's ``command_line``), tested with recorded values.
"""
from __future__ import annotations

import ipaddress
from typing import Callable

from accel_magics.kernel_ext import options

#: Addresses that reach node 0 only from node 0's own machine.
_HERE_ONLY = ("localhost", "0.0.0.0", "::")


def reaches_this_machine_only(host: str) -> bool:
    if host in _HERE_ONLY:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def other_node_lines(values: dict, command_line: Callable[[dict], str], hostname: str = "") -> list[str]:
    """For several nodes: one line per other node, ``--node_rank`` included
    (none for one node).  ``hostname``: this machine's name, said where the
    master address reaches only this machine and this kernel is node 0."""
    nodes = options.value(values, "num_nodes")
    if nodes < 2 or values.get("launcher") == "slurm":   # Slurm: this kernel runs every node itself
        return []
    me = options.value(values, "node_rank")
    port = values.get("master_port") or options.DEFAULT_MULTINODE_PORT
    common = command_line({**values, "node_rank": None, "master_port": port}).replace(
        "--rendezvous_key <set>", "--rendezvous_key <the same key>")
    host = options.value(values, "master_addr")
    if "--master_addr" not in common:   # the default, spelled out: the line is the whole of it
        common += f" --master_addr {host}"
    lines = [f"on node {node}, run: {common} --node_rank {node}" for node in range(nodes) if node != me]
    if reaches_this_machine_only(host):
        where = f" (this machine is {hostname})" if me == 0 and hostname else ""
        lines.append(f"note: --master_addr {host} reaches node 0 from its own machine only; for nodes on other "
                     f"machines give node 0's address or host name{where}, the same on every node")
    return lines
