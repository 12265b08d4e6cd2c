"""A hostile peer on the cluster network (issue 24 item 1), as a process of its
own: ``python flood.py HOST SECONDS PORT...``.  For SECONDS it floods every PORT
with what a stranger can send without the allocation's key:

* raw TCP connections (hundreds held open per port), each sending garbage;
* ZMQ peers of the plain (NULL) mechanism sending 128 MB frames;
* ZMQ CURVE peers that guess the server key, also sending 128 MB frames.

Run as root, it first becomes ``nobody`` (a second unix user, as on a shared
cluster).  It prints what it sent as JSON on its last line.
"""
from __future__ import annotations

import encodings.idna  # noqa: F401  (socket needs it; imported before the user changes)
import json
import os
import pwd
import resource
import socket
import sys
import time

BIG = 128 << 20
HELD_PER_PORT = 400


def become_nobody() -> None:
    if os.getuid() != 0:
        return
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)


def main() -> None:
    host, seconds, ports = sys.argv[1], float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    import zmq   # before the user changes: this Python may live where nobody cannot read

    ctx = zmq.Context()
    become_nobody()
    big = os.urandom(1 << 20) * 128          # one 128 MB frame, built once
    sent = {"connections": 0, "garbage_bytes": 0, "big_frames": 0, "uid": os.getuid()}
    held: list[socket.socket] = []
    zsocks = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for port in ports:
            for _ in range(50):
                try:
                    s = socket.create_connection((host, port), timeout=1)
                    s.setblocking(False)
                    s.send(os.urandom(4096))
                    sent["connections"] += 1
                    sent["garbage_bytes"] += 4096
                    held.append(s)
                except OSError:
                    pass
            while len(held) > HELD_PER_PORT * len(ports):
                held.pop(0).close()
            if len(zsocks) < 4 * len(ports):
                for kind in (zmq.PUSH, zmq.DEALER):
                    z = ctx.socket(kind)
                    z.setsockopt(zmq.LINGER, 0)
                    z.setsockopt(zmq.SNDTIMEO, 100)
                    if kind == zmq.DEALER:   # a CURVE client with a guessed server key
                        public, secret = zmq.curve_keypair()
                        z.curve_serverkey, z.curve_publickey, z.curve_secretkey = zmq.curve_keypair()[0], public, secret
                    z.connect(f"tcp://{host}:{port}")
                    zsocks.append(z)
            for z in zsocks:
                try:
                    z.send(big, copy=False)
                    sent["big_frames"] += 1
                except zmq.Again:
                    pass
        time.sleep(0.05)   # pacing the attack, not synchronising with anything
    for s in held:
        s.close()
    for z in zsocks:
        z.close(linger=0)
    ctx.term()
    print(json.dumps(sent))


if __name__ == "__main__":
    main()
