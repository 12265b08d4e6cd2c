"""The kernel's side of a failed rank held for a post-mortem (``%distributed_debug``).

When a rank of a one-shot run fails and the run holds it (``--debug_hold``:
rank/held.py, supervisor/one_shot.py), the run's :class:`DistributedRunError`
carries a :class:`HeldRun`: what the kernel needs to reach the held ranks
after the cell has ended: the run's id and key, its supervisor, the socket
that supervisor takes the kernel's word on.  :func:`debug` opens one held
rank's post-mortem and reads it to its end (the rank's messages still come
on the launcher's socket under the run's id, as during the cell), answering
its questions as a cell's are (``ask``: the notebook's input box);
:func:`release` lets every held rank go (the next cell does, so a held rank
never holds GPU memory that a new run needs).

How the kernel reaches a held rank is its placement's (``Attempt.held_reach``):
``run_handle.LocalReach`` for a run of this machine's launcher (the supervisor's
input socket, signed with the run's key); a Slurm run's goes through the
node's agent (slurm.SlurmReach).  A reach opens a *reader* of the run: its
verified messages (``messages``), its ranks' answers (``answer``), the
kernel's word to a supervisor (``tell(address, content)``), ``close``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..timing import HELD_SEND_WAIT, SESSION_STOP_WAIT, WAIT_TICK
from .errors import DistributedRunError, LauncherError, ranks_text
from .run_handle import RunHandle

log = logging.getLogger("accel_magics.kernel.post_mortem")


@dataclass
class HeldRun:
    """The failed ranks of one run that are held for a post-mortem."""
    run_id: str
    key: bytes
    supervisor_pid: int
    ranks: dict            # rank -> the address its supervisor takes the kernel's word on
    root: Optional[int]    # the root cause's rank
    seconds: float         # how long they are held from ``since`` (the run's --debug_hold)
    since: float = field(default_factory=time.monotonic)
    reach: object = field(default=None, repr=False, compare=False)   # how the kernel reaches them (the module doc)
    background: bool = False   # a background run's: its handle's .debug() opens the post-mortem
    # A session cell's (kernel.session.DistributedSession): its ranks live on at their prompt, each
    # keeping the cell's frames until the session's next cell; the kernel's word goes on its cells socket.
    session: object = field(default=None, repr=False, compare=False)
    cells_run: int = -1    # a session's: its cells run by then (the next cell ends the hold)

    def left(self) -> float:
        """Seconds the hold has left (0: it ended, the ranks were let go)."""
        return max(0.0, self.since + self.seconds - time.monotonic())

    def alive(self) -> bool:
        if self.session is not None:   # until the session's next cell (or its end)
            return bool(self.ranks) and self.session.alive and self.session.cells_run == self.cells_run
        return bool(self.ranks) and self.left() > 0 and self.reach is not None and self.reach.alive(self)

    def default_rank(self) -> int:
        """The root cause's rank where it is held, else the first held."""
        return self.root if self.root in self.ranks else min(self.ranks)

    def hint(self) -> str:
        """What the cell's error says after its report."""
        first = self.default_rank()
        others = sorted(set(self.ranks) - {first})
        how, other = ("its handle's .debug()", ".debug(rank=N)") if self.background else \
            ("%distributed_debug", "%distributed_debug --rank N")
        until = "until the session's next cell" if self.session is not None else \
            f"for the next {self.seconds:g} s (--debug_hold)"
        text = (f"{how} opens a post-mortem (pdb) in rank {first}'s failing frame, in this "
                f"notebook's input box, {until}")
        if others:
            text += f"; {other} for {ranks_text(others, '')}"
        return text + ". The next %%distributed cell lets the failed rank(s) go."

    def ended(self, rank: int) -> str:
        """What is said once ``rank``'s post-mortem ended (a session's rank lives on)."""
        if self.session is not None:
            return f"rank {rank}'s post-mortem ended; the rank is back at the session's prompt."
        return f"rank {rank}'s post-mortem ended, and the rank with it."

    def close(self) -> None:
        """No rank is held any more: what its reach holds is let go."""
        self.ranks.clear()
        if self.reach is not None:
            self.reach.close()


def held_run(handle, outcome, background: bool = False) -> Optional[HeldRun]:
    """The held ranks of a failed attempt (None: none), from its outcome and
    its handle (which says how to reach them: ``held_reach``)."""
    reach = handle.held_reach() if outcome.held else None
    if reach is None:
        return None
    root = outcome.finished.root_cause
    seconds = min(float(msg.get("seconds") or 0) for msg in outcome.held.values())
    return HeldRun(handle.run_id, handle.session.key, getattr(handle, "supervisor_pid", 0),
                   {rank: msg.get("reply_to", "") for rank, msg in outcome.held.items()},
                   root.rank if root is not None else None, seconds, reach=reach, background=background)


@contextlib.contextmanager
def noted(handle, outcome, background: bool = False):
    """A :class:`DistributedRunError` raised inside says how to reach the held
    ranks (``held``) and, after its report, that they can be inspected."""
    try:
        yield
    except DistributedRunError as exc:
        exc.held = held_run(handle, outcome, background)
        if exc.held is not None:
            exc.after = exc.held.hint()
        raise


def held_in_session(session, run_id: str, outcome, background: bool = False) -> HeldRun:
    """A session cell's failed ranks, each keeping the cell's frames at its prompt."""
    root = outcome.finished.root_cause
    # Reached through the session (its cells socket, its messages): no key or supervisor of the run's own.
    return HeldRun(run_id, b"", 0, {rank: "" for rank in outcome.held},
                   root.rank if root is not None else None, 0.0, session=session, cells_run=session.cells_run,
                   background=background)


#: How a post-mortem's output is shown: ``show(rank, text)``; ``ask(rank, prompt)``: see run.Ask.
Show = Callable[[int, str], None]


def debug(held: HeldRun, rank: int, ask: Callable[[int, str], str], show: Show) -> dict:
    """Open ``rank``'s post-mortem and read it to its end: its output goes to
    ``show``, its questions are asked with ``ask``.  Returns the supervisor's
    ``held_end`` (how the rank ended).  A press (KeyboardInterrupt) lets the
    rank go and propagates; the rank is no longer held afterwards either way."""
    if held.session is not None:
        return _debug_in_session(held, rank, ask, show)
    address = held.ranks[rank]
    handle = held.reach.reader(held)
    linger = 0.0
    try:
        handle.tell(address, {"op": "debug", "rank": rank})
        return _read(handle, rank, ask, show)
    except KeyboardInterrupt:
        handle.tell(address, {"op": "release", "rank": rank})   # the stop ends the post-mortem and the rank
        linger = HELD_SEND_WAIT
        raise
    except LauncherError as exc:
        raise LauncherError(f"rank {rank}'s post-mortem ended: its supervisor is gone ({exc})") from None
    finally:
        held.ranks.pop(rank, None)
        handle.close(linger)
        if not held.ranks:
            held.close()


def _read(handle: RunHandle, rank: int, ask, show: Show) -> dict:
    """A post-mortem's messages to its end (``held_end``): output shown, questions answered."""
    for msg in handle.messages():
        kind = msg.get("kind")
        if kind == "output" and msg.get("rank") == rank and msg.get("text"):
            show(rank, msg["text"])
        elif kind == "input_request":
            _answer(handle, msg, ask)
        elif kind == "held_end" and msg.get("rank") in (rank, None):
            return msg
    raise LauncherError(f"the run of rank {rank} ended without a word about it")   # a "finished": not its own


def _debug_in_session(held: HeldRun, rank: int, ask, show: Show) -> dict:
    """The post-mortem of a session's rank at its prompt (see debug): the
    kernel's word goes on the session's cells socket, the rank's messages come
    on its events socket.  A press stops it (end of input, SIGINT to a long
    command); a rank not back at its prompt within SESSION_STOP_WAIT ends the
    session (a cell sent to it then could be read as an answer)."""
    ranks = held.session.ranks
    handle = ranks.cell(held.run_id, None)
    try:
        ranks.send("debug", {"op": "debug", "rank": rank})
        return _read(handle, rank, ask, show)
    except KeyboardInterrupt:
        ranks.send("release", {"op": "release", "rank": rank})
        if not _back(handle, rank, time.monotonic() + SESSION_STOP_WAIT):
            held.session.stop()
            print(f"accel_magics: rank {rank} did not come back from its post-mortem within {SESSION_STOP_WAIT:g} s; "
                  "the session was stopped", flush=True)
        raise
    finally:
        held.ranks.pop(rank, None)
        handle.close()


def _back(handle: RunHandle, rank: int, deadline: float) -> bool:
    """Whether ``rank`` is back at its prompt (``held_end``) by ``deadline``."""
    for msg in handle.messages(heartbeat=WAIT_TICK):
        if msg.get("kind") == "held_end" and msg.get("rank") == rank:
            return True
        if time.monotonic() >= deadline:
            return False
    return False


def _answer(handle: RunHandle, request: dict, ask: Callable[[int, str], str]) -> None:
    """A held rank's question (its pdb prompt), asked and answered (EOFError: end of input)."""
    line: Optional[str] = None
    why = ""
    try:
        line = ask(request["rank"], request.get("prompt", ""))
    except EOFError as exc:
        why = str(exc) or "end of input"
    handle.answer(request, line, why)


def release(held: Optional[HeldRun]) -> None:
    """Let every held rank of ``held`` go (each ends as a script that raised)."""
    if held is None:
        return
    if not held.ranks or not held.alive():
        held.close()
        return
    if held.session is not None:   # its ranks keep the frames until its next cell, or until told now
        if held.alive():
            try:
                held.session.ranks.send("release", {"op": "release", "rank": None})
            except LauncherError:   # the session is gone: so are the frames
                pass
        held.close()
        return
    for address in set(held.ranks.values()):
        handle = held.reach.reader(held)
        try:
            handle.tell(address, {"op": "release", "rank": None})
        except LauncherError:   # its node is gone: so is the rank
            pass
        finally:
            handle.close(HELD_SEND_WAIT)
    held.close()
    log.info("run %s: its held ranks were let go", held.run_id)
