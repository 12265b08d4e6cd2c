"""The one message schema of a run: what supervisors, node agents and ranks say.

Every message on a run's channel is a dict with a ``kind`` (:class:`Kind`);
a rank's own reports travel inside a ``rank_event`` message as its ``event``,
with a kind of their own (:class:`RankEvent`).  Why a run ended is a
:class:`StopReason`, and how the kernel words it for the user a
:class:`Status`.  They are ``str`` enums, so a message stays a dict of
builtins on the wire (a member pickles as its class and value, and compares
equal to its value); a receiver turns the text into a member with
``Kind(text)`` before it dispatches, and an unknown kind fails there, in one
place, instead of falling through a chain of string comparisons.

What each kind carries (the fields besides ``kind`` and ``run_id``):

=====================  ===========================================================
``started``            ``pids`` {rank: pid}; Slurm: ``nodes`` {rank: node name}, ``master_addr``
``released``           (multi-node) the rendezvous is complete: the ranks run
``ready``              (session) every rank is at its prompt
``output``             ``rank``, ``text`` (lines, or None), ``omitted``, ``progress``
``rank_event``         ``rank``, ``event``: a rank's report, see :class:`RankEvent`
``stacks``             ``rank``, ``text``, ``native``, ``where``: where the rank was when stopped
``exit``               ``rank``, ``exitcode``, ``signal``, ``stopped``, ``timestamp``, ``prompt``, ``where``;
                       ``recorded``: what @record wrote (a failed rank's TORCHELASTIC_ERROR_FILE)
``waiting``            ``joined``, ``expected``, ``address``: nodes in the rendezvous so far; ``problem``:
                       what is wrong meanwhile ("node 0 at ... refuses connections, retrying"), or ""
``rendezvous_failed``  ``message``
``stalled``            ``ranks``, ``finished``, ``seconds``
``resources``          ``ranks``: {rank: [cpu %, resident bytes, GPU bytes or None, GPU % busy or None]}, a few times a second
``remote_failure``     ``rank``, ``node``, ``summary``: another node's root cause; ``verified`` (signed
                       with the nodes' ``--rendezvous_key``) and, when not, ``unverified`` (why not);
                       ``gone``: this node saw node ``node`` go away (``summary`` says so whole)
``remote_departed``    ``rank``, ``node``, ``how``, ``rounds``: a rank of another node finished the
                       cell after ``rounds`` rounds of the world's init (a kernel per node)
``supervisor_error``   ``traceback``, ``message``
``session_lost``       ``lost``: why the session's ranks are gone
``input_request``      ``rank``, ``prompt``, ``seq``, ``reply_to``: the rank reads its stdin; the answer goes
                       to ``reply_to`` signed with the run's key (supervisor/rank_input.py)
``held``               ``rank``, ``seconds``, ``reply_to``: a failed rank is held for a post-mortem (its exit
                       comes as ``held_end``, after ``finished``); the kernel's ``debug``/``release`` go to
                       ``reply_to`` signed with the run's key (supervisor/one_shot.py)
``held_end``           ``rank``, ``exitcode``, ``signal`` (or ``gone``: no such rank was held): a held rank exited
``finished``           ``reason`` (a :class:`StopReason` or None), ``elapsed``; ``session``
                       ("alive", "lost", "stopped"), ``lost``; ``forced`` (the kernel
                       killed it: why); ``terminated_on`` (nodes whose supervisor got SIGTERM)
``heartbeat``          (kernel side only) nothing arrived for a while
``batch``              ``messages``: several of the above from one supervisor, in order, all
                       of this ``run_id``, signed once (see :func:`batch`); a reader unpacks
                       it with :func:`unbatched` and never passes the batch itself on
=====================  ===========================================================
"""
from __future__ import annotations

from enum import Enum


class _Text(str, Enum):
    """A str enum that reads as its value everywhere (``str``, f-strings), on 3.10 too."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls, text):
        """The member for ``text``, or None for a kind this version does not know."""
        try:
            return cls(text)
        except ValueError:
            return None


class Kind(_Text):
    HEARTBEAT = "heartbeat"
    STARTED = "started"
    RELEASED = "released"
    READY = "ready"
    OUTPUT = "output"
    RANK_EVENT = "rank_event"
    STACKS = "stacks"
    EXIT = "exit"
    WAITING = "waiting"
    RENDEZVOUS_FAILED = "rendezvous_failed"
    STALLED = "stalled"
    QUIET = "quiet"                  # ranks quiet after a peer finished, but not stuck: told, not stopped
    RESOURCES = "resources"          # each running rank's CPU, memory (and GPU memory), sampled
    REMOTE_FAILURE = "remote_failure"
    REMOTE_DEPARTED = "remote_departed"
    SUPERVISOR_ERROR = "supervisor_error"
    SESSION_LOST = "session_lost"
    INPUT_REQUEST = "input_request"  # a rank reads its stdin: the kernel answers (rank_stdin.py)
    HELD = "held"          # a failed rank held for a post-mortem (%distributed_debug)
    HELD_END = "held_end"  # a held rank exited (after "finished")
    FINISHED = "finished"
    BATCH = "batch"


#: The kinds a batching supervisor sends at once, with what it holds: what
#: the kernel waits on to end a cell or to know it cannot go on.
SEND_NOW = frozenset(k.value for k in (Kind.FINISHED, Kind.SUPERVISOR_ERROR, Kind.SESSION_LOST,
                                         Kind.RENDEZVOUS_FAILED, Kind.INPUT_REQUEST))


def batch(messages: list) -> dict:
    """One message for ``messages`` (each with the same ``run_id`` and
    ``node_rank``): a supervisor sends what it has when its loop is about
    to wait (supervisor/outbox.py), so the kernel verifies and unpickles one
    frame per turn (on Slurm, per node and wakeup) instead of one per
    message.  A single message goes as it is."""
    if len(messages) == 1:
        return messages[0]
    first = messages[0]
    return {"kind": Kind.BATCH, "run_id": first["run_id"], "node_rank": first.get("node_rank"),
            "messages": messages}


def answer_content(request: dict, line, why: str = "") -> dict:
    """The kernel's answer to a rank's ``input_request``, as its supervisor
    takes it (supervisor/rank_input.py): ``line`` (None: end of input, ``why``)."""
    return {"rank": request.get("rank"), "seq": request.get("seq"), "line": line, "why": why}


def unbatched(msg: dict) -> list:
    """The messages a received (verified) message stands for, in order: a
    batch's, else itself."""
    return msg["messages"] if msg.get("kind") == Kind.BATCH else [msg]


class RankEvent(_Text):
    """What a rank reports about itself (inside a ``rank_event`` message)."""
    FAILED = "failed"          # exc_type, message, traceback, timestamp, secondary
    RESULT = "result"          # value, returns, missing, new_modules, exited, in_world, rounds, timestamp
    PROGRESS = "progress"      # n, total, desc
    BAR = "bar"                # id, pos, desc, n, total, stats, leave, closed, line (as tqdm draws it)
    NAMES = "names"            # assigned, deleted (a session cell)
    SESSION_READY = "session_ready"
    JOINING = "joining"        # round: entered the round-th init_process_group for the run's world
    JOINED = "joined"          # round: left it (joined, or it raised)
    PHASE = "phase"            # text: what the cell is busy with ("importing accelerate", "in init_process_group"; '': its own code)


def failure_summary(event: dict) -> str:
    """A ``failed`` rank event in one line, ``"ValueError: boom"``: how every
    process words it (the supervisors' logs and stores, the kernel's record)."""
    return f"{event['exc_type']}: {event['message']}" if event.get("message") else event["exc_type"]


class StopReason(_Text):
    """Why a supervisor stopped its ranks (``finished``'s ``reason``; None: they all ended)."""
    FAILED = "failed"              # a rank failed
    INTERRUPT = "interrupt"        # the stop button, h.stop(), a node told to stop
    TIMEOUT = "timeout"            # --timeout
    TERMINATED = "terminated"      # the supervisor got SIGTERM from outside
    RENDEZVOUS = "rendezvous"      # the nodes did not all join in time
    STALLED = "stalled"            # a rank stuck where nothing can move it
    REMOTE_FAILED = "remote_failed"  # another node's rank failed

    @classmethod
    def merged(cls, reasons) -> "StopReason | None":
        """One run on several nodes: the reason the whole run ended, from each
        node's.  What the user did wins (a stop), then what the kernel enforced,
        then what happened to the ranks; a node stopped for another's failure
        is that failure."""
        present = {cls.parse(r) for r in reasons if r is not None}
        for reason in _PRECEDENCE:
            if reason in present:
                return cls.FAILED if reason is cls.REMOTE_FAILED else reason
        return None


_PRECEDENCE = (StopReason.INTERRUPT, StopReason.TIMEOUT, StopReason.TERMINATED, StopReason.RENDEZVOUS,
               StopReason.STALLED, StopReason.FAILED, StopReason.REMOTE_FAILED)


class Status(_Text):
    """How a run ended, as views and errors word it (``events.RunFinished.status``)."""
    OK = "ok"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    TIMEOUT = "timeout"
    TERMINATED = "terminated"
    STALLED = "stalled"
    RENDEZVOUS_FAILED = "rendezvous_failed"

    @classmethod
    def of(cls, reason, has_failure: bool) -> "Status":
        """The status for a run that stopped for ``reason`` (None: its ranks all
        ended), with or without a failed rank."""
        reason = StopReason.parse(reason) if reason is not None else None
        if reason is None or reason in (StopReason.FAILED, StopReason.REMOTE_FAILED):
            return cls.FAILED if has_failure else cls.OK
        return _STATUS_OF[reason]


_STATUS_OF = {StopReason.INTERRUPT: Status.INTERRUPTED, StopReason.TIMEOUT: Status.TIMEOUT,
              StopReason.TERMINATED: Status.TERMINATED, StopReason.RENDEZVOUS: Status.RENDEZVOUS_FAILED,
              StopReason.STALLED: Status.STALLED}
