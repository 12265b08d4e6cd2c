"""Start a test kernel under the conditions of a container, for real.

:class:`WrappedKernelManager` starts the kernel under a wrapper command (the
kernel is what the wrapper finally ``exec``s, so its pid, process group and
interrupt are the kernel's own).  The wrappers make what a container makes,
with the same kernel mechanisms: a mount namespace with a 64 MB tmpfs at
/dev/shm (Docker's and Kubernetes' default), CAP_SYS_PTRACE dropped from the
bounding set plus a seccomp filter that refuses ptrace (Docker's default
profile on kernels before 4.8, gVisor), a cgroup with a CPU quota (``--cpus``),
a read-only HOME (a read-only bind mount), another user.  Each is undone when
its ``with`` block ends: namespaces die with their last process, cgroups and
users the test made are removed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from typing import Callable, Iterator, Optional

from jupyter_client.manager import KernelManager

HERE = os.path.dirname(os.path.abspath(__file__))
NO_PTRACE = os.path.join(HERE, "no_ptrace.py")


class WrappedKernelManager(KernelManager):
    """A KernelManager whose kernel command runs under ``prefix`` (which must
    end by exec-ing the command it is given).  ``prepare(km)`` runs after the
    connection file is written, before the kernel starts (to hand it to another user)."""

    def __init__(self, prefix: list[str], prepare: Optional[Callable] = None, **kw) -> None:
        super().__init__(kernel_name="python3", **kw)
        self._prefix = list(prefix)
        self._prepare = prepare

    def format_kernel_cmd(self, extra_arguments=None):
        cmd = super().format_kernel_cmd(extra_arguments)
        if self._prepare is not None:
            self._prepare(self)
        return self._prefix + cmd


def can(*argv: str) -> Optional[str]:
    """None if ``argv`` runs here with status 0, else why not (a skip reason)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]} cannot run here: {exc}"
    if done.returncode != 0:
        return f"`{' '.join(argv)}` is not permitted here: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


# -- /dev/shm of a container -----------------------------------------------------

def small_shm(size: str = "64m") -> list[str]:
    """A mount namespace with a ``size`` tmpfs at /dev/shm (the host's is untouched)."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && exec "$@"', "sh"]


def small_shm_unsupported() -> Optional[str]:
    return can(*small_shm(), "true")


# -- no ptrace --------------------------------------------------------------------

def no_ptrace() -> list[str]:
    return ["setpriv", "--bounding-set", "-sys_ptrace", "--inh-caps=-sys_ptrace", sys.executable, NO_PTRACE]


def no_ptrace_unsupported() -> Optional[str]:
    return can(*no_ptrace(), "true")


# -- a CPU quota (cgroup v1 cpu controller, or v2 cpu.max) --------------------------

def _cpu_cgroup_root() -> Optional[tuple[str, bool]]:
    """(the cgroup folder new groups go in, whether it is v2)."""
    if os.path.isfile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        return "/sys/fs/cgroup/cpu", False
    if os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            if "cpu" in f.read().split():
                return "/sys/fs/cgroup", True
    return None


@contextlib.contextmanager
def cpu_quota(cores: float) -> Iterator[list[str]]:
    """A cgroup limited to ``cores`` CPUs' time; yields the wrapper that moves
    the kernel into it.  Removed at the end (its processes must be gone: a
    process left in it is a leak the test reports)."""
    with cpu_cgroup(cores) as (wrapper, _):
        yield wrapper


def set_cpu_quota(path: str, cores: float) -> None:
    """Change the quota of a cgroup :func:`cpu_cgroup` made (as ``docker update --cpus`` does)."""
    period = 100_000
    if os.path.exists(os.path.join(path, "cpu.max")):
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{int(cores * period)} {period}")
    else:
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(cores * period)))


@contextlib.contextmanager
def cpu_cgroup(cores: float) -> Iterator[tuple[list[str], str]]:
    """:func:`cpu_quota`'s cgroup: (the wrapper, the cgroup's directory)."""
    found = _cpu_cgroup_root()
    if found is None:
        raise PermissionError("no cgroup cpu controller is mounted")
    root, v2 = found
    path = os.path.join(root, f"accel-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    try:
        period = 100_000
        if v2:
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write(f"{int(cores * period)} {period}")
        else:
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write(str(period))
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(int(cores * period)))
        yield ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"], path
    finally:
        left = _procs(path)
        for pid in left:   # a leak: out of the group, so the group can go; the test fails on it
            with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        os.rmdir(path)
        assert not left, f"processes left in the test's cgroup: {left}"


def _procs(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def cpu_quota_unsupported() -> Optional[str]:
    try:
        with cpu_quota(1.0):
            pass
    except (OSError, AssertionError) as exc:
        return f"cannot make a cgroup with a CPU quota here: {exc}"
    return None


# -- a low ulimit -n ------------------------------------------------------------------------

def nofile(soft: int, hard: int) -> list[str]:
    return ["prlimit", f"--nofile={soft}:{hard}", "--"]


# -- a read-only HOME ----------------------------------------------------------------

def read_only(path: str) -> list[str]:
    """A mount namespace where ``path`` is a read-only bind mount of itself."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount --bind "{path}" "{path}" && mount -o remount,bind,ro "{path}" && exec "$@"', "sh"]


# -- another user ----------------------------------------------------------------------

def as_user(uid: int, gid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]


@contextlib.contextmanager
def reachable_by(uid: int, path: str) -> Iterator[None]:
    """Let ``uid`` reach ``path`` (the interpreter, the venv): folders above it
    that it cannot enter get the search bit for others (never read or write),
    taken back at the end."""
    changed = []
    probe = os.path.dirname(os.path.realpath(path))
    folders = []
    while probe not in ("/", ""):
        folders.append(probe)
        probe = os.path.dirname(probe)
    try:
        for folder in reversed(folders):
            mode = os.stat(folder).st_mode
            if not mode & 0o001:
                os.chmod(folder, mode | 0o001)
                changed.append((folder, mode))
        yield
    finally:
        for folder, mode in reversed(changed):
            os.chmod(folder, mode & 0o7777)


@contextlib.contextmanager
def owned_dir(uid: int, gid: int, prefix: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        os.chown(path, uid, gid)
        os.chmod(path, 0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
