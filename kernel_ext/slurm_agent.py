"""The agent on one node of a Slurm allocation (``--launcher slurm``).

Started by the kernel, one per node, with ``srun --nodes N --ntasks-per-node 1
python -m accel_magics.kernel_ext.slurm_agent``, and kept for the later cells
of the same allocation.  On its node it plays the kernel's part for the
launcher: it runs a :class:`launcher.Launcher` (the node's launcher process,
which forks each run's supervisor and ranks, exactly as on a workstation)
and relays between it and the kernel.

The channel to the kernel is ZMQ over TCP on the cluster network (a DEALER
connected to the kernel's ROUTER).  It carries pickles, so every message,
both ways, is HMAC-signed with the allocation's random key and checked
before it is unpickled (jupyter_client's ``Session``, as for the local
channel).  The key and the kernel's address come on srun's stdin, never on a
command line or in an environment that ranks inherit.

The agent ends, and its launcher with every run of this node, when the
kernel says so, when the kernel's connection is gone for ``LOST_AFTER``
seconds (ZMTP heartbeats: a kernel killed with -9 is noticed at once, a
vanished host within seconds), or when srun ends the step.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from typing import Optional

import zmq

from . import wire
from .environment import LaunchConfig, free_port, host_address
from .launcher import Launcher

LOST_AFTER = 5.0        # seconds without the kernel's connection before the agent gives up
HEARTBEAT_MS = 1000     # ZMTP heartbeat interval (and 5x that as its timeout)
IDLE_POLL_MS = 200


class Agent:
    def __init__(self, address: str, key: bytes) -> None:
        self.node = int(os.environ.get("SLURM_NODEID", "0"))
        self.nodename = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.session = wire.signed_session(key)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.IDENTITY, f"node{self.node}".encode())
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, 5 * HEARTBEAT_MS)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.connected = False
        self.lost_since: Optional[float] = time.monotonic()   # until the first connection
        self.launcher = Launcher()
        self.handle = None          # the run in progress on this node
        self.messages = None
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
            _, frames = self.session.feed_identities(frames)
            return self.session.deserialize(frames)["content"]
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
        while not self.stopping:
            if self.messages is not None:
                self._relay()   # blocks at most ~50 ms (the handle's heartbeat)
                ready = dict(poller.poll(0))
            else:
                ready = dict(poller.poll(IDLE_POLL_MS))
            if self.monitor in ready:
                self._watch_connection()
            if self.sock in ready:
                while True:
                    msg = self.receive()
                    if msg is None:
                        break
                    if msg:
                        self._on_command(msg)
            if self.lost_since is not None and time.monotonic() - self.lost_since > LOST_AFTER:
                print(f"accel_magics agent on {self.nodename}: the kernel's connection is gone; ending",
                      file=sys.stderr, flush=True)
                break

    def close(self) -> None:
        if self.handle is not None and not self.handle.finished:
            self.handle.kill()
        self.launcher.close()
        self.sock.close(linger=500)

    def _on_command(self, msg: dict) -> None:
        op = msg.get("op")
        if op == "run":
            self._start_run(msg)
        elif op == "port":
            self.send({"kind": "port", "port": free_port("0.0.0.0"), "request": msg.get("request")})
        elif op == "interrupt" and self.handle is not None and msg.get("run_id") == self.run_id:
            self.handle.interrupt()
        elif op == "kill" and self.handle is not None and msg.get("run_id") == self.run_id:
            self.handle.kill()
        elif op == "shutdown":
            self.stopping = True

    def _start_run(self, msg: dict) -> None:
        self.run_id = msg["run_id"]
        if self.messages is not None:   # the kernel starts a run only after the last one finished
            self.handle.kill()
        cfg = LaunchConfig(**msg["cfg"])
        try:
            self.handle = self.launcher.launch(cfg, msg["payload"], log_dir=msg.get("log_dir", ""),
                                               excerpt=msg.get("excerpt"))
        except Exception as exc:
            self.handle = self.messages = None
            self.send({"kind": "supervisor_error", "run_id": self.run_id, "message": str(exc),
                       "traceback": f"the launcher on node {self.node} ({self.nodename}) could not start the run: "
                                    f"{type(exc).__name__}: {exc}"})
            return
        self.messages = self.handle.messages(heartbeat=0.05)

    def _relay(self) -> None:
        """Forward what the node's run says (one message, or none within 50 ms)."""
        try:
            msg = next(self.messages)
        except StopIteration:
            self._end_run()
            return
        except Exception as exc:   # the node's supervisor died without finishing
            self.send({"kind": "supervisor_error", "run_id": self.run_id, "message": str(exc),
                       "traceback": f"on node {self.node} ({self.nodename}): {exc}"})
            self._end_run()
            return
        if msg.get("kind") == "heartbeat":
            return
        msg["run_id"] = self.run_id
        self.send(msg)
        if msg.get("kind") == "finished":
            self._end_run()

    def _end_run(self) -> None:
        if self.messages is not None:
            self.messages.close()
        if self.handle is not None:
            self.handle.close()
            self.launcher.learn_modules([])
        self.messages = self.handle = None


def main() -> None:
    # The kernel's interrupt never reaches here (srun runs in its own session);
    # srun's own SIGTERM/SIGKILL of the step ends the agent, and its launcher with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.readline()
    if not line:
        return
    hello = json.loads(line)
    agent = Agent(hello["address"], hello["key"].encode())
    try:
        agent.serve()
    finally:
        agent.close()


if __name__ == "__main__":
    main()
