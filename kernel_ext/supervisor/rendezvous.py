"""The run's rendezvous: torch's own TCPStore, hosted by node 0's supervisor.

As with torchrun's agent store: node 0's supervisor hosts a TCPStore on
``master_addr:master_port`` before any rank starts, and every rank connects to
it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``), so ``env://``
``init_process_group`` works unchanged and no rank races to bind the port.

Before the ranks are released, the supervisors of all nodes count themselves
in on the same store, so waiting for other nodes is visible and bounded.
During the run the store carries one more thing between nodes: the first
failure, so the other nodes stop with that root cause instead of hanging or
reporting their own secondary "connection closed" errors.

Where the store comes up is the ``store`` hook (``kernel_ext/hooks.py``):
on one node the port is bound (to the master address only: torch's own
store listens on every interface) before the ranks start, and torch's
store takes that socket over at the first connection
(:meth:`NodeRendezvous.listen`), off the run's critical path.  That needs a
TCPStore that accepts ``master_listen_fd``: torch's default backend does,
but torch 2.4-2.7's libuv backend does not ("does not support initialization
with an listen fd"), so there the store runs on torch's other backend
(``use_libuv=False``: the ranks, its clients, are torch's own either way).
Where neither takes a bound socket, or with ``ACCEL_MAGICS_DISABLE=store``,
node 0 creates the store on the port before the ranks start, with torch's
default backend, exactly as torchrun's agent does (:data:`prebound`).

Restarts (``--max_restarts`` with one kernel per node) are rendezvous
*rounds*, as in torch elastic: every node's kernel starts attempt N on the
same address, node 0's store says which round it hosts (``ROUND``), and a
node that reaches a store of an earlier round (node 0's last attempt still
closing) lets go and tries again: each round is a store of its own.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Optional

from . import node_notes
from .. import hooks
from ..environment import resolve_host
# The ladders' order: see timing.py.
from ..timing import (CONNECT_SLACK, CONNECT_WAIT, HOST_RETRY, HOST_RETRY_POLL, PORT_ASK_POLL, PORT_ASK_ROUND_WAIT,
                      PORT_ASK_STORE_WAIT, PORT_ASK_WAIT, PROBE_WAIT, STORE_OP_WAIT, STORE_TRY_WAIT)

log = logging.getLogger("accel_magics.rendezvous")

ROUND = "accel_magics/round"
JOINED = "accel_magics/nodes_joined"
FINISHED = "accel_magics/nodes_finished"
CHECKED = "accel_magics/nodes_checked"   # restarts may follow: every node has looked for a failure elsewhere
FAILED = "accel_magics/failure"
DEPARTED = "accel_magics/departed"   # ranks that finished the cell, with their rounds of init (a count, then each)
ALIVE = "accel_magics/alive"         # each node's count of its beats (see beat)
CLAIMS = "accel_magics/node0_claims"  # kernels that tried to be node 0 too (a count, then each: node_notes)
NODE = "accel_magics/node"           # each node's address, as it joined (NODE/<node rank>)


#: The ``store`` hook is in place in this process (set in the launcher,
#: inherited by every supervisor it forks): one node binds its port first and
#: hosts the store on it at the first connection.  False: the store is
#: created eagerly, as torchrun's agent creates it.
prebound = False
#: The TCPStore arguments that make it take a bound socket (the backend).
_prebound_backend: dict = {}


class RendezvousTimeout(Exception):
    pass


def _store_on_bound_socket(**backend) -> Optional[str]:
    """Host a TCPStore on a socket bound (loopback, a free port), with
    ``backend``'s arguments, in a child process: None when it works, else
    why not.  Never here: libuv's process-wide state (its thread pool) does
    not survive a fork, and every supervisor is forked from this process
    (a libuv store tried here left node 0's store of a two-node run mute)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        try:
            os.close(read)
            os.write(write, (_try_store(**backend) or "").encode()[:4000])
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        why = answer.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        return f"the child that tried it ended with status {status}"
    return why or None


def _try_store(**backend) -> Optional[str]:
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=STORE_TRY_WAIT), wait_for_workers=False,
                         master_listen_fd=sock.detach(), **backend)
    except Exception as exc:   # NotImplementedError from torch 2.4-2.7's libuv backend
        sock.close()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    del store
    return None


def prebound_store_unsupported() -> Optional[str]:
    """The ``store`` hook's guard: None when this torch's TCPStore takes over a
    listening socket (``master_listen_fd``) with its default backend or,
    where that backend refuses (torch 2.4-2.7's libuv), with the other one;
    else why not.  Tried for real on a loopback port: a version list would
    be a guess.  Sets the backend the store will use."""
    global _prebound_backend
    default = _store_on_bound_socket()
    if default is None:
        _prebound_backend = {}
        return None
    legacy = _store_on_bound_socket(use_libuv=False)
    if legacy is None:
        _prebound_backend = {"use_libuv": False}
        return None
    return f"this torch's TCPStore takes no bound socket (default backend: {default}; use_libuv=False: {legacy})"


def install_store_hook() -> bool:
    """In the launcher (inherited by every fork): decide :data:`prebound`."""
    global prebound

    def take() -> str:
        global prebound
        prebound = True
        how = ("on torch's non-libuv backend (this torch's libuv backend takes no bound socket)"
               if _prebound_backend else "on torch's default backend")
        return f"one node binds its port before the ranks start; the store comes up at the first connection, {how}"

    prebound = False
    return hooks.install("store", take, guard=prebound_store_unsupported)


def _bounded(call, timeout: float):
    """``call()`` in a daemon thread; TimeoutError if it does not return in time."""
    import threading

    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name="accel_magics-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class NodeRendezvous:
    def __init__(self, host: str, port: int, num_nodes: int, node_rank: int, timeout: float,
                 attempt: int = 0) -> None:
        self.host, self.port = host, port
        self.attempt = attempt
        self.num_nodes, self.node_rank = num_nodes, node_rank
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.store = None
        self.silent = False   # an attempt found the address mute (accepts, never answers)
        self.reach: Optional[str] = None   # why node 0 was not reached at the last try (node_notes.how_unreachable)
        self.local_addr = ""   # this node's address towards node 0 (its last probe's)
        self.claimed: list = []   # node 0: second node 0s that announced themselves (whose_port), and
        self.claims_seen = 0      # how many announcements were read
        self.joined_self = False
        self.listener: Optional[socket.socket] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bound(self) -> str:
        """What a node's signed record is bound to besides its round: the port
        (nodes may spell node 0's address differently: a name, an address)."""
        return f"port {self.port}"

    def host_store(self) -> None:
        """Node 0: listen now (raises if the port cannot be bound).

        With one node, the port was bound by :meth:`listen`; the store takes
        that socket over.
        """
        from torch.distributed import TCPStore

        listen_fd = None
        if self.listener is not None:
            listen_fd, self.listener = self.listener.detach(), None   # the store owns it now
        backend = _prebound_backend if listen_fd is not None else {}
        retry_until = time.monotonic() + (HOST_RETRY if listen_fd is None and self.attempt else 0)
        while True:
            try:
                self.store = TCPStore("0.0.0.0" if self.num_nodes > 1 else self.host, self.port, None, True,
                                      timedelta(seconds=max(self.timeout, STORE_OP_WAIT)), wait_for_workers=False,
                                      master_listen_fd=listen_fd, **backend)
                break
            except Exception:   # a restart: this node's last round may still hold the port a moment
                if time.monotonic() >= retry_until:
                    raise
                time.sleep(HOST_RETRY_POLL)
        if self.num_nodes > 1:
            self.store.set(ROUND, str(self.attempt))

    def listen(self) -> int:
        """One node: bind ``host:port`` now, host the store on the first connection.

        A bound, listening socket is all a rank needs to connect (its
        connection waits in the backlog until the store accepts it), so
        creating torch's store (a server thread and an event loop: ~1-3 ms)
        is off the run's critical path, and a cell that never uses
        torch.distributed never pays for it.  The socket is bound to the
        master address only, so a one-node store is not reachable from other
        machines.  Returns the socket's fd, to watch for the first connection.
        """
        # Several nodes: every interface, as the store itself listens (see host_store).
        address = resolve_host(self.host) if self.num_nodes == 1 else "0.0.0.0"
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, self.port))
            sock.listen(socket.SOMAXCONN)
        except BaseException:
            sock.close()
            raise
        self.listener = sock
        return sock.fileno()

    def close(self) -> None:
        """Stop listening: the store (joins its thread) or the unused socket."""
        self.store = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def try_connect(self, attempt_timeout: float = CONNECT_WAIT) -> bool:
        """Other nodes: one bounded attempt to reach node 0's store.

        Bounded for real: torch's client can block far past its timeout when
        the address accepts TCP connections but never answers (measured:
        > 110 s in its first ping), so the attempt runs in a helper thread and
        is abandoned (the thread left blocked) once it takes too long.
        """
        from torch.distributed import TCPStore

        if time.monotonic() >= self.deadline:
            raise RendezvousTimeout(self.timeout_message(0))
        if not self.probe(min(attempt_timeout, PROBE_WAIT)):
            return False
        try:
            self.store = _bounded(lambda: TCPStore(self.host, self.port, None, False,
                                                   timedelta(seconds=attempt_timeout)),
                                  attempt_timeout + CONNECT_SLACK)
        except Exception:   # not listening yet, unreachable, refused, mute: try again until the deadline
            self.silent = True
            self.reach = "silent"
            return False
        self.reach = None
        self.store.set_timeout(timedelta(seconds=STORE_OP_WAIT))
        try:
            hosted = int(self.store.get(ROUND)) if self.store.check([ROUND]) else None
        except Exception:
            hosted = None
        if hosted is None or hosted < self.attempt:
            # Node 0 is not hosting this round yet (its last attempt's store is still closing).
            self.store = None
            return False
        if hosted > self.attempt:
            self.store = None
            raise RendezvousTimeout(
                f"node 0 at {self.address} already runs attempt {hosted + 1}, and this node attempt "
                f"{self.attempt + 1}: the nodes' cells restarted a different number of times (one node's "
                "attempt ended without seeing the others' failure). Run the cell again on every node.")
        return True

    def probe(self, timeout: float = PROBE_WAIT) -> bool:
        """Is node 0 listening yet?  A plain TCP connect, closed at once.

        Not yet (node 0 is a moment behind): say so at once, where torch's
        client would retry with its own back-off, costing the run up to a
        second.  Listening is enough for a rank to connect: its connection
        waits in the backlog until the store accepts it (see :meth:`listen`).
        """
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
                self.local_addr = sock.getsockname()[0]
            return True
        except OSError as exc:
            self.reach = node_notes.how_unreachable(exc)
            return False

    def join_step(self, key: Optional[str] = None) -> int:
        """Count this node in (once, saying where it is); how many nodes have joined so far."""
        if not self.joined_self:
            self.joined_self = True
            record = {"host": socket.gethostname(), "addr": self.local_addr or self.host}
            try:
                self.store.set(f"{NODE}/{self.node_rank}",
                               json.dumps(node_notes.sign(key, self.attempt, self.bound, record)))
            except Exception:
                pass
            return int(self.store.add(JOINED, 1))
        return int(self.store.add(JOINED, 0))

    def timeout_message(self, joined: int) -> str:
        return node_notes.timeout_message(self.address, self.host, self.port, self.timeout, self.num_nodes, joined,
                                          self.store is not None, "silent" if self.silent else self.reach,
                                          tuple(self.claimed))

    def check_deadline(self, joined: int) -> None:
        if time.monotonic() >= self.deadline:
            raise RendezvousTimeout(self.timeout_message(joined))

    def problem(self, key: Optional[str] = None) -> str:
        """What is wrong while this node waits, for its view ('' if nothing):
        node 0 not reached (refused, no answer), or, on node 0, a second node
        0 that tried to host this rendezvous (the latest)."""
        if self.node_rank == 0 and self.store is not None:
            self.claims_seen, new = self.claims(self.claims_seen, key)
            for claim in new:
                log.warning("rendezvous at %s: %s", self.address, node_notes.claim_note(claim))
            self.claimed += new
        if self.claimed:
            return node_notes.claim_note(self.claimed[-1])
        return node_notes.reach_problem(self.address, self.reach if self.store is None else None)

    # -- a second node 0 ----------------------------------------------------------------
    def whose_port(self, key: Optional[str] = None) -> dict:
        """Node 0 could not listen on its port: what holds it (see
        node_notes.second_node0_message).  Where it is node 0 of an
        accel_magics rendezvous, this kernel says there that it tried to be
        node 0 too (CLAIMS), so that node 0's view tells its user at once."""
        from torch.distributed import TCPStore

        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host

        def ask() -> dict:
            store = TCPStore(host, self.port, None, False, timedelta(seconds=PORT_ASK_STORE_WAIT))
            store.set_timeout(timedelta(seconds=PORT_ASK_STORE_WAIT))
            until = time.monotonic() + PORT_ASK_ROUND_WAIT   # a node 0 that started the same moment may not have said its round yet
            while not store.check([ROUND]):
                if time.monotonic() >= until:
                    return {"kind": "store"}
                time.sleep(PORT_ASK_POLL)
            joined = int(store.add(JOINED, 0))
            claim = node_notes.sign(key, self.attempt, self.bound,
                                    {"host": socket.gethostname(), "pid": os.getpid()})
            store.set(f"{CLAIMS}/{int(store.add(CLAIMS, 1)) - 1}", json.dumps(claim))
            return {"kind": "node0", "joined": joined}

        try:
            # Whole, in a thread: a program that accepts and never answers holds torch 2.4's
            # client in recv past its timeout (its check() waits without one).
            return _bounded(ask, PORT_ASK_WAIT)
        except Exception as exc:
            return {"kind": "other", "why": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    if not isinstance(exc, TimeoutError) else "it does not answer as a torch store"}

    def claims(self, seen: int, key: Optional[str] = None) -> tuple[int, list]:
        """Second node 0s that announced themselves after the first ``seen``:
        (how many there are now, those whose record counts: node_notes.verified)."""
        try:
            count = int(self.store.add(CLAIMS, 0))
            found = [json.loads(self.store.get(f"{CLAIMS}/{i}")) for i in range(seen, count)]
        except Exception:
            return seen, []
        records = [node_notes.verified(key, self.attempt, self.bound, f) for f in found if isinstance(f, dict)]
        return count, [r for r in records if r is not None]

    def node_info(self, node: int, key: Optional[str] = None) -> Optional[dict]:
        """Where node ``node`` said it was when it joined (None: unknown, or not signed with ``key``)."""
        try:
            stored = json.loads(self.store.get(f"{NODE}/{node}")) if self.store.check([f"{NODE}/{node}"]) else None
        except Exception:
            return None
        return node_notes.verified(key, self.attempt, self.bound, stored) if isinstance(stored, dict) else None

    # -- during and after the run -------------------------------------------------
    def report_failure(self, node_rank: int, rank: int, summary: str, key: Optional[str] = None,
                       left: bool = False) -> None:
        """This node's root cause, for the other nodes (the first one only).
        ``left``: not a failure of a rank, this node left the run (``summary``
        names the node and why).  ``key``: the run's ``--rendezvous_key``; the
        record is signed with it (its round and address too), so a node that
        has the same key can tell it from one any process that reaches the
        store's port wrote."""
        record = {"node": node_rank, "rank": rank, "summary": summary, **({"left": True} if left else {})}
        if key:
            record["sig"] = node_notes.mac(key, self.attempt, self.address, record, node_notes.FAILURE_RECORD)
        try:
            if not self.store.check([FAILED]):
                self.store.set(FAILED, json.dumps(record))
        except Exception:
            pass

    def remote_failure(self, key: Optional[str] = None) -> Optional[dict]:
        """Another node's root cause, if one is in the store: ``node``,
        ``rank``, ``summary`` and ``verified``: whether it is signed with
        ``key`` (never without one: the store takes anyone's writes; then
        ``unverified`` says why it cannot be trusted)."""
        import hmac

        try:
            if not self.store.check([FAILED]):
                return None
            stored = json.loads(self.store.get(FAILED))
            failure = {"node": int(stored["node"]), "rank": int(stored["rank"]), "summary": str(stored["summary"])}
            if stored.get("left") is True:
                failure["left"] = True
        except Exception:
            return None
        if failure["node"] == self.node_rank:
            return None
        sig = stored.get("sig")
        if not key:
            failure["verified"] = False
            failure["unverified"] = "no --rendezvous_key was given"
        elif not isinstance(sig, str):
            failure["verified"] = False
            failure["unverified"] = "it is not signed"
        else:
            expected = node_notes.mac(key, self.attempt, self.address, failure, node_notes.FAILURE_RECORD)
            failure["verified"] = hmac.compare_digest(sig, expected)
            if not failure["verified"]:
                failure["unverified"] = "it is signed with another --rendezvous_key"
        return failure

    def report_departed(self, node_rank: int, rank: int, how: str, rounds: int) -> None:
        """A rank of this node finished the cell after ``rounds`` rounds of the
        world's init_process_group: the other nodes' ranks that wait for it in
        a later round never see it come."""
        try:
            index = int(self.store.add(DEPARTED, 1)) - 1
            self.store.set(f"{DEPARTED}/{index}", json.dumps({"node": node_rank, "rank": rank, "how": how,
                                                               "rounds": rounds}))
        except Exception:
            pass

    def departed_elsewhere(self, seen: int) -> tuple[int, list]:
        """The departures reported after the first ``seen`` (how many there are
        now, and those of other nodes)."""
        try:
            count = int(self.store.add(DEPARTED, 0))
            found = [json.loads(self.store.get(f"{DEPARTED}/{i}")) for i in range(seen, count)]
        except Exception:
            return seen, []
        return count, [d for d in found if d["node"] != self.node_rank]

    def beat(self) -> Optional[dict]:
        """A session's node says it is there (its count goes up by one) and
        reads the other nodes' counts: {node: count}, or None when the store
        did not answer.  A count that stops moving is a node whose part of the
        session is gone (its kernel killed, its supervisor dead): torch's
        store tells nobody when a client goes, so the nodes tell each other."""
        try:
            self.store.add(f"{ALIVE}/{self.node_rank}", 1)
            return {node: int(self.store.add(f"{ALIVE}/{node}", 0))
                    for node in range(self.num_nodes) if node != self.node_rank}
        except Exception:
            return None

    def quick(self, seconds: float) -> None:
        """Bound every later store call to ``seconds`` (a session's beats must
        not hold its supervisor's loop while a node's machine is unreachable)."""
        try:
            self.store.set_timeout(timedelta(seconds=seconds))
        except Exception:
            pass

    def finish(self, name: str = FINISHED) -> None:
        """Count this node as done (``FINISHED``: its beats end, see
        :meth:`ended`), or as having checked (``CHECKED``)."""
        try:
            if name == FINISHED:
                self.store.set(f"{ALIVE}/{self.node_rank}/end", "1")
            self.store.add(name, 1)
        except Exception:
            pass

    def ended(self, node: int) -> bool:
        """Whether ``node`` finished its part (a stop in its beats is no loss then)."""
        try:
            return bool(self.store.check([f"{ALIVE}/{node}/end"]))
        except Exception:
            return False

    def finished(self, name: str = FINISHED) -> int:
        """How many nodes are done (or have checked); all of them once the store is gone."""
        try:
            return int(self.store.add(name, 0))
        except Exception:
            return self.num_nodes
