"""A kernel per node, during a run: is every other node still there?

torch's store tells nobody when a client goes, so the nodes tell each other:
each node's supervisor counts itself in node 0's store (``beat``) and reads
the others' counts; a node whose count stands still for ``NODE_GONE_AFTER``
without having finished (node 0: its store not answering) went away.  A
node that saw only lost connections, with no failure told by another node,
then names the node that went away as the root cause, where it was too.
"""
from __future__ import annotations

import time
from typing import Optional

from . import node_notes
# The ladders' order: see timing.py.
from ..timing import NODE_GONE_AFTER, REMOTE_CHECK


class NodeLiveness:
    def __init__(self, rdzv, spec: dict) -> None:
        self.rdzv, self.spec = rdzv, spec
        self.watch = node_notes.NodeWatch(spec["num_nodes"], spec["node_rank"], time.monotonic())
        self.beat_due = 0.0

    def beat(self) -> None:
        """Count this node in and read the others' counts (at most every REMOTE_CHECK)."""
        now = time.monotonic()
        if now >= self.beat_due:
            self.beat_due = now + REMOTE_CHECK
            self.watch.feed(self.rdzv.beat(), time.monotonic())

    def gone(self) -> Optional[tuple]:
        """(node, seconds) of a node that went away, or None (beats on the way)."""
        self.beat()
        gone = self.watch.gone(time.monotonic(), NODE_GONE_AFTER)
        if gone is None or (gone[0] != 0 and self.rdzv.ended(gone[0])):
            return None
        return gone

    def gone_message(self) -> Optional[dict]:
        """The ``remote_failure`` (``gone``) that names a node that went away, or None."""
        gone = self.gone()
        if gone is None:
            return None
        node, seconds = gone
        info = self.rdzv.node_info(node, self.spec.get("rendezvous_key")) if node != 0 else {"addr": self.rdzv.host}
        return {"kind": "remote_failure", "rank": node * self.spec["num_processes"], "node": node,
                "summary": node_notes.gone_summary(node, info, seconds, self.rdzv.address), "gone": True}
