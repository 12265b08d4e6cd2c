"""The agent on one node of a Slurm allocation (``--launcher slurm``).

Started by the kernel, one per node, with ``srun --nodes N --ntasks-per-node 1
python -m accel_magics.kernel_ext.node_agent.slurm_agent``, and kept for the later cells
of the same allocation.  On its node it plays the kernel's part for the
launcher: it runs a :class:`launcher.Launcher` (the node's launcher process,
which forks each run's supervisor and ranks, exactly as on a workstation),
hands it the runs the kernel sends, passes stops on, and says when a run's
supervisor has exited.

Two channels to the kernel, ZMQ over TCP on the cluster network.  Commands
and the agent's own messages: a DEALER connected to the kernel's ROUTER.  A
run's messages (output, rank events, "finished"): from the node's supervisor
straight to the kernel's PULL socket, so the agent is never a hop (nor a
process to wake on a busy node) on a rank's output.  Both carry pickles, so
every message is HMAC-signed and checked before it is unpickled
(jupyter_client's ``Session``, as for the local channel): the agent's with
the allocation's random key, a run's with a key derived from it for that run
(:func:`wire.derive_key`: both ends compute it, nothing more travels).  The
key and the kernel's addresses come on srun's stdin, never on a command line
or in an environment that ranks inherit.

The agent ends, and its launcher with every run of this node, when the
kernel says so, when the kernel's connection is gone for ``LOST_AFTER``
seconds (ZMTP heartbeats: a kernel killed with -9 is noticed at once, a
vanished host within seconds), or when srun ends the step.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from typing import Optional

import zmq

from .. import logs, wire
from ..wire import transport
from ..environment import LaunchConfig, free_port, host_address
from ..kernel.launcher import Launcher
# The ladders' order: see timing.py.
from ..timing import (AGENT_HEARTBEAT, AGENT_HEARTBEAT_TIMEOUT, AGENT_LINGER,
                      AGENT_IDLE_POLL, AGENT_LOST_AFTER as LOST_AFTER, AGENT_SEND_WAIT,
                      SESSION_STOP_WAIT)

HEARTBEAT_MS = int(AGENT_HEARTBEAT * 1000)   # ZMTP heartbeat interval (AGENT_HEARTBEAT_TIMEOUT: its timeout)
IDLE_POLL_MS = int(AGENT_IDLE_POLL * 1000)
log = logging.getLogger("accel_magics.node_agent")


class SessionPart:
    """This node's part of a session (``%distributed_session start --launcher
    slurm``): its supervisor's handle (it stays, see session_supervisor), the
    socket its cells go in on and the signer of those cells (the session's
    key, derived as for a run)."""

    def __init__(self, launcher: Launcher, sid: str, key: bytes, cfg: LaunchConfig) -> None:
        self.id = sid
        self.launcher = launcher
        self.cell_id = None         # the session cell running now
        self.cells = launcher.channel(zmq.PUSH, f"s{sid}-in")
        self.cells[0].setsockopt(zmq.SNDTIMEO, int(AGENT_SEND_WAIT * 1000))
        self.signer = wire.signed_session(key)
        try:
            self.handle = launcher.launch(
                cfg, None, run_id=sid, key=key, persistent=True, stop_wait=SESSION_STOP_WAIT,
                extra={"session": True, "cells_addr": self.cells[1], "payload": None,
                       "dispatched_together": True})
        except BaseException:
            self.close_channel()
            raise

    def forward(self, op: str, content: dict) -> bool:
        """A cell or the stop to its supervisor; False: nobody reads it (it
        exited, a rank died at its prompt, and we are not told yet: a send
        with no peer would block the agent's loop, and the node, for ever)."""
        if op == "cell":
            self.cell_id = content["run_id"]
        try:
            self.signer.send(self.cells[0], op, content)
            return True
        except zmq.Again:
            return False

    def recall(self) -> None:
        """The cell's ranks back to their prompt.  The kernel escalates (it
        reads the cell); an escalation armed here would outlive the cell and
        end the session cells later.  Sent after the cell on the same socket,
        not as a signal: a signal overtook the cell, the supervisor had none
        yet and dropped it, and the kernel's escalation then ended the session."""
        if not self.forward("interrupt", {"op": "interrupt", "run_id": self.cell_id}):
            self.handle.signal_stop()   # no supervisor reads it (gone, not told yet): the signal, as before

    def end(self) -> None:
        self.launcher.live.pop(self.id, None)
        self.handle.close()
        self.close_channel()

    def close_channel(self) -> None:
        if self.cells is not None:
            self.cells[0].close(linger=0)
            try:
                os.unlink(self.cells[1][len("ipc://"):])
            except OSError:
                pass
            self.cells = None


class Answers:
    """The kernel's answers to ranks of this node that read their stdin
    (supervisor/rank_input.py), and its word about a failed rank held for a
    post-mortem (``run_op``: debug, release): each to the socket its supervisor
    named, which must be one of this node's launcher's (``in-<pid>`` in its
    private directory), signed with the run's (or the session's) key."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.socks: dict = {}

    def forward(self, private_dir: str, signer, msg: dict) -> None:
        """``msg``'s content to the supervisor's socket it names: an answer
        (op ``answer``) or the kernel's word about a held rank (op ``run_op``)."""
        msg_type = "run_op" if msg.get("op") == "run_op" else "input_reply"
        address = msg.get("reply_to") or ""
        prefix = f"ipc://{private_dir}/in-"
        if not address.startswith(prefix) or not address[len(prefix):].isdigit():
            log.warning("an answer for %r, not a supervisor's socket of this node: dropped", address)
            return
        sock = self.socks.get(address)
        if sock is None:
            sock = self.socks[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(AGENT_SEND_WAIT * 1000))
            sock.connect(address)
        try:
            signer.send(sock, msg_type, msg.get("content") or {})
        except zmq.Again:   # its supervisor is gone: so is the question
            pass

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(linger=0)
        self.socks.clear()


class Agent:
    def __init__(self, address: str, events: str, key: bytes, ident: str) -> None:
        self.node = int(os.environ.get("SLURM_NODEID", "0"))
        self.nodename = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.key = key
        self.session = wire.signed_session(key)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, int(AGENT_LINGER * 1000))
        self.sock.setsockopt(zmq.IDENTITY, f"{ident}-{self.node}".encode())
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(AGENT_HEARTBEAT_TIMEOUT * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(AGENT_HEARTBEAT_TIMEOUT * 1000))
        keys = transport.curve_keys(key)   # the kernel's ports take only peers with the allocation's key
        transport.dial(self.sock, keys)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.connected = False
        self.lost_since: Optional[float] = time.monotonic()   # until the first connection
        # The node's runs report straight to the kernel (``events``), signed with
        # a key derived from the allocation's for each run: this agent only starts,
        # stops and watches them, and is never a hop on their output.
        self.launcher = Launcher(report_to=events, report_keys=keys)
        self.answers = Answers(self.ctx)   # to ranks that read their stdin
        self.handle = None          # the run in progress on this node
        self.run_id = None
        self.part: Optional[SessionPart] = None   # this node's part of a session
        self.stopping = False

    # -- the channel ----------------------------------------------------------------
    def send(self, content: dict) -> None:
        content["node"] = self.node
        self.session.send(self.sock, "agent", content)

    def receive(self) -> Optional[dict]:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return wire.verified_content(self.session, frames)
        except Exception:
            return {}   # not signed with the allocation's key: never unpickled, ignored

    def _watch_connection(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected, self.lost_since = True, None
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected, self.lost_since = False, time.monotonic()

    # -- life cycle ---------------------------------------------------------------------
    def serve(self) -> None:
        self.launcher.start()
        info = self.launcher.wait_ready()
        self.send({"kind": "hello", "nodename": self.nodename, "hostname": socket.gethostname(),
                   "address": host_address("ACCEL_MAGICS_NODE_ADDR"), "pid": os.getpid(), "gpu_count": info.get("gpu_count", 0)})
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        watched: set = set()
        while not self.stopping:
            watched = self._watch_exits(poller, watched)
            ready = dict(poller.poll(IDLE_POLL_MS))
            if self.monitor in ready:
                self._watch_connection()
            if self.sock in ready:
                self._read_commands()
            if self.handle is not None and self.handle.watch():
                self._end_run()
            if self.part is not None and self.part.handle.watch():
                self._end_session()
            if self.lost_since is not None and time.monotonic() - self.lost_since > LOST_AFTER:
                log.warning("agent on %s: the kernel's connection is gone for %gs; ending", self.nodename,
                            LOST_AFTER)
                break

    def _handles(self) -> list:
        """The supervisors this node runs now: a run's, a session part's."""
        return [h for h in (self.handle, self.part and self.part.handle) if h is not None]

    def _watch_exits(self, poller, watched: set) -> set:
        """Each supervisor's exit (its pidfd) is polled with the commands."""
        exit_fds = {h.pidfd for h in self._handles() if h.pidfd is not None}
        for fd in watched - exit_fds:
            poller.unregister(fd)
        for fd in exit_fds - watched:
            poller.register(fd, zmq.POLLIN)
        return exit_fds

    def _read_commands(self) -> None:
        while True:
            msg = self.receive()
            if msg is None:
                return
            if msg:
                self._on_command(msg)

    def close(self) -> None:
        for handle in self._handles():
            handle.kill()
        if self.part is not None:
            self.part.close_channel()
        self.answers.close()
        self.launcher.close()
        self.sock.close(linger=500)

    def _on_command(self, msg: dict) -> None:
        op = msg.get("op")
        if op not in ("ping", "port"):
            log.info("node %d (%s): %s for run %s", self.node, self.nodename, op, msg.get("run_id"))
        if msg.get("session") is not None:   # addressed to a session's part on this node
            self._on_session_command(op, msg)
            return
        if op in self._RUN_OPS and (self.handle is None or msg.get("run_id") != self.run_id):
            return   # a run that is not this node's now (ended, never got here)
        getattr(self, self._OPS.get(op, "_ignore"))(msg)

    _OPS = {"run": "_start_run", "port": "_port", "interrupt": "_interrupt", "peers_ended": "_peers_ended",
            "kill": "_kill", "shutdown": "_shutdown", "answer": "_to_supervisor", "run_op": "_to_supervisor"}
    # The run of this node (in progress, or its failed rank held for a post-mortem): to it, by its id.
    _RUN_OPS = ("interrupt", "peers_ended", "kill", "answer", "run_op")

    def _ignore(self, msg: dict) -> None:
        """``ping`` (the kernel looks whether this agent is connected), an unknown op."""

    def _port(self, msg: dict) -> None:
        self.send({"kind": "port", "port": free_port("0.0.0.0"), "request": msg.get("request")})

    def _interrupt(self, msg: dict) -> None:
        self.handle.interrupt()

    def _peers_ended(self, msg: dict) -> None:
        self.handle.peers_ended()

    def _kill(self, msg: dict) -> None:
        self.handle.rank_pids = set(msg.get("pids", ()))   # what SIGKILL takes if it comes to that
        self.handle.kill()

    def _shutdown(self, msg: dict) -> None:
        self.stopping = True

    def _to_supervisor(self, msg: dict) -> None:
        """An answer to a rank's question, or the kernel's word about the run's
        held rank (``debug``, ``release``: supervisor/one_shot.py), signed with the run's key."""
        self.answers.forward(self.launcher.dir, wire.signed_session(wire.derive_key(self.key, self.run_id)), msg)

    def _start_run(self, msg: dict) -> None:
        if self.handle is not None:   # the kernel starts a run only after the last one finished
            self.handle.kill()
            self.handle.close()
        self.handle, self.run_id = None, msg["run_id"]
        self.answers.close()   # the last run's supervisors are gone
        try:
            cfg = LaunchConfig(**msg["cfgs"][self.node])   # one message for every node: this node's part
            # Every node got the run at once from one kernel: no count-in before the ranks start.
            self.handle = self.launcher.launch(cfg, msg["payload"], attempt=msg.get("attempt", 0),
                                               log_dir=msg.get("log_dir", ""),
                                               excerpt=msg.get("excerpt"), extra={"dispatched_together": True},
                                               run_id=self.run_id, key=wire.derive_key(self.key, self.run_id))
        except Exception as exc:
            self.send({"kind": "supervisor_error", "run_id": self.run_id, "message": str(exc),
                       "traceback": f"the launcher on node {self.node} ({self.nodename}) could not start the run: "
                                    f"{type(exc).__name__}: {exc}"})

    # -- a session's part on this node --------------------------------------------------
    def _on_session_command(self, op: str, msg: dict) -> None:
        """``session_start``: this node's part of the session; ``cell``,
        ``stop``, and ``debug`` and ``release`` (a failed cell's rank's
        post-mortem): passed to its supervisor, signed with the session's key;
        ``interrupt`` (recall the cell's ranks to their prompt) and ``kill``:
        as for a run."""
        if op == "session_start":
            self._start_session(msg)
            return
        part = self.part
        if part is None or msg["session"] != part.id:
            if op in ("cell", "stop"):   # its reader must not wait for a supervisor that is gone
                self.send({"kind": "supervisor_exit", "run_id": msg["content"]["run_id"]})
            return   # an old session's (it is gone): nothing else to do
        if op in ("cell", "stop"):
            if not part.forward(op, msg["content"]):
                self.send({"kind": "supervisor_exit", "run_id": msg["content"]["run_id"]})
        elif op in ("debug", "release"):   # a failed cell's rank at its prompt (session_supervisor)
            part.forward(op, msg["content"])
        elif op == "interrupt" and msg.get("run_id") == part.cell_id:
            part.recall()
        elif op == "answer" and msg.get("run_id") == part.cell_id:
            self.answers.forward(self.launcher.dir, part.signer, msg)
        elif op == "kill":
            part.handle.rank_pids = set(msg.get("pids", ()))
            part.handle.kill()

    def _start_session(self, msg: dict) -> None:
        if self.part is not None:   # the kernel starts one only after the last one ended
            self.part.handle.kill()
            self._end_session(quiet=True)
        sid = msg["session"]
        try:
            self.part = SessionPart(self.launcher, sid, wire.derive_key(self.key, sid), LaunchConfig(**msg["cfg"]))
        except Exception as exc:
            self.send({"kind": "supervisor_error", "run_id": sid, "message": str(exc),
                       "traceback": f"the launcher on node {self.node} ({self.nodename}) could not start the "
                                    f"session: {type(exc).__name__}: {exc}"})

    def _end_session(self, quiet: bool = False) -> None:
        """The session's supervisor exited (stopped, lost): the kernel is told."""
        part, self.part = self.part, None
        if not quiet:
            self.send({"kind": "supervisor_exit", "run_id": part.id, "cell": part.cell_id})
        part.end()

    def _end_run(self) -> None:
        """The run's supervisor exited: the kernel decides whether it had
        finished (after the run: a held rank's post-mortem reads it)."""
        self.send({"kind": "supervisor_exit", "run_id": self.run_id})
        self.handle.close()
        self.handle = None


def main() -> None:
    # The kernel's interrupt never reaches here (srun runs in its own session).
    # srun's SIGTERM of the step (srun stopped, scancel, the allocation's end) ends
    # the agent the orderly way: its launcher, every run of this node and their
    # directory go with it (SIGKILL, after Slurm's KillWait, would leave the directory).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def stop(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: the clean-up must not be cut short
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    line = sys.stdin.readline()
    if not line:
        return
    logs.to_log_file(2)   # srun's log
    hello = json.loads(line)
    agent = Agent(hello["address"], hello["events"], hello["key"].encode(), hello["ident"])
    try:
        agent.serve()
    finally:
        agent.close()


if __name__ == "__main__":
    main()
