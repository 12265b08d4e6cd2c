"""Fixtures: a real kernel with the extension loaded, and leak checks."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from kernel_harness import (  # noqa: E402
    KernelSession, children, descendants, listening_ports, temp_entries, wait_until,
)


def _launcher_dirs() -> set:
    found = set()
    for base in {tempfile.gettempdir(), "/tmp"}:
        try:
            found |= {os.path.join(base, e) for e in os.listdir(base) if e.startswith("accel_magics-")}
        except OSError:
            pass
    return found


def pytest_sessionfinish(session, exitstatus):
    """The whole session must leave no launcher directory behind (whichever
    test leaked it): a failure of the run if one is left."""
    before = getattr(session.config, "_launcher_dirs", None)
    if before is None:
        return
    import time
    deadline = time.monotonic() + 10
    while _launcher_dirs() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _launcher_dirs() - before
    if left:
        print(f"\nLEAK: launcher directories left behind by this test session: {sorted(left)}")
        session.exitstatus = 1


def pytest_configure(config):
    config._launcher_dirs = _launcher_dirs()
    # Run logs of every kernel the tests start (nbval's included) go to a
    # directory of this session, never to the user's ~/.cache.
    if "ACCEL_MAGICS_LOG_DIR" not in os.environ:
        config._accel_log_dir = tempfile.mkdtemp(prefix="accel-test-logs-")
        os.environ["ACCEL_MAGICS_LOG_DIR"] = config._accel_log_dir


def pytest_unconfigure(config):
    log_dir = getattr(config, "_accel_log_dir", None)
    if log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
        os.environ.pop("ACCEL_MAGICS_LOG_DIR", None)


class LoadedKernel(KernelSession):
    """A kernel with ``%load_ext accel_magics`` done and its launcher ready."""

    def __init__(self, extra_env: dict | None = None, cwd: str | None = None, ranks: int = 2) -> None:
        # A temp directory of its own: the kernel, launcher and ranks all use it,
        # so "no temp file left" is checked exactly, whatever else runs here.
        self.tmpdir = tempfile.mkdtemp(prefix="accel-test-tmp-")
        super().__init__(extra_env={"PYTHONUNBUFFERED": "1", "TMPDIR": self.tmpdir, **(extra_env or {})}, cwd=cwd)
        self.ok("%load_ext accel_magics")
        # The first run also waits for the launcher to import torch.
        self.ok(f"%%distributed -n {ranks} --output text\npass", timeout=120)
        self.wait_quiet()
        self.zygote = self.launcher_pid()
        self.base_ports = listening_ports({self.pid} | descendants(self.pid))
        self.base_temp = temp_entries(self.tmpdir)

    def ports_by_process(self) -> str:
        """What listens, per process of the kernel's tree (for a leak's message)."""
        lines = [f"ports at the kernel's start: {sorted(self.base_ports)}"]
        for pid in sorted({self.pid} | descendants(self.pid)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                command = "(gone)"
            lines.append(f"pid {pid}: ports {sorted(listening_ports({pid}))}: {command}")
        return "\n".join(lines)

    def launcher_pid(self) -> int:
        kids = children(self.pid)
        assert len(kids) == 1, f"the kernel should have one child, the launcher: {kids}"
        return kids.pop()

    def idle_tree(self) -> bool:
        """Only the launcher and its spare (a supervisor and idle ranks forked
        ahead for the next run) are alive: every process of past runs is gone."""
        zygote = self.launcher_pid()
        spares = children(zygote)
        if len(spares) != 1:
            return False
        idle_ranks = children(next(iter(spares)))
        return all(not children(p) for p in idle_ranks) and \
            descendants(self.pid) == {zygote} | spares | idle_ranks

    def wait_quiet(self, timeout: float = 10) -> None:
        self.release_held()
        wait_until(self.idle_tree, timeout, "every process of finished runs to exit")

    def release_held(self) -> None:
        """Let go a failed rank the kernel keeps on purpose, for a post-mortem
        (``%distributed_debug``, for ``--debug_hold`` seconds), as a user does
        (``%distributed_debug --release``); not in the notebook's history."""
        if self.km.is_alive():
            self.result_of(self.kc.execute("%distributed_debug --release", store_history=False), timeout=30)

    def launcher_token(self) -> str:
        """The marker every process of this kernel's launcher carries in its environment."""
        with open(f"/proc/{self.zygote}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"ACCEL_MAGICS_LAUNCHER="):
                    return item.split(b"=", 1)[1].decode()
        raise AssertionError("the launcher has no ACCEL_MAGICS_LAUNCHER marker")

    def escaped(self) -> set[int]:
        """Processes of this kernel's launcher that left its process tree (setsid,
        double fork, a killed parent): a leak even if reparented to init."""
        from accel_magics.kernel_ext.process_tree import marked_processes
        return set(marked_processes(self.launcher_token())) - descendants(self.pid)

    def assert_no_leaks(self) -> None:
        wait_until(lambda: not self.escaped(), 10, "processes that escaped the launcher's tree to exit")
        self.wait_quiet()
        assert self.launcher_pid() == self.zygote, "the launcher was restarted"
        # A run's store stops listening right after the run reports "finished".
        # Only a port beyond those of the kernel's start is a leak: one of
        # those may close meanwhile (a port of the kernel process itself went
        # from the 7 at its start to 6, in CI beside busy loops).
        try:
            wait_until(lambda: listening_ports({self.pid} | descendants(self.pid)) <= self.base_ports, 10,
                       "every port of finished runs to close")
        except AssertionError as exc:   # which process listens where: the leak's story
            raise AssertionError(f"{exc}\n{self.ports_by_process()}") from None
        assert temp_entries(self.tmpdir) == self.base_temp, "a temp file was left behind"

    def shutdown(self) -> None:
        super().shutdown()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process, as in a kernel: a
    process started in the background by a non-interactive shell (CI's
    ``nohup ... &``) inherits SIGINT ignored, and Python keeps it ignored."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def launcher():
    """The engine's launcher on its own, no kernel (one per test module)."""
    from accel_magics.kernel_ext.kernel.launcher import Launcher

    lau = Launcher()
    lau.start()
    lau.wait_ready()
    yield lau
    lau.close()
    assert not os.path.exists(lau.dir), "the private directory was left behind"


@pytest.fixture(scope="module")
def kernel():
    k = LoadedKernel()
    try:
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def clean_kernel(kernel):
    """The module's kernel, checked for leaks after the test."""
    yield kernel
    kernel.assert_no_leaks()
