"""A supervisor's part in a run of several nodes: the rendezvous, the other
nodes' failures and departures, and the nodes' common end.

One node hosts or reaches the run's store (:class:`rendezvous.NodeRendezvous`,
node 0 hosts it) before its ranks start; while they run, a node whose kernel
is its own (one kernel per node) looks at the other nodes' failure flags
every ``REMOTE_CHECK`` and says why it stops when that is news to them; at
the end node 0 keeps the store up until every node is done.  Nodes the
kernel dispatched together (``--launcher slurm``) skip the count-in and the
looks: the kernel watches them all.
"""
from __future__ import annotations

import logging
import selectors
import socket
import time
from typing import Optional

from . import node_notes, rendezvous
from .node_liveness import NodeLiveness
from .rendezvous import CHECKED, FINISHED, NodeRendezvous, RendezvousTimeout
from ..timing import FINISH_WAIT, NODE_BEAT, NODE_LOST_AFTER, NODE_STORE_WAIT, RDZV_NOTE_EVERY, RDZV_NOTE_QUIET, \
    RDZV_POLL, REMOTE_CHECK, REMOTE_WAIT

log = logging.getLogger("accel_magics.supervisor")


class Nodes:
    """The node side of one supervisor (see the module doc); ``run`` is the
    supervisor: its spec, its loop (``poll``), its channel (``send``), its stop."""

    def __init__(self, run) -> None:
        self.run = run
        self.rdzv: Optional[NodeRendezvous] = None
        self.remote_check: Optional[float] = None   # the next look at the other nodes (a kernel per node)
        self.departures_seen = 0   # other nodes' ranks that left, relayed so far
        self.liveness: Optional[NodeLiveness] = None   # a kernel per node: is every other node still there?
        self.peers_done = False   # runs dispatched together: the kernel said every node is done

    @property
    def spec(self) -> dict:
        return self.run.spec

    # -- before the ranks start -------------------------------------------------------
    def rendezvous(self, spec: dict) -> None:
        """Host (node 0) or reach the run's store; with several nodes, wait for all.

        Interruptible, bounded by the rendezvous timeout; progress goes to the
        kernel once a second ("waiting for 1 of 2 nodes at 10.1.2.3:29500").
        """
        nodes = spec["num_nodes"]
        self.rdzv = NodeRendezvous(spec["master_addr"], spec["master_port"], nodes, spec["node_rank"],
                                   spec["rdzv_timeout"], attempt=spec.get("attempt", 0))
        try:
            self._meet(spec)
        except RendezvousTimeout as exc:
            self.run.rendezvous_failed(str(exc))
        except Exception as exc:   # e.g. node 0 could not listen on the port
            self.run.rendezvous_failed(self._failure(spec, exc))

    def _meet(self, spec: dict) -> None:
        if spec["num_nodes"] == 1 or (spec.get("dispatched_together") and spec["node_rank"] == 0):
            if not rendezvous.prebound:   # the store hook is off here: the store now, as torchrun's agent
                self.rdzv.host_store()
                return
            fd = self.rdzv.listen()
            self.run.sel.register(fd, selectors.EVENT_READ, ("store", None))
            return
        if spec.get("dispatched_together"):
            self._wait_for_nodes(self._node0_listening, quiet_for=RDZV_NOTE_QUIET)
            return
        if spec["node_rank"] == 0:
            self.rdzv.host_store()
        self._wait_for_nodes(self._count_in, quiet_for=0.0)

    def _failure(self, spec: dict, exc: Exception) -> str:
        nodes = spec["num_nodes"]
        if nodes > 1 and spec["node_rank"] == 0 and any(
                word in str(exc).lower() for word in ("address already in use", "eaddrinuse")):
            found = self.rdzv.whose_port(spec.get("rendezvous_key"))   # another node 0? it is told too
            return node_notes.second_node0_message(self.rdzv.address, self.rdzv.port, nodes, found)
        return (f"could not {'host' if spec['node_rank'] == 0 else 'reach'} the "
                f"rendezvous at {self.rdzv.address}: {type(exc).__name__}: {exc}")

    def _wait_for_nodes(self, joined_now, quiet_for: float) -> None:
        """Until ``joined_now()`` counts every node in, or the run is stopped;
        bounded by the rendezvous timeout.  Progress goes to the kernel once a
        second, the first time after ``quiet_for`` seconds."""
        nodes = self.spec["num_nodes"]
        last_note = time.monotonic() - RDZV_NOTE_EVERY + quiet_for
        while self.run.stopping is None:
            joined = joined_now()
            if joined >= nodes:
                return
            if time.monotonic() - last_note >= RDZV_NOTE_EVERY:
                last_note = time.monotonic()
                self.run.send({"kind": "waiting", "joined": joined, "expected": nodes,
                               "address": self.rdzv.address,
                               "problem": self.rdzv.problem(self.spec.get("rendezvous_key"))})
            self.rdzv.check_deadline(joined)
            self.run.poll(RDZV_POLL)

    def _count_in(self) -> int:
        """One kernel per node: count this node in on node 0's store; how many are in."""
        if self.rdzv.store is not None or self.rdzv.try_connect():
            return self.rdzv.join_step(self.spec.get("rendezvous_key"))
        return 1   # this node; node 0 not reached yet (rdzv.reach says why)

    def _node0_listening(self) -> int:
        """Nodes handed the run at once by one kernel (``--launcher slurm``).

        The kernel started every node's part in the same moment and watches
        them all, so the one-kernel-per-node count-in before the ranks start
        (for a person who has not run the other node's cell yet), and the
        store client each node keeps for it, only cost the run time: the
        kernel stops the other nodes when one fails, and tells node 0 when
        every node is done (SIGHUP both, see :meth:`Supervisor._peers_ended`).
        Node 0 listens at once and hosts its store on the first connection,
        as on one node; the other nodes start their ranks as soon as node 0's
        port accepts (a rank's connection then waits in its backlog, never in
        torch's retry back-off, which costs about half a second): every node
        counts as in then, only this one until.
        """
        return self.spec["num_nodes"] if self.rdzv.probe() else 1

    def host_store(self, fd: int) -> None:
        """A rank is connecting to the store for the first time: start it now."""
        self.run.sel.unregister(fd)
        try:
            self.rdzv.host_store()
        except Exception as exc:
            if self.run.stopping is None:
                self.run.rendezvous_failed(f"could not host the store at {self.rdzv.address}: "
                                           f"{type(exc).__name__}: {exc}")

    # -- while the ranks run -------------------------------------------------------------
    def check_remote(self) -> None:
        """Several nodes: stop when another node reports a failure; report ours.
        Ranks of other nodes that left without joining the world go to the
        kernel too (its fold sees whether one of ours waits for them)."""
        self.remote_check = time.monotonic() + REMOTE_CHECK
        self._liveness().beat()
        self.departures_seen, departed = self.rdzv.departed_elsewhere(self.departures_seen)
        for d in departed:
            self.run.send({"kind": "remote_departed", **d})
        remote = self.rdzv.remote_failure(self.spec.get("rendezvous_key"))
        if remote is not None and self.run.stopping is None:
            self.run.send({"kind": "remote_failure", **remote})
            self.run.stop("remote_failed", stacks=False)

    def on_time(self, now: float) -> None:
        if self.remote_check is not None and now >= self.remote_check:
            self.check_remote()

    def report_departed(self, rank: int, event: dict) -> None:
        """A kernel per node: a rank of this node left the cell (the others' folds judge)."""
        if self.remote_check is not None:
            self.rdzv.report_departed(self.spec["node_rank"], rank,
                                      "sys.exit(0)" if event.get("exited") else "returned",
                                      event.get("rounds", 1 if event.get("in_world") else 0))

    def tell_others(self, reason: str, first_failure: Optional[tuple]) -> None:
        """Several nodes: why this node stops, in node 0's store, when it is
        news to them: its own root cause, or that it left with none (its
        kernel stopped it or went away, its --timeout): their ranks only see
        lost connections.  A consequence of another node's failure is not."""
        if self.remote_check is None or self.rdzv is None or reason == "remote_failed":
            return
        key = self.spec.get("rendezvous_key")
        if reason == "failed":
            if first_failure is not None and not first_failure[0]:
                _, _, rank, summary = first_failure
                self.rdzv.report_failure(self.spec["node_rank"], rank, summary, key)
            return
        node = self.spec["node_rank"]
        self.rdzv.quick(NODE_STORE_WAIT)   # node 0's machine may be gone: never hold this node's stop
        self.rdzv.report_failure(node, node * self.spec["num_processes"],
                                 node_notes.left_summary(node, socket.gethostname(), reason), key, left=True)

    def _liveness(self) -> NodeLiveness:
        """A kernel per node: the other nodes' beats (made at the first look)."""
        if self.liveness is None:
            self.liveness = NodeLiveness(self.rdzv, self.spec)
        return self.liveness

    # -- the end ----------------------------------------------------------------------------
    def finish(self) -> None:
        """Several nodes: node 0 keeps the store up until every node is done.

        If this node only saw consequences (its ranks lost their peers), the
        root cause is on another node: give its report a moment to arrive.
        """
        if self.spec["num_nodes"] == 1 or self.rdzv is None or self.rdzv.store is None:
            return
        # Waiting for other nodes can take long: no parked ranks meanwhile (a held one stays held).
        self.run.rank_set.release_all(spare_held=True)
        first = self.run.first_failure
        if self.run.stopping == "failed" and first is not None and first[0]:
            self._wait_for_cause()
        self.rdzv.finish()
        if self.spec.get("attempt", 0) < self.spec.get("max_restarts", 0):
            self._agree_on_outcome()
            return
        if self.spec["node_rank"] != 0:
            return
        self._wait_all(FINISHED)

    def _wait_for_cause(self) -> None:
        deadline = time.monotonic() + REMOTE_WAIT
        while time.monotonic() < deadline:
            remote = self.rdzv.remote_failure(self.spec.get("rendezvous_key"))
            if remote is not None:
                self.run.send({"kind": "remote_failure", **remote})
                return
            gone = self._liveness().gone_message()   # no word from it: did a node go away?
            if gone is not None:
                self.run.send(gone)
                return
            self.run.poll(REMOTE_CHECK)

    def _wait_all(self, name: str) -> None:
        """Until every node counted itself in ``name`` (bounded; a stop ends the wait)."""
        deadline = time.monotonic() + FINISH_WAIT
        while self.rdzv.finished(name) < self.spec["num_nodes"] and time.monotonic() < deadline:
            self.run.poll(RDZV_POLL)
            if self.run.stopping in ("interrupt", "terminated"):
                return
            gone = self._liveness().gone()
            if gone is not None:   # it never will
                log.warning("run %s: node %d went away (silent for %.1fs); not waiting for it",
                            self.spec.get("run_id"), *gone)
                return

    def _agree_on_outcome(self) -> None:
        """Kernel per node, with a restart to come if this attempt failed: every
        node must come to the same verdict, or one node's kernel starts the next
        attempt while another's says done.  So every node waits until all are
        done, then looks for a failure elsewhere (it fails this attempt too), and
        node 0 keeps the store up until every node has looked (``CHECKED``)."""
        self._wait_all(FINISHED)
        if self.run.stopping is None:
            remote = self.rdzv.remote_failure(self.spec.get("rendezvous_key"))
            if remote is not None:
                self.run.send({"kind": "remote_failure", **remote})
                self.run.stopping = "remote_failed"
        self.rdzv.finish(CHECKED)
        if self.spec["node_rank"] == 0:
            self._wait_all(CHECKED)

    def keep_store_for_peers(self) -> None:
        """Node 0, after its "finished": ranks of other nodes may still be
        starting or use the store it hosts; keep listening until the kernel
        says every node is done (or the launcher ends this run)."""
        # Done here: no parked ranks meanwhile (their memory, their GPUs); a held one stays held.
        self.run.rank_set.release_all(spare_held=True)
        while not self.peers_done and self.run.stopping not in ("interrupt", "terminated"):
            self.run.poll(None)

    def close(self) -> None:
        if self.rdzv is not None:
            self.rdzv.close()   # stop listening (joins the store's thread)


class SessionBeats:
    """A session of several nodes, one kernel per node: nothing else tells
    one node's part that another's is gone.  Each node counts itself in node
    0's store every NODE_BEAT and looks at the others' counts; ``lose(why)``
    is the session's end (see :meth:`watch`)."""

    def __init__(self, nodes: Nodes, lose) -> None:
        self.nodes = nodes
        self.lose = lose
        self.node_check: Optional[float] = None   # when to count this node in next (None: not watched)
        self.node_seen: dict[int, tuple[int, float]] = {}   # each other node's count, and when it last moved
        self.store_heard = 0.0
        self.back_at: Optional[float] = None   # when a failed cell's ranks were all back

    def begin(self) -> None:
        """Watched from now on, where a node's part can go unseen."""
        spec, rdzv = self.nodes.spec, self.nodes.rdzv
        if spec["num_nodes"] > 1 and not spec.get("dispatched_together") \
                and rdzv is not None and rdzv.store is not None:
            rdzv.quick(NODE_STORE_WAIT)
            self.store_heard = self.node_check = time.monotonic()

    def on_time(self, now: float) -> None:
        if self.node_check is not None and now >= self.node_check:
            self.watch(now)

    def watch(self, now: float) -> None:
        """Several nodes: count this node in node 0's store and look at the
        others' counts.  A node whose count stood still for NODE_LOST_AFTER (or
        node 0's store not answering that long) has lost its part of the
        session: its kernel was shut down or killed, or its supervisor died.
        The world can never be whole again, so the session is lost here too,
        saying which node, instead of failing each cell in gloo and claiming
        that the session lives on."""
        self.node_check = now + NODE_BEAT
        rdzv = self.nodes.rdzv
        counts = rdzv.beat()
        if counts is None:
            if now - self.store_heard >= NODE_LOST_AFTER:
                self.lose(f"node 0's part of the session is gone: its store at {rdzv.address} has not "
                          f"answered for {NODE_LOST_AFTER:g}s (its kernel was shut down or died, or its machine "
                          "is unreachable), and a world that lost a node cannot go on")
            return
        self.store_heard = now
        for node, count in counts.items():
            seen = self.node_seen.get(node)
            if seen is None or seen[0] != count:
                self.node_seen[node] = (count, now)
            elif now - seen[1] >= NODE_LOST_AFTER:
                self.lose(f"node {node}'s part of the session is gone: no sign of it for {NODE_LOST_AFTER:g}s "
                          "(its kernel was shut down or died, or its supervisor ended), and a world that lost "
                          "a node cannot go on")
                return

    def seen_after_failure(self, failed: bool) -> bool:
        """A failed cell of several nodes ends once every other node has been
        heard from since (at most NODE_LOST_AFTER later: else it is lost): a
        gloo error may mean a node is gone, and the cell must not then say the
        session lives on."""
        if self.node_check is None or not failed:
            return True
        if self.back_at is None:
            self.back_at = time.monotonic()
            self.watch(self.back_at)
        # Strictly after: the look taken at back_at may see a count the node made before it went.
        spec = self.nodes.spec
        return all(self.node_seen.get(node, (0, 0.0))[1] > self.back_at
                   for node in range(spec["num_nodes"]) if node != spec["node_rank"])
