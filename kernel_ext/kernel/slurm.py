"""Kernel side of ``--launcher slurm``: one run on every node of the allocation.

The kernel runs inside a Slurm allocation (``salloc -N 2`` then Jupyter, or
Jupyter started by ``sbatch``).  :class:`SlurmAgents` starts one agent per
node with a single ``srun`` step (:mod:`slurm_agent`) the first time a cell
needs them and keeps them for the later cells of that allocation, so a
second cell costs a few milliseconds, not srun plus ``import torch``.

:class:`SlurmPlacement` is the placement (:mod:`placement`) of every node
of the allocation: each attempt of a run is one run per node, as if each
node had its own kernel (the one-kernel-per-node mode), all dispatched and
watched from here: :class:`SlurmRun` sends each agent its node's part
(``node_rank`` = the node's index in the allocation, node 0's address as
``MASTER_ADDR``, a fresh port for all) and merges what the nodes say into
the messages of one run, which the kernel folds (:mod:`fold`) as a local
run's.  So every mode of :func:`run.execute` works here: one-shot,
background, restarts (a failure on any node stops every node; the next
attempt starts on all of them on a fresh port).

Stopping never goes through srun's signals (one SIGINT to srun forwards
nothing, two kill the tasks; SIGKILL to its process group leaves the tasks
running): the stop button, ``--timeout`` and shutdown go through the signed
channel to each agent.  Agents end when the kernel's connection is gone
(heartbeats), and at shutdown srun is stopped and the step cancelled
(``scancel``) as the last resort, so nothing outlives the kernel on any node.
"""
from __future__ import annotations

import atexit
import dataclasses
import fcntl
import functools
import json
import logging
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Iterator, Optional

import zmq

from .. import child_environment, wire
from ..wire import transport
from ..environment import LaunchConfig, host_address
from .errors import LauncherError
from ..stop_ladder import Rung, StopLadder
from .placement import Attempt, Placement
from .slurm_session import SlurmSessionRanks
from .run_handle import receive_verified
from ..wire.messages import Kind, RankEvent, StopReason, answer_content, unbatched
# The ladders' order: see timing.py.
from ..timing import (
    SLURM_START_WAIT as START_WAIT, SLURM_STOP_WAIT as STOP_WAIT, SLURM_KILL_WAIT as KILL_WAIT,
    SLURM_GONE_WAIT as GONE_WAIT, SLURM_GONE_DRAIN as GONE_DRAIN, SLURM_JOB_SETTLE, SLURM_AGENT_LOOK as AGENT_LOOK,
    SLURM_AGENT_SETTLE as AGENT_SETTLE, SLURM_AGENT_SETTLE_POLL, SLURM_BEAT, SLURM_COMMAND_WAIT, SLURM_JOB_POLL,
    SLURM_PORT_WAIT, SLURM_RECEIVE_SLICE, SLURM_START_SLICE, SESSION_STOP_WAIT,
)

_live: "weakref.WeakSet[SlurmAgents]" = weakref.WeakSet()
_MORE = int(zmq.SNDMORE)
log = logging.getLogger("accel_magics.kernel.slurm")

#: why a run ended without some nodes, once its stop's ladder reached the top
FORCED_BY_THE_LADDER = "a node did not answer the stop"


@atexit.register
def _close_all() -> None:
    for agents in list(_live):
        agents.close()


class SlurmError(Exception):
    """No allocation, or one that cannot run the cell; the message says what to do."""


def allocation() -> dict:
    """The allocation this kernel runs in: job id, node names, node count."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job:
        raise SlurmError("--launcher slurm needs a Slurm allocation, and this kernel runs outside one "
                         "(no SLURM_JOB_ID). Start Jupyter inside one (`salloc -N 2` then `jupyter lab`, or "
                         "an sbatch job that starts it), or use one kernel per node (see Several nodes).")
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    nodes = expand_nodelist(nodelist)
    count = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or len(nodes) or 1)
    return {"job": job, "nodelist": nodelist, "nodes": nodes, "count": count}


def describe_allocation() -> str:
    """One line for %distributed_config: the allocation this kernel is in, if any."""
    try:
        alloc = allocation()
    except SlurmError:
        return ""
    return (f"Slurm allocation: job {alloc['job']}, {alloc['count']} node(s): {alloc['nodelist']} "
            "(--launcher slurm runs on all of them)")


def expand_nodelist(nodelist: str) -> list[str]:
    """``n[1-3],gpu7`` -> ``['n1', 'n2', 'n3', 'gpu7']`` (``scontrol show hostnames``,
    else a parser of the common forms).  Asked once per node list: every cell
    checks its flags against the allocation, and scontrol is a process."""
    return list(_expand_nodelist(nodelist))


@functools.lru_cache(maxsize=16)
def _expand_nodelist(nodelist: str) -> tuple[str, ...]:
    if not nodelist:
        return ()
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=SLURM_COMMAND_WAIT)
        if out.returncode == 0 and out.stdout.split():
            return tuple(out.stdout.split())
    except (OSError, subprocess.SubprocessError):
        pass
    names = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.match(r"^(.*)\[(.*)\]$", part)
        if not m:
            names.append(part)
            continue
        prefix, ranges = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{str(i).zfill(len(lo))}")
    return tuple(names)


#: How squeue's state of an allocation that ended reads to the user.
_ENDED = {"CANCELLED": "was cancelled (scancel)", "TIMEOUT": "reached its time limit",
          "PREEMPTED": "was preempted", "NODE_FAIL": "lost a node", "DEADLINE": "reached its deadline",
          "OUT_OF_MEMORY": "ran out of memory", "FAILED": "failed", "COMPLETED": "ended", "BOOT_FAIL": "failed to boot"}
_RUNNING = {"RUNNING", "SUSPENDED", "CONFIGURING", "RESIZING", "STAGE_OUT", "SIGNALING"}


def job_ended(job: str, settle: float = SLURM_JOB_SETTLE) -> Optional[str]:
    """How the allocation ended ("was cancelled (scancel)"), or None while it
    runs (or when squeue cannot tell: never a guess that it is gone).  A job
    that ends reads COMPLETING while Slurm kills its steps: asked again for up
    to ``settle`` seconds, for its final state (cancelled, time limit, ...)."""
    deadline = time.monotonic() + settle
    while True:
        how = _job_state(job)
        if how != "COMPLETING" or time.monotonic() >= deadline:
            return "ended" if how == "COMPLETING" else how
        time.sleep(SLURM_JOB_POLL)


def _job_state(job: str) -> Optional[str]:
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True,
                             text=True, timeout=SLURM_COMMAND_WAIT)
    except (OSError, subprocess.SubprocessError):
        return None
    state = out.stdout.strip().split("\n")[0].strip()
    if out.returncode != 0:
        return "ended" if "Invalid job id" in out.stderr else None
    if not state or state in _RUNNING:
        return None if state else "ended"
    return state if state == "COMPLETING" else _ENDED.get(state, f"ended (state {state})")


class SlurmJobGone(LauncherError):
    """The allocation ended under a run (scancel, its time limit, preemption):
    Slurm stopped the agents and every rank; said as what happened, not as a
    failure of ours."""

    def __init__(self, job: str, how: str) -> None:
        self.job = job
        super().__init__(f"the Slurm job {job} {how} during the run: Slurm stopped the node agents and "
                         "every rank on every node, so the cell could not finish. Nothing of it is left; "
                         "to go on, start a new allocation (salloc) and a kernel inside it.")


class AgentGone(LauncherError):
    """An agent's connection failed as a run was being dispatched: nothing of
    that run goes on (nodes already sent it are told to kill it), so the
    agents can be started again and the run dispatched afresh."""


class SlurmAgents:
    """The agents of one allocation: started once, kept, stopped with the kernel."""

    def __init__(self, num_nodes: int, slurm_args: str = "", python: str = sys.executable) -> None:
        self.alloc = allocation()
        self.num_nodes = num_nodes
        self.slurm_args = slurm_args
        self.python = python
        self.proc: Optional[subprocess.Popen] = None
        self.nodes: dict[int, dict] = {}      # SLURM_NODEID -> its hello
        self.log = None   # srun's output: a file with no name (nothing to leave behind, even on kill -9)

    @property
    def alive(self) -> bool:
        """srun runs and every agent is still connected (srun keeps its step while
        any task lives: an agent can be gone, killed or crashed, with srun alive)."""
        return (self.proc is not None and self.proc.poll() is None and len(self.nodes) == self.num_nodes
                and self._reachable())

    def _reachable(self) -> bool:
        return not self.send_all(self.nodes, {"op": "ping"})

    def connected(self, node: int) -> bool:
        """Is that node's agent still connected?  (ROUTER_MANDATORY: a message to
        an agent whose connection is gone fails at once; the agent ignores a ping.)"""
        return not self.send_all([node], {"op": "ping"})

    def matches(self, num_nodes: int, slurm_args: str) -> bool:
        return self.alive and num_nodes == self.num_nodes and slurm_args == self.slurm_args

    def start(self) -> None:
        self.key = wire.new_key()
        # The agents' socket identities: secret too (a ROUTER refuses a second peer
        # with an identity it has, so a guessable one could be taken first).
        self.ident = secrets.token_hex(16)
        self.session = wire.signed_session(self.key)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Both ports are on the cluster network: only peers holding the
        # allocation's key get past the handshake (wire/transport.py).
        keys = transport.curve_keys(self.key)
        transport.listen(self.sock, keys, max_bytes=transport.CONTROL_MAX_BYTES)
        address = host_address("ACCEL_MAGICS_KERNEL_ADDR")
        port = self.sock.bind_to_random_port(f"tcp://{address}")
        # The runs' own messages, from every node's supervisor (see slurm_agent).
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.LINGER, 0)
        self.events.setsockopt(zmq.RCVHWM, 0)   # authenticated peers only: a run's messages are never dropped
        transport.listen(self.events, keys)
        events_port = self.events.bind_to_random_port(f"tcp://{address}")
        argv = ["srun", "--overlap", f"--nodes={self.num_nodes}", f"--ntasks={self.num_nodes}",
                "--ntasks-per-node=1", "--input=all", "--kill-on-bad-exit=0", "--job-name=accel_magics-agents",
                *shlex.split(self.slurm_args), self.python, "-m", "accel_magics.kernel_ext.node_agent.slurm_agent"]
        env = child_environment(os.environ)
        self.log = tempfile.TemporaryFile(prefix="accel_magics-srun-")
        # O_APPEND: srun writes at the end whatever this side reads (log_tail uses pread).
        fcntl.fcntl(self.log.fileno(), fcntl.F_SETFL, fcntl.fcntl(self.log.fileno(), fcntl.F_GETFL) | os.O_APPEND)
        try:
            # Its own session: the kernel's interrupt (SIGINT to its group) must
            # never reach srun (two SIGINTs within a second kill the step).
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, env=env,
                                         start_new_session=True, close_fds=True)
        except OSError as exc:
            self.close()
            raise SlurmError(f"could not start srun ({exc}); is Slurm's client installed here?") from None
        _live.add(self)
        try:
            self.proc.stdin.write((json.dumps({"address": f"tcp://{address}:{port}",
                                               "events": f"tcp://{address}:{events_port}",
                                               "ident": self.ident, "key": self.key.decode()}) + "\n").encode())
            self.proc.stdin.close()
            self._wait_hellos()
        except BaseException:
            self.close()
            raise

    def _wait_hellos(self) -> None:
        deadline = time.monotonic() + START_WAIT
        while len(self.nodes) < self.num_nodes:
            if self.proc.poll() is not None:
                raise SlurmError(f"srun ended (code {self.proc.returncode}) before every agent started:\n"
                                 + self.log_tail())
            if time.monotonic() > deadline:
                raise SlurmError(f"only {len(self.nodes)} of {self.num_nodes} node agents started within "
                                 f"{START_WAIT:g}s:\n" + self.log_tail())
            msg = self.receive(int(SLURM_START_SLICE * 1000))
            if msg is not None and msg.get("kind") == "hello":
                self.nodes[msg["node"]] = msg

    def log_tail(self, n: int = 30) -> str:
        try:
            fd = self.log.fileno()
            size = os.fstat(fd).st_size
            data = os.pread(fd, min(size, 1 << 16), max(0, size - (1 << 16)))
            return b"".join(data.splitlines(keepends=True)[-n:]).decode("utf-8", "replace")
        except (OSError, AttributeError, ValueError):   # closed, or never opened
            return ""

    # -- the channel --------------------------------------------------------------------
    def send(self, node: int, content: dict) -> None:
        gone = self.send_all([node], content)
        if gone:
            raise LauncherError(f"the agent on node {node} is gone ({gone[node]})")

    def send_all(self, nodes, content: dict) -> dict[int, zmq.ZMQError]:
        """``content`` to each agent of ``nodes``, signed once: what every node of
        a run gets (the cell's payload, each node's part in it) is pickled and
        HMAC'd once, not once per node, and a payload over ``copy_threshold``
        goes out without a copy per node.  Each agent checks the signature
        against its own replay history, so N agents see it once each.
        Returns the nodes whose agent is gone (ROUTER_MANDATORY: not
        connected), each with its error, after sending to every other one."""
        frames = wire.packed(self.session.serialize(self.session.msg("kernel", content)))
        copy = max(len(f) for f in frames) < self.session.copy_threshold
        *first, last = frames
        send = self.sock.send   # frame by frame with int flags: send_multipart's enum flags cost more per node
        gone = {}
        for node in nodes:
            try:
                send(f"{self.ident}-{node}".encode(), _MORE)   # an agent that is gone fails here, nothing queued
                for part in first:
                    send(part, _MORE, copy=copy)
                send(last, 0, copy=copy)
            except zmq.ZMQError as exc:
                gone[node] = exc
        return gone

    def receive(self, timeout_ms: int) -> Optional[dict]:
        """The next verified message from any agent (None: nothing within the timeout)."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        try:
            return wire.verified_content(self.session, frames[1:])
        except Exception:
            return {}   # not signed with the allocation's key: dropped unread

    def node_messages(self, session, run_id: str, also: tuple = ()) -> Iterator[dict]:
        """What the nodes' supervisors sent under ``run_id`` (or ``also``) and
        is waiting now, verified with ``session``'s key once per node's message,
        one message per item of its batch, each stamped with its ``node``
        (SLURM_NODEID)."""
        node_ids = sorted(self.nodes)   # node_rank -> SLURM_NODEID
        while True:
            msg, _ = receive_verified(self.events, session, run_id, also)
            if msg is None:
                return
            node = node_ids[msg.get("node_rank", 0)]
            for one in unbatched(msg):
                one["node"] = node
                yield one

    def ended_under(self, exc: BaseException) -> None:
        """The allocation ended under a cell (scancel, its time limit), or srun
        did: the agents are gone for good, so their two ports on the cluster
        network, srun's log and its pipes are let go now, not at the next
        cell (which says the allocation is gone) or the kernel's end."""
        if isinstance(exc, SlurmJobGone) or self.proc is None or self.proc.poll() is not None:
            self.close()

    # -- where a run's parts go -----------------------------------------------------------
    def node_part(self, cfg: LaunchConfig, node_rank: int, master_port: int, fields: tuple) -> dict:
        """What node ``node_rank``'s launcher gets of ``cfg`` (``fields`` of it, and
        its place in the world), as one kernel per node would set it.  The stall
        check is the kernel's here: each node sees only its own ranks."""
        part = {name: getattr(cfg, name) for name in fields}
        part.update(num_nodes=cfg.num_nodes, node_rank=node_rank, master_addr=self.nodes[min(self.nodes)]["address"],
                    master_port=master_port, stall_timeout=0)
        return part

    def rank_nodes(self, num_processes: int) -> dict:
        """Global rank -> node name: ranks numbered as torchrun does, node by node."""
        return {node_rank * num_processes + i: self.nodes[node]["nodename"]
                for node_rank, node in enumerate(sorted(self.nodes)) for i in range(num_processes)}

    def free_port(self) -> int:
        """A free port on node 0 (its supervisor hosts the rendezvous there)."""
        request = wire.new_id(8)
        self.send(0, {"op": "port", "request": request})
        deadline = time.monotonic() + SLURM_PORT_WAIT
        while time.monotonic() < deadline:
            msg = self.receive(int(SLURM_RECEIVE_SLICE * 1000))
            if msg and msg.get("kind") == "port" and msg.get("request") == request:
                return msg["port"]
        raise LauncherError("node 0's agent did not answer")

    def close(self) -> None:
        """Agents told to end, srun stopped, the step cancelled if anything is left."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for node in list(self.nodes):
                try:
                    self.send(node, {"op": "shutdown"})
                except Exception:
                    pass
            try:
                # No agent ever connected (stopped while they started): none was told to end.
                proc.wait(GONE_WAIT if self.nodes else 0)
            except subprocess.TimeoutExpired:
                proc.terminate()   # SIGTERM to srun: it kills the tasks within ~50 ms
                try:
                    proc.wait(GONE_WAIT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._cancel_steps()
        for name in ("sock", "events"):
            if getattr(self, name, None) is not None:
                getattr(self, name).close(linger=0)
                setattr(self, name, None)
        if self.log is not None:
            self.log.close()
            self.log = None
        self.nodes = {}
        _live.discard(self)

    def _cancel_steps(self) -> None:
        """The last resort: scancel any step of ours still in squeue."""
        try:
            out = subprocess.run(["squeue", "-h", "-s", "-j", self.alloc["job"], "-o", "%i %j"],
                                 capture_output=True, text=True, timeout=SLURM_COMMAND_WAIT).stdout
            for line in out.splitlines():
                step, _, name = line.partition(" ")
                if name.strip() == "accel_magics-agents":
                    subprocess.run(["scancel", step], capture_output=True, timeout=SLURM_COMMAND_WAIT)
        except (OSError, subprocess.SubprocessError):
            pass


class SlurmPlacement(Placement):
    """Every node of the allocation, through its agents (one run per node)."""

    name = "slurm"

    def __init__(self, agents: SlurmAgents) -> None:
        self.agents = agents

    def launch(self, cfg, payload, *, attempt: int = 0, log_dir: str = "", excerpt=None, events=None) -> Attempt:
        run = SlurmRun(self.agents, cfg)
        run.dispatch(payload, log_dir, excerpt, attempt)
        log.info("run %s attempt %d: %d rank(s) on each of %d node(s) of job %s (port %d)", run.run_id, attempt,
                 cfg.num_processes, cfg.num_nodes, self.agents.alloc["job"], run.master_port)
        return run

    def open_session(self, cfg) -> SlurmSessionRanks:
        return SlurmSessionRanks(self, cfg)

    def session_cell(self, ranks: SlurmSessionRanks, run_id: str, timeout: Optional[float]) -> "SlurmRun":
        """A session's cell (or its stop) on every node: an attempt over the
        nodes' parts of the session, which the session sends it to."""
        cfg = dataclasses.replace(ranks.cfg, timeout=timeout, master_port=ranks.master_port)
        return SlurmRun(self.agents, cfg, run_id=run_id, part_of=ranks.id, policy=SESSION_CELL)


#: What each node's launcher is given of a run's config (a session's: slurm_session.SESSION_FIELDS).
RUN_FIELDS = ("num_processes", "max_restarts", "mixed_precision", "timeout", "rendezvous_timeout", "extra_env",
              "debug_hold")


@dataclasses.dataclass(frozen=True)
class PartPolicy:
    """How an attempt treats each node's part of it: a run's (dispatched by
    the attempt, ended when it closes) or a session cell's (sent by the
    session into parts that outlive the cell)."""
    #: What the other nodes are told when a rank fails on one.
    peers_failed: str = "peers_ended"
    #: What ended when a node's supervisor exited without its answer.
    part_gone: str = "the run's supervisor on node {node} ({name}) exited without finishing the run"
    #: After a stop, how long the nodes get before they are told to kill (see timing).
    stop_wait: float = STOP_WAIT
    #: Whether the close lets node 0 end (its store up for the others until then).
    ends_parts: bool = True


RUN = PartPolicy()
#: A session's cell: a failure recalls the other nodes' ranks to their prompt
#: (as on one node), within each node's session ladder; the parts stay.
SESSION_CELL = PartPolicy(
    peers_failed="interrupt", stop_wait=SESSION_STOP_WAIT, ends_parts=False,
    part_gone="the session's supervisor on node {node} ({name}) exited during the cell, without its answer")


class SlurmRun(Attempt):
    """One attempt on every node, over the agents' messages (see the module
    doc); ``part_of``: the session whose parts a session cell runs in."""

    def __init__(self, agents: SlurmAgents, cfg: LaunchConfig, run_id: Optional[str] = None,
                 part_of: Optional[str] = None, policy: PartPolicy = RUN) -> None:
        self.agents = agents
        self.run_id = run_id or wire.new_id()
        # Its supervisors sign with a key both ends derive from the allocation's
        # (for the run's id; a session cell's: the session's).
        self.session = wire.signed_session(wire.derive_key(agents.key, part_of or self.run_id))
        self.cfg = cfg
        self.policy = policy
        self.finished = False
        # A session cell's commands say which session; its parts may say they are gone under its id.
        self.part_id = part_of
        self.route = {"session": part_of} if part_of else {}
        self.session_cell = part_of is not None
        self.forced: Optional[str] = None
        nodes = self.node_ids = sorted(agents.nodes)   # node_rank -> SLURM_NODEID
        self.master_addr = agents.nodes[nodes[0]]["address"]
        self.master_port = cfg.master_port or agents.free_port()
        P = cfg.num_processes
        self.ranks = list(range(cfg.num_nodes * P))
        self.node_of = agents.rank_nodes(P)
        self.pending = {node: None for node in nodes}    # node -> its "finished" message, once there
        self.started: dict[int, dict] = {}
        self.exited: dict[int, float] = {}   # node -> when its agent saw its supervisor exit (+ drain)
        self.peers_told = False   # the other nodes were told to stop (a rank failed)
        # The kernel's backstop of a stop: every node told to stop (each runs its
        # own ladder), then to kill, then the run ends without them (forced).
        self.ladder = StopLadder(f"run {self.run_id} on {len(nodes)} node(s)", [
            Rung("every node told to stop", lambda: self._each({"op": "interrupt", "run_id": self.run_id}),
                 self.policy.stop_wait),
            Rung("every node told to kill", lambda: self._each({"op": "kill", "run_id": self.run_id}), KILL_WAIT),
            Rung("ended without the nodes that did not answer", self._force)], done=lambda: self.finished, log=log)
        self._presses = self._pressed = 0   # stops asked (any thread) / carried out (the reading thread)
        self.timeout_at = time.monotonic() + cfg.timeout + STOP_WAIT + KILL_WAIT if cfg.timeout else None
        # A session's world formed when it started: a cell has no rendezvous to wait for.
        self.rendezvous_at = None if part_of else time.monotonic() + cfg.rendezvous_timeout + STOP_WAIT
        self.look_at = time.monotonic() + AGENT_LOOK
        self.unreachable: set[int] = set()   # nodes whose agent the last look could not reach
        self.held_at: dict[str, int] = {}   # a held rank's supervisor's socket -> its node (see held_reach)

    def dispatch(self, payload, log_dir: str, excerpt, attempt: int) -> None:
        """Each node its part of the run (as one kernel per node would), in one
        message for all: every node's part keyed by its node id, the payload
        once (see ``SlurmAgents.send_all``)."""
        cfg, nodes = self.cfg, self.node_ids
        agents = self.agents
        parts = {node: agents.node_part(cfg, node_rank, self.master_port, RUN_FIELDS)
                 for node_rank, node in enumerate(nodes)}
        gone = agents.send_all(nodes, {"op": "run", "run_id": self.run_id, "cfgs": parts, "payload": payload,
                                       "log_dir": log_dir, "excerpt": excerpt, "attempt": attempt})
        if gone:
            # The nodes that got it kill it (the others ignore a run they never got).
            self._each({"op": "kill", "run_id": self.run_id})
            node, exc = next(iter(gone.items()))
            raise AgentGone(f"the agent on node {node} is gone ({exc})")

    def messages(self, heartbeat: Optional[float] = None) -> Iterator[dict]:
        beat = int((heartbeat or SLURM_BEAT) * 1000)
        poller = zmq.Poller()
        poller.register(self.agents.events, zmq.POLLIN)
        poller.register(self.agents.sock, zmq.POLLIN)
        while not self.finished:
            self._carry_stops()
            ready = dict(poller.poll(beat))
            if not ready and heartbeat is not None:
                yield {"kind": "heartbeat"}
            if self.agents.events in ready:   # what the supervisors said, verified with the run's key
                for one in self.agents.node_messages(self.session, self.run_id,
                                                     (self.part_id,) if self.part_id else ()):
                    yield from (self._merge(one) if self._ours(one) else self._part_lost(one))
                    if self.finished:
                        return
            if self.agents.sock in ready:
                while True:
                    msg = self.agents.receive(0)
                    if msg is None:
                        break
                    if msg and (msg.get("run_id") == self.run_id or self._ends_part(msg)):
                        yield from self._agent_message(msg)
            if not self.finished and self._check(time.monotonic()):
                yield {"kind": "finished", "reason": "interrupt", "forced": self.forced}

    def _ours(self, msg: dict) -> bool:
        """This attempt's message; a session cell's also: what its ranks say
        between cells, under the session's id (a failed cell's post-mortem),
        but not that the part is gone (``_part_lost``)."""
        return msg.get("run_id") == self.run_id or (
            self.part_id is not None and msg.get("run_id") == self.part_id and msg.get("kind") != Kind.SESSION_LOST)

    def _ends_part(self, msg: dict) -> bool:
        """An agent's word that this node's part ended, under the part's id
        rather than this attempt's: a session's supervisor that exited between
        cells as this cell (or the stop) was sent, which it never read."""
        return msg.get("kind") == "supervisor_exit" and self.part_id is not None \
            and (msg.get("run_id") == self.part_id or msg.get("cell") == self.run_id)

    def _part_lost(self, msg: dict) -> list[dict]:
        """A node's part said, under its own id, that it is gone ("session
        lost": a rank died at its prompt) as this cell or the stop reached it:
        that node's answer, as if it had finished the cell with the session
        lost (never waited for, as a part that is gone never answers)."""
        if msg.get("kind") != Kind.SESSION_LOST or self.pending.get(msg["node"]) is not None:
            return []
        return self._merge_finished({"kind": "finished", "node": msg["node"], "reason": StopReason.FAILED,
                                     "session": "lost", "lost": msg.get("lost")})

    def _agent_message(self, msg: dict) -> list[dict]:
        if msg.get("kind") == "supervisor_exit":
            # Its "finished" may still be on its way (another connection): a moment's grace.
            if self.pending.get(msg["node"]) is None:
                self.exited[msg["node"]] = time.monotonic() + GONE_DRAIN
            return []
        return self._merge(msg)

    def _merge(self, msg: dict) -> list[dict]:
        """One node's message into the run's: a handler per kind (``_MERGE``).
        Kinds without one ("remote_failure" among them: every node's own failures
        come here directly, and the root cause is found from them all) are dropped."""
        name = self._MERGE.get(Kind.parse(msg.get("kind")))
        return getattr(self, name)(msg) if name else []

    def _merge_rank(self, msg: dict) -> list[dict]:
        """A rank's output, event, stacks or exit: passed on; a failure stops the other nodes."""
        self.rendezvous_at = None
        kind = msg["kind"]
        failed = ((kind == Kind.RANK_EVENT and msg["event"].get("kind") == RankEvent.FAILED)
                  or (kind == Kind.EXIT and not msg["stopped"] and (msg["exitcode"] or msg["signal"])))
        if failed:
            self._peers_failed(msg.get("node"))
        return [msg] if kind != Kind.RELEASED else []

    def _merge_started(self, msg: dict) -> list[dict]:
        """One "started" for the run, once every node's ranks are up."""
        self.started[msg.get("node")] = msg
        if len(self.started) < len(self.pending):
            return []
        pids = {r: p for m in self.started.values() for r, p in m["pids"].items()}
        return [{"kind": "started", "pids": pids, "nodes": self.node_of, "master_addr": self.master_addr}]

    def _merge_finished(self, msg: dict) -> list[dict]:
        """One "finished" for the run, once every node finished (the reason merged)."""
        node = msg.get("node")
        if msg.get("reason") == StopReason.TERMINATED and self._agent_went(node):
            # Its launcher ended with its agent (killed, crashed), which stopped the run there.
            raise self._agent_gone(node)
        self.pending[node] = msg
        if msg.get("reason") not in (None, StopReason.INTERRUPT) or msg.get("session") == "lost":
            self._peers_failed(node)
        if any(m is None for m in self.pending.values()):
            return []
        self.finished = True
        reasons = [m.get("reason") for m in self.pending.values()]
        if self.peers_told and not self._presses:   # those stops were the kernel's, for a failure
            reasons = [StopReason.REMOTE_FAILED if r == StopReason.INTERRUPT else r for r in reasons]
        reason = StopReason.merged(reasons)
        # SIGTERM from outside: scancel of the job, its time limit?  Slurm signals
        # every process of the step, so a rank can take it before its supervisor
        # and be reported failed ("killed by SIGTERM"): a failure asks too.
        if reason in (StopReason.TERMINATED, StopReason.FAILED):
            how = job_ended(self.agents.alloc["job"])
            if how is not None:
                raise SlurmJobGone(self.agents.alloc["job"], how)
        merged = self._session_state() if any(m.get("session") for m in self.pending.values()) else {}
        return [{"kind": "finished", "reason": reason, "forced": self.forced, **merged,
                 "terminated_on": [f"{n} ({self.agents.nodes[n]['nodename']})"
                                   for n, m in sorted(self.pending.items()) if m.get("reason") == "terminated"]}]

    def _merge_as_is(self, msg: dict) -> list[dict]:
        return [msg]

    def _merge_held(self, msg: dict) -> list[dict]:
        """A failed rank held for a post-mortem: where its supervisor takes the kernel's word."""
        self.held_at[msg.get("reply_to") or ""] = msg.get("node")
        return [msg]

    _MERGE = {Kind.OUTPUT: "_merge_rank", Kind.RANK_EVENT: "_merge_rank", Kind.STACKS: "_merge_rank",
              Kind.EXIT: "_merge_rank", Kind.RELEASED: "_merge_rank", Kind.STARTED: "_merge_started",
              Kind.FINISHED: "_merge_finished", Kind.SUPERVISOR_ERROR: "_merge_as_is",
              Kind.WAITING: "_merge_as_is", Kind.RENDEZVOUS_FAILED: "_merge_as_is", Kind.STALLED: "_merge_as_is",
              Kind.QUIET: "_merge_as_is", Kind.INPUT_REQUEST: "_merge_rank", Kind.HELD: "_merge_held",
              Kind.HELD_END: "_merge_as_is"}

    def _session_state(self) -> dict:
        """A session cell on every node: lost if it is lost on any node (why, there),
        stopped when every node stopped it, else alive."""
        states = {node: m.get("session") for node, m in self.pending.items()}
        lost = [f"on node {node} ({self.agents.nodes[node]['nodename']}): {m.get('lost') or 'its ranks ended'}"
                for node, m in sorted(self.pending.items()) if m.get("session") == "lost"]
        if lost:
            return {"session": "lost", "lost": "; ".join(lost)}
        return {"session": "stopped" if set(states.values()) == {"stopped"} else "alive"}

    def _check(self, now: float) -> bool:
        """The kernel's backstop: nodes that do not finish after a stop are told to
        kill; True when the run must end without them (forced)."""
        if self.agents.proc is None or self.agents.proc.poll() is not None:
            self.forced = "srun (the node agents) ended during the run"
            self.finished = True
            raise self._ended("the node agents ended during the run (srun exited):\n" + self.agents.log_tail())
        if now >= self.look_at:
            self.look_at = now + AGENT_LOOK
            self._look_at_agents()
        for node, at in list(self.exited.items()):
            if self.pending.get(node) is None and now >= at:
                self.finished = True
                name = self.agents.nodes[node]["nodename"]
                raise self._ended(self.policy.part_gone.format(node=node, name=name))
        for deadline in ("timeout_at", "rendezvous_at"):
            at = getattr(self, deadline)
            if at is not None and now >= at and not self.ladder.started:
                setattr(self, deadline, None)
                self.ladder.start(now)
        self.ladder.on_time(now)
        return self.forced == FORCED_BY_THE_LADDER

    def _force(self) -> None:
        self.forced = FORCED_BY_THE_LADDER
        self.finished = True

    def _agent_gone(self, node: int) -> LauncherError:
        self.finished = True
        name = self.agents.nodes[node]["nodename"]
        return self._ended(f"the agent on node {node} ({name}) ended during the run (killed, or it crashed), so "
                           "that node's ranks were stopped or never started; the next cell starts the agents again")

    def _agent_went(self, node: int) -> bool:
        """Did ``node``'s agent end, taking its launcher and so this run's
        supervisor there with it (which says "sent SIGTERM")?  The supervisor's
        word comes over its own connection and can be here before the
        kernel's socket has seen the agent's connection close (CI, a loaded
        machine: the wrong error, "sent SIGTERM by another process"); so the
        agent is looked at again for up to ``AGENT_SETTLE``.  A live agent
        (a real SIGTERM from elsewhere) costs the cell that second."""
        deadline = time.monotonic() + AGENT_SETTLE
        while self.agents.connected(node):
            if time.monotonic() >= deadline:
                return False
            time.sleep(SLURM_AGENT_SETTLE_POLL)   # nothing to wait on: the socket learns of the close by itself
        return True

    def _look_at_agents(self) -> None:
        """An agent that died just before the run reached it never ran its part
        and never says so: the kernel's socket still had its connection when
        the run was sent (the close is seen a moment later), and srun lives on
        while another node's task does.  The other nodes' ranks would wait in
        the rendezvous for it.  So each agent of a node still running is
        pinged every ``AGENT_LOOK``; one unreachable in two looks in a row is
        gone (a live agent whose connection broke reconnects within one)."""
        running = [node for node, done in self.pending.items() if done is None]
        now_unreachable = set(self.agents.send_all(running, {"op": "ping"}))   # one signed ping for all
        for node in sorted(now_unreachable & self.unreachable):
            raise self._agent_gone(node)
        self.unreachable = now_unreachable

    def _ended(self, message: str) -> LauncherError:
        """The error for a node or the agents gone mid-run: the allocation's end
        when that is what it was (Slurm kills every step then), else ``message``."""
        how = job_ended(self.agents.alloc["job"])
        return SlurmJobGone(self.agents.alloc["job"], how) if how is not None else LauncherError(message)

    def _each(self, content: dict, skip: Optional[int] = None) -> None:
        """To every node still running; with its ranks' pids (what a kill takes if it comes to that)."""
        for node, done in self.pending.items():
            if done is None and node != skip:
                try:
                    pids = list(self.started.get(node, {}).get("pids", {}).values())
                    self.agents.send(node, {**content, **self.route, "pids": pids})
                except LauncherError:
                    pass

    def _peers_failed(self, node: int) -> None:
        """A rank failed on ``node``: the other nodes stop (their ranks would wait
        for it); the root cause is that node's, which the kernel already has."""
        if not self.peers_told:
            self.peers_told = True
            self._each({"op": self.policy.peers_failed, "run_id": self.run_id}, skip=node)

    def close(self) -> None:
        """The run is over: node 0 (waiting after its "finished", its store up for
        the others) may end, whatever the way out (done, error, interrupt).  A
        session cell's parts stay: nothing to release."""
        if not self.policy.ends_parts:
            return
        try:
            self.agents.send_all(self.pending, {"op": "peers_ended", "run_id": self.run_id})
        except Exception:
            pass

    def answer(self, request: dict, line: Optional[str], why: str = "", paused: float = 0.0) -> None:
        """See :meth:`Attempt.answer`: through the rank's node agent (the
        allocation's authenticated channel), which passes it to the
        supervisor's socket signed with the run's key."""
        if self.timeout_at is not None:
            self.timeout_at += paused
        try:
            self.agents.send(request["node"], {"op": "answer", "run_id": self.run_id, **self.route,
                                               "reply_to": request.get("reply_to"),
                                               "content": answer_content(request, line, why)})
        except LauncherError:
            pass   # the node is gone: its ranks with it

    def held_reach(self) -> Optional["SlurmReach"]:
        """See :meth:`Attempt.held_reach` (a session cell's ranks are not held on Slurm)."""
        return SlurmReach(self.agents, self.session, dict(self.held_at)) if not self.session_cell else None

    def interrupt(self) -> None:
        """The stop button, from any thread (a background run's ``h.stop()``):
        the thread that reads the run carries it out within a poll (the
        agents' sockets are that thread's alone)."""
        self._presses += 1

    def _carry_stops(self) -> None:
        while self._pressed < self._presses:
            self._pressed += 1
            self._stop_now()

    def _stop_now(self) -> None:
        """Every node's supervisor stops its ranks (stacks first); again: kill now."""
        if not self.ladder.started:
            self.ladder.start()
        else:   # pressed again: kill now
            self.ladder.skip_to(1)

    def kill(self) -> None:
        self._each({"op": "kill", "run_id": self.run_id})


class SlurmReach:
    """How the kernel reaches the failed ranks of a Slurm run held for a
    post-mortem (post_mortem.HeldRun), after the run: its word goes to the
    rank's node agent (op ``run_op``) over the allocation's authenticated
    channel, which passes it to that node's supervisor signed with the run's
    key, as it passes an answer; the held rank's output, questions and end
    still come from its supervisor on the agents' events socket, under the
    run's id and key.  ``held_at``: a held rank's supervisor socket -> its node."""

    def __init__(self, agents: SlurmAgents, session, held_at: dict) -> None:
        self.agents = agents
        self.session = session
        self.held_at = held_at

    def alive(self, held) -> bool:
        return self.agents.alive   # srun's step, every agent connected

    def reader(self, held) -> "SlurmHeldReader":
        return SlurmHeldReader(self.agents, held.run_id, self.session, self.held_at)

    def close(self) -> None:
        """Nothing of its own: the agents serve the next cells."""


class SlurmHeldReader:
    """A held Slurm run as the post-mortem reads it (see SlurmReach): its
    messages until its supervisors are gone, the ranks' answers, the kernel's word."""

    def __init__(self, agents: SlurmAgents, run_id: str, session, held_at: dict) -> None:
        self.agents = agents
        self.run_id = run_id
        self.session = session
        self.held_at = held_at

    def messages(self, heartbeat: Optional[float] = None) -> Iterator[dict]:
        """The run's messages; raises LauncherError once a held rank's
        supervisor exited (its last words drained) or its agent is gone."""
        poller = zmq.Poller()
        poller.register(self.agents.events, zmq.POLLIN)
        poller.register(self.agents.sock, zmq.POLLIN)
        gone_at: Optional[float] = None
        while True:
            ready = dict(poller.poll(int((heartbeat or SLURM_BEAT) * 1000)))
            if not ready and heartbeat is not None:
                yield {"kind": "heartbeat"}
            if self.agents.events in ready:
                yield from self.agents.node_messages(self.session, self.run_id)
            if self.agents.sock in ready:
                while True:
                    msg = self.agents.receive(0)
                    if msg is None:
                        break
                    if msg.get("kind") == "supervisor_exit" and msg.get("run_id") == self.run_id \
                            and gone_at is None:   # its last words may still be on their way
                        gone_at = time.monotonic() + GONE_DRAIN
            now = time.monotonic()
            if gone_at is not None and now >= gone_at:
                raise LauncherError(f"the supervisor of run {self.run_id} exited")
            if not ready and not self.agents.alive:
                raise LauncherError("a node agent of the allocation is gone, and the held rank with it")

    def answer(self, request: dict, line: Optional[str], why: str = "", paused: float = 0.0) -> None:
        self._send("answer", request.get("reply_to") or "", answer_content(request, line, why))

    def tell(self, address: str, content: dict) -> None:
        """``content`` (``debug``, ``release``) to the supervisor's socket at ``address``."""
        self._send("run_op", address, content)

    def _send(self, op: str, address: str, content: dict) -> None:
        """To the supervisor's socket at ``address``, through its node's agent."""
        node = self.held_at.get(address)
        if node is not None:
            self.agents.send(node, {"op": op, "run_id": self.run_id, "reply_to": address, "content": content})

    def close(self, linger: float = 0.0) -> None:
        """Nothing of its own (the agents' sockets serve the next cells)."""
