"""GPU memory and utilisation per process, from NVML: never from CUDA.

Why here, on its own: the kernel (``%distributed_session status``) and every
supervisor (each rank's row in the view) ask the same question, and neither
may initialise CUDA (the kernel's pre-flight rule; a supervisor has no GPU
work).  Where there is no NVIDIA GPU, no driver or no pynvml, every answer
is empty: nothing here raises.
"""
from __future__ import annotations

import logging

log = logging.getLogger("accel_magics.gpu_memory")


class GpuMemory:
    """NVML initialised once (an init costs tens of ms); :meth:`used` as often as wanted."""

    def __init__(self) -> None:
        self.nvml = None
        self.devices: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.devices = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:   # no NVIDIA GPU, no driver, no pynvml: no GPU column
            self.nvml = None
        self._seen = [0] * len(self.devices)   # per device: the newest utilisation sample read (NVML's µs)

    def used(self) -> dict[int, int]:
        """pid -> bytes of GPU memory it holds, over every GPU; {} without NVML."""
        if self.nvml is None:
            return {}
        used: dict[int, int] = {}
        try:
            for device in self.devices:
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(device):
                    if proc.usedGpuMemory:
                        used[proc.pid] = used.get(proc.pid, 0) + proc.usedGpuMemory
        except Exception:
            log.debug("NVML did not answer", exc_info=True)
        return used

    def busy(self) -> dict[int, int]:
        """pid -> percent of a GPU's SMs it kept busy since the last call
        (NVML's per-process samples, the busiest device); {} without NVML,
        and for a process NVML has no sample of (an idle one, an old driver)."""
        if self.nvml is None:
            return {}
        busy: dict[int, int] = {}
        for i, device in enumerate(self.devices):
            try:
                samples = self.nvml.nvmlDeviceGetProcessUtilization(device, self._seen[i])
            except Exception:   # NVML_ERROR_NOT_FOUND: no sample since the last call; unsupported
                continue
            for sample in samples:
                busy[sample.pid] = max(busy.get(sample.pid, 0), int(sample.smUtil))
                self._seen[i] = max(self._seen[i], int(sample.timeStamp))
        return busy

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml = None
