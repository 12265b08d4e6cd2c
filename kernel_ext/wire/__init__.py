"""The wire formats between the kernel, the launcher process and the workers.

Two channels, each with one job:

* Pipes (kernel -> launcher control, worker -> supervisor events) carry
  length-prefixed frames.  A pipe is private to the two processes at its ends,
  so its frames need no signature.
* The run channel (supervisor -> kernel) is a ZMQ PUSH/PULL pair over an
  ``ipc://`` path inside a private (0700) directory.  It carries pickles, which
  is code execution, so every message is HMAC-signed with a per-run random key
  by jupyter_client's :class:`~jupyter_client.session.Session`, which checks the
  signature with ``compare_digest`` *before* unpickling and refuses replayed
  signatures.  Messages of an earlier run, signed with that run's key, fail the
  check of the current run and are dropped.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import random
import secrets
import struct

from jupyter_client.session import Session

_LEN = struct.Struct("<Q")


def new_key() -> bytes:
    """A fresh random HMAC key (hex, as Jupyter's connection files use)."""
    return secrets.token_hex(32).encode()


_ids = random.Random()   # seeded from the OS once: a notebook's random.seed() never repeats an id


def new_id(chars: int = 12) -> str:
    """A random hex id the kernel gives a run, a session or a log folder:
    unique among its runs, not a secret, so no syscall (``os.urandom`` lets
    the kernel's other threads take the GIL on a cell's way to its ranks)."""
    return f"{_ids.getrandbits(4 * chars):0{chars}x}"


def derive_key(key: bytes, label: str) -> bytes:
    """A key of its own for ``label`` (a run), from a shared secret: both ends
    compute it, so it never travels, and holding it reveals nothing of ``key``."""
    return hmac.new(key, label.encode(), hashlib.sha256).hexdigest().encode()


def signed_session(key: bytes) -> Session:
    """A Session that signs with ``key`` and packs content with pickle.

    Pickle (not JSON) because rank results and tracebacks are Python objects;
    safe only because Session verifies the HMAC over header and content before
    it calls the unpacker.
    """
    return Session(key=key, packer="pickle", unpacker="pickle", username="accel_magics")


def packed(frames: list) -> list:
    """A signed message's frames as ZMQ sends them: one frame when they are
    small (each ZMQ frame costs the receiving process its own CURVE box and
    read; a Slurm cell's messages are a few hundred bytes in 6 frames), as
    they are when large (no copy of a payload).  :func:`verified_content`
    takes either."""
    if sum(len(f) for f in frames) >= PACK_LIMIT:
        return frames
    return [b"".join(b for f in frames for b in (_LEN.pack(len(f)), f))]


PACK_LIMIT = 1 << 16   # bytes: as Session's copy threshold


def _unpacked(data) -> list:
    """The frames :func:`packed` put in one (views, no copy)."""
    view, frames, at = memoryview(data), [], 0
    while at < len(view):
        if at + _LEN.size > len(view):
            raise ValueError("malformed packed message")
        (size,) = _LEN.unpack_from(view, at)
        at += _LEN.size
        if at + size > len(view):
            raise ValueError("malformed packed message")
        frames.append(view[at:at + size])
        at += size
    return frames


def verified_content(session: Session, frames: list):
    """The content of one signed message as received (identities first):
    checked as ``Session.deserialize`` checks it, the HMAC compared with
    ``compare_digest`` before anything is unpickled and a replayed signature
    refused, but without unpacking the header, parent header and metadata,
    which no reader here uses.  (``deserialize`` parses their ISO dates with
    dateutil: two thirds of its time, measured on an 8-node Slurm cell, whose
    kernel reads ~50 messages.)  Raises ValueError if it is not signed with
    ``session``'s key, or was seen before."""
    if len(frames) == 1:   # packed (see packed)
        frames = _unpacked(frames[0])
    _, msg = session.feed_identities(frames)
    if len(msg) < 5:
        raise ValueError(f"malformed message: {len(msg)} frames")
    if session.auth is not None:
        signature = bytes(msg[0])
        if not signature:
            raise ValueError("unsigned message")
        if signature in session.digest_history:
            raise ValueError("duplicate signature")
        check = session.sign(msg[1:5])
        if not hmac.compare_digest(signature, check):
            raise ValueError("invalid signature")
        _remember(session, signature)
    return session.unpack(msg[4])


def verified_waiting(sock, session: Session):
    """The content of every message waiting on ``sock`` now, each verified
    (:func:`verified_content`) before it is unpickled; one not signed with
    ``session``'s key is dropped unread.  The socket's fd is edge-triggered:
    it is drained until nothing is left."""
    import zmq

    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        frames = sock.recv_multipart(zmq.NOBLOCK)
        try:
            content = verified_content(session, frames)
        except Exception:
            continue   # not signed with the key: never unpickled
        yield content


def _remember(session: Session, signature: bytes) -> None:
    """A verified signature into the session's replay history, kept bounded
    (at its size, the oldest tenth goes, as Session does)."""
    history = session.digest_history
    history.add(signature)
    if len(history) > session.digest_history_size:
        for old in list(history)[: max(1, len(history) // 10)]:
            history.discard(old)


def frame(obj) -> bytes:
    """One pickled, length-prefixed frame (what :func:`read_frame` reads)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def write_frame(fd: int, obj) -> None:
    """Write one pickled, length-prefixed frame to a blocking pipe fd."""
    write_all(fd, frame(obj))


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes | None:
    """Read exactly ``n`` bytes from a blocking fd; None on EOF."""
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int):
    """Read one frame written by :func:`write_frame`; None on EOF."""
    head = read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = read_exact(fd, _LEN.unpack(head)[0])
    if body is None:
        return None
    return pickle.loads(body)


class FrameBuffer:
    """Reassembles length-prefixed frames from a non-blocking pipe.

    The supervisor reads worker event pipes with non-blocking reads inside its
    event loop, so frames arrive in arbitrary pieces.  Frames are returned as
    raw bytes: the supervisor forwards them without unpickling.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < _LEN.size + size:
                break
            frames.append(bytes(self._buf[_LEN.size : _LEN.size + size]))
            del self._buf[: _LEN.size + size]
        return frames
