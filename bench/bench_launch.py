"""accel_magics vs accelerate.notebook_launcher (and torchrun), side by side.

    python bench/bench_launch.py           # every benchmark, table on stdout and in bench/RESULTS.md
    python bench/bench_launch.py --quick   # fewer repetitions
    python bench/bench_launch.py --only ab --ab_base 8fb5e0d --out /tmp/ab.md
                                           # the warm empty 2-rank cell, this tree vs a commit

Real kernels over the Jupyter protocol: one runs ``%%distributed`` cells, the
other the same work through ``notebook_launcher`` (given ACCELERATE_USE_CPU=1
so that it, too, really trains distributed on CPU).  Where both sides run, the
cells alternate A/B so drift hits both.  Times are per cell as a frontend sees
them (execute request to idle) unless a row says it is measured inside the
ranks.  Medians; ratio < 1 means accel_magics is faster.

The ab section compares the package at another commit (--ab_base) with the
working tree's: both installed (not editable) into directories of their own,
one kernel each in this venv, cells alternating; ratio < 1 means this tree
is faster.
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from kernel_harness import KernelSession  # noqa: E402

from accel_magics.kernel_ext.environment import free_port  # noqa: E402

TRAINING_DEFS = '''
import torch
from torch.utils.data import Dataset, DataLoader
from accelerate import Accelerator

class SyntheticImages(Dataset):
    """Small synthetic 'images': class = which quadrant is brightest."""
    def __init__(self, n=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 1, 16, 16, generator=g) * 0.5
        for i, c in enumerate(self.y.tolist()):
            r, q = divmod(c, 2)
            self.x[i, 0, r*8:(r+1)*8, q*8:(q+1)*8] += 1.0
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

def training_loop(epochs=5, lr=3e-3, batch_size=32, seed=42):
    torch.manual_seed(seed)
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4))
    train = DataLoader(SyntheticImages(), batch_size=batch_size, shuffle=True)
    evald = DataLoader(SyntheticImages(128, seed=1), batch_size=batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=epochs, steps_per_epoch=len(train))
    model, opt, train, evald, sched = accelerator.prepare(model, opt, train, evald, sched)
    for epoch in range(epochs):
        model.train()
        for x, y in train:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
        model.eval(); correct = total = 0
        for x, y in evald:
            with torch.no_grad():
                pred = model(x).argmax(1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item(); total += len(y)
        accelerator.print(f"epoch {epoch}: {100 * correct / total:.1f}%")

def empty():
    pass
'''

# The DDP throughput body: the same code runs in a cell and under torchrun.
DDP_BODY = '''
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
def step():
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
for _ in range(20):
    step()
dist.barrier(); t0 = time.perf_counter()
for _ in range(__STEPS__):
    step()
dist.barrier(); elapsed = time.perf_counter() - t0
if dist.get_rank() == 0:
    print(f"DDP_STEPS_PER_S {__STEPS__ / elapsed:.2f}", flush=True)
dist.destroy_process_group()
'''

DDP_GPU_BODY = '''
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
torch.manual_seed(0)
# Small on purpose: a step of well under a millisecond of GPU work, so the
# rank's Python (launch overhead) sets the pace and any CPU the rank's
# surroundings take shows.
model = DDP(torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda(),
            device_ids=[local])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 1024, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
def step():
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
for _ in range(50):
    step()
torch.cuda.synchronize(); dist.barrier(); t0 = time.perf_counter()
for _ in range(__STEPS__):
    step()
torch.cuda.synchronize(); dist.barrier(); elapsed = time.perf_counter() - t0
if dist.get_rank() == 0:
    print(f"DDP_STEPS_PER_S {__STEPS__ / elapsed:.2f}", flush=True)
dist.destroy_process_group()
'''

BIG_DEFS = '''
import numpy as np, torch
big_tensor = torch.ones(128 * 1024 * 1024, dtype=torch.float32)   # 512 MB
big_array = np.ones(64 * 1024 * 1024, dtype=np.float64)           # 512 MB
def use_big():
    import os
    return float(big_tensor[:1000].sum()) + float(big_array[-1000:].sum())
'''


def runall_ours() -> list[str]:
    return ["%load_ext accel_magics"] + [dist(2) + "pass"] * 19
RUNALL_THEIRS = (["import os\nos.environ['ACCELERATE_USE_CPU'] = '1'\nfrom accelerate import notebook_launcher\n"
                  "def empty():\n    pass"] + ["notebook_launcher(empty, num_processes=2)"] * 19)


def run_notebook(cells: list[str]) -> tuple[float, list[float]]:
    """Execute a notebook of ``cells`` with nbclient in a fresh kernel: the
    whole run's seconds, and each cell's after the first (nbclient's timing:
    execute_input to the reply)."""
    import nbclient
    import nbformat
    from datetime import datetime

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=True)
    start = time.perf_counter()
    client.execute()
    took = time.perf_counter() - start

    def at(cell, what):
        return datetime.fromisoformat(cell.metadata.execution[what].replace("Z", "+00:00"))

    per_cell = [(at(c, "shell.execute_reply") - at(c, "iopub.execute_input")).total_seconds() for c in nb.cells[1:]]
    return took, per_cell


class MemWatch:
    """Lowest MemAvailable during a block: the machine's peak extra memory."""

    def __enter__(self):
        self.base = self._available()
        self.low = self.base
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop.wait(0.005):
            self.low = min(self.low, self._available())

    @staticmethod
    def _available() -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak_extra = max(0, self.base - self.low)


def settle(seconds: float) -> None:
    """A pause before timing, as a person makes after a kernel's first cells:
    each launcher moves its heap into huge pages while idle
    (kernel_ext/launcher/hugepages.py), about 1.5 s of CPU each on a VM that
    is slow to hand out fresh pages; timed cells must not share the cores
    with that, nor a reference arm with another kernel's."""
    time.sleep(seconds)


def tree_cpu(k: KernelSession) -> dict:
    """CPU seconds used so far, by part: the kernel itself, its launchers
    themselves, everything the launchers reaped (each run's supervisor with
    the ranks it reaped: a supervisor's own CPU cannot be told from its
    ranks' once it is reaped), and this client.  Their sum is what a cell
    costs the machine, whoever's core it ran on."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(pid: int) -> list[int]:
        with open(f"/proc/{pid}/stat") as f:
            return [int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15]]   # utime stime cutime cstime

    with open(f"/proc/{k.pid}/task/{k.pid}/children") as f:
        launchers = [stat(int(p)) for p in f.read().split()]
    me = os.times()
    return {"kernel": sum(stat(k.pid)[:2]) / tick, "launcher": sum(sum(s[:2]) for s in launchers) / tick,
            "runs": sum(sum(s[2:]) for s in launchers) / tick, "client": me.user + me.system}


def kernel_cpu(k: KernelSession) -> float:
    """CPU seconds the kernel process itself has used (every thread, to the
    nanosecond: schedstat): on a real cluster the one process all nodes
    share, so its work per node is the part of a cell's cost that grows
    with the node count whatever each node's own cores are."""
    total = 0
    for task in os.listdir(f"/proc/{k.pid}/task"):
        try:
            with open(f"/proc/{k.pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):   # a thread that just ended
            pass
    return total / 1e9


def machine_cpu() -> float:
    """CPU seconds every process on this machine has used (all cores, /proc/stat):
    over a cell's window, against cores x its time, how busy the cores were."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(k: KernelSession, code: str, timeout: float = 300) -> float:
    start = time.perf_counter()
    k.ok(code, timeout=timeout)
    return time.perf_counter() - start


def median_ms(xs) -> str:
    return f"{statistics.median(xs) * 1000:.1f} ms"


def machine() -> str:
    import accelerate
    import torch
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), Python "
            f"{platform.python_version()}, torch {torch.__version__}, accelerate {accelerate.__version__}")


def loaded_kernel(env=None) -> KernelSession:
    k = KernelSession(extra_env={"PYTHONUNBUFFERED": "1", **(env or {})})
    k.ok("%load_ext accel_magics")
    k.ok(f"%%distributed -n 2{oversubscribe(2)} --output text\npass\n", timeout=300)
    return k


def dist(nproc: int) -> str:
    """A CPU row's ``%%distributed`` line (with its newline)."""
    return f"%%distributed -n {nproc}{oversubscribe(nproc)} --output text\n"


def oversubscribe(nproc: int) -> str:
    """The flag a CPU row's cell needs on a machine with fewer GPUs than its
    ranks (a one-GPU box refuses 2 ranks otherwise); nothing elsewhere."""
    return " --oversubscribe" if 0 < cuda_devices() < nproc else ""


SECTIONS = ("first", "runall", "ab", "empty", "session", "slurm", "training", "globals", "scale", "output", "ddp",
            "ddp_gpu")
PAUSE = 0.5   # seconds between paced cells: a person's pace is slower still
AB_BASE = "8fb5e0d"   # the commit whose empty 2-rank cell issue 46 measures against


@functools.lru_cache(maxsize=None)
def cuda_devices() -> int:
    """GPUs torch sees, asked in a subprocess: CUDA is never initialised in
    the bench itself (its kernels fork ranks)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
                          "if torch.cuda.is_available() else 0)"], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def ddp_row(ours: KernelSession, row, label: str, template: str, nproc: int, steps: int, rounds: int) -> None:
    """DDP throughput in a cell vs torchrun (measured inside rank 0), with two
    more arms: the same script in ranks that a plain os.fork() of a
    torch-loaded process starts (bench/fork_ranks.py), all in one session, and
    the same with a session per rank, as torchrun starts them (the scheduler's
    autogroups are per session: the difference between the two forks is
    that).  Single runs vary +-15% on a small VM, so the arms alternate
    (A B C D, then D C B A) and each ratio is the median over rounds of the
    per-round ratio."""
    body = template.replace("__STEPS__", str(steps))
    rates = {"cell": [], "torchrun": [], "fork": [], "fork_setsid": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "ddp.py")
        with open(script, "w") as f:
            f.write(body)
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))

        def steps_per_s(out: str) -> float:
            return float(out.split("DDP_STEPS_PER_S")[1].split()[0])

        crashed_after = {"torchrun": 0, "fork": 0, "fork_setsid": 0}

        def run(name: str, cmd: list, **kw) -> str:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
            if "DDP_STEPS_PER_S" not in res.stdout:
                raise RuntimeError(f"{cmd} failed ({res.returncode}):\n{res.stderr[-3000:]}")
            # torch 2.13 sometimes aborts a rank at exit ("terminate
            # called without an active exception"); rank 0 printed its
            # rate after the last barrier, so the measurement is whole.
            crashed_after[name] += res.returncode != 0
            return res.stdout

        arms = {
            "cell": lambda: ours.ok(f"%%distributed -n {nproc}{oversubscribe(nproc)} --output text\n" + body, timeout=600).stdout,
            # torchrun's default port is fixed (29500): a free one each
            # time, so no round depends on that port being free
            "torchrun": lambda: run("torchrun", [sys.executable, "-m", "torch.distributed.run",
                                                 "--nproc_per_node", str(nproc), f"--master_port={free_port()}",
                                                 script], env=env),
            "fork": lambda: run("fork", [sys.executable, os.path.join(HERE, "fork_ranks.py"), str(nproc), script]),
            "fork_setsid": lambda: run("fork_setsid", [sys.executable, os.path.join(HERE, "fork_ranks.py"),
                                                       "--setsid", str(nproc), script]),
        }
        order = list(arms)
        for i in range(rounds):
            for name in (order if i % 2 == 0 else order[::-1]):
                rates[name].append(steps_per_s(arms[name]()))
            print(f"  {label} round {i + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()),
                  flush=True)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    def interval(a: str, b: str) -> str:
        """95% bootstrap interval of that median (fixed seed): how
        finely this machine can tell the arms apart at all."""
        pairs = [x / y for x, y in zip(rates[a], rates[b])]
        rnd = random.Random(0)
        meds = sorted(statistics.median(rnd.choices(pairs, k=len(pairs))) for _ in range(2000))
        return f"95% interval {meds[len(meds) // 40]:.3f}-{meds[len(meds) - 1 - len(meds) // 40]:.3f}"

    med = {k: statistics.median(v) for k, v in rates.items()}
    row(label, f"{med['cell']:.1f} steps/s",
        f"torchrun {med['torchrun']:.1f} steps/s",
        f"{ratio('cell', 'torchrun'):.3f}x ({interval('cell', 'torchrun')}), median of {len(rates['cell'])} "
        f"rounds' ratios (spread: cell "
        f"{min(rates['cell']):.0f}-{max(rates['cell']):.0f}, torchrun {min(rates['torchrun']):.0f}-"
        f"{max(rates['torchrun']):.0f}). Plain os.fork() of a torch-loaded process, same script, ranks in "
        f"one session: {med['fork']:.1f} steps/s, {ratio('fork', 'torchrun'):.3f}x torchrun "
        f"({interval('fork', 'torchrun')}), cell vs that fork {ratio('cell', 'fork'):.3f}x; the same fork with "
        f"a session per rank (as torchrun and the cell start them; sched_autogroup_enabled="
        f"{autogroup_setting()}): {med['fork_setsid']:.1f} steps/s, {ratio('fork_setsid', 'torchrun'):.3f}x "
        f"torchrun, cell vs that fork {ratio('cell', 'fork_setsid'):.3f}x ({interval('cell', 'fork_setsid')})"
        + (". Runs where torch aborted a rank at exit, after measuring: "
           + ", ".join(f"{k} {v}" for k, v in crashed_after.items()) if any(crashed_after.values()) else ""),
        ">= 0.98x torchrun, >= 0.99x the plain fork and the fork with a session per rank (issue 27)",
        ratio("cell", "torchrun") >= 0.98 and ratio("cell", "fork") >= 0.99
        and ratio("cell", "fork_setsid") >= 0.99)


def repo_root() -> str:
    return subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, cwd=HERE,
                          check=True).stdout.strip()


def install_into(src: str, target: str) -> None:
    """A real install of the package in ``src`` into ``target`` (what pip puts
    in site-packages, with kernel_ext/ and widgets/ mapped into
    accel_magics/ by pyproject's package-dir): never editable, no
    dependencies (the venv's torch etc. serve both versions)."""
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", target, src], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"pip install of {src} failed ({res.returncode}):\n"
                           f"{res.stdout[-3000:]}{res.stderr[-3000:]}")


def export_commit(root: str, commit: str, dest: str) -> None:
    """The files of ``commit`` (git archive) extracted into ``dest``."""
    os.mkdir(dest)
    archive = subprocess.Popen(["git", "-C", root, "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")


def build_ab(base: str, tmp: str, tree_commit: str | None = None) -> tuple[str, str, str]:
    """The package at commit ``base`` and the working tree's (tracked and
    untracked files git does not ignore, uncommitted changes included), or
    the package at ``tree_commit`` if given, each installed into a directory
    of its own under ``tmp``: (base's directory, the tree's, the tree's
    name).  Both sources are copies under ``tmp``, so the build leaves
    nothing in the repository."""
    root = repo_root()
    src_a, src_b = os.path.join(tmp, "src-base"), os.path.join(tmp, "src-tree")
    export_commit(root, base, src_a)
    if tree_commit:
        export_commit(root, tree_commit, src_b)
    else:
        files = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                               capture_output=True, check=True).stdout.decode().split("\0")
        for rel in filter(None, files):
            path = os.path.join(root, rel)
            if os.path.isfile(path):   # a tracked file deleted in the tree is not part of it
                os.makedirs(os.path.join(src_b, os.path.dirname(rel)), exist_ok=True)
                shutil.copy2(path, os.path.join(src_b, rel))
    site_a, site_b = os.path.join(tmp, "site-base"), os.path.join(tmp, "site-tree")
    install_into(src_a, site_a)
    install_into(src_b, site_b)
    if tree_commit:
        return site_a, site_b, tree_commit[:7]
    tree = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=7"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return site_a, site_b, tree


def resolve_commit(name: str) -> str | None:
    """The full hash of commit ``name`` in this repository, or None."""
    res = subprocess.run(["git", "-C", repo_root(), "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"],
                         capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def stat_cpu(pid: int) -> float:
    """utime + stime of a process (every thread), from /proc/<pid>/stat, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = (int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def ab_kernel(site: str, cwd: str, nproc: int, history: bool = True) -> KernelSession:
    """A kernel that imports the package from ``site`` only, checked: in the
    kernel and in the ranks its launcher starts.  Its cwd is ``cwd``, not the
    repository (the kernel puts its cwd first on sys.path, and the
    repository's accel_magics/ has no kernel_ext).  ``history=False``: an
    IPython profile of its own with ``HistoryManager.enabled = False`` (no
    history thread writing the cell to SQLite while the cell starts)."""
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": site}
    if not history:
        profile = os.path.join(cwd, f"ipython-{os.path.basename(site)}", "profile_default")
        os.makedirs(profile, exist_ok=True)
        with open(os.path.join(profile, "ipython_config.py"), "w") as f:
            f.write("c.HistoryManager.enabled = False\n")
        env["IPYTHONDIR"] = os.path.dirname(profile)
    k = KernelSession(extra_env=env, cwd=cwd)
    try:
        k.ok("%load_ext accel_magics")
        where = k.ok("import accel_magics, accel_magics.kernel_ext as _ke\n"
                     "print(accel_magics.__file__); print(_ke.__file__)").stdout.split()
        print(f"  kernel {k.pid} imported {where}", flush=True)
        assert where and all(w.startswith(site + os.sep) for w in where), (site, where)
        res = k.ok(dist(nproc) + "import accel_magics.kernel_ext as _ke\nprint('WHERE', _ke.__file__)\n",
                   timeout=300)
        ranks = [line.split("WHERE", 1)[1].strip() for line in res.stdout.splitlines() if "WHERE" in line]
        assert len(ranks) == nproc and all(r.startswith(site + os.sep) for r in ranks), (site, res.stdout)
    except BaseException:
        k.shutdown()
        raise
    return k


#: The A/B rows' person's pause between cells (each kernel idle before its cell).
AB_PAUSE = 0.5


def ab_row(row, base: str, cells: int, pauses=(AB_PAUSE, 0.0), tree_commit: str | None = None,
           history: bool = True, rounds: int = 1) -> None:
    """The warm empty 2-rank cell of the package at ``base`` (A) against the
    working tree's (B): both installed (not editable) into directories of
    their own, one kernel each in the same venv, cells alternating A B A B.
    Per cell: the round trip (execute_request to execute_reply, as the
    "empty cell, 2 ranks, warm" row) and the kernel process's own CPU
    (utime + stime, before and after the cell; a clock tick is 10 ms, so the
    CPU is a mean over the cells, not a median).  One row per pause in
    ``pauses``: cells a person's pause apart (each kernel idle before its cell),
    and back to back (each cell sent as the other kernel's ended, so one
    version's work after a run overlaps the other's cell).  With
    ``tree_commit``, B is the package at that commit instead of the working
    tree (bisecting between two commits).

    ``rounds``: the cells are split over that many pairs of fresh kernels,
    started and run in turn A first, then B first.  Where the scheduler puts
    a kernel's processes stays with them for the pair's life, and one pair's
    ratio can sit a few percent off another's; the row gives the median of
    every round's cells and each round's ratio."""
    full = resolve_commit(base)
    short = full[:7]
    per_round = [cells // rounds + (i < cells % rounds) for i in range(rounds)]
    # side -> pause -> round trips, cell CPU; side -> pause -> whole-loop CPU by part (summed over rounds)
    times = {side: {p: [] for p in pauses} for side in "ab"}
    cpu = {side: {p: [] for p in pauses} for side in "ab"}
    whole = {side: {p: {"kernel": 0.0, "launcher": 0.0, "runs": 0.0} for p in pauses} for side in "ab"}
    ratios = {p: [] for p in pauses}
    with tempfile.TemporaryDirectory(prefix="ab-", dir=os.environ.get("TMPDIR")) as tmp:
        t0 = time.perf_counter()
        site_a, site_b, tree = build_ab(full, tmp, tree_commit and resolve_commit(tree_commit))
        print(f"ab: built {short} and {'commit' if tree_commit else 'the working tree'} ({tree}) in {time.perf_counter() - t0:.1f} s", flush=True)
        cwd = os.path.join(tmp, "cwd")
        os.mkdir(cwd)
        for rnd, n in enumerate(per_round):
            order = ("a", "b") if rnd % 2 == 0 else ("b", "a")
            kernels: dict[str, KernelSession] = {}
            try:
                for side in order:
                    kernels[side] = ab_kernel(site_a if side == "a" else site_b, cwd, 2, history)
                code = dist(2) + "pass\n"
                for _ in range(3):
                    for side in order:
                        timed(kernels[side], code)
                settle(8)
                for pause in pauses:
                    t, c, w = ab_cells([kernels[side] for side in order], code, n, pause)
                    for side in order:
                        pid = kernels[side].pid
                        times[side][pause] += t[pid]
                        cpu[side][pause] += c[pid]
                        for part, value in w[pid].items():
                            whole[side][pause][part] += value * n
                    ratios[pause].append(statistics.median(t[kernels["b"].pid]) / statistics.median(t[kernels["a"].pid]))
            finally:
                for k in kernels.values():
                    k.shutdown()
    for pause in pauses:
        ta, tb = times["a"][pause], times["b"][pause]
        ma, mb = statistics.median(ta), statistics.median(tb)

        def cpu_ms(side: str) -> str:
            parts = {part: value / cells for part, value in whole[side][pause].items()}
            return (f"kernel CPU {statistics.mean(cpu[side][pause]) * 1000:.1f} ms a cell "
                    f"({parts['kernel'] * 1000:.1f} ms counting between cells; launcher "
                    f"{parts['launcher'] * 1000:.1f} ms, supervisor and ranks {parts['runs'] * 1000:.1f} ms a cell)")

        how = f"each {pause:g} s after the last" if pause else "back to back"
        how += "" if history else ", IPython's history off"
        each = (f"; {rounds} pairs of kernels ({'/'.join(map(str, per_round))} cells), each pair's ratio "
                + ", ".join(f"{r:.2f}x" for r in ratios[pause])) if rounds > 1 else ""
        row(f"empty cell, 2 ranks, warm, {how}: A/B against {short}",
            f"this tree ({tree}) {median_ms(tb)}, {cpu_ms('b')}",
            f"{short} {median_ms(ta)}, {cpu_ms('a')}",
            f"{mb / ma:.2f}x; {cells} cells each, alternating (spread: this tree {min(tb) * 1000:.1f}-"
            f"{max(tb) * 1000:.1f} ms, {short} {min(ta) * 1000:.1f}-{max(ta) * 1000:.1f} ms){each}; "
            "both installed, same venv", f"<= 1.0x {short}", mb <= ma)


def ab_cells(kernels, code: str, cells: int, pause: float):
    """``cells`` alternating cells per kernel, each ``pause`` seconds after the
    one before: per kernel pid, the round trips, the CPU of each cell, and the
    CPU per cell over the whole loop by part (tree_cpu's, less this client:
    the kernel, its launcher, the supervisors and ranks the launcher reaped)."""
    times = {k.pid: [] for k in kernels}
    cpu = {k.pid: [] for k in kernels}
    start = {k.pid: tree_cpu(k) for k in kernels}
    for _ in range(cells):
        for k in kernels:
            if pause:
                time.sleep(pause)
            before = stat_cpu(k.pid)
            times[k.pid].append(timed(k, code))
            cpu[k.pid].append(stat_cpu(k.pid) - before)
    whole = {}
    for k in kernels:
        end = tree_cpu(k)
        whole[k.pid] = {part: (end[part] - start[k.pid][part]) / cells for part in ("kernel", "launcher", "runs")}
    return times, cpu, whole


def autogroup_setting() -> str:
    """The kernel's autogroup switch: 1 groups processes by session for
    scheduling, which is why a rank's session matters for its speed."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip()
    except OSError:
        return "absent"


def main() -> None:
    # A scratch directory of the bench's own, removed at the end: the kernels'
    # run logs go there (not to the user's ~/.cache/accel_magics/runs), and it
    # is the temp dir of everything the bench starts, because torchrun and
    # notebook_launcher (torchelastic) leave a directory behind per run.
    with tempfile.TemporaryDirectory(prefix="accel_magics-bench-") as scratch:
        os.environ.setdefault("ACCEL_MAGICS_LOG_DIR", os.path.join(scratch, "logs"))
        os.environ["TMPDIR"] = os.path.join(scratch, "tmp")
        os.mkdir(os.environ["TMPDIR"])
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="where to write the table (default: bench/RESULTS.md, "
                                                    "or nowhere with --only)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of the DDP rows (default 14, 4 with --quick)")
    parser.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(SECTIONS))
    parser.add_argument("--ab_base", default=AB_BASE, help=f"the commit the ab section measures the working "
                                                           f"tree against (default {AB_BASE})")
    parser.add_argument("--ab_tree", default="", help="a commit to measure instead of the working tree in the "
                                                      "ab section (bisecting between two commits)")
    parser.add_argument("--ab_pauses", default="", help=f"comma-separated pauses between cells of the ab "
                                                        f"section, in seconds (default {AB_PAUSE:g},0: paced and "
                                                        f"back to back)")
    parser.add_argument("--ab_cells", type=int, default=0, help="cells per side in the ab section "
                                                                "(default 60, 10 with --quick)")
    parser.add_argument("--ab_rounds", type=int, default=1, help="pairs of fresh kernels the ab section's cells "
                        "are split over, A first then B first in turn (default 1)")
    parser.add_argument("--ab_no_history", action="store_true", help="the ab section's kernels without IPython's "
                        "history (HistoryManager.enabled = False): its thread writes each cell to SQLite as the "
                        "cell starts and takes the GIL wherever the magic first waits on a system call")
    args = parser.parse_args()
    reps = 5 if args.quick else 15
    chosen = set(filter(None, args.only.split(",")))
    if chosen - set(SECTIONS):
        parser.error(f"--only: unknown {sorted(chosen - set(SECTIONS))}; choose from {', '.join(SECTIONS)}")

    ab_missing = not resolve_commit(args.ab_base)
    if "ab" in chosen and ab_missing:
        parser.error(f"--ab_base: {args.ab_base!r} is not a commit of this repository")
    if args.ab_tree and not resolve_commit(args.ab_tree):
        parser.error(f"--ab_tree: {args.ab_tree!r} is not a commit of this repository")

    out_path = args.out or (None if chosen else os.path.join(HERE, "RESULTS.md"))

    def want(name: str) -> bool:
        return not chosen or name in chosen

    tail_runs = 50 if args.quick else 200
    rows: list[tuple] = []   # (benchmark, accel_magics, reference, ratio, target, met)

    def row(name, ours, ref, ratio, target, met):
        rows.append((name, ours, ref, ratio, target, "yes" if met else "NO"))
        print(f"{name}: {ours} | {ref} | {ratio} | target {target} | met: {met}", flush=True)

    if want("first"):
        # 2. First distributed cell in a fresh kernel vs `import torch`.
        imports, firsts = [], []
        for _ in range(2 if args.quick else 3):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import torch"], check=True)
            imports.append(time.perf_counter() - t)
            k = KernelSession(extra_env={"PYTHONUNBUFFERED": "1"})
            t = time.perf_counter()
            k.ok("%load_ext accel_magics")
            k.ok(dist(2) + "pass\n", timeout=300)
            firsts.append(time.perf_counter() - t)
            k.shutdown()
        fi, im = statistics.median(firsts), statistics.median(imports)
        row("first cell in a fresh kernel (load_ext + launcher start + 2-rank run)", f"{fi:.2f} s",
            f"`import torch` {im:.2f} s", f"{fi - im:+.2f} s", "<= import torch + 0.5 s", fi <= im + 0.5)

    if want("runall"):
        # "Run All": a 20-cell notebook executed by nbclient (as nbconvert,
        # papermill and nbval do: each cell sent as the last one ended), in a
        # fresh kernel; ours vs the same notebook with notebook_launcher
        # cells, alternating.  Whole notebook (kernel start included) and the
        # median cell from nbclient's own timing.
        a, b, ca, cb = [], [], [], []
        for _ in range(2 if args.quick else 3):
            for cells, totals, per_cell in ((runall_ours(), a, ca), (RUNALL_THEIRS, b, cb)):
                took, cell_times = run_notebook(cells)
                totals.append(took)
                per_cell.extend(cell_times)
        ta, tb = statistics.median(a), statistics.median(b)
        row("\"Run All\" of a 20-cell notebook (nbclient, fresh kernel: a set-up cell, then 19 empty 2-rank "
            "cells)", f"{ta:.2f} s, median cell {median_ms(ca)}",
            f"notebook_launcher {tb:.2f} s, median cell {median_ms(cb)}",
            f"{ta / tb:.2f}x the notebook; median cell {statistics.median(ca) / statistics.median(cb):.2f}x",
            "faster than notebook_launcher, median cell <= 0.5x",
            ta < tb and statistics.median(ca) <= 0.5 * statistics.median(cb))

    if want("ab"):
        # The empty 2-rank cell of the package at --ab_base against the working tree's, A/B.
        if ab_missing:
            print(f"ab: skipped ({args.ab_base} is not a commit of this checkout: a shallow clone?)", flush=True)
        else:
            pauses = tuple(float(p) for p in args.ab_pauses.split(",")) if args.ab_pauses else (AB_PAUSE, 0.0)
            ab_row(row, args.ab_base, args.ab_cells or (10 if args.quick else 60), pauses, args.ab_tree or None,
                   history=not args.ab_no_history, rounds=max(1, args.ab_rounds))

    if not any(want(s) for s in SECTIONS[SECTIONS.index("empty"):]):
        write_table(rows, args, out_path)
        return
    ours = loaded_kernel()
    theirs = KernelSession(extra_env={"PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1"})
    try:
        ours.ok(TRAINING_DEFS)
        theirs.ok(TRAINING_DEFS + "\nfrom accelerate import notebook_launcher\n")
        settle(8)

        if want("empty"):
            # 1. Empty cell, warm, A/B; then the tail over many runs.
            a_code, b_code = dist(2) + "pass\n", "notebook_launcher(empty, num_processes=2)\n"
            timed(ours, a_code), timed(theirs, b_code)
            a, b = [], []
            for _ in range(max(reps, 10)):
                a.append(timed(ours, a_code))
                b.append(timed(theirs, b_code))
            ma, mb = statistics.median(a), statistics.median(b)
            row("empty cell, 2 ranks, warm", median_ms(a), f"notebook_launcher {median_ms(b)}", f"{ma / mb:.2f}x",
                "<= 0.1x", ma / mb <= 0.1)
            # Back to back: each cell sent the moment the last one ended, as
            # "Run All", nbval, papermill and nbconvert do; against the same
            # cell after a pause (PAUSE), in alternating blocks.
            for n in (2, 8):
                code = f"%%distributed -n {n} --output text --oversubscribe\npass\n"
                timed(ours, code), timed(ours, code)
                paced, b2b, parts = [], [], dict.fromkeys(("kernel", "launcher", "runs", "client"), 0.0)
                for _ in range(4 if args.quick else 8):
                    for _ in range(5):
                        time.sleep(PAUSE)
                        paced.append(timed(ours, code))
                    before = tree_cpu(ours)   # each block misses its first cell's exit and has the one before
                    b2b += [timed(ours, code) for _ in range(tail_runs // 8)]
                    for part, used in tree_cpu(ours).items():
                        parts[part] += used - before[part]
                cpu = sum(parts.values())
                split = ", ".join(f"{name} {parts[part] / len(b2b) * 1000:.0f}" for part, name in (
                    ("kernel", "kernel"), ("launcher", "launcher"), ("runs", "supervisor and ranks"),
                    ("client", "this client")))
                mp, mt = statistics.median(paced), statistics.median(b2b)
                cores = os.cpu_count() or 1
                row(f"empty cell back to back ({len(b2b)} cells, each sent as the last one ended), {n} ranks",
                    f"median {mt * 1000:.1f} ms, max {max(b2b) * 1000:.1f} ms",
                    f"the same cell {PAUSE:g} s after the last: {mp * 1000:.1f} ms",
                    f"{mt / mp:.2f}x; max/median {max(b2b) / mt:.1f}; CPU a cell, every process: "
                    f"{cpu / len(b2b) * 1000:.0f} ms ({split}) on {cores} cores, so back to back at least "
                    f"{cpu / len(b2b) / cores * 1000:.0f} ms", "<= 1.5x the paced cell, none > 3x median",
                    mt <= 1.5 * mp and max(b2b) <= 3 * mt)

        if want("session"):
            # 8. A trivial cell on persistent ranks: a session cell vs ipyparallel's
            # %%px on 2 engines that stay up (its cluster started once, as a user does).
            ours.ok("%distributed_session start -n 2")
            px = KernelSession(extra_env={"PYTHONUNBUFFERED": "1"})
            try:
                px.ok("import ipyparallel as ipp\ncluster = ipp.Cluster(n=2, log_level=40)\n"
                      "rc = cluster.start_and_connect_sync(activate=True)\nrc.wait_for_engines(2, timeout=120)",
                      timeout=300)
                a_code, b_code = "%%distributed --session --output text\npass\n", "%%px\npass\n"
                for _ in range(3):
                    timed(ours, a_code), timed(px, b_code)
                a, b = [], []
                for _ in range(max(reps, 20)):
                    a.append(timed(ours, a_code))
                    b.append(timed(px, b_code))
                ma, mb = statistics.median(a), statistics.median(b)
                row("trivial session cell, 2 persistent ranks", median_ms(a), f"ipyparallel %%px, 2 engines "
                    f"{median_ms(b)}", f"{ma / mb:.2f}x", "<= 1.0x (no slower)", ma / mb <= 1.0)
            finally:
                try:
                    px.ok("cluster.stop_cluster_sync()", timeout=120)
                finally:
                    px.shutdown()
                ours.ok("%distributed_session stop")

        if want("slurm"):
            # 9. A warm cell on a 2-node Slurm allocation (tests/slurm_cluster.py: slurmctld and two
            # slurmd on this machine), 2 ranks per node, vs a one-node warm 2-rank cell, A/B.
            from slurm_cluster import SlurmCluster, missing

            why = missing()
            if why:
                print(f"slurm: skipped ({why})", flush=True)
            else:
                cluster = SlurmCluster(nodes=8, cpus=2)
                try:
                    alloc = cluster.allocate(2)
                    # A kernel per arm, so each launcher keeps the spare its arm needs (2 or 4 ranks).
                    sk = KernelSession(extra_env={"PYTHONUNBUFFERED": "1", **alloc})
                    k4, k2 = loaded_kernel(), loaded_kernel()
                    try:
                        sk.ok("%load_ext accel_magics")
                        arms = [(sk, "%%distributed --launcher slurm -n 2 --output text\npass\n", []),
                                (k4, dist(4) + "pass\n", []),
                                (k2, dist(2) + "pass\n", [])]
                        first = timed(sk, arms[0][1], 300)
                        for k, code, _ in arms:
                            timed(k, code), timed(k, code)
                        settle(6)
                        for _ in range(max(reps, 10)):
                            # Cells 1 s apart, as a person runs them: each launcher has its next
                            # run's processes forked ahead, for every arm alike.
                            for k, code, times in arms:
                                time.sleep(1.0)
                                times.append(timed(k, code))
                        ma, mc, mb = (statistics.median(times) for _, _, times in arms)
                        row("second cell on a 2-node Slurm allocation (2 ranks per node: a world of 4), warm, "
                            "cells 1 s apart; both nodes share this machine's cores", median_ms(arms[0][2]),
                            f"one-node warm cell: 4 ranks {median_ms(arms[1][2])}, 2 ranks {median_ms(arms[2][2])}",
                            f"{ma / mc:.2f}x the 4-rank cell, {ma / mb:.2f}x the 2-rank one (first cell, agents "
                            f"starting: {first:.1f} s)", "<= 2x a one-node warm cell of the same world", ma / mc <= 2)
                    finally:
                        sk.shutdown()
                        k4.shutdown()
                        k2.shutdown()
                        cluster.release(alloc["SLURM_JOB_ID"])
                    # The cost per node: 2, 4 and 8 nodes of one rank each, against one
                    # node with the same world (all on this machine's cores), A/B.
                    per_node, kernel_per_node, cores_busy = {}, {}, {}
                    for nodes in (2, 4, 8):
                        alloc = cluster.allocate(nodes)
                        sk = KernelSession(extra_env={"PYTHONUNBUFFERED": "1", **alloc})
                        lk = loaded_kernel()
                        try:
                            sk.ok("%load_ext accel_magics")
                            arms = [(sk, "%%distributed --launcher slurm -n 1 --output text\npass\n", []),
                                    (lk, f"%%distributed -n {nodes} --output text --oversubscribe\npass\n", [])]
                            for k, code, _ in arms:
                                timed(k, code, 300), timed(k, code), timed(k, code)
                            settle(4 + 2 * nodes)
                            kcpu, busy = {sk: [], lk: []}, {sk: 0.0, lk: 0.0}
                            for _ in range(max(reps, 10)):
                                for k, code, times in arms:
                                    time.sleep(1.0)
                                    before, machine_before = kernel_cpu(k), machine_cpu()
                                    times.append(timed(k, code))
                                    kcpu[k].append(kernel_cpu(k) - before)
                                    busy[k] += machine_cpu() - machine_before
                            per_node[nodes] = tuple(statistics.median(times) for _, _, times in arms)
                            kernel_per_node[nodes] = (statistics.median(kcpu[sk]), statistics.median(kcpu[lk]))
                            cores_busy[nodes] = tuple(busy[k] / sum(times) for k, _, times in arms)
                        finally:
                            sk.shutdown()
                            lk.shutdown()
                            cluster.release(alloc["SLURM_JOB_ID"])
                    slope = (per_node[8][0] - per_node[2][0]) / 6
                    kslope = (kernel_per_node[8][0] - kernel_per_node[2][0]) / 6
                    ms = lambda xs: " / ".join(f"{x * 1000:.1f}" for x in xs)   # noqa: E731
                    row("a warm --launcher slurm cell on 2 / 4 / 8 nodes of one rank each, cells 1 s apart; "
                        "every node shares this machine's 2 cores",
                        ms(per_node[n][0] for n in (2, 4, 8)) + " ms",
                        "one node, same world: " + ms(per_node[n][1] for n in (2, 4, 8)) + " ms",
                        " / ".join(f"{per_node[n][0] / per_node[n][1]:.2f}x" for n in (2, 4, 8))
                        + f"; {slope * 1000:.1f} ms per added node. The kernel's own CPU a cell: "
                        + ms(kernel_per_node[n][0] for n in (2, 4, 8)) + " ms (one node: "
                        + ms(kernel_per_node[n][1] for n in (2, 4, 8)) + f" ms), {kslope * 1000:.2f} ms per added "
                        "node; cores busy during the cell (every process): "
                        + " / ".join(f"{cores_busy[n][0]:.1f}" for n in (2, 4, 8)) + " (one node: "
                        + " / ".join(f"{cores_busy[n][1]:.1f}" for n in (2, 4, 8)) + f") of {os.cpu_count()}",
                        "8 nodes <= 1.5x one node", per_node[8][0] <= 1.5 * per_node[8][1])
                finally:
                    cluster.stop()

        if want("training"):
            # 3. The Accelerate training cell, A/B.
            a_code, b_code = (dist(2) + "training_loop()\n",
                              "notebook_launcher(training_loop, num_processes=2)\n")
            timed(ours, a_code), timed(ours, a_code), timed(theirs, b_code)
            a, b = [], []
            for _ in range(reps):
                a.append(timed(ours, a_code))
                b.append(timed(theirs, b_code))
            ma, mb = statistics.median(a), statistics.median(b)
            row("Accelerate training cell (5 epochs, synthetic), 2 ranks", median_ms(a),
                f"notebook_launcher {median_ms(b)}", f"{ma / mb:.2f}x", "<= 0.6x", ma / mb <= 0.6)

        if want("globals"):
            # 6. 512 MB tensor + 512 MB numpy array in kernel globals, 4 ranks, used by
            # cell after cell (kept in shared memory while unchanged), and changed
            # before a cell (one element: the kept memory is updated in place, as
            # no rank maps it between cells).
            ours.ok(BIG_DEFS)
            theirs.ok(BIG_DEFS)
            big_a = dist(4) + "use_big()\n"
            big_b = "notebook_launcher(use_big, num_processes=4)\n"
            change = "big_array[0] += 1\n"
            with MemWatch() as first_mem:
                t_first = timed(ours, big_a, 600)
            timed(theirs, big_b, 600)
            for label, prefix in (("used by two cells in a row (the second timed)", ""),
                                  ("changed before the cell (big_array[0] += 1: the chunk that differs is written in place)", change)):
                runs = []
                for _ in range(3):
                    if prefix:
                        ours.ok(prefix)
                        theirs.ok(prefix)
                    with MemWatch() as ma_mem:
                        ta = timed(ours, big_a, 600)
                    with MemWatch() as mb_mem:
                        tb = timed(theirs, big_b, 600)
                    runs.append((ta, tb, ma_mem.peak_extra, mb_mem.peak_extra))
                ta = statistics.median(r[0] for r in runs)
                tb = statistics.median(r[1] for r in runs)
                mem_a = statistics.median(r[2] for r in runs) / 2**20
                mem_b = statistics.median(r[3] for r in runs) / 2**20
                data, target = 1024, 0.25
                row(f"1 GB of globals (512 MB tensor + 512 MB array), 4 ranks, {label}: time", f"{ta:.2f} s",
                    f"notebook_launcher {tb:.2f} s", f"{ta / tb:.2f}x", "<= 1.0x notebook_launcher", ta <= tb)
                row("... peak extra memory (machine-wide)", f"{mem_a:.0f} MB ({mem_a / 1024:.2f}x the data)",
                    f"notebook_launcher {mem_b:.0f} MB", "-", f"<= {target}x the data",
                    mem_a <= target * data)
            row("... the first cell that uses them (written into shared memory)", f"{t_first:.2f} s, "
                f"{first_mem.peak_extra / 2**20:.0f} MB extra", "-", "-", "none (kept for later cells)", True)
            ours.ok("del big_tensor, big_array")
            theirs.ok("del big_tensor, big_array")

        if want("scale"):
            # 7. Scale: empty cell on 1, 2, 4, 8 ranks.
            scale = {}
            for n in (1, 2, 4, 8):
                code = f"%%distributed -n {n} --output text --oversubscribe\npass\n"
                timed(ours, code), timed(ours, code)
                scale[n] = statistics.median(timed(ours, code) for _ in range(reps))
            per_rank = [(scale[8] - scale[4]) / 4, (scale[4] - scale[2]) / 2, scale[2] - scale[1]]
            row("empty cell on 1/2/4/8 ranks", " / ".join(f"{scale[n] * 1000:.0f}" for n in (1, 2, 4, 8)) + " ms",
                "-", f"per extra rank {per_rank[2] * 1000:.1f} / {per_rank[1] * 1000:.1f} / {per_rank[0] * 1000:.1f} ms",
                "linear or better", per_rank[0] <= 2 * max(per_rank[2], per_rank[1]) + 0.005)

        if want("output"):
            # 5. Output: 2 ranks x 200k lines.  Both ranks write to a file, then
            # print, in step (a barrier before each phase, so both phases see
            # the same contention), seven times; per rank, median print time
            # over median file time.
            lines, rounds = 200_000, 7
            code = (dist(2) + ""
                    "import os, sys, time, tempfile, statistics, torch.distributed as dist\n"
                    "dist.init_process_group('gloo')\n"
                    f"N, ROUNDS = {lines}, {rounds}\n"
                    "rank = os.environ['RANK']\n"
                    "files, prints = [], []\n"
                    "for r in range(ROUNDS):\n"
                    "    with tempfile.TemporaryFile('w') as f:\n"
                    "        dist.barrier(); t = time.perf_counter()\n"
                    "        for i in range(r * N, (r + 1) * N):\n"
                    "            print(f'line {i} of rank {rank}', file=f)\n"
                    "        f.flush(); files.append(time.perf_counter() - t)\n"
                    "    dist.barrier(); t = time.perf_counter()\n"
                    "    for i in range(r * N, (r + 1) * N):\n"
                    "        print(f'line {i} of rank {rank}')\n"
                    "    sys.stdout.flush(); prints.append(time.perf_counter() - t)\n"
                    "dist.barrier()\n"
                    "print(f'SLOWDOWN {statistics.median(prints) / statistics.median(files):.3f}', file=sys.stderr)\n"
                    "dist.destroy_process_group()\n")
            worsts, rates, complete = [], [], True
            for _ in range(3 if args.quick else 5):
                res = ours.run(code, timeout=600)
                slowdowns = [float(line.split()[-1]) for line in res.stdout.splitlines() if "SLOWDOWN" in line]
                worsts.append(max(slowdowns) if len(slowdowns) == 2 else float("nan"))
                msgs = sum(1 for m in res.messages
                           if m["msg_type"] in ("stream", "display_data", "update_display_data"))
                took = (res.messages[-1]["header"]["date"] - res.messages[0]["header"]["date"]).total_seconds()
                rates.append((msgs, took))
                logs = ours.ok("from accel_magics.run_logs import log_root\nimport os\n"
                               "d = sorted(os.listdir(log_root()))[-1]\n"
                               "print(os.path.join(log_root(), d))").stdout.strip()
                for rank in (0, 1):
                    with open(os.path.join(logs, f"rank{rank}.log")) as f:
                        got = [ln.rstrip("\n") for ln in f if ln.startswith("line ")]
                    complete &= got == [f"line {i} of rank {rank}" for i in range(rounds * lines)]
            worst = statistics.median(worsts)
            msgs, took = max(rates, key=lambda r: r[0] / max(r[1], 1))
            row(f"output: 2 ranks x {lines // 1000}k lines ({rounds} rounds)", f"rank slowdown vs a file {worst:.2f}x",
                "-", f"median of {len(worsts)} runs (spread {min(worsts):.2f}-{max(worsts):.2f}); at most {msgs} "
                f"frontend messages in {took:.1f} s; every line, in order, in every run: {complete}",
                "<= 1.2x, bounded rate, complete",
                worst <= 1.2 and complete and all(m / max(t, 1) < 50 for m, t in rates))

        if want("ddp"):
            ddp_row(ours, row, "DDP training throughput (inside rank 0)", DDP_BODY, nproc=2,
                    steps=100 if args.quick else 300, rounds=args.rounds or (4 if args.quick else 14))
        if want("ddp_gpu"):
            gpus = cuda_devices()
            if not gpus:
                print("ddp_gpu: skipped, torch sees no CUDA device here", flush=True)
            else:
                ddp_row(ours, row, f"DDP training throughput on {gpus} GPU(s), NCCL (inside rank 0)", DDP_GPU_BODY,
                        nproc=gpus, steps=500 if args.quick else 2000, rounds=args.rounds or (4 if args.quick else 14))
    finally:
        ours.shutdown()
        theirs.shutdown()
    write_table(rows, args, out_path)


def write_table(rows: list, args, out_path) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    out = [
        "# Benchmarks: accel_magics vs accelerate.notebook_launcher and torchrun",
        "",
        f"Machine: {machine()}. Commit {commit}. Command: `python bench/bench_launch.py"
        f"{' --quick' if args.quick else ''}{f' --only {args.only}' if args.only else ''}"
        f"{f' --ab_base {args.ab_base}' if args.ab_base != AB_BASE else ''}"
        f"{f' --ab_tree {args.ab_tree}' if args.ab_tree else ''}"
        f"{f' --ab_pauses {args.ab_pauses}' if args.ab_pauses else ''}"
        f"{f' --ab_cells {args.ab_cells}' if args.ab_cells else ''}{' --ab_no_history' if args.ab_no_history else ''}"
        f"{f' --ab_rounds {args.ab_rounds}' if args.ab_rounds > 1 else ''}`.",
        "Real kernels over the Jupyter protocol; A/B rows alternate cell by cell; medians.",
        "Ratio < 1: accel_magics is faster (for throughput, > 1 is better).",
        "",
        "| benchmark | accel_magics | reference | ratio / detail | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    out += [f"| {' | '.join(str(c) for c in r)} |" for r in rows]
    text = "\n".join(out) + "\n"
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
