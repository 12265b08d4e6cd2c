"""What a ``%%distributed --background`` cell returns: a handle on its run.

The cell's value (``Out[N]``, so ``h = _`` works).  ``h.wait()`` gives what
the cell would have given in the foreground: rank 0's last expression, the
``--return`` names assigned in the notebook, or the run's error (root cause,
stacks) raised in the cell that waits.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Callable, Optional

from accel_magics.kernel_ext.clip import clip
from accel_magics.kernel_ext.kernel.background import BackgroundRun
from accel_magics.kernel_ext.kernel.errors import (DistributedRunError, DistributedStallError, DistributedTimeoutError,
                                                   RunInterrupted, RunStopped, SessionLostError, WaitStopped)
# The ladders' order: see timing.py.
from accel_magics.kernel_ext.stop_ladder import Rung, StopLadder
from accel_magics.kernel_ext.timing import BACKGROUND_STOP_POLL, BACKGROUND_STOP_WAIT as STOP_WAIT, DEBUG_FOLLOW

from . import rank_prompt

log = logging.getLogger("accel_magics.background")



class BackgroundCell:
    """A run going on while the notebook is free.  ``done()``, ``wait()``,
    ``stop()``, ``returns``, ``status``; its repr says where it stands."""

    def __init__(self, run: BackgroundRun, label: str, deliver: Callable, where: str = "") -> None:
        self._run = run
        self.label = label
        self._deliver = deliver   # (result) -> value: assigns the --return names, raises for missing ones
        self._where = where       # "in the session" or ""
        self._handed: list[str] = []   # the --return names wait() assigned (their values are the notebook's now)
        self._value_ref: Optional[weakref.ref] = None   # the value, once it is one of those (see wait)

    # -- the user's API ------------------------------------------------------------
    def done(self) -> bool:
        """True once the run is over (whatever its outcome)."""
        return self._run.done()

    def wait(self, timeout: Optional[float] = None):
        """Wait for the run; rank 0's last expression (its --return names are
        then assigned in the notebook), or the run's error.  The stop button
        stops the waiting, not the run (``stop()`` stops the run)."""
        try:
            finished = self._run.wait(timeout)
        except KeyboardInterrupt:
            raise WaitStopped(f"stopped waiting; {self.label} goes on in the background (its handle's "
                              ".stop() stops it)") from None
        if not finished:
            raise TimeoutError(f"{self.label} is still running after {timeout:g}s; .wait() again, or .stop() it.")
        error = self._run.error
        if isinstance(error, RunInterrupted):   # stopped on request: an Exception where it is raised
            raise RunStopped(error, self.label) from None
        if error is not None:
            raise error
        result = self._run.result
        try:
            value = self._deliver(result)
            print(self._done_line(result, value))
            return value
        finally:
            # The values are the notebook's now: the handle (kept in Out[N])
            # must not keep them alive after a `del` (a 1 GB tensor stayed).
            if result.returns:
                self._handed = list(result.returns)
                if result.has_value and any(result.value is v for v in result.returns.values()):
                    try:   # the last expression was a --return name: the notebook's, as that name
                        self._value_ref, result.value = weakref.ref(result.value), None
                    except TypeError:   # no weak reference to it (a list): kept, as any value
                        pass
                result.returns.clear()

    def _done_line(self, result, value) -> str:
        """What ``wait()`` says of a run that succeeded: its time, the names it
        assigned, whether a value is returned (shown as the cell's ``Out``)."""
        took = f"{(self._run.ended or self._run.started) - self._run.started:.1f}s"
        said = []
        names = list(result.returns) or self._handed
        if names:
            said.append(f"assigned {', '.join(names)} in the notebook")
        if value is not None:
            said.append(f"returns rank 0's value ({type(value).__name__}), shown below")
        if not said:
            said.append("nothing to return (no --return names, and its last line is not an expression with a value)")
        return f"{self.label} done in {took}: " + "; ".join(said)

    def debug(self, rank: Optional[int] = None) -> int:
        """Answer the run's ranks that wait at a prompt (``breakpoint()``'s
        pdb, ``input()``) in this cell's input box, one question after the
        other, as a foreground cell would have asked them.  Waits for a first
        question if none waits yet; returns (the number answered) once no
        new question came within ``DEBUG_FOLLOW`` seconds of the last answer
        (pdb's ``c``), or the run ended.  The stop button stops answering,
        not the run (the rank still waits: ``debug()`` again, or ``stop()``).

        A run that failed with a rank held (``--debug_hold``): pdb's
        post-mortem in that rank's failing frame (``rank``: another failed
        rank), as ``%distributed_debug`` after a foreground cell; ``q`` ends
        it and the rank."""
        held = getattr(self._run.error, "held", None) if self._run.done() else None
        if held is not None and held.alive():
            return self._post_mortem(held, rank)
        return self._answer_questions()

    def _answer_questions(self) -> int:
        """The questions of ranks at a prompt, one after the other (see debug)."""
        questions = self._run.control.questions
        answered = 0
        try:
            while True:
                question = questions.next(DEBUG_FOLLOW if answered else None)
                if question is None:
                    break
                try:
                    line: Optional[str] = rank_prompt.ask(question[0], question[1])
                except EOFError:
                    line = None
                questions.reply(question, line)
                answered += 1
        except KeyboardInterrupt:
            waiting = ", ".join(f"rank {rank}" for rank, _ in questions.pending())
            raise WaitStopped(f"stopped answering {self.label}" + (f"; {waiting} still waits at its prompt "
                              "(.debug() again, or .stop())" if waiting else "")) from None
        if not answered and self._run.done():
            print(f"{self.label} has ended ({self.status}): no rank waits at a prompt")
        return answered

    def _post_mortem(self, held, rank: Optional[int]) -> int:
        """The post-mortem of a held rank of this run (see debug): the number of lines answered."""
        from accel_magics.kernel_ext.kernel import post_mortem

        rank = held.default_rank() if rank is None else rank
        if rank not in held.ranks:
            raise ValueError(f"rank {rank} of {self.label} is not held; held: {', '.join(map(str, sorted(held.ranks)))}")
        answered = []

        def ask(rank: int, prompt: str) -> str:
            answered.append(rank)
            return rank_prompt.ask(rank, prompt)

        post_mortem.debug(held, rank, ask, rank_prompt.show)
        print(f"{self.label}: {held.ended(rank)}", flush=True)
        return len(answered)

    def stop(self) -> None:
        """Stop the run as the stop button would (stacks, then every rank
        stopped; a session lives on if its ranks come back), wait until it
        has ended, and say in one line how it ended (the stacks are in the
        run's view)."""
        already = self._run.done()
        # A second stop kills the ranks, as a second press of the stop button does;
        # a run that outlives even that is asked again, until it ends.
        while not StopLadder(f"{self.label} in the background", [
                Rung("the stop", self._run.stop, STOP_WAIT),
                Rung("the stop again: every rank killed", self._run.stop, STOP_WAIT)],
                done=self._run.done, log=log).run(lambda seconds: self._run.wait(min(seconds, BACKGROUND_STOP_POLL))):
            pass
        # One line, so the cell that stopped it says what happened (it said nothing).
        held = getattr(self._run.error, "held", None)
        if already and held is not None and held.alive():   # it failed, a rank held for .debug(): let it go
            from accel_magics.kernel_ext.kernel import post_mortem

            post_mortem.release(held)
            print(f"{self.label} had ended already ({self.status}); its failed rank(s) held for .debug() were let go")
        elif already:
            print(f"{self.label} had ended already ({self.status}); nothing to stop")
        elif self.status == "stopped":
            print(f"stopped {self.label}; where each rank was is in its view; .wait() raises RunStopped")
        else:
            print(f"{self.label} ended before the stop landed: {self.status}; .wait() for its outcome")

    @property
    def returns(self) -> dict:
        """The ``--return`` values, from when the run succeeded until ``wait()``
        assigns them in the notebook; then the handle keeps none of them
        (``returned`` names them), so ``del`` in the notebook frees them."""
        result = self._run.result
        return dict(result.returns) if result is not None else {}

    @property
    def returned(self) -> list:
        """The ``--return`` names the run brought back."""
        return self._handed or list(self.returns)

    @property
    def result(self):
        """Rank 0's last expression, None until the run succeeded (and once a
        --return name that was also the last expression is freed in the notebook)."""
        if self._value_ref is not None:
            return self._value_ref()
        result = self._run.result
        return result.value if result is not None and result.has_value else None

    @property
    def status(self) -> str:
        """running, done, failed, stopped, timeout, stalled or lost."""
        if not self._run.done():
            return "running"
        error = self._run.error
        if error is None:
            return "done"
        if isinstance(error, SessionLostError):
            return "lost"
        if isinstance(error, RunInterrupted):
            return "stopped"
        if isinstance(error, DistributedStallError):
            return "stalled"
        if isinstance(error, DistributedTimeoutError):
            return "timeout"
        return "failed"

    @property
    def error(self) -> Optional[BaseException]:
        return self._run.error

    def __repr__(self) -> str:
        status = self.status
        began = self._run.started
        where = f" {self._where}" if self._where else ""
        if status == "running":
            running = time.monotonic() - began
            # As the cell's value it is shown once, at the start: its view tells how the run goes.
            how = "started (its view shows how it goes)" if running < 1 else f"running for {running:.1f}s"
            paused = ", ".join(f"rank {rank}" for rank, _ in self._run.control.questions.pending())
            if paused:
                how += f"; {paused} waits at its prompt: .debug() answers it"
            return f"<background run {self.label}{where}: {how}; .wait() for its result, .stop() to stop it>"
        took = f"{(self._run.ended or began) - began:.1f}s"
        if status == "done":
            value = self.result
            shown = "" if value is None else f": {_short(repr(value))}"
            names = f", returned {', '.join(self.returned)}" if self.returned else ""
            return f"<background run {self.label}{where}: done in {took}{names}{shown}; .wait() assigns and returns>"
        error = self._run.error
        summary = str(error).splitlines()[0] if error is not None else ""
        if isinstance(error, DistributedRunError):
            summary = f"rank {error.root.rank} failed: {error.root.summary}"
        return f"<background run {self.label}{where}: {status} after {took}: {_short(summary)}; .wait() raises it>"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))

    def _ipython_display_(self) -> None:
        """Shown as the cell's value (``Out[N]``, ``_``): a display the handle
        updates in place when the run ends, so the notebook (saved too) says
        how it ended instead of "started" for ever."""
        from IPython.display import display

        handle = display({"text/plain": repr(self)}, raw=True, display_id=True)
        if handle is not None and not self._run.done():
            self._run.add_done_callback(lambda run: handle.update({"text/plain": repr(self)}, raw=True))


def _short(text: str, limit: int = 200) -> str:
    return clip(text, limit)
