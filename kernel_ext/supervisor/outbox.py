"""What a supervisor holds to send as one message.

The kernel verifies and unpickles each message it gets, and each costs the
supervisor a signature and a wake-up of its ZMQ thread: an empty cell was
six messages.  A supervisor keeps what it says in one turn of its loop
here and sends it as one (``wire.messages.batch``) when the loop is about to
wait: "started", a rank's result and its exit, and "finished" after the last
rank's, each go with what came in the same turn, and nothing waits longer
than the turn that made it.

A supervisor of a Slurm run (dispatched to every node at once) holds its
messages longer, until its loop would wait past ``BATCH_HOLD``: every node
reports to the one kernel, and a short cell is then one message per node.
Output (already batched by the pump) goes when the loop next waits there
too.  Either way the kinds the kernel waits on (``SEND_NOW``: the end of
the run, an error, a question) go at once, with what is held before them.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from ..wire.messages import SEND_NOW, batch
from ..timing import BATCH_HOLD


class Outbox:
    """Messages held, each already stamped with its ``run_id`` and ``node_rank``."""

    def __init__(self, send: Callable[[dict], None], hold: float = 0.0) -> None:
        self.send = send   # signs and sends one message
        self.hold = hold   # seconds a message may wait (0: until the loop waits)
        self.held: list[dict] = []
        self.due = 0.0     # when what it holds goes at the latest

    @classmethod
    def of(cls, spec: dict, send: Callable[[dict], None]) -> "Outbox":
        """The run's outbox: held up to ``BATCH_HOLD`` for a run dispatched to
        every node at once, until the loop waits for any other."""
        return cls(send, BATCH_HOLD if spec.get("dispatched_together") else 0.0)

    def add(self, content: dict) -> None:
        if self.held and self.held[0]["run_id"] != content["run_id"]:   # a batch is of one run (a session's cells)
            self.flush()
        if not self.held:
            self.due = time.monotonic() + self.hold
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
        """The loop is about to wait: sent if its time has come; else how long
        it may still wait (None: nothing held)."""
        if not self.held:
            return None
        left = self.due - time.monotonic()
        if left <= 0:
            self.flush()
            return None
        return left

    def turn_ended(self) -> None:
        """The loop's turn is over: what has waited its time goes.  Not a
        message held only until the loop waits: what the end of the turn
        brings (the run's "finished") may still join it."""
        if self.hold and self.held and self.due <= time.monotonic():
            self.flush()
