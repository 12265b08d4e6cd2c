"""The doctor's verdicts as plain functions of what it reads (recorded cgroup
trees, limits, environments and failure texts), and ``%distributed_doctor``
in a real kernel.  The container conditions themselves: test_containers.py."""
from __future__ import annotations

import os
import sys

import pytest

from accel_magics.kernel_ext import cpu_quota
from accel_magics.kernel_ext.doctor import checks, explain, probes
from accel_magics.kernel_ext.kernel.errors import DistributedRunError
from accel_magics.kernel_ext.kernel.events import RankFailure

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


# -- the CPU quota, from recorded cgroup trees ------------------------------------------

def _tree(root, files: dict) -> str:
    for rel, text in files.items():
        path = os.path.join(str(root), rel.lstrip("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


HYBRID_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_v1_quota_of_the_process_cgroup(tmp_path):
    root = _tree(tmp_path, {"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
                            "/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "150000",
                            "/sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000"})
    found = cpu_quota.quota_from("2:cpuacct:/\n1:cpu:/job\n0::/\n", HYBRID_MOUNTS, root)
    assert found == cpu_quota.CpuQuota(1.5, "/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us")
    assert found.whole == 2   # rounded up, as the JVM and Go count a quota
    assert cpu_quota.effective_cpus(found, affinity=8) == 2
    assert cpu_quota.effective_cpus(found, affinity=1) == 1
    assert cpu_quota.effective_cpus(None, affinity=8) == 8
    assert cpu_quota.quota_from("1:cpu:/\n0::/\n", HYBRID_MOUNTS, root) is None   # -1: no quota


def test_v2_the_tightest_ancestor_wins(tmp_path):
    mounts = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    root = _tree(tmp_path, {"/sys/fs/cgroup/user.slice/cpu.max": "50000 100000",
                            "/sys/fs/cgroup/user.slice/kernel.scope/cpu.max": "max 100000"})
    found = cpu_quota.quota_from("0::/user.slice/kernel.scope\n", mounts, root)
    assert found.cores == 0.5 and found.whole == 1 and found.source == "/sys/fs/cgroup/user.slice/cpu.max"


def test_in_a_container_the_mount_root_is_the_containers_cgroup(tmp_path):
    # Docker with cgroup v1: /proc/self/cgroup names the host's path, the mount shows only the container's group.
    mounts = "700 690 0:40 /docker/ab12 /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    root = _tree(tmp_path, {"/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000",
                            "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"})
    found = cpu_quota.quota_from("4:cpu,cpuacct:/docker/ab12\n", mounts, root)
    assert found is not None and found.cores == 2.0


# -- verdicts ---------------------------------------------------------------------------

def test_a_64_mb_shm_is_a_warning_that_names_the_fix():
    small = checks.shm_check(probes.ShmUsage("/dev/shm", 64 * MiB, 60 * MiB), ranks=2, gpus=0)
    assert small.level == "warn" and small.state.startswith("64 MB, 60 MB free")
    assert "--shm-size=1g" in small.fix and "emptyDir: {medium: Memory" in small.fix
    assert checks.shm_check(probes.ShmUsage("/dev/shm", 24 << 30, 24 << 30), 2, 0).level == "ok"
    # NCCL on GPUs: 1 GB, whatever the ranks
    assert checks.shm_check(probes.ShmUsage("/dev/shm", 512 * MiB, 512 * MiB), 2, gpus=2).level == "warn"
    assert checks.shm_check(probes.ShmUsage("/dev/shm", 0, 0), 2, 0).level == "fail"


def test_ulimit_n():
    low = checks.nofile_check(1024, 1 << 20)
    assert low.level == "warn" and "resource.setrlimit(resource.RLIMIT_NOFILE, (1048576, 1048576))" in low.fix
    assert "(65536, resource.RLIM_INFINITY)" in checks.nofile_check(1024, -1).fix
    stuck = checks.nofile_check(1024, 1024)
    assert "--ulimit nofile=65536:65536" in stuck.fix
    assert checks.nofile_check(65536, 65536).level == "ok"
    assert checks.nofile_check(1024, 1 << 20, checks.PRE_RUN_NOFILE).level == "ok"   # not before a first run
    assert checks.nofile_check(256, 1 << 20, checks.PRE_RUN_NOFILE).level == "warn"


def test_the_cpu_quota_says_what_the_defaults_become():
    one = checks.quota_check(cpu_quota.CpuQuota(1.0, "/sys/fs/cgroup/cpu.max"), affinity=8, host=8, default_ranks=1)
    assert one.level == "warn" and "1 core(s) of the host's 8" in one.state and "OMP_NUM_THREADS=1" in one.state
    assert "--cpus" in one.fix
    assert checks.quota_check(None, 8, 8, 2).level == "ok"
    assert checks.quota_check(None, 2, 8, 2).level == "info"
    assert "not below the host's 8" in checks.quota_check(cpu_quota.CpuQuota(16.0, "cpu.max"), 8, 8, 2).state


def test_ptrace():
    refused = checks.ptrace_check("PTRACE_ATTACH to a child process was refused (EPERM ...)", "/usr/bin/py-spy")
    assert refused.level == "warn" and "native frames will be missing" in refused.state
    assert "--cap-add SYS_PTRACE" in refused.fix
    assert checks.ptrace_check(None, None).fix == "`pip install py-spy`"
    assert checks.ptrace_check(None, "/usr/bin/py-spy").level == "ok"


def test_torch_outside_the_supported_range_fails():
    assert checks.torch_check({"__version__": "2.3.1+cu121", "cuda": "12.1"}, ">=2.4,<3").level == "fail"
    ok = checks.torch_check({"__version__": "2.6.0+cu124", "cuda": "12.4"}, ">=2.4,<3")
    assert ok.level == "ok" and "CUDA 12.4 build" in ok.state
    assert checks.torch_check(None, ">=2.4,<3").level == "fail"


def test_gpu_driver_older_than_torchs_cuda():
    old = checks.gpu_check(probes.Gpus("NVML", ("Tesla T4", "Tesla T4"), "470.1", "11.4"), {"cuda": "12.4"})
    assert old.level == "fail" and "2 x Tesla T4" in old.state
    assert checks.gpu_check(probes.Gpus("NVML", ("Tesla T4",), "550.54", "12.4"), {"cuda": "12.4"}).level == "ok"


def test_slurm_step_and_leaking_variables():
    assert checks.slurm_check({}).state == "not in a Slurm job"
    inside = checks.slurm_check({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
                                 "SLURM_CPUS_PER_TASK": "4", "SLURM_JOB_NODELIST": "n1"})
    assert inside.level == "warn" and "waits silently until they are free unless it has `--overlap`" in inside.state
    assert "job 42, step 0" in inside.state
    batch = checks.slurm_check({"SLURM_JOB_ID": "42"})
    assert batch.level == "info" and "outside any step" in batch.state and "1 SLURM_* variables" in batch.state
    assert "SLURM_NTASKS, SLURM_CPUS_PER_TASK" in inside.state and "5 SLURM_* variables" in inside.state


def test_torchs_version_is_read_without_importing_it():
    import importlib.metadata
    values = probes.torch_version_file()
    # PyPI's CUDA wheels: "2.4.1" in the metadata, "2.4.1+cu121" in version.py
    assert values["__version__"].split("+")[0] == importlib.metadata.version("torch").split("+")[0]
    recorded = ['torchvision>=0.19', 'torch<3,>=2.4', 'ipython>=8.0', 'py-spy>=0.3.14; sys_platform == "linux"']
    assert probes.supported_torch(recorded) == "<3,>=2.4"
    assert probes.supported_torch(["torch"]) == ">=0"


def test_the_kernels_cuda():
    assert checks.kernel_cuda_check(["cuda"], True, "at In[3], line 2").level == "fail"
    assert checks.kernel_cuda_check([], False).state == "not initialised (torch not imported here)"


# -- failures a check explains (recorded texts) -----------------------------------------------

# torch 2.13, a DataLoader worker's batch into a 64 MB /dev/shm (test_containers).
TORCH_SHM = """RuntimeError: Caught RuntimeError in DataLoader worker process 0.
Original Traceback (most recent call last):
  File ".../torch/storage.py", line 414, in _new_shared
    return cls._new_using_fd_cpu(size)
RuntimeError: unable to allocate shared memory(shm) for file </torch_15734_3536008059_0>: No space left on device (28)"""
# torch 1.x - 2.0 wording of the same.
TORCH_SHM_OLD = "RuntimeError: unable to write to file </torch_18_1693845321>: No space left on device (28)"
# torch's DataLoader when a worker dies of SIGBUS (its C++ worker-failure check).
BUS_ERROR = ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that "
             "dataloader's workers are out of shared memory. Please try to raise your shared memory limit.")
BUS_ERROR_WORKER = "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm)."
# NCCL 2.18+ (torch.distributed.DistBackendError) and NCCL's own warning line.
NCCL_SHM = ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, "
            "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.18.1\n"
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.\n"
            "Last error:\nError while creating shared memory segment /dev/shm/nccl-vzIpS6 (size 9637888)")
NCCL_WARN = "node0:123:456 [1] include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device"
FDS = "RuntimeError: received 0 items of ancdata"


@pytest.mark.parametrize("text", [TORCH_SHM, TORCH_SHM_OLD, BUS_ERROR, BUS_ERROR_WORKER, "killed by SIGBUS"])
def test_shm_failures_name_dev_shm_and_the_fix(text):
    why = explain.explain(text, probes.ShmUsage("/dev/shm", 64 * MiB, 1 * MiB))
    assert "/dev/shm (64 MB, 1 MB free now)" in why and "--shm-size=1g" in why and "emptyDir" in why


@pytest.mark.parametrize("text", [NCCL_SHM, NCCL_WARN])
def test_nccls_shm_failures(text):
    why = explain.explain(text)
    assert why.startswith("NCCL could not make its shared-memory buffers in /dev/shm") and "--shm-size=1g" in why


@pytest.mark.parametrize("text", ["ValueError: boom", "OSError: [Errno 28] No space left on device: '/data/ckpt.pt'",
                                  "RuntimeError: DataLoader worker (pid(s) 77) exited unexpectedly",
                                  "killed by SIGSEGV", "psycopg2.errors.OutOfMemory: out of shared memory"])
def test_other_failures_are_not_explained(text):
    assert explain.explain(text) is None


def test_file_descriptors():
    assert "ulimit -n" in explain.explain(FDS) and "file_system" in explain.explain("OSError: [Errno 24] Too many open files")


def test_the_run_error_carries_the_explanation_beside_its_root_cause():
    root = RankFailure(1, "exception", TORCH_SHM.splitlines()[0], traceback=TORCH_SHM)
    error = DistributedRunError(root, [root], {})
    assert str(error).startswith("rank 1 failed: RuntimeError: Caught RuntimeError in DataLoader worker process 0.")
    assert "is full: DataLoader workers pass every batch" in str(error) and "--shm-size=1g" in error.report()
    plain = RankFailure(0, "exception", "ValueError: boom", traceback="ValueError: boom")
    assert "/dev/shm" not in str(DistributedRunError(plain, [plain], {}))


# -- the magic, in a real kernel -------------------------------------------------------------

def test_the_doctor_in_a_kernel(clean_kernel):
    k = clean_kernel
    before = k.ok("import sys\nprint('torch' in sys.modules)").stdout.strip()
    res = k.ok("%distributed_doctor")
    for name in ("torch", "GPUs", "/dev/shm", "ulimit -n", "CPU quota", "ptrace (native stacks)", "ports and loopback",
                 "Slurm", "the kernel's CUDA", "Jupyter packages", "widgets in the frontend"):
        assert f" {name}: " in res.result, (name, res.result)
    html = [m["content"]["data"].get("text/html", "") for m in res.messages if m["msg_type"] == "execute_result"]
    assert html and html[0].startswith("<table>") and "what to do" in html[0]
    records = k.ok("_r = %distributed_doctor -n 3\nprint(type(_r[0]).__name__, sorted(_r[0]))").stdout
    assert "dict ['check', 'fix', 'level', 'state']" in records
    after = k.ok("import sys\nprint('torch' in sys.modules, __import__('torch').cuda.is_initialized() "
                 "if 'torch' in sys.modules else False)").stdout.split()
    assert after[0] == before and after[1] == "False"   # nothing imported torch or touched CUDA
    bad = k.run("%distributed_doctor -n 0")
    assert bad.status == "error" and "--num_processes must be at least 1" in bad.error_text


# -- Slurm, for real (tests/slurm_cluster.py; run with -m slurm) -------------------------------

STEP_PROBE = """
import os, subprocess, sys
from accel_magics.kernel_ext.doctor import checks
print("VERDICT", checks.slurm_check(os.environ).state)
for extra in ([], ["--overlap"]):
    try:
        done = subprocess.run(["srun", "-n1", *extra, "hostname"], capture_output=True, text=True, timeout=6)
        print("NESTED", extra, "ran" if done.returncode == 0 else "failed: " + done.stderr.strip()[-200:])
    except subprocess.TimeoutExpired as exc:
        print("NESTED", extra, "waited:", (exc.stderr or b"").decode(errors="replace").strip()[-200:])
"""


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_the_slurm_verdict_inside_a_real_step():
    from slurm_cluster import SlurmCluster, missing

    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=1, cpus=1)
    try:
        alloc = cluster.allocate(1)
        done = cluster.run(["srun", "--jobid", alloc["SLURM_JOB_ID"], "-n1", sys.executable, "-c", STEP_PROBE],
                           timeout=90)
        out = done.stdout
        assert "VERDICT in job" in out and "waits silently until they are free unless it has `--overlap`" in out, \
            out + done.stderr
        # What the verdict says is what Slurm does: without --overlap the new step waits, with it, it runs.
        assert "NESTED [] waited:" in out and "NESTED ['--overlap'] ran" in out, out + done.stderr
        cluster.release(alloc["SLURM_JOB_ID"])
    finally:
        cluster.stop()


def test_pre_run_warnings_come_once_and_take_the_launchers_ptrace_verdict():
    from accel_magics.kernel_ext.kernel.preflight import LaunchRisks
    from accel_magics.kernel_ext.supervisor import native_stacks

    if native_stacks.tool() is None:
        pytest.skip("neither py-spy nor gdb is installed: the ptrace verdict is then about the tool")
    risks = LaunchRisks()
    lines = risks.once(2, 0, ["stepped aside", "PTRACE_ATTACH to a child process was refused (EPERM)"], 2)
    assert [line for line in lines if "native frames will be missing" in line and "SYS_PTRACE" in line]
    assert risks.once(2, 0, ["stepped aside", "refused"], 2) == []   # once per kernel
    assert risks.seconds < 0.5
    for state in (["disabled", ""], None):   # turned off by name; a launcher that did not say
        quiet = LaunchRisks()
        quiet.once(2, 0, state, 2)
        assert not [c for c in quiet.checked if c.check.startswith("ptrace")]
    allowed = LaunchRisks()
    assert not [line for line in allowed.once(2, 0, ["installed", "py-spy"], 2) if "ptrace" in line]


def test_a_cells_reads_of_the_cpu_count_read_the_cgroup_files_once(monkeypatch):
    """A cell asked for the CPU count five times (its checks, its defaults,
    each rank's thread split, the payload's compare threads), each a walk of
    /proc/self/mountinfo and the cgroup files: about 1 ms of the kernel's CPU
    per cell.  One read serves CPU_QUOTA_FRESH seconds; given values are never
    cached."""
    from accel_magics.kernel_ext import timing

    reads = []
    real = cpu_quota.cpu_quota
    monkeypatch.setattr(cpu_quota, "cpu_quota", lambda: reads.append(1) or real())
    monkeypatch.setattr(cpu_quota, "_last_read", (-float("inf"), 0))
    first = cpu_quota.effective_cpus()
    assert [cpu_quota.effective_cpus() for _ in range(4)] == [first] * 4
    assert len(reads) == 1
    assert cpu_quota.effective_cpus(None, affinity=3) == 3   # given values: computed, not the cached count
    monkeypatch.setattr(cpu_quota, "_last_read", (cpu_quota._last_read[0] - timing.CPU_QUOTA_FRESH, first))
    assert cpu_quota.effective_cpus() == first and len(reads) == 2   # stale: read again
