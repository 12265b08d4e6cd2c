"""Kernel side of one run: its verified messages, and stopping it for sure.

:class:`RunHandle` reads the run's messages off the launcher's ZMQ socket
(each verified by the per-run ``Session`` before it is unpickled) and owns the
escalation that makes the stop button and ``--timeout`` always work, even when
the run's supervisor cannot answer (SIGSTOPped, stuck in a blocking call):

* stop (first press): the supervisor collects stacks, then stops the ranks;
* no end after ``STOP_WAIT`` (or a second press): SIGUSR2, the supervisor
  kills its ranks at once;
* no end after ``KILL_WAIT`` more (or a third press): the kernel itself
  SIGKILLs the supervisor and every rank it knows of, and the run ends as
  "forced" (the launcher process reaps them and kills their orphans).

``--timeout`` and the multi-node rendezvous get the same backstop, started at
``timeout`` + ``TIMEOUT_SLACK`` (the supervisor's own stop normally ends the
run well before): straight to its second rung.  The three rungs are one
:class:`~kernel_ext.stop_ladder.StopLadder` (``RunHandle.ladder``).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Iterator, Optional

import zmq

from .. import logs, wire
from .errors import LauncherError
from .placement import Attempt
from ..wire.messages import answer_content, unbatched
from ..process_tree import running
from ..sigint import sigint_deferred
from ..stop_ladder import Rung, StopLadder
# The ladders' order: see timing.py.
from ..timing import STOP_WAIT, KILL_WAIT, TIMEOUT_SLACK, GONE_DRAIN, FORCED_GONE_DRAIN, SUPERVISOR_LOOK

log = logging.getLogger("accel_magics.kernel.run_handle")


def receive_verified(sock, session, run_id: str, also: tuple = ()) -> tuple[Optional[dict], int]:
    """The next message of run ``run_id`` (or of an id in ``also``) waiting on
    ``sock`` (None: none is), and how many were dropped before it: a wrong or
    missing signature, a replay, another run's (stale: signed with its own
    key) are never unpickled."""
    dropped = 0
    while True:
        # A message taken off the socket is processed whole (an interrupt
        # waits): losing "finished" would turn a clean stop into an error.
        with sigint_deferred():
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None, dropped
            try:
                content = wire.verified_content(session, frames)
            except Exception:
                content = None
        if content is None or (content.get("run_id") != run_id and content.get("run_id") not in also):
            dropped += 1
            continue
        return content, dropped


class RunHandle(Attempt):
    """One run: verified messages in order, and the means to stop it."""

    def __init__(self, launcher, run_id: str, key: bytes, supervisor_pid: int,
                 master_port: int, timeout: Optional[float], rendezvous_timeout: Optional[float] = None,
                 pull=None, stop_wait: Optional[float] = None, session=None,
                 ranks: Optional[list] = None, timeout_slack: float = TIMEOUT_SLACK) -> None:
        """``pull``: the run's own socket (a session's, a background run's: read
        in another thread, or between cells), else the launcher's shared one.
        ``stop_wait``: how long the supervisor gets to end the run after a stop;
        ``timeout_slack``: past ``timeout``, when the kernel steps in."""
        self.launcher = launcher
        self.run_id = run_id
        # A run on a socket of its own may be read while another run is: its own verifier.
        self.session = session or (wire.signed_session(key) if pull is not None else launcher.session_for(key))
        self.pull = pull if pull is not None else launcher.pull
        self.stop_wait = stop_wait or STOP_WAIT
        self.session_cell = False   # a cell of a session (see kernel_ext.kernel.session)
        # How the first stop reaches the supervisor when not as SIGUSR1: a
        # session cell's goes in-band, after the cell on the session's cells
        # socket (see interrupt).  Raises LauncherError if nobody takes it.
        self.send_stop: Optional[Callable[[], None]] = None
        self.also: tuple = ()       # ids whose messages are this run's too (a session cell: its session's)
        self.supervisor_pid = supervisor_pid
        self.ranks = list(ranks or [])   # the global ranks this node runs
        self.node_of: dict = {}
        self.master_port = master_port
        self.rank_pids: set[int] = set()
        self.finished = False
        self.interrupted = 0
        self.forced: Optional[str] = None   # why the kernel had to kill the run itself
        now = time.monotonic()
        self.timeout_at = now + timeout + timeout_slack if timeout else None
        # Several nodes: until the ranks are released, the wait is bounded by the rendezvous timeout.
        self.rendezvous_at = now + rendezvous_timeout + TIMEOUT_SLACK if rendezvous_timeout else None
        # The kernel's ladder over the supervisor (see the module doc).
        self.ladder = StopLadder(f"run {run_id} (supervisor {supervisor_pid})", [
            Rung("the stop (stacks, then the ranks)", self._send_first_stop, self.stop_wait),
            Rung("SIGUSR2 to its supervisor (kill the ranks now)", lambda: self._signal(signal.SIGUSR2), KILL_WAIT),
            Rung("SIGKILL to its supervisor and ranks", self.force_kill)], done=lambda: self.finished, log=log)
        self._why = "it did not answer"
        self._reason = "interrupt"
        self._answers = None   # (socket, address): the ranks' stdin (see answer)
        try:
            self._pidfd = os.pidfd_open(supervisor_pid)
        except (AttributeError, OSError):
            self._pidfd = None

    # -- messages --------------------------------------------------------------
    def messages(self, heartbeat: Optional[float] = None) -> Iterator[dict]:
        """Yield the run's messages (content dicts) until it finishes.

        With ``heartbeat`` (seconds), a ``{"kind": "heartbeat"}`` message is
        yielded whenever nothing arrived for that long, so views can refresh.
        If the kernel had to kill the run, the last message is a "finished"
        with ``forced`` set.  Raises LauncherError if the supervisor died
        without finishing.  KeyboardInterrupt propagates to the caller, who
        decides to :meth:`interrupt` and keep reading.
        """
        poller = zmq.Poller()
        pull = self.pull
        poller.register(pull, zmq.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, zmq.POLLIN)
        gone_deadline = None  # set once the supervisor has exited: drain, then give up
        try:
            while not self.finished:
                ready = dict(poller.poll(self._poll_ms(heartbeat, gone_deadline)))
                if pull in ready:
                    yield from self._received()
                    if self.finished:
                        return
                    continue
                now = time.monotonic()
                if heartbeat is not None and not ready:
                    yield {"kind": "heartbeat"}
                gone_deadline, last = self._look_gone(now, gone_deadline, poller)
                if last is not None:
                    yield last
                    return
                self._escalate(now)
        finally:
            poller.unregister(pull)

    def _poll_ms(self, heartbeat: Optional[float], gone_deadline: Optional[float]) -> Optional[int]:
        """How long the next poll may wait: until the next deadline or heartbeat,
        or a look at the supervisor where there is no pidfd for it."""
        deadlines = [d for d in (self.timeout_at, self.rendezvous_at, self.ladder.due, gone_deadline)
                     if d is not None]
        timeout_ms = None if self._pidfd is not None else int(SUPERVISOR_LOOK * 1000)
        if heartbeat is not None:
            beat = int(heartbeat * 1000)
            timeout_ms = beat if timeout_ms is None else min(beat, timeout_ms)
        if deadlines:
            left = max(0, int((min(deadlines) - time.monotonic()) * 1000))
            timeout_ms = left if timeout_ms is None else min(left, timeout_ms)
        return timeout_ms

    def _received(self) -> Iterator[dict]:
        """Every message waiting now, in order (a batch's one by one), until the run's last."""
        while True:
            msg = self._recv()
            if msg is None:
                return
            for one in unbatched(msg):
                self._note(one)
                yield one
                if self.finished:
                    return

    def _look_gone(self, now: float, gone_deadline: Optional[float], poller) -> tuple[Optional[float], Optional[dict]]:
        """Has the supervisor exited?  Then its last messages get a moment to
        arrive; after that, the run's end: a "finished" (the kernel killed it:
        returned as the last message) or LauncherError (it died by itself).
        Returns the drain's deadline and that last message (None: none yet)."""
        if gone_deadline is None and self._supervisor_gone():
            # Its last messages may still be in flight: drain briefly
            # (not when the kernel killed it: nothing more is coming).
            gone_deadline = now + (FORCED_GONE_DRAIN if self.forced else GONE_DRAIN)
            if self._pidfd is not None:
                poller.unregister(self._pidfd)
        elif gone_deadline is not None and now >= gone_deadline:
            if self.forced:
                self.finished = True
                return gone_deadline, {"kind": "finished", "reason": self._reason, "forced": self.forced}
            raise self._gone_error()
        return gone_deadline, None

    def _gone_error(self) -> LauncherError:
        """The supervisor exited without a word: blame what is gone (the
        launcher, killed with its supervisors; or this supervisor alone), and
        add what the launcher's log says of this run, if anything."""
        if not self.launcher.alive:
            # Said once it is true: what the ranks started outside the launcher's tree is ended first.
            escaped = self.launcher.escaped_ended()
            also = (", and the kernel ended what they had started outside its tree (in a session of their own, "
                    f"or double-forked: {escaped} process(es) in all)" if escaped else "")
            what = ("the launcher process (it forks every run's supervisor) was killed during the run, and the "
                    f"run's supervisor and ranks ended with it{also}; the next cell starts a new launcher")
        else:
            what = (f"the run's supervisor (pid {self.supervisor_pid}) was killed during the run (a signal from "
                    "outside accel_magics: kill -9, the out-of-memory killer; see `dmesg`), and its ranks "
                    "ended with it")
        about = [line for line in self.launcher.launch_log_tail(200).splitlines(True)
                 if self.run_id in line or logs.of_process(line, self.supervisor_pid)]
        return LauncherError(what + "." + ("\nThe launcher's log of this run:\n" + "".join(about[-20:])
                                           if about else ""))

    @property
    def pidfd(self) -> Optional[int]:
        """Readable once the supervisor has exited (None where pidfds are missing)."""
        return self._pidfd

    def watch(self) -> bool:
        """For a caller that does not read the run's messages (a Slurm node's
        agent: the kernel reads them, and owns the --timeout and rendezvous
        backstops): carry a stop that is not answered on (SIGUSR2, then
        SIGKILL); True once the supervisor has exited."""
        self.timeout_at = self.rendezvous_at = None
        self._escalate(time.monotonic())
        return self._supervisor_gone()

    def _note(self, msg: dict) -> None:
        kind = msg.get("kind")
        if kind in ("finished", "session_lost"):   # session_lost: a session cell's session ended first
            self.finished = True
        elif kind == "started":
            self.rank_pids = set(msg.get("pids", {}).values())
        elif kind in ("released", "output", "rank_event"):
            self.rendezvous_at = None   # past the rendezvous: the ranks run

    def _escalate(self, now: float) -> None:
        if self.timeout_at is not None and now >= self.timeout_at:
            self.timeout_at = None
            self._reason = "timeout" if not self.interrupted else self._reason
            self._begin_kill("it did not stop the run at --timeout")
        if self.rendezvous_at is not None and now >= self.rendezvous_at:
            self.rendezvous_at = None
            self._reason = "rendezvous" if not self.interrupted else self._reason
            self._begin_kill("it did not end the rendezvous at --rendezvous_timeout")
        if self.ladder.due is not None and now >= self.ladder.due and self.ladder.climbed == 1:
            self._why = f"it did not end the run within {self.stop_wait:g}s of the stop"
        self.ladder.on_time(now)

    def _begin_kill(self, why: str) -> None:
        """SIGUSR2 now (the supervisor kills its ranks at once); SIGKILL after
        KILL_WAIT (already on its way: at its time)."""
        self._why = why
        if not self.ladder.skip_to(1):   # the kill is on its way: SIGUSR2 again, the SIGKILL at its time
            self._signal(signal.SIGUSR2)

    def force_kill(self) -> None:
        """SIGKILL the supervisor and every rank it reported (and their groups)."""
        if self.finished:
            return
        self.forced = self._why
        for pid in (self.supervisor_pid, *self.rank_pids):
            for kill in (os.kill, os.killpg):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def answer(self, request: dict, line: Optional[str], why: str = "", paused: float = 0.0) -> None:
        """See :meth:`Attempt.answer`: sent signed with the run's key to the
        socket the supervisor named (in the launcher's private directory)."""
        if self.timeout_at is not None:
            self.timeout_at += paused
        self.tell(request.get("reply_to") or "", answer_content(request, line, why), "input_reply")

    def tell(self, address: str, content: dict, msg_type: str = "run_op") -> None:
        """Send ``content`` signed with the run's key to the supervisor's input
        socket at ``address`` (an answer; a held rank's ``debug`` or ``release``)."""
        if not address.startswith("ipc://"):
            return
        if self._answers is None or self._answers[1] != address:
            self._close_answers()
            sock = self.launcher.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._answers = (sock, address)
        self.session.send(self._answers[0], msg_type, content)

    def held_reach(self) -> "LocalReach":
        """See :meth:`Attempt.held_reach`: a background run's own socket stays
        open with the hold (its messages come there)."""
        own = self.pull is not self.launcher.pull
        return LocalReach(self.launcher, (self.pull, "") if own else None)

    def _close_answers(self, linger: float = 0.0) -> None:
        if self._answers is not None:
            self._answers[0].close(linger=int(linger * 1000))
            self._answers = None

    def close(self, linger: float = 0.0) -> None:
        """Release what it holds; ``linger``: seconds what it sent last may
        still take to leave (a supervisor that is gone never takes it)."""
        self._close_answers(linger)
        self._pidfd_close()

    def __del__(self) -> None:
        self._pidfd_close()

    def _recv(self) -> Optional[dict]:
        content, dropped = receive_verified(self.pull, self.session, self.run_id, self.also)
        self.launcher.dropped += dropped
        self.launcher.received += content is not None
        return content

    def _supervisor_gone(self) -> bool:
        try:
            os.kill(self.supervisor_pid, 0)
        except ProcessLookupError:
            return True
        if self._pidfd is not None:
            return bool(zmq.select([self._pidfd], [], [], 0)[0])
        return False

    def _pidfd_close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # -- stopping --------------------------------------------------------------
    def interrupt(self) -> None:
        """The stop button.  First press: stacks, then the ranks are stopped;
        second: kill the ranks now; third: the kernel kills everything itself.
        Unanswered presses escalate by themselves (see the module doc).

        A press that lands while this runs is raised when it is done (the
        first stop's in-band send is Python code: cut in half, the press was
        counted and nothing sent); the reader takes it as the next press."""
        with sigint_deferred():
            self._next_rung()

    def _next_rung(self) -> None:
        self.interrupted += 1
        self._reason = "interrupt"
        if self.interrupted == 1:
            if self.ladder.started:   # --timeout began the kill already: the stop goes too, the kill keeps its time
                self._send_first_stop()
            else:
                self.ladder.climb()
        elif self.interrupted == 2:
            self._begin_kill("it did not answer the stop")
        else:
            self._why = "it did not answer the stop"
            self.force_kill()

    def _send_first_stop(self) -> None:
        """Stacks, then the stop: SIGUSR1, or in-band for a session's cell."""
        if self.send_stop is None or self.finished:
            self._signal(signal.SIGUSR1)
            return
        # A session's supervisor takes a stop for the cell it runs; a
        # signal could overtake the cell on its socket, find no cell
        # and be dropped, the cell ran on and the escalation ended the
        # session (a stop right after a background cell started lost
        # it, 1 time in 12).  In-band it comes after its cell.
        try:
            self.send_stop()
        except LauncherError:   # nobody reads it: gone; the ladder's later rungs see to the rest
            log.info("run %s: the stop found its session's supervisor gone", self.run_id)

    def signal_stop(self) -> None:
        """The stop alone (stacks, then the stop), with no escalation of its own:
        for a holder that leaves that to whoever reads the run (a Slurm node's
        agent holding a session's part: the kernel escalates, cell by cell)."""
        self._signal(signal.SIGUSR1)

    def peers_ended(self) -> None:
        """A run on several nodes, dispatched together: another node failed
        (this one stops), or every node is done (node 0 closes its store)."""
        self._signal(signal.SIGHUP)

    def kill(self) -> None:
        """Stop now: SIGUSR2, then SIGKILL if that is not answered."""
        self._begin_kill("it did not answer")

    def _signal(self, sig: int) -> None:
        if self.finished:
            return
        try:
            os.kill(self.supervisor_pid, sig)
        except ProcessLookupError:
            pass


class LocalReach:
    """How the kernel reaches the held ranks (post_mortem.HeldRun) of a run of
    this machine's launcher: its supervisor's input socket, signed with the run's key; its messages on
    the launcher's shared socket, or a background run's own (``channel``:
    (socket, address), read here, closed and its file removed with the hold)."""

    def __init__(self, launcher, channel: Optional[tuple] = None) -> None:
        self.launcher = launcher
        self.channel = channel

    def alive(self, held) -> bool:
        return running(held.supervisor_pid)

    def reader(self, held) -> "RunHandle":
        pull = self.channel[0] if self.channel is not None else None
        return RunHandle(self.launcher, held.run_id, held.key, held.supervisor_pid, 0, None, pull=pull)

    def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            channel[0].close(linger=0)
            try:
                os.unlink(channel[1][len("ipc://"):])
            except OSError:
                pass
