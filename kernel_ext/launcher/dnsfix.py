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
from typing import Optional

from ..timing import STORE_TRY_WAIT

# glibc's struct __res_state on 64-bit Linux: int retrans; int retry;
# unsigned long options; int nscount; struct sockaddr_in nsaddr_list[3]; ...
_NSCOUNT, _NSADDR = 16, 20


def _resolver():
    """(libc, glibc's resolver state address), or why this is not the resolver the fix knows."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return "not 64-bit Linux"
    try:
        libc = ctypes.CDLL(None)
        res_init, res_state = libc.__res_init, libc.__res_state
    except (OSError, AttributeError):
        return "not glibc"
    res_state.restype = ctypes.c_void_p
    if res_init() != 0:
        return "the resolver did not initialise"
    state = res_state()
    nscount = ctypes.c_int.from_address(state + _NSCOUNT).value
    family = struct.unpack("=H", bytes((ctypes.c_char * 2).from_address(state + _NSADDR)))[0]
    if not 1 <= nscount <= 3 or family != socket.AF_INET:
        return f"glibc's resolver state is not laid out as expected (nscount={nscount}, family={family})"
    return libc, state


def unsupported() -> Optional[str]:
    """The ``reverse_dns`` hook's guard: glibc's resolver state where the fix writes."""
    found = _resolver()
    return found if isinstance(found, str) else None


def install() -> bool:
    """The ``reverse_dns`` hook, in the launcher (every fork inherits torch's flag)."""
    from .. import hooks

    return hooks.install("reverse_dns", disable_reverse_dns, guard=unsupported)


def disable_reverse_dns() -> str:
    """Trip torch's flag (the guard said the resolver is the one we know)."""
    libc, state = _resolver()
    ns0 = (ctypes.c_char * 16).from_address(state + _NSADDR)
    saved = bytes(ns0)
    from torch.distributed import TCPStore

    try:
        ns0[:] = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 9) + socket.inet_aton("127.0.0.1") + b"\0" * 8
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=STORE_TRY_WAIT), wait_for_workers=False,
                          use_libuv=False)
        client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=STORE_TRY_WAIT))
        del client, server
    finally:
        libc.__res_init()
    if bytes((ctypes.c_char * 16).from_address(libc.__res_state() + _NSADDR)) != saved:
        ns0[:] = saved
        return "resolver restored by hand"
    return "reverse DNS lookups of torch.distributed sockets disabled"
