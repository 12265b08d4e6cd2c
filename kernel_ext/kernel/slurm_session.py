"""A session's ranks on every node of a Slurm allocation (``%distributed_session start --launcher slurm``).

The Slurm placement's part of a session (:class:`placement.SessionAttempt`;
the session itself is :class:`session.DistributedSession`, the same as on one
machine): each node's agent (:mod:`..node_agent.slurm_agent`) starts that
node's part, a session supervisor like a local session's, and passes it the
cells and the stop; every node's supervisor reports straight to the kernel,
signed with a key both ends derive from the allocation's for the session.
A cell is read and stopped through a :class:`slurm.SlurmRun` with the
session-cell policy (``slurm.SESSION_CELL``): the nodes' messages are merged
into one cell's, a failure on one node recalls the ranks of the others to
their prompt, and the cell's session state is the nodes' together (lost if it
is lost on any node, which then ends it on every node).
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Optional

from .. import wire
from .errors import LauncherError, SessionGone
from .placement import Attempt, SessionAttempt
from ..timing import SESSION_START_WAIT as START_WAIT, SLURM_RECEIVE_SLICE

log = logging.getLogger("accel_magics.kernel.slurm_session")

#: What each node's launcher is given of a session's config (a run's: slurm.RUN_FIELDS).
SESSION_FIELDS = ("num_processes", "mixed_precision", "rendezvous_timeout", "extra_env")


class SlurmSessionRanks(SessionAttempt):
    """A session's ranks on every node of the allocation, through its agents
    (``placement``: a ``slurm.SlurmPlacement``)."""

    def __init__(self, placement, cfg) -> None:
        self.placement = placement
        self.agents = placement.agents
        self.cfg = cfg
        self.pids: dict[int, int] = {}
        self.node_of: dict[int, str] = {}

    @property
    def _nodes(self) -> list:
        """The session's nodes (SLURM_NODEID), in node-rank order: those of its agents."""
        return sorted(self.agents.nodes)

    def open(self) -> None:
        agents, cfg = self.agents, self.cfg
        if agents.proc is None:   # closed: the allocation or srun ended (a restart after it finds that)
            raise SessionGone("the node agents are gone (srun ended, or the allocation)")
        self.id = wire.new_id()
        self.verifier = wire.signed_session(wire.derive_key(agents.key, self.id))
        self.master_port = cfg.master_port or agents.free_port()
        for node_rank, node in enumerate(self._nodes):
            part = agents.node_part(cfg, node_rank, self.master_port, SESSION_FIELDS)
            agents.send(node, {"op": "session_start", "session": self.id, "cfg": part})
        self.node_of = agents.rank_nodes(cfg.num_processes)
        self._wait_ready(self._nodes)

    def _wait_ready(self, nodes: list) -> None:
        """Every node's ranks set up: "ready" from each node's supervisor."""
        started: dict = {}
        ready: set = set()
        deadline = time.monotonic() + START_WAIT
        while len(ready) < len(nodes):
            if time.monotonic() > deadline:
                raise SessionGone(f"the session's ranks did not set up within {START_WAIT:g}s on "
                                  f"node(s) {sorted(set(nodes) - ready)}")
            if not self.agents.alive:
                raise SessionGone("the node agents ended while the session started")
            for msg in self._messages(int(SLURM_RECEIVE_SLICE * 1000)):
                kind, node = msg.get("kind"), msg.get("node")
                if kind == "started":
                    started[node] = msg["pids"]
                elif kind == "ready":
                    ready.add(node)
                elif kind in ("session_lost", "rendezvous_failed", "supervisor_error", "finished",
                              "supervisor_exit"):
                    why = msg.get("lost") or msg.get("message") or "its ranks could not start"
                    raise SessionGone(f"the session could not start on node {node} "
                                      f"({self.agents.nodes[node]['nodename']}): {why}")
        self.pids = {rank: pid for pids in started.values() for rank, pid in pids.items()}

    def _messages(self, timeout_ms: int) -> list:
        """What the session's supervisors (verified with its key) and the agents
        said about it since the last look."""
        out = []
        if self.agents.events.poll(timeout_ms):
            out.extend(self.agents.node_messages(self.verifier, self.id))
        while True:
            msg = self.agents.receive(0)
            if msg is None:
                break
            if msg and msg.get("run_id") == self.id:
                out.append(msg)
        return out

    def cell(self, run_id: str, timeout: Optional[float]) -> Attempt:
        return self.placement.session_cell(self, run_id, timeout)

    def stop_id(self) -> str:
        """A fresh id: each node's part answers the stop under it (its "lost" comes apart, see lost_since)."""
        return wire.new_id()

    def send(self, op: str, content: dict) -> None:
        for node in self._nodes:
            self.agents.send(node, {"op": op, "session": self.id, "content": content})

    def lost_since(self) -> Optional[str]:
        if not self.agents.alive:
            return "the node agents are gone (srun ended, or the allocation)"
        for msg in self._messages(0):
            if msg.get("kind") in ("session_lost", "supervisor_exit"):
                node = msg.get("node")
                return (f"on node {node} ({self.agents.nodes[node]['nodename']}): "
                        f"{msg.get('lost') or 'its supervisor exited'}")
        return None

    def end(self, attempt: Optional[Attempt]) -> None:
        """Every node's part ended (its supervisor ends after its ranks): what is
        left anywhere is killed."""
        for node in self._nodes:
            try:
                self.agents.send(node, {"op": "kill", "session": self.id, "pids": []})
            except LauncherError:
                pass

    def release(self) -> None:
        if self.id and self.agents.proc is not None:
            self.end(None)

    def ended_under(self, exc: BaseException) -> None:
        self.agents.ended_under(exc)

    def locate(self, rows: list, current: Optional[str]) -> list:
        """Each rank's node; a rank on another host than this kernel's cannot be
        looked at from here (its state reads "remote")."""
        here = socket.gethostname()
        for row in rows:
            row["node"] = self.node_of.get(row["rank"])
            if self._host_of(row["rank"]) not in (None, here):
                row.update(state="remote", rss=None, gpu=None, cell=current)
        return rows

    def _host_of(self, rank: int) -> Optional[str]:
        name = self.node_of.get(rank)
        return next((hello.get("hostname") for hello in self.agents.nodes.values() if hello["nodename"] == name),
                    None)


__all__ = ["SlurmSessionRanks", "SESSION_FIELDS"]
