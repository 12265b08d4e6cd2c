"""The doctor's verdicts: plain functions of what :mod:`.probes` read.

Each returns a :class:`Check`: what was checked, its state in a few words,
``ok`` / ``warn`` / ``fail`` / ``info``, and what to do.  :func:`launch_risks`
are the ones that can make a run fail (``/dev/shm``, ``ulimit -n``, the CPU
quota, ptrace): cheap enough to run before a kernel's first cell.
:func:`doctor` is all of them, for ``%distributed_doctor``.

Rules of thumb, and where they come from:

* ``/dev/shm``: a DataLoader worker hands every batch to its rank through a
  shared-memory file there, ``prefetch_factor`` (2) batches per worker in
  flight (torch.utils.data docs; PyTorch's README: "the default shared memory
  segment size that container runs with is not enough ... increase shared
  memory size either with --ipc=host or --shm-size"); NCCL keeps its
  intra-node buffers there and asks for ``--shm-size=1g`` in containers
  (NCCL troubleshooting guide).  So: at least 128 MiB per rank (2 workers x 2
  batches x 32 MB), and 1 GiB on a node with GPUs.  Docker's and Kubernetes'
  default is 64 MB.
* ``ulimit -n``: torch shares tensors between processes through file
  descriptors by default; "Too many open files" / "received 0 items of
  ancdata" come below a few thousand (torch.multiprocessing docs).  Below 4096
  is flagged by the doctor, below 1024 before a first run.
"""
from __future__ import annotations

import os
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Mapping, Optional

from .. import cpu_quota as quota_mod
from . import probes

MiB = 1 << 20
SHM_PER_RANK = 128 * MiB
SHM_WITH_GPUS = 1024 * MiB
LOW_NOFILE = 4096
#: Before a first run only a limit below this warns: 1024 is many hosts' and
#: Docker 25's default soft limit, and the run's error explains it if it bites.
PRE_RUN_NOFILE = 1024

SHM_FIX = ("give the container a bigger /dev/shm: `docker run --shm-size=1g` (or `--ipc=host`); Kubernetes: "
           "an `emptyDir: {medium: Memory, sizeLimit: 1Gi}` volume mounted at /dev/shm; or DataLoader(num_workers=0)")
PTRACE_FIX = ("`docker run --cap-add SYS_PTRACE` (Kubernetes: securityContext.capabilities.add: [SYS_PTRACE]); "
              "on a host with kernel.yama.ptrace_scope=2 or 3, set it to 1")


@dataclass
class Check:
    check: str
    state: str
    level: str = "ok"        # ok, warn, fail, info
    fix: str = ""

    def record(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """The one-line warning before a first cell."""
        return f"accel_magics: {self.check}: {self.state}" + (f"; fix: {self.fix}" if self.fix else "")


def size_text(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", MiB), ("kB", 1024)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def shm_need(ranks: int, gpus: int) -> int:
    return max(ranks * SHM_PER_RANK, SHM_WITH_GPUS if gpus else 0)


def shm_check(usage: probes.ShmUsage, ranks: int, gpus: int) -> Check:
    need = shm_need(ranks, gpus)
    if usage.size == 0:
        return Check(usage.path, f"missing: DataLoader workers and NCCL need it", "fail", SHM_FIX)
    state = f"{size_text(usage.size)}, {size_text(usage.free)} free"
    if usage.size < need or usage.free < need:
        why = (f"{ranks} rank(s){' with GPUs (NCCL)' if gpus else ''} need about {size_text(need)} for DataLoader "
               f"workers' batches{' and NCCL' if gpus else ''}")
        return Check(usage.path, f"{state}: {why}", "warn", SHM_FIX)
    return Check(usage.path, state)


def nofile_check(soft: int, hard: int, low: int = LOW_NOFILE) -> Check:
    def text(n):
        return "unlimited" if n < 0 or n == resource.RLIM_INFINITY else str(n)
    state = f"{text(soft)} (hard limit {text(hard)})"
    if 0 <= soft < low:
        unlimited = hard < 0 or hard == resource.RLIM_INFINITY
        if unlimited or hard >= low:
            pair = "65536, resource.RLIM_INFINITY" if unlimited else f"{hard}, {hard}"
            raise_it = (f"`import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({pair}))` in a cell "
                        "(the ranks inherit it)")
        else:
            raise_it = "`docker run --ulimit nofile=65536:65536` (the hard limit is too low to raise it from here)"
        return Check("ulimit -n", f"{state}: DataLoader workers share tensors through file descriptors",
                     "warn", f"{raise_it}; or torch.multiprocessing.set_sharing_strategy('file_system') in the cell")
    return Check("ulimit -n", state)


def quota_check(quota: Optional[quota_mod.CpuQuota], affinity: int, host: int, default_ranks: int) -> Check:
    effective = quota_mod.effective_cpus(quota, affinity)
    threads = max(1, effective // max(1, default_ranks))
    follow = (f"defaults follow it: {default_ranks} rank(s) on CPU, OMP_NUM_THREADS={threads} per rank "
              f"(-n N still asks for more)")
    if quota is not None and quota.whole < host:
        return Check("CPU quota", f"{quota.cores:g} core(s) of the host's {host} ({quota.source}); {follow}", "warn",
                     "ask the container for more CPUs (`docker run --cpus N`, Kubernetes resources.limits.cpu) "
                     "for more ranks or threads")
    if quota is not None:
        return Check("CPU quota", f"{quota.cores:g} core(s) ({quota.source}), not below the host's {host}; "
                     f"{effective} core(s)" + (f"; {follow}" if affinity < host else ""))
    if affinity < host:
        return Check("CPU quota", f"no quota; this process may use {affinity} of {host} cores (affinity); {follow}",
                     "info")
    return Check("CPU quota", f"none; {effective} core(s)")


def ptrace_check(refused: Optional[str], tool: Optional[str]) -> Check:
    if tool is None:
        return Check("ptrace (native stacks)", "neither py-spy nor gdb is installed: native frames will be missing "
                     "from the stacks of a --timeout or a stall", "warn", "`pip install py-spy`")
    if refused:
        return Check("ptrace (native stacks)", f"not allowed: native frames will be missing from the stacks of a "
                     f"--timeout or a stall ({refused})", "warn", PTRACE_FIX)
    return Check("ptrace (native stacks)", f"allowed ({os.path.basename(tool)})")


def launch_risks(ranks: int, gpus: int, ptrace_refused: Optional[str], tool: Optional[str],
                 default_ranks: int = 2) -> list[Check]:
    """The checks that can make a run fail or lose its stacks, each a few
    µs (``ptrace_refused``: the launcher's probe, taken as given)."""
    soft, hard = probes.nofile_limits()
    return [shm_check(probes.shm_usage(), ranks, gpus), nofile_check(soft, hard, PRE_RUN_NOFILE),
            quota_check(quota_mod.cpu_quota(), quota_mod.affinity_count(), os.cpu_count() or 1, default_ranks),
            ptrace_check(ptrace_refused, tool)]


def torch_check(values: Optional[dict], supported: str) -> Check:
    if values is None:
        return Check("torch", "not installed", "fail", f"`pip install 'torch{supported}'`")
    version = str(values.get("__version__", "?"))
    build = ("CUDA " + values["cuda"] if values.get("cuda") else "ROCm " + values["hip"] if values.get("hip")
             else "XPU" if values.get("xpu") else "CPU")
    state = f"{version} ({build} build); supported: {supported}"
    if not version_in(version, supported):
        return Check("torch", state + ": outside the supported range", "fail",
                     f"`pip install 'torch{supported}'`")
    return Check("torch", state)


def version_in(version: str, spec: str) -> bool:
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(version.split("+")[0]) in SpecifierSet(spec)
    except Exception:   # no packaging, or a version it cannot read: not flagged
        return True


def gpu_check(found: probes.Gpus, torch_values: Optional[dict]) -> Check:
    cuda_build = (torch_values or {}).get("cuda")
    if not found.source:
        if cuda_build:
            return Check("GPUs", f"none found ({found.error or 'no NVIDIA driver'}); torch is a CUDA build",
                         "info", "ranks run on CPU with gloo; for GPUs check the driver (`nvidia-smi`) and that "
                         "the container has them (`docker run --gpus all`)")
        return Check("GPUs", "none: ranks run on CPU with gloo")
    names = ", ".join(sorted(set(found.names))) or "none"
    state = f"{len(found.names)} x {names}; driver {found.driver}" + (
        f" (CUDA {found.cuda_driver})" if found.cuda_driver else "") + f", via {found.source}"
    if cuda_build and found.cuda_driver and _major(found.cuda_driver) < _major(cuda_build):
        return Check("GPUs", f"{state}: older than torch's CUDA {cuda_build}", "fail",
                     f"update the NVIDIA driver, or install a torch built for CUDA {found.cuda_driver}")
    if found.names and not cuda_build:
        return Check("GPUs", f"{state}; torch is not a CUDA build", "warn", "install a CUDA build of torch")
    return Check("GPUs", state)


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def network_check(loopback_problem: Optional[str], port: int, port_free: bool, hostname: str,
                  address: Optional[str]) -> Check:
    if loopback_problem:
        return Check("ports and loopback", loopback_problem, "fail",
                     "the ranks talk over 127.0.0.1: bring the loopback interface up (`ip link set lo up`)")
    state = f"loopback works; a free port is there for each run; {port} (the several-node default) is " + (
        "free" if port_free else "in use")
    if address is None:
        return Check("ports and loopback", f"{state}; the hostname {hostname!r} does not resolve", "warn",
                     f"add `{hostname}` to /etc/hosts, or set GLOO_SOCKET_IFNAME=lo for one-machine runs")
    return Check("ports and loopback", f"{state}; {hostname} is {address}")


#: Variables srun and sbatch read as input: a job submitted from here gets this job's sizes.
SLURM_INPUTS = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_CPUS_PER_TASK", "SLURM_MEM_PER_CPU",
                "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_GPU", "SLURM_NTASKS_PER_NODE", "SLURM_TRES_PER_TASK",
                "SLURM_CPU_BIND", "SLURM_DISTRIBUTION", "SLURM_EXPORT_ENV", "SLURM_GPUS", "SLURM_GPUS_PER_NODE")


def slurm_check(environ: Mapping[str, str]) -> Check:
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return Check("Slurm", "not in a Slurm job")
    names = sorted(k for k in environ if k.startswith("SLURM_"))
    inputs = [k for k in SLURM_INPUTS if k in environ]
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if step is not None and step not in ("batch", "extern", "4294967294", "4294967295"):
        new_step = (f"in job {job}, step {step} (this kernel runs inside a step that holds its CPUs): a new `srun` "
                    "from here waits silently until they are free unless it has `--overlap` (Slurm >= 20.11; "
                    "`--launcher slurm` adds it)")
    else:
        new_step = (f"in job {job}, outside any step: a new `srun` starts while the allocation has free CPUs; "
                    "add `--overlap` to share CPUs another step holds")
    state = (f"{new_step}; {len(names)} SLURM_* variables leak into jobs started from here"
             + (f", {len(inputs)} of them read by srun/sbatch as options ({', '.join(inputs)})" if inputs else ""))
    return Check("Slurm", state, "info" if not inputs else "warn",
                 "use `srun --overlap` inside the job; for a new job, start it with the SLURM_* variables removed "
                 "(as submitit does): `env $(env | grep -o '^SLURM_[A-Z_]*' | sed 's/^/-u /') sbatch ...`")


def kernel_cuda_check(initialised: list[str], torch_imported: bool, where: str = "") -> Check:
    if initialised:
        names = "/".join(r.upper() for r in initialised)
        return Check("the kernel's CUDA", f"{names} initialised in this kernel{(' ' + where) if where else ''}: "
                     "the next %%distributed cell will refuse to run", "fail",
                     "restart the kernel and move the code that touches the GPU into the %%distributed cell")
    return Check("the kernel's CUDA", "not initialised" + ("" if torch_imported else " (torch not imported here)"))


def versions_check(versions: Mapping[str, Optional[str]]) -> Check:
    text = ", ".join(f"{name} {version or 'missing'}" for name, version in versions.items())
    widgets = versions.get("ipywidgets")
    if widgets is None or _major(widgets) < 8:
        return Check("Jupyter packages", text, "warn",
                     "`pip install 'ipywidgets>=8'` for the live view; without it the view is text")
    return Check("Jupyter packages", text)


def widgets_check(shown: Optional[bool]) -> Check:
    if shown:
        return Check("widgets in the frontend", "a view of this kernel has rendered (the frontend answered)")
    return Check("widgets in the frontend", "unknown until a widget is shown: the kernel cannot ask the "
                 "frontend's widget manager while a cell runs", "info",
                 "if a view shows as text such as 'HBox(...)' or 'Loading widget...', use `--output text`, or "
                 "install/enable the frontend's ipywidgets support (JupyterLab 4 and Notebook 7 have it; VS Code "
                 "needs its Jupyter extension; Colab: core widgets work)")


def doctor(ranks: int, gpus_counted: int, default_ranks: int, tool: Optional[str], initialised: list[str],
           cuda_where: str = "", port: int = 29500, widgets_shown: Optional[bool] = None,
           environ: Optional[Mapping[str, str]] = None) -> list[Check]:
    """Every check, in a few seconds at most (the ptrace probe and NVML are the slow ones)."""
    environ = os.environ if environ is None else environ
    torch_values = probes.torch_version_file()
    found = probes.gpus()
    soft, hard = probes.nofile_limits()
    problem, free = probes.loopback(port)
    host, address = probes.hostname_address()
    gpus = max(gpus_counted, len(found.names))
    return [
        torch_check(torch_values, probes.supported_torch()),
        gpu_check(found, torch_values),
        shm_check(probes.shm_usage(), ranks, gpus),
        nofile_check(soft, hard),
        quota_check(quota_mod.cpu_quota(), quota_mod.affinity_count(), os.cpu_count() or 1, default_ranks),
        ptrace_check(probes.ptrace_refused() if tool else None, tool),
        network_check(problem, port, free, host, address),
        slurm_check(environ),
        kernel_cuda_check(initialised, "torch" in sys.modules, cuda_where),
        versions_check({name: probes.package_version(name) for name in
                        ("IPython", "ipykernel", "ipywidgets", "jupyter_client")}
                       | {"python": sys.version.split()[0]}),
        widgets_check(widgets_shown),
    ]
