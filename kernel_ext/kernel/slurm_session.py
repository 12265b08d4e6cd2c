"""A session on every node of a Slurm allocation (``%distributed_session start --launcher slurm``).

The same session as on one machine (:mod:`session`: ranks that live across
cells, one cell at a time, the names rule), placed on the allocation's
nodes: each node's agent (:mod:`..node_agent.slurm_agent`) starts that node's
part, a session supervisor like a local session's, and passes it the cells
and the stop; every node's supervisor reports straight to the kernel, signed
with a key both ends derive from the allocation's for the session.  A cell is
a :class:`SlurmSessionCell`, the Slurm attempt (:class:`slurm.SlurmRun`) of
a cell that was sent rather than dispatched: the nodes' messages are merged
into one cell's, a failure on one node recalls the ranks of the others to
their prompt, and the cell's session state is the nodes' together (lost if it
is lost on any node, which then ends it on every node).
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import time
import uuid
from typing import Optional

from .. import wire
from ..environment import LaunchConfig
from .errors import LauncherError
from .run_handle import receive_verified
from .session import DistributedSession, SessionGone
from .slurm import SESSION_FIELDS, SlurmAgents, SlurmJobGone, SlurmRun
from ..timing import SESSION_START_WAIT as START_WAIT, SESSION_STOP_WAIT, SLURM_RECEIVE_SLICE

log = logging.getLogger("accel_magics.kernel.slurm_session")


class SlurmSessionCell(SlurmRun):
    """One cell (or the stop) of a session on every node: sent by the session,
    read and stopped here (see the module doc)."""

    PEERS_FAILED = "interrupt"   # the other nodes' ranks are recalled to their prompt, as on one node
    PART_GONE = "the session's supervisor on node {node} ({name}) exited during the cell, without its answer"

    def __init__(self, session: "SlurmSession", run_id: str, timeout: Optional[float]) -> None:
        cfg = dataclasses.replace(session.cfg, timeout=timeout, master_port=session.master_port)
        self.route = {"session": session.id}
        self.part_id = session.id
        self.stop_wait = SESSION_STOP_WAIT   # a recall to the prompt, inside each node's session ladder
        super().__init__(session.agents, cfg, None, "", None, run_id=run_id, key_of=session.id)
        self.session_cell = True
        self.rendezvous_at = None   # the session's world formed when it started

    def _dispatch(self, payload, log_dir: str, excerpt, attempt: int) -> None:
        """Nothing: the session sends the cell itself (``SlurmSession._send``)."""

    def close(self) -> None:
        """Nothing to release: the session's nodes keep their store and ranks."""


class SlurmSession(DistributedSession):
    """A :class:`session.DistributedSession` whose ranks are on every node of
    the allocation (the placement hooks of the base class, for the agents)."""

    def __init__(self, agents: SlurmAgents, cfg: LaunchConfig, options: Optional[dict] = None) -> None:
        super().__init__(None, cfg, options)
        self.agents = agents
        self.node_of: dict[int, str] = {}

    # -- the placement hooks --------------------------------------------------------------
    def _open(self) -> None:
        agents, cfg = self.agents, self.cfg
        self.id = uuid.uuid4().hex[:12]
        self.verifier = wire.signed_session(wire.derive_key(agents.key, self.id))
        self.master_port = cfg.master_port or agents.free_port()
        for node_rank, node in enumerate(self._nodes):
            part = agents.node_part(cfg, node_rank, self.master_port, SESSION_FIELDS)
            try:
                agents.send(node, {"op": "session_start", "session": self.id, "cfg": part})
            except LauncherError:
                self._forget()
                raise
        self.node_of = agents.rank_nodes(cfg.num_processes)
        self._wait_ready(self._nodes)

    @property
    def _nodes(self) -> list:
        """The session's nodes (SLURM_NODEID), in node-rank order: those of its agents."""
        return sorted(self.agents.nodes)

    def _wait_ready(self, nodes: list) -> None:
        """Every node's ranks set up: "ready" from each node's supervisor."""
        started: dict = {}
        ready: set = set()
        deadline = time.monotonic() + START_WAIT
        try:
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
        except BaseException:
            self._forget()
            raise
        self.pids = {rank: pid for pids in started.values() for rank, pid in pids.items()}
        self.alive = True

    def _messages(self, timeout_ms: int) -> list:
        """What the session's supervisors (verified with its key) and the agents
        said about it since the last look."""
        out = []
        if self.agents.events.poll(timeout_ms):
            while True:
                msg, _ = receive_verified(self.agents.events, self.verifier, self.id)
                if msg is None:
                    break
                msg["node"] = self._nodes[msg.get("node_rank", 0)]
                out.append(msg)
        while True:
            msg = self.agents.receive(0)
            if msg is None:
                break
            if msg and msg.get("run_id") == self.id:
                out.append(msg)
        return out

    def _stop_id(self) -> str:
        """A fresh id: each node's part answers the stop under it (its "lost" comes apart, see _lost_since)."""
        return uuid.uuid4().hex[:12]

    def _send(self, op: str, content: dict) -> None:
        for node in self._nodes:
            self.agents.send(node, {"op": op, "session": self.id, "content": content})

    def _handle(self, run_id: str, timeout: Optional[float]) -> SlurmSessionCell:
        return SlurmSessionCell(self, run_id, timeout)

    def _learn(self, modules: list) -> None:
        """Nothing: each node's launcher preloads for runs, not for a session."""

    def _lost_since(self) -> Optional[str]:
        if not self.agents.alive:
            return "the node agents are gone (srun ended, or the allocation)"
        for msg in self._messages(0):
            if msg.get("kind") in ("session_lost", "supervisor_exit"):
                node = msg.get("node")
                return (f"on node {node} ({self.agents.nodes[node]['nodename']}): "
                        f"{msg.get('lost') or 'its supervisor exited'}")
        return None

    def _wait_gone(self, handle) -> None:
        """Every node's part ended (its supervisor ends after its ranks): what is
        left anywhere is killed."""
        for node in self._nodes:
            try:
                self.agents.send(node, {"op": "kill", "session": self.id, "pids": []})
            except LauncherError:
                pass

    def _ended_under(self, exc: LauncherError) -> None:
        """The allocation ended under the cell (scancel, its time limit), or
        srun did: the agents are gone for good, so their two ports on the
        cluster network, srun's log and its pipes are let go now, not at the
        next cell (which says the allocation is gone) or the kernel's end."""
        proc = self.agents.proc
        if isinstance(exc, SlurmJobGone) or proc is None or proc.poll() is not None:
            self.agents.close()

    def _forget(self) -> None:
        if self.id and self.agents is not None and self.agents.proc is not None:
            self._wait_gone(None)
        self.alive = False
        self.owned.clear()

    def status(self) -> list[dict]:
        """As on one machine, with each rank's node; a rank on another host than
        this kernel's cannot be looked at from here (its state reads "remote")."""
        here = socket.gethostname()
        remote = {rank for rank in self.pids
                  if self._host_of(rank) not in (None, here)}
        rows = super().status()
        for row in rows:
            row["node"] = self.node_of.get(row["rank"])
            if row["rank"] in remote:
                row.update(state="remote", rss=None, gpu=None, cell=self.current)
        return rows

    def _host_of(self, rank: int) -> Optional[str]:
        name = self.node_of.get(rank)
        return next((hello.get("hostname") for hello in self.agents.nodes.values() if hello["nodename"] == name),
                    None)


__all__ = ["SlurmSession", "SlurmSessionCell"]
