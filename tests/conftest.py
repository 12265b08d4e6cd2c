"""Fixtures: a real kernel with the extension loaded, and leak checks."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from kernel_harness import (  # noqa: E402
    KernelSession, descendants, listening_ports, temp_entries, wait_until,
)


class LoadedKernel(KernelSession):
    """A kernel with ``%load_ext accel_magics`` done and its launcher ready."""

    def __init__(self) -> None:
        super().__init__(extra_env={"PYTHONUNBUFFERED": "1"})
        self.ok("%load_ext accel_magics")
        # The first run also waits for the launcher to import torch.
        self.ok("%%distributed -n 2 --output text\npass", timeout=120)
        self.wait_quiet()
        self.launcher_pids = descendants(self.pid)
        assert len(self.launcher_pids) == 1, self.launcher_pids
        self.base_ports = listening_ports({self.pid} | self.launcher_pids)
        self.base_temp = temp_entries()

    def wait_quiet(self, timeout: float = 10) -> None:
        """Wait until the launcher has no children left (every run fully gone)."""
        def quiet():
            kids = descendants(self.pid)
            return len(kids) <= 1
        wait_until(quiet, timeout, "worker and supervisor processes to exit")

    def assert_no_leaks(self) -> None:
        self.wait_quiet()
        assert descendants(self.pid) == self.launcher_pids, "a process outlived its run"
        assert listening_ports({self.pid} | self.launcher_pids) == self.base_ports, "a port was left listening"
        assert temp_entries() == self.base_temp, "a temp file was left behind"


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
