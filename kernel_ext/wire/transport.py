"""The defences of the sockets that listen on a network (``--launcher slurm``).

Why: on an allocation the kernel listens on two TCP ports of the cluster
network (the agents' ROUTER and the runs' events PULL), which every user of
the cluster can reach.  Signing (``wire.signed_session``) already keeps a
stranger's message from being *unpickled*, but not from being *received*:
ZMQ reads and queues whatever a peer sends, so garbage connections and big
frames grew the kernel by a gigabyte.  Here the transport itself refuses them:

* **CURVE** (ZMQ's CurveZMQ handshake).  Both key pairs are derived from the
  allocation's secret (:func:`curve_keys`), which reaches the agents only on
  srun's stdin; the server's public key is never published either, so a peer
  without the secret cannot even form a valid HELLO: its connection is closed
  in the handshake, before any message exists, at the cost of a few hundred
  bytes for at most :data:`HANDSHAKE_MS`.
* a **handshake deadline** (``HANDSHAKE_IVL``), so idle connections that send
  nothing are closed too;
* a **message size cap** (``MAXMSGSIZE``) where messages are small by design
  (the agents' control messages to the kernel).  The events socket has none:
  authenticated runs send results there as big as a ``--return`` value.

A local run uses ``ipc://`` in a private (0700) directory and none of this.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from ..timing import HANDSHAKE_WAIT

HANDSHAKE_MS = int(HANDSHAKE_WAIT * 1000)   # a connection that has not authenticated within this is closed
CONTROL_MAX_BYTES = 64 << 20    # an agent's message to the kernel (hello, port, exit): kilobytes


@dataclass(frozen=True)
class CurveKeys:
    """Z85 key pairs of the listening end (server) and of every dialling end (client)."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def client_half(self) -> dict:
        """What a dialling process needs (JSON-able: it goes in the launcher's init)."""
        return {"server_public": self.server_public.decode(), "client_public": self.client_public.decode(),
                "client_secret": self.client_secret.decode()}

    @classmethod
    def from_client_half(cls, half: dict) -> "CurveKeys":
        return cls(half["server_public"].encode(), b"", half["client_public"].encode(),
                   half["client_secret"].encode())


def curve_keys(secret: bytes) -> CurveKeys:
    """Both key pairs from the allocation's secret: every end computes them, so
    no key travels but the secret itself (any 32 bytes are a Curve25519 secret key)."""
    def secret_key(role: bytes) -> bytes:
        return z85.encode(hmac.new(secret, b"accel_magics curve " + role, hashlib.sha256).digest())

    server, client = secret_key(b"server"), secret_key(b"client")
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def listen(sock: zmq.Socket, keys: CurveKeys, max_bytes: int = -1) -> None:
    """Make ``sock`` a CURVE server (before its bind)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def events_socket(ctx: zmq.Context, address: str, keys=None) -> zmq.Socket:
    """The PUSH socket a supervisor reports on: CURVE over TCP when the kernel's
    end is a CURVE server (a Slurm node's runs), plain over ``ipc://`` (a local
    run, a session's channel), whose directory is private."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    if keys is not None and address.startswith("tcp://"):
        dial(sock, keys)
    sock.connect(address)
    return sock


def dial(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE client of the server of ``keys`` (before its connect)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
