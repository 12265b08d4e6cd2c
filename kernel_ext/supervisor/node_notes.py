"""What a node of a kernel-per-node run tells its user about the other nodes.

Plain functions of what the rendezvous saw (tests feed them recorded
values): why node 0 cannot be reached yet (refused, no answer), why the
rendezvous timed out, who holds node 0's port when this kernel is a second
node 0, and which node went away during a run.  :class:`NodeWatch` judges
the last one from each node's count of beats in node 0's store.

The records the nodes leave in node 0's store (a second node 0's claim, each
node's address) are signed with the run's ``--rendezvous_key`` where one is
given, as the failure records are (rendezvous.py): anything that reaches the
store's port can write to it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import socket
from typing import Optional

# -- reaching node 0 ----------------------------------------------------------------


def how_unreachable(exc: BaseException) -> str:
    """What a failed TCP connect to node 0 says: ``refused``, ``timeout``, or
    the system's own words (``No route to host``)."""
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout"
    return getattr(exc, "strerror", None) or type(exc).__name__


def reach_problem(address: str, how: Optional[str]) -> str:
    """The view's line while node 0 cannot be reached ('' when nothing is wrong)."""
    if not how:
        return ""
    if how == "refused":
        return f"node 0 at {address} refuses connections (nothing listens there), retrying"
    if how == "timeout":
        return f"node 0 at {address} does not answer, retrying"
    if how == "silent":
        return f"node 0 at {address} accepts connections but its store does not answer, retrying"
    return f"node 0 at {address} does not answer ({how}), retrying"


def timeout_message(address: str, host: str, port: int, timeout: float, nodes: int, joined: int,
                    reached: bool, how: Optional[str], claims: tuple = ()) -> str:
    """The ``RendezvousError`` after ``--rendezvous_timeout``: who did not come, and what to check."""
    if reached:
        who = f"only {joined} of {nodes} nodes joined"
    elif how == "silent":
        who = "node 0's address accepted the connection but never answered (is it node 0's store?)"
    elif how == "refused":
        who = f"node 0 at {address} refused every connection: nothing listens there"
    elif how == "timeout":
        who = f"node 0 at {address} never answered"
    elif how:
        who = f"node 0 at {address} could not be reached ({how})"
    else:
        who = "node 0's store was not reachable"
    for claim in claims:
        who += "; " + claim_note(claim)
    return (f"rendezvous at {address} timed out after {timeout:g}s: {who}. Check that the %%distributed cell "
            f"runs on every node with the same --num_nodes, --master_addr and --master_port, that node 0's cell "
            f"was started, and that port {port} on {host} is reachable from every node (firewall).")


# -- a second node 0 -------------------------------------------------------------------


def second_node0_message(address: str, port: int, nodes: int, found: dict) -> str:
    """Node 0 could not listen on its port: what holds it, and what to do.

    ``found``: what answered there, from :meth:`NodeRendezvous.whose_port`:
    ``{"kind": "node0", "joined": n}`` (node 0 of an accel_magics rendezvous,
    i.e. this cell should be another node), ``{"kind": "store"}`` (a torch
    store of something else, torchrun's), or ``{"kind": "other", "why": ...}``.
    """
    kind = found.get("kind")
    if kind == "node0":
        joined = found.get("joined")
        waits = f" ({joined} of its nodes joined so far)" if isinstance(joined, int) else ""
        ranks = f" (each other node its own rank, 1 .. {nodes - 1})" if nodes > 2 else ""
        return (f"another node 0 already holds {address}: its rendezvous answers there{waits}. This cell is node 0 "
                f"too (--node_rank 0, the default). If it is meant to be another node, run it with --node_rank 1"
                f"{ranks}, the same --num_nodes, --master_addr and --master_port: node 0's cell goes on waiting "
                "for it. If this one is node 0, stop the other kernel's cell first.")
    if kind == "store":
        return (f"port {port} of {address.rsplit(':', 1)[0]} is held by a torch.distributed store that is not an "
                "accel_magics rendezvous (a torchrun job?): give every node's cell another --master_port.")
    why = f" ({found['why']})" if found.get("why") else ""
    return (f"port {port} of {address.rsplit(':', 1)[0]} is already in use by another program, not a node 0 of "
            f"accel_magics{why}: give every node's cell another --master_port.")


def claim_note(claim: dict) -> str:
    """What node 0 shows when a second node 0 tried to host its rendezvous."""
    who = ", ".join(part for part in (f"host {claim['host']}" if claim.get("host") else "",
                                      f"pid {claim['pid']}" if claim.get("pid") else "") if part)
    return (f"a second node 0 ({who or 'another kernel'}) tried to host this rendezvous and was told to pass "
            "--node_rank")


# -- a node gone during the run ------------------------------------------------------


def gone_summary(node: int, info: Optional[dict], seconds: float, address: str) -> str:
    """The root cause when a node vanished: which node, where it was, what that means."""
    where = ""
    if info:
        parts = [f"at {info['addr']}" if info.get("addr") else "", f"host {info['host']}" if info.get("host") else ""]
        where = " (" + ", ".join(p for p in parts if p) + ")" if any(parts) else ""
    if node == 0:
        return (f"node 0{where} went away: its store at {address} has not answered for {seconds:.0f}s and it "
                "reported no failure (its kernel died, was restarted or shut down, or its machine is unreachable), "
                "so this node's ranks lost their connections to it")
    return (f"node {node}{where} went away: it has not counted itself in node 0's store for {seconds:.0f}s and "
            "reported no failure (its kernel died, was restarted or shut down, or its machine is unreachable), "
            "so this node's ranks lost their connections to it")


LEFT_BECAUSE = {
    "interrupt": "its kernel stopped it (the stop button or an interrupt there)",
    "terminated": "its kernel shut down, restarted or died, so its launcher ended the run there",
    "timeout": "its --timeout passed there",
}


def left_summary(node: int, host: str, reason: str) -> str:
    """Why a node left a run with no failure of its own (``reason``: its stop),
    for the other nodes, whose ranks then only lose their connections."""
    why = LEFT_BECAUSE.get(reason, f"it stopped ({reason})")
    where = f" (host {host})" if host else ""
    return f"node {node}{where} left the run: {why}, so this node's ranks lost their connections to it"


class NodeWatch:
    """The other nodes' beat counts (rendezvous ``beat``) and since when each
    stood still; node 0's store itself (``None`` counts) likewise."""

    def __init__(self, nodes: int, me: int, now: float) -> None:
        self.seen = {node: (None, now) for node in range(nodes) if node != me}
        self.store_heard = now

    def feed(self, counts: Optional[dict], now: float) -> None:
        if counts is None:
            return
        self.store_heard = now
        for node, count in counts.items():
            if self.seen.get(node, (None,))[0] != count:
                self.seen[node] = (count, now)

    def gone(self, now: float, after: float) -> Optional[tuple[int, float]]:
        """(node, seconds) of a node silent for ``after`` seconds (node 0: its
        store), or None.  A node never heard from at all is not judged: it
        may not have started."""
        if now - self.store_heard >= after:
            return 0, now - self.store_heard
        for node, (count, since) in sorted(self.seen.items()):
            if count is not None and now - since >= after:
                return node, now - since
        return None


# -- signed records in node 0's store ----------------------------------------------


def sign(key: Optional[str], attempt: int, address: str, record: dict) -> dict:
    """``record`` with its signature (``sig``) when a key is given."""
    if not key:
        return dict(record)
    return {**record, "sig": mac(key, attempt, address, record)}


def verified(key: Optional[str], attempt: int, address: str, stored: dict) -> Optional[dict]:
    """The record without its signature, or None where a key is given and the
    record is not signed with it (without a key every record counts, as the
    store takes anyone's writes: docs/design/security.md says so)."""
    record = {k: v for k, v in stored.items() if k != "sig"}
    if not key:
        return record
    sig = stored.get("sig")
    if isinstance(sig, str) and hmac.compare_digest(sig, mac(key, attempt, address, record)):
        return record
    return None


NODE_RECORD = b"accel_magics node record"          # a node's address, a second node 0's claim
FAILURE_RECORD = b"accel_magics failure record"    # a node's root cause, or why it left (rendezvous FAILED)


def mac(key: str, attempt: int, address: str, record: dict, kind: bytes = NODE_RECORD) -> str:
    """``record``'s signature with the run's key, bound to its round and
    address; ``kind`` keeps one kind of record from passing for another."""
    bound = json.dumps([attempt, address, record], sort_keys=True).encode()
    secret = hashlib.sha256(kind + b"\0" + key.encode()).digest()
    return hmac.new(secret, bound, hashlib.sha256).hexdigest()
