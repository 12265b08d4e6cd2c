"""A supervisor's relay of the ranks' standard input (see rank/rank_stdin.py).

A rank that reads its stdin (``input()``, ``breakpoint()``'s pdb) sends an
``input_request`` event.  The relay takes the rank's unfinished output line
as the prompt, tells the kernel (``input_request``: ``rank``, ``prompt``,
``seq``, ``reply_to``) and writes the answer to the rank's go pipe.

The answers come on a PULL socket of the run's own, bound in the launcher's
private (0700) directory at the first question: no port, nothing when no
rank asks.  On a Slurm node the kernel's answer reaches that socket through
the node's agent (its authenticated channel to the kernel).  Every answer is verified with the run's key before it is
unpickled, as a session's cells are, and one that answers no open question
is dropped.  The same socket takes the kernel's word about a failed rank held
for a post-mortem (``{"op": "debug"}``, ``{"op": "release"}``: one_shot.py),
signed the same way.

While a rank waits for an answer the run is paused, as a terminal's user
pausing at a breakpoint pauses a torchrun job: ``--timeout`` and the stall
check do not count the time (:meth:`paused`, :meth:`take_pause`).
"""
from __future__ import annotations

import logging
import os
import selectors
import time
from typing import Optional

from .. import wire
from .output_batch import strip_escapes
from .rank_process import RankProcess

log = logging.getLogger("accel_magics.supervisor.input")

PROMPT_CHARS = 400   # the prompt shown in the input box: the unfinished line's end


class RankInput:
    """The ranks' questions and their answers (see the module doc)."""

    def __init__(self, run) -> None:
        self.run = run                       # the Supervisor: its selector, channel, key, ranks
        self.sock = None
        self.address: Optional[str] = None
        self.waiting: dict[int, tuple[RankProcess, int]] = {}   # rank -> (its process, its question's seq)
        self.paused_since: Optional[float] = None
        self.pause_total = 0.0
        self._verifier = None
        self.refused: set[int] = set()   # ranks whose questions get end of input (a stopped post-mortem)

    # -- questions ------------------------------------------------------------
    def ask(self, r: RankProcess, event: dict) -> None:
        """``r`` reads its stdin: its output so far goes first, then the question."""
        self.run.pump.catch_up(r)
        prompt = strip_escapes(r.output.take_unfinished()).decode("utf-8", "replace")[-PROMPT_CHARS:]
        if not self.open():
            self._answer(r, event.get("seq"), None, "this run cannot take input (see the supervisor's log)")
            return
        if r.rank in self.refused:
            self._answer(r, event.get("seq"), None, "the post-mortem was stopped")
            return
        if not self.waiting:
            self.paused_since = time.monotonic()
        self.waiting[r.rank] = (r, event.get("seq"))
        self.run.logs.note(r.rank, f"--- waiting for input: {prompt!r} ---")
        self.run.send({"kind": "input_request", "rank": r.rank, "prompt": prompt, "seq": event.get("seq"),
                       "reply_to": self.address})

    def paused(self) -> bool:
        return bool(self.waiting)

    def take_pause(self) -> float:
        """Seconds paused since the last call (the deadlines move by as much)."""
        total, self.pause_total = self.pause_total, 0.0
        if self.paused_since is not None:
            now = time.monotonic()
            total += now - self.paused_since
            self.paused_since = now
        return total

    # -- answers ------------------------------------------------------------------
    def open(self) -> bool:
        """The answers' socket, in the launcher's private directory (where the
        run's error files go: on a Slurm node, that node's launcher's), bound
        once; False where this run cannot have one."""
        if self.address is not None:
            return True
        spec = getattr(self.run, "spec", {}) or {}
        events = getattr(self.run, "events_addr", "") or ""
        if spec.get("error_dir"):
            directory = os.path.dirname(spec["error_dir"])
        elif events.startswith("ipc://"):
            directory = os.path.dirname(events[len("ipc://"):])
        else:
            log.warning("a rank asked for input, but this run has no private directory: answered end of input")
            return False
        import zmq

        self.address = f"ipc://{directory}/in-{os.getpid()}"
        self.sock = self.run.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.address)
        self._verifier = wire.signed_session(self.run.session.key)
        self.run.sel.register(self.sock.getsockopt(zmq.FD), selectors.EVENT_READ, ("input", None))
        self.run.sources["input"] = lambda key: self._take_answers()
        return True

    def _take_answers(self) -> None:
        for content in wire.verified_waiting(self.sock, self._verifier):   # signed with the run's key
            if "op" in content:   # for the run, not an answer: a held rank's post-mortem (one_shot.py)
                self.run.on_op(content)
                continue
            waiting = self.waiting.get(content.get("rank"))
            if waiting is None or waiting[1] != content.get("seq"):
                continue   # no such question open (answered, or its rank was stopped)
            r, seq = waiting
            self._answer(r, seq, content.get("line"), content.get("why", ""))

    def _answer(self, r: RankProcess, seq, line: Optional[str], why: str) -> None:
        if self.waiting.pop(r.rank, None) is not None and not self.waiting:
            self._unpause()
        self.run.logs.note(r.rank, f"--- input: {line!r} ---" if line is not None else f"--- end of input ({why}) ---")
        if r.go is None:
            return
        try:
            wire.write_frame(r.go, {"input": seq, "line": line, "why": why})
        except OSError:   # it is gone: its exit says so
            pass

    def refuse(self, r: RankProcess, why: str) -> None:
        """End of input for ``r``: its open question now, its next ones at once."""
        self.refused.add(r.rank)
        waiting = self.waiting.get(r.rank)
        if waiting is not None:
            self._answer(r, waiting[1], None, why)

    def forget(self, r: RankProcess) -> None:
        """``r`` exited or was stopped: its question is void."""
        if self.waiting.pop(r.rank, None) is not None and not self.waiting:
            self._unpause()

    def reset(self) -> None:
        """A session's next cell: no question of the last one is open."""
        self.waiting.clear()
        self.refused.clear()
        self.paused_since, self.pause_total = None, 0.0

    def _unpause(self) -> None:
        if self.paused_since is not None:
            self.pause_total += time.monotonic() - self.paused_since
            self.paused_since = None

    def close(self) -> None:
        if self.sock is not None:
            import zmq

            try:
                self.run.sel.unregister(self.sock.getsockopt(zmq.FD))
            except (KeyError, ValueError):
                pass
            self.sock.close(linger=0)
            self.sock = None
            if self.address is not None:
                try:
                    os.unlink(self.address[len("ipc://"):])
                except OSError:
                    pass
