"""What the GPU paths decide without a GPU (issue 26): the GPU count the
launcher reports (from NVML, never by initialising CUDA) and how the session's
status reads NVML's answers.  The driver libraries are the boundary: torch's
NVML probes and the pynvml module are replaced by stand-ins that answer as
the real ones do; the code under test is ours."""
from __future__ import annotations

import sys
import types

import pytest

pytestmark = pytest.mark.timeout(30)


def test_the_gpu_count_comes_from_nvml_and_never_from_cuda(monkeypatch):
    import torch

    from accel_magics.kernel_ext.launcher import zygote

    calls = []
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: calls.append("nvml") or 3, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("device_count() initialises CUDA"))
    assert zygote.gpu_count() == 3 and calls == ["nvml"]


def test_no_nvml_answer_falls_back_to_amd_smi_then_to_none(monkeypatch):
    import torch

    from accel_magics.kernel_ext.launcher import zygote

    def broken():
        raise RuntimeError("NVML unavailable")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", broken, raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: 2, raising=False)
    assert zygote.gpu_count() == 2
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: -1, raising=False)   # "cannot tell"
    assert zygote.gpu_count() == 0


def test_a_cpu_build_of_torch_counts_no_gpu(monkeypatch):
    import torch

    from accel_magics.kernel_ext.launcher import zygote

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    assert zygote.gpu_count() == 0


class _Proc:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


def _fake_nvml(devices, init_error=None):
    nvml = types.ModuleType("pynvml")
    state = {"shutdown": 0}

    def init():
        if init_error:
            raise init_error

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)
    nvml.nvmlDeviceGetCount = lambda: len(devices)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: devices[handle]
    return nvml, state


def test_session_status_sums_each_processs_gpu_memory_over_devices(monkeypatch):
    # The one NVML reader: %distributed_session status and every supervisor's samples use it.
    from accel_magics.kernel_ext.gpu_memory import GpuMemory

    nvml, state = _fake_nvml([[_Proc(10, 1 << 30), _Proc(11, None)], [_Proc(10, 1 << 20), _Proc(12, 0)]])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpu = GpuMemory()
    assert gpu.used() == {10: (1 << 30) + (1 << 20)}   # None / 0: NVML could not tell
    gpu.close()
    assert state["shutdown"] == 1


def test_gpu_utilisation_per_process_from_nvmls_samples_since_the_last_look(monkeypatch):
    """Issue 25 item 7: a rank's row shows how busy its GPU is (NVML's
    per-process samples; each look asks only for samples newer than the last)."""
    from accel_magics.kernel_ext.gpu_memory import GpuMemory

    class Sample:
        def __init__(self, pid, sm, stamp):
            self.pid, self.smUtil, self.timeStamp = pid, sm, stamp

    nvml, _ = _fake_nvml([[_Proc(10, 1 << 30)], [_Proc(11, 1 << 30)]])
    asked = []

    def samples(device, since):
        asked.append((device, since))
        if device == 1 and since:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")   # nothing new on that device
        return [Sample(10, 40, 100), Sample(10, 90, 200)] if device == 0 else [Sample(11, 7, 150)]
    nvml.nvmlDeviceGetProcessUtilization = samples
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpu = GpuMemory()
    assert gpu.busy() == {10: 90, 11: 7}
    assert gpu.busy() == {10: 90} and asked[-2:] == [(0, 200), (1, 150)]
    gpu.close()
    nvml, _ = _fake_nvml([[_Proc(10, 1 << 30)]])   # an old driver: no per-process samples at all
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert GpuMemory().busy() == {}


def test_session_status_without_nvml_or_a_driver_shows_no_gpu_memory(monkeypatch):
    from accel_magics.kernel_ext.gpu_memory import GpuMemory

    nvml, state = _fake_nvml([], init_error=RuntimeError("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert GpuMemory().used() == {}
    monkeypatch.setitem(sys.modules, "pynvml", None)   # not installed: import fails
    assert GpuMemory().used() == {}
