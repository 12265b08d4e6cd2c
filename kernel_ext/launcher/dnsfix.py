"""Make torch.distributed's store connections immune to slow reverse DNS.

Every TCP connection torch's c10d sockets make (TCPStore clients, the store's
accept loop) formats the peer address with ``getnameinfo`` *without*
``NI_NUMERICHOST``: a reverse DNS lookup, for the IPv4-mapped IPv6 address
(``::ffff:127.0.0.1``) that ``/etc/hosts`` does not list.  When the resolver
drops one such query, the connect stalls for the resolver's timeout (5 s);
measured here in about 4% of store connections, with or without Jupyter.

torch keeps a process-wide flag that turns those lookups off after the first
failure (pytorch#159007).  The launcher process trips it once, at start, by
making one lookup fail at once (the resolver pointed for that moment at a
closed loopback port), then restores the resolver.  Every supervisor and rank
is forked from the launcher, so they inherit the flag: no reverse lookups, no
stall; real name resolution (``getaddrinfo``) is untouched.
"""
from __future__ import annotations

import ctypes
import socket
import struct
import sys
from datetime import timedelta

# glibc's struct __res_state on 64-bit Linux: int retrans; int retry;
# unsigned long options; int nscount; struct sockaddr_in nsaddr_list[3]; ...
_NSCOUNT, _NSADDR = 16, 20


def disable_reverse_dns() -> str:
    """Trip torch's flag; returns what happened (for the launcher's log)."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return "skipped: not 64-bit Linux"
    try:
        libc = ctypes.CDLL(None)
        res_init, res_state = libc.__res_init, libc.__res_state
    except (OSError, AttributeError):
        return "skipped: not glibc"
    res_state.restype = ctypes.c_void_p
    if res_init() != 0:
        return "skipped: resolver did not initialise"
    state = res_state()
    nscount = ctypes.c_int.from_address(state + _NSCOUNT)
    ns0 = (ctypes.c_char * 16).from_address(state + _NSADDR)
    if not 1 <= nscount.value <= 3 or struct.unpack("=H", bytes(ns0)[:2])[0] != socket.AF_INET:
        return f"skipped: unexpected resolver layout (nscount={nscount.value})"
    saved = bytes(ns0)
    from torch.distributed import TCPStore

    try:
        ns0[:] = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 9) + socket.inet_aton("127.0.0.1") + b"\0" * 8
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5), wait_for_workers=False,
                          use_libuv=False)
        client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
        del client, server
    finally:
        res_init()
    if bytes((ctypes.c_char * 16).from_address(res_state() + _NSADDR)) != saved:
        ns0[:] = saved
        return "resolver restored by hand"
    return "reverse DNS lookups of torch.distributed sockets disabled"
