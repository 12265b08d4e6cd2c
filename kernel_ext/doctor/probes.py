"""Reads of the machine a launch depends on, each cheap and side-effect free.

Nothing here initialises CUDA or imports torch: torch's version is read from
its ``version.py`` file, GPUs from NVML (which has no CUDA context).  A probe
that needs a process of its own (ptrace) starts a short helper interpreter:
the kernel never forks itself.  The verdicts on what is read are in
:mod:`.checks`, plain functions of these values.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import resource
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from ..timing import GPU_QUERY_WAIT, LOOPBACK_WAIT, PTRACE_PROBE_WAIT

CAP_SYS_PTRACE = 19


@dataclass(frozen=True)
class ShmUsage:
    path: str
    size: int        # bytes; 0 where the path is missing
    free: int        # bytes available


def shm_usage(path: str = "/dev/shm") -> ShmUsage:
    try:
        st = os.statvfs(path)
    except OSError:
        return ShmUsage(path, 0, 0)
    return ShmUsage(path, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def nofile_limits() -> tuple[int, int]:
    """``ulimit -n``: (soft, hard); RLIM_INFINITY as -1."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def _status_field(name: str, pid: str = "self") -> Optional[str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def has_cap_sys_ptrace() -> Optional[bool]:
    caps = _status_field("CapEff")
    return None if caps is None else bool(int(caps, 16) >> CAP_SYS_PTRACE & 1)


def seccomp_mode() -> Optional[int]:
    """0 none, 1 strict, 2 a filter (Docker's default profile is one)."""
    mode = _status_field("Seccomp")
    return int(mode) if mode and mode.isdigit() else None


def yama_scope() -> Optional[int]:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None


# A helper interpreter forks a child and attaches to it as py-spy attaches to a
# rank (a parent's descendant, or one that allowed it with PR_SET_PTRACER).
_PTRACE_PROBE = r"""
import ctypes, errno, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
pid = os.fork()
if pid == 0:
    signal.pause()
    os._exit(0)
try:
    if libc.ptrace(16, pid, None, None) == -1:
        e = ctypes.get_errno()
        print(errno.errorcode.get(e, str(e)), os.strerror(e))
    else:
        os.waitpid(pid, 0x40000000)
        libc.ptrace(17, pid, None, None)
        print("ok")
finally:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""


class PtraceProbe:
    """A real PTRACE_ATTACH to a child process, in a helper interpreter
    started now (tens of ms: the launcher starts it before importing torch
    and reads it after)."""

    def __init__(self) -> None:
        self.error = ""
        try:
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _PTRACE_PROBE], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            self.proc, self.error = None, f"the probe did not run ({exc})"

    def refused(self, timeout: float = PTRACE_PROBE_WAIT) -> Optional[str]:
        """None when the attach worked; else its error (``EPERM Operation not permitted``)."""
        if self.proc is None:
            return self.error
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return f"the probe did not answer within {timeout:g}s"
        answer = out.strip()
        if answer == "ok":
            return None
        return answer or f"the probe failed ({err.strip().splitlines()[-1:] or self.proc.returncode})"


def ptrace_refused(probe: Optional[PtraceProbe] = None) -> Optional[str]:
    """Why a process here cannot read another's native stacks, or None
    (``probe``: one started earlier)."""
    scope = yama_scope()
    cap = has_cap_sys_ptrace()
    if scope is not None and scope >= 3:
        return "ptrace is disabled on this machine (kernel.yama.ptrace_scope=3)"
    refused = (probe or PtraceProbe()).refused()
    if refused is None:
        return None
    why = [f"PTRACE_ATTACH to a child process was refused ({refused})",
           "CAP_SYS_PTRACE is " + ("held" if cap else "not held" if cap is not None else "unknown")]
    if scope is not None:
        why.append(f"kernel.yama.ptrace_scope={scope}")
    if seccomp_mode() == 2:
        why.append("a seccomp filter is in place")
    return "; ".join(why)


def torch_version_file() -> Optional[dict]:
    """torch's ``version.py`` values (__version__, cuda, hip, xpu, git_version)
    without importing torch; None where torch is not installed."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    values: dict = {}
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py")) as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and node.value is not None:
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
        break
    return values


def supported_torch(requires: Optional[list] = None) -> str:
    """The package's torch requirement (``<3,>=2.4``), from ``requires`` (its
    metadata's Requires-Dist lines, read here unless given)."""
    if requires is None:
        try:
            requires = importlib.metadata.requires("accel-magics") or []
        except importlib.metadata.PackageNotFoundError:
            requires = []
    for req in requires:
        name = req.split(";")[0].strip()
        spec = name[len("torch"):].strip()
        if name.startswith("torch") and (not spec or spec[0] in "<>=!~"):
            return spec or ">=0"
    return ">=2.4,<3"


def package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Gpus:
    source: str                  # "NVML", "nvidia-smi" or "" (none answered)
    names: tuple = ()
    driver: str = ""
    cuda_driver: str = ""        # the newest CUDA the driver runs ("12.4")
    error: str = ""


def gpus(timeout: float = GPU_QUERY_WAIT) -> Gpus:
    """NVIDIA GPUs and their driver through NVML (no CUDA context), else nvidia-smi."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            error = str(exc)
        else:
            try:
                names = tuple(_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                              for i in range(pynvml.nvmlDeviceGetCount()))
                version = pynvml.nvmlSystemGetCudaDriverVersion()
                return Gpus("NVML", names, _text(pynvml.nvmlSystemGetDriverVersion()),
                            f"{version // 1000}.{version % 1000 // 10}")
            finally:
                pynvml.nvmlShutdown()
    else:
        error = "pynvml is not installed"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Gpus("", error=error)
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Gpus("", error=f"nvidia-smi did not answer ({exc})")
    if out.returncode != 0:   # "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver..."
        said = (out.stdout + out.stderr).strip().splitlines()
        return Gpus("", error=said[-1] if said else f"nvidia-smi exited {out.returncode}")
    rows = [line.rsplit(",", 1) for line in out.stdout.strip().splitlines() if "," in line]
    return Gpus("nvidia-smi", tuple(r[0].strip() for r in rows), rows[0][1].strip() if rows else "")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def loopback(port: int) -> tuple[Optional[str], bool]:
    """(None or why a loopback connection failed, whether ``port`` is free on all addresses)."""
    problem = None
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=LOOPBACK_WAIT):
                pass
    except OSError as exc:
        problem = f"a connection to 127.0.0.1 failed: {exc}"
    free = True
    try:
        with socket.socket() as probe:
            probe.bind(("", port))
    except OSError:
        free = False
    return problem, free


def hostname_address() -> tuple[str, Optional[str]]:
    """(hostname, what it resolves to or None): gloo and torchrun name a node by it."""
    name = socket.gethostname()
    try:
        return name, socket.gethostbyname(name)
    except OSError:
        return name, None
