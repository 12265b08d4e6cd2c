"""What a node's supervisor holds to send as one message (``--launcher slurm``).

Every node of a Slurm run reports to the one kernel, which verifies and
unpickles each message it gets: an empty cell was six messages per node.  A
supervisor of a run dispatched to every node at once keeps its messages here
until its loop would wait past ``BATCH_HOLD``, then sends them as one
(``wire.messages.batch``): a short cell is one message per node.  Output
(already batched by the pump) goes when the loop next waits, and the kinds
the kernel waits on (``SEND_NOW``: the end of the run, an error) go at once.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from ..wire.messages import SEND_NOW, batch
from ..timing import BATCH_HOLD


class Outbox:
    """Messages held, each already stamped with its ``run_id`` and ``node_rank``."""

    def __init__(self, send: Callable[[dict], None]) -> None:
        self.send = send   # signs and sends one message
        self.held: list[dict] = []
        self.due = 0.0     # when what it holds goes at the latest

    @classmethod
    def of(cls, spec: dict, send: Callable[[dict], None]) -> "Optional[Outbox]":
        """An outbox for a run dispatched to every node at once; None (each
        message sent as it comes) for any other."""
        return cls(send) if spec.get("dispatched_together") else None

    def add(self, content: dict) -> None:
        if self.held and self.held[0]["run_id"] != content["run_id"]:   # a batch is of one run (a session's cells)
            self.flush()
        if not self.held:
            self.due = time.monotonic() + BATCH_HOLD
        self.held.append(content)
        if content["kind"] in SEND_NOW:
            self.flush()
        elif content["kind"] == "output":
            self.due = 0.0

    def flush(self) -> None:
        if self.held:
            held, self.held = self.held, []
            self.send(batch(held))

    def wait(self) -> Optional[float]:
        """Sent if its time has come; else how long it may still wait (None: nothing held)."""
        if not self.held:
            return None
        left = self.due - time.monotonic()
        if left <= 0:
            self.flush()
            return None
        return left
