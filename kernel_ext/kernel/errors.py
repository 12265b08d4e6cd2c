"""Root-cause reporting for a run, and the exceptions a run raises.

When one rank fails, the ranks waiting for it in a collective fail too, with
errors such as gloo's "Connection closed by peer".  Those are consequences.
The root cause is the earliest failure that is not such a consequence (each
rank stamps its failure with the time it happened), as torchrun's
``ChildFailedError`` reports the first failure.
"""
from __future__ import annotations

from typing import Optional

from ..doctor.explain import explain_here
from ..timing import PEERS_JOIN_WAIT
from .events import RankFailure


def root_cause(failures: list[RankFailure]) -> Optional[RankFailure]:
    if not failures:
        return None
    primary = [f for f in failures if not f.secondary]
    return min(primary or failures, key=lambda f: (f.timestamp, f.rank))


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip("\n").splitlines(True)) + "\n"


class ReportedError:
    """An error IPython shows as its report alone: the magic's own frames would
    only hide the ranks' story (IPython calls ``_render_traceback_``)."""

    #: Said after the report (a session cell: whether the session lives on).
    after: str = ""

    def report(self) -> str:
        return f"{type(self).__name__}: {self}"

    def _render_traceback_(self) -> list[str]:
        return (self.report().rstrip("\n") + ("\n\n" + self.after if self.after else "")).splitlines()


class DistributedRunError(ReportedError, RuntimeError):
    """A run in which a rank failed; the message is the failing rank's own story."""

    #: The failed ranks held for a post-mortem (post_mortem.HeldRun), or None.
    held = None

    def __init__(self, root: RankFailure, failures: list[RankFailure], others: dict[int, str],
                 attempts: int = 1, stacks: Optional[dict[int, str]] = None,
                 departed: Optional[dict[int, str]] = None, in_setup: bool = False) -> None:
        self.root = root
        self.failures = failures
        self.others = dict(others)    # rank -> what happened to it ("stopped", ...)
        self.attempts = attempts
        self.stacks = stacks or {}
        self.departed = departed or {}   # rank -> how it left ("returned", "sys.exit(0)")
        failing = sorted({f.rank for f in failures if not f.secondary} or {root.rank})
        if self.departed:
            # The cause is a rank that left while this one waited for it in a collective.
            left = ", ".join(f"rank {r} ({how})" for r, how in sorted(self.departed.items()))
            if in_setup:   # its init_process_group: a finished rank waits PEERS_JOIN_WAIT for that, no longer
                head = (f"rank {root.rank} failed in init_process_group, still connecting to a rank that had "
                        f"already finished the cell: {left}. A finished rank waits at most {PEERS_JOIN_WAIT:g} s "
                        f"for its peers' set-up, and this one's took longer; a dist.barrier() after the set-up "
                        f"makes every rank wait for the slowest. {root.summary}")
            else:
                head = (f"rank {root.rank} failed waiting in a collective for a rank that had already finished "
                        f"the cell: {left}. Every rank must take part in every collective. {root.summary}")
            for rank, how in self.departed.items():
                self.others.setdefault(rank, f"finished the cell early ({how}) while rank {root.rank} "
                                             "still waited for it")
        elif root.kind == "node_gone":   # a whole node, not one of its ranks
            head = root.summary
        elif root.summary.split(":", 1)[0].strip() in ("BdbQuit", "bdb.BdbQuit"):
            head = (f"rank {root.rank} quit its debugger (q): the run was stopped on every rank, as a "
                    f"script that raised BdbQuit is. To leave the debugger and let the run go on, use c (continue)")
        else:
            head = f"rank {root.rank} failed: {root.summary}"
        if len(failing) > 1:
            head += f" (ranks that failed on their own: {', '.join(map(str, failing))}; rank {root.rank} first)"
        if attempts > 1:
            head += f" [after {attempts} attempts]"
        self.explained = explain_here(f"{root.summary}\n{root.traceback}")   # /dev/shm full, a bus error...
        if self.explained:
            head += f"\n{self.explained}"
        super().__init__(head)

    def report(self) -> str:
        """The full text: root cause traceback first, then the other ranks."""
        parts = [f"DistributedRunError: {self}\n"]
        if self.root.traceback:
            parts.append(f"\n--- rank {self.root.rank} traceback (root cause) ---\n")
            parts.append(self.root.traceback.rstrip("\n") + "\n")
        others = [f for f in self.failures if f is not self.root]
        if others or self.others:
            parts.append("\n--- other ranks ---\n")
            for f in sorted(others, key=lambda f: f.rank):
                note = " (a consequence of the failure above)" if f.secondary else ""
                parts.append(f"rank {f.rank}: {f.summary}{note}\n")
            for rank, what in sorted(self.others.items()):
                parts.append(f"rank {rank}: {what}\n")
        parts.append(format_stacks(self.stacks))
        return "".join(parts)


def ranks_text(ranks, none: str) -> str:
    """``"rank(s) 0, 1"``, or what to say when there is none (never "rank(s) -")."""
    return f"rank(s) {', '.join(map(str, ranks))}" if ranks else none


#: An unfinished rank whose stack did not come: it could not run to dump it.
NO_STACK = ("no stack came back: the process did not run when asked (stopped by a signal such as SIGSTOP, "
            "or blocked in the operating system)")


def format_stacks(stacks: dict[int, str], unfinished=()) -> str:
    """Each rank's stack; an ``unfinished`` rank without one is named too, not
    left out.  Nothing where no stack came at all (the kernel killed the
    supervisor itself: its note says so)."""
    if not stacks:
        return ""
    parts = ["\n--- where each unfinished rank was (most recent call first) ---\n"]
    for rank in sorted(set(stacks) | set(unfinished)):
        text = stacks.get(rank)
        parts.append(f"rank {rank}: {NO_STACK}\n" if text is None else f"rank {rank}:\n{_indent(text)}")
    return "".join(parts)


def forced_note(why: str) -> str:
    """What the kernel says when it had to kill a run's supervisor itself."""
    return (f"\n(the run's supervisor did not respond: {why}; the kernel killed it and its ranks, "
            "so there are no stacks)")


class DistributedTimeoutError(ReportedError, TimeoutError):
    """The run exceeded --timeout; carries where each unfinished rank was."""

    def __init__(self, timeout: float, stacks: dict[int, str], unfinished: list[int], note: str = "") -> None:
        self.stacks = stacks
        self.unfinished = unfinished
        self.note = note
        super().__init__(
            f"the run exceeded --timeout {timeout:g}s; "
            + (f"{ranks_text(unfinished, '')} had not finished and were stopped" if unfinished else
               "its ranks were stopped")
        )

    def report(self) -> str:
        return super().report() + self.note + "\n" + format_stacks(self.stacks, self.unfinished)


class DistributedStallError(ReportedError, TimeoutError):
    """A rank stayed in the cell, with no CPU time and no output, after other ranks finished it."""

    def __init__(self, stalled: list[int], finished: list[int], seconds: float, stacks: dict[int, str],
                 left: Optional[dict] = None, why: Optional[dict] = None) -> None:
        self.stalled, self.finished, self.stacks = stalled, finished, stacks
        which = ", ".join(map(str, stalled))
        if left:   # {rank: (how it finished, its node or None)}: they wait in init_process_group
            gone = ", ".join(f"rank {rank}" + (f" (on node {node})" if node else "")
                             for rank, (_, node) in sorted(left.items()))
            hows = ", ".join(sorted({how for how, _ in left.values()}))
            super().__init__(
                f"rank(s) {which} wait in init_process_group for {gone}, which had already finished the "
                f"cell ({hows}): init_process_group needs every rank of the world, so the run was stopped. "
                "Every rank must call it (or none); where each rank waited is below.")
            return
        reasons = "; ".join(f"rank {rank}: {text}" for rank, text in sorted((why or {}).items()))
        super().__init__(
            f"rank(s) {which} stalled: no CPU time and no output for {seconds:g}s after rank(s) "
            f"{', '.join(map(str, finished))} finished the cell, and stuck where nothing can move "
            f"{'them' if len(stalled) > 1 else 'it'}" + (f" ({reasons})" if reasons else "") +
            ", so the run was stopped. Where each was is below (native frames included); "
            "--stall_timeout 0 turns this check off."
        )

    def report(self) -> str:
        return super().report() + "\n" + format_stacks(self.stacks)


class RunInterrupted(ReportedError, KeyboardInterrupt):
    """The run was stopped by the kernel's interrupt; every rank was stopped."""

    def __init__(self, stacks: dict[int, str], unfinished: list[int], note: str = "",
                 message: Optional[str] = None) -> None:
        self.stacks = stacks
        self.unfinished = unfinished
        self.note = note
        super().__init__(message or (
            f"interrupted: {ranks_text(unfinished, 'no rank was still running')}"
            + (" were stopped" if unfinished else "")
        ))

    @classmethod
    def before_start(cls, why: str) -> "RunInterrupted":
        """Stopped before any rank of the run existed: one line that says so
        and why the cell was still waiting (never a traceback of ours)."""
        return cls({}, [], message=f"interrupted: nothing ran; {why}. Run the cell again")

    def report(self) -> str:
        return f"RunInterrupted: {self}{self.note}\n" + format_stacks(self.stacks, self.unfinished)


class RunStopped(ReportedError, RuntimeError):
    """What ``h.wait()`` raises for a background run that was stopped on
    request (``h.stop()``, ``%distributed_session stop`` or ``restart``).

    An ``Exception``, not the ``KeyboardInterrupt`` a foreground cell raises:
    nothing interrupts the cell that waits, the stop was asked for earlier,
    and ``except Exception`` around ``h.wait()`` must see it (as
    ``concurrent.futures``' ``CancelledError``)."""

    def __init__(self, interrupted: RunInterrupted, label: str) -> None:
        self.stacks = interrupted.stacks
        self.unfinished = interrupted.unfinished
        self.note = interrupted.note
        stopped = (f"{ranks_text(self.unfinished, '')} were stopped" if self.unfinished
                   else "no rank was still running")
        super().__init__(f"{label} was stopped: {stopped}")

    def report(self) -> str:
        return f"RunStopped: {self}{self.note}\n" + format_stacks(self.stacks, self.unfinished)


class WaitStopped(ReportedError, KeyboardInterrupt):
    """The stop button while a cell waited, not ran: for a session's turn, or
    in ``h.wait()`` for a background run (which goes on)."""


class CompletedBeforeTheStop(ReportedError, KeyboardInterrupt):
    """The stop button after a session cell had completed on every rank:
    nothing was stopped and what the cell did is in the session, so it must
    not be run again; only its results were not brought back.  A
    ``KeyboardInterrupt`` still, so a "Run All" stops here as the user asked."""

    def __init__(self, label: str) -> None:
        super().__init__(
            f"{label} had completed on every rank when the stop came: nothing was stopped, and what it did is "
            "kept in the session (running it again would do it twice). Rank 0's value and the --return names "
            "were not brought back; a session cell `%%distributed --session --return NAMES` brings them.")


class RunTerminated(ReportedError, RuntimeError):
    """The run's supervisor got SIGTERM from outside accel_magics; every rank was stopped."""


class RendezvousError(ReportedError, RuntimeError):
    """The nodes did not all meet at the rendezvous; nothing ran."""


class SessionGone(RuntimeError):
    """The session is not there (never started, stopped, or lost)."""


class SessionLostError(ReportedError, RuntimeError):
    """A session cell could not bring every rank back to its prompt (or a rank
    died): the session was stopped and its state is gone.  ``cause`` is the
    cell's own error (the failing rank's traceback, the stacks)."""

    def __init__(self, why: str, cause: Optional[BaseException] = None) -> None:
        self.why, self.cause = why, cause
        super().__init__(
            f"session lost: {why}. The session's ranks were stopped and its state is gone; "
            "`%distributed_session restart` starts a new one with the same options."
        )

    def report(self) -> str:
        text = f"SessionLostError: {self}\n"
        if isinstance(self.cause, ReportedError):
            text += "\n" + self.cause.report()
        return text


class LauncherError(ReportedError, RuntimeError):
    """The launcher process or a supervisor died or could not start.  Shown as
    its message alone: the magic's frames say nothing about what happened."""
