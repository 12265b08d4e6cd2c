"""``python no_ptrace.py CMD ARGS...``: run CMD where ptrace is refused.

A seccomp filter makes ptrace, process_vm_readv and process_vm_writev fail
with EPERM in CMD and everything it starts, as Docker's default seccomp
profile did before kernel 4.8 and as some sandboxes (gVisor) do; run it under
``setpriv --bounding-set -sys_ptrace`` for the capability side too.  x86_64
and aarch64.
"""
import ctypes
import errno
import os
import platform
import struct
import sys

ARCH = {"x86_64": (0xC000003E, (101, 310, 311)), "aarch64": (0xC00000B7, (117, 270, 271))}
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def _filter(arch: int, calls: tuple) -> list:
    ptrace, readv, writev = calls
    return [
        (BPF_LD_W_ABS, 0, 0, 4),          # seccomp_data.arch
        (BPF_JEQ_K, 0, 4, arch),          # another ABI: allow
        (BPF_LD_W_ABS, 0, 0, 0),          # seccomp_data.nr
        (BPF_JEQ_K, 3, 0, ptrace),
        (BPF_JEQ_K, 2, 0, readv),
        (BPF_JEQ_K, 1, 0, writev),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
    ]


def main() -> None:
    arch, calls = ARCH[platform.machine()]
    program = b"".join(struct.pack("HBBI", *insn) for insn in _filter(arch, calls))
    buf = ctypes.create_string_buffer(program)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Prog(len(program) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        sys.exit(f"no_ptrace: seccomp filter refused: {os.strerror(ctypes.get_errno())}")
    if len(sys.argv) > 1:
        os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
