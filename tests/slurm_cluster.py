"""A real two-node Slurm cluster on this one machine, for the Slurm tests.

Debian's ``slurmctld``, ``slurmd`` and ``munge`` (``apt-get install
--no-install-recommends slurmctld slurmd slurm-client munge``): one munged,
one slurmctld and two slurmd (``-N n1``, ``-N n2``, each on its own port),
with every file (config, state, spool, logs, pid files, the munge key and
socket) in one temporary directory, stopped by PID and removed at the end.
Both "nodes" share this host's network namespace: same address, same
hostname; they are told apart by ``SLURM_NODEID`` / ``SLURMD_NODENAME``.
See ../shared/SLURM-NOTES.md for the measured facts this relies on.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "squeue", "scancel")


def missing() -> Optional[str]:
    """Why a cluster cannot be started here (None: it can)."""
    for tool in DAEMONS:
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return (f"{tool} is not installed (apt-get install --no-install-recommends slurmctld slurmd "
                    "slurm-client munge)")
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root (SlurmUser=root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Not gone and not a zombie (PID 1 here reaps orphans only every few seconds)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class SlurmCluster:
    """``SlurmCluster(nodes=2)``: up on construction; ``stop()`` tears it down."""

    def __init__(self, nodes: int = 2, cpus: int = 2) -> None:
        self.dir = tempfile.mkdtemp(prefix="accel-slurm-")
        os.chmod(self.dir, 0o711)   # munged wants its socket's directory reachable (not 700)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.pids: list[int] = []
        try:
            self._munge()
            self._config(cpus)
            self._start([self._sbin("slurmctld"), "-f", self.conf], "slurmctld.pid")
            for node in self.nodes:
                self._start([self._sbin("slurmd"), "-f", self.conf, "-N", node], f"slurmd.{node}.pid")
            self._wait_idle()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _sbin(name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def _munge(self) -> None:
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(self.dir, "munge.socket.2")
        pidfile = os.path.join(self.dir, "munged.pid")
        subprocess.run([self._sbin("munged"), f"--key-file={key}", f"--socket={self.munge_socket}",
                        f"--pid-file={pidfile}", f"--log-file={os.path.join(self.dir, 'munged.log')}",
                        f"--seed-file={os.path.join(self.dir, 'munged.seed')}", "--force"],
                       check=True, capture_output=True, timeout=30)
        self._wait_pidfile(pidfile)

    def _config(self, cpus: int) -> None:
        d = self.dir
        host = socket.gethostname()
        lines = [
            "ClusterName=accel", "SlurmctldHost=localhost", f"SlurmctldPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}", f"StateSaveLocation={d}/ctld", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2", "InactiveLimit=0",
            "KillWait=5", "MinJobAge=30", "MailProg=/bin/true",
            # Job ids of its own: tests tell their processes apart by SLURM_JOB_ID, and two
            # clusters on one machine (two test sessions) would both start at job 1.
            f"FirstJobId={random.randrange(1000, 60_000_000)}",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={cpus} RealMemory=2000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        for sub in ("ctld", "spool"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start(self, argv: list[str], pidfile: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, env=self.env, timeout=30)
        self._wait_pidfile(os.path.join(self.dir, pidfile))

    def _wait_pidfile(self, path: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(path) as f:
                    pid = int(f.read().strip())
                self.pids.append(pid)
                return
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path} did not appear: {self.logs()}") from None
                time.sleep(0.02)

    def _wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes did not become idle: {states}\n{self.logs()}")
            time.sleep(0.05)

    def run(self, argv: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout, **kw)

    def allocate(self, nodes: int = 2) -> dict:
        """An allocation (``salloc --no-shell``): the environment a kernel started
        inside it has (SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_CONF)."""
        res = self.run(["salloc", "-N", str(nodes), "--no-shell", "-J", "accel-test"])
        job = None
        for line in (res.stdout + res.stderr).splitlines():
            if "Granted job allocation" in line:
                job = line.split()[-1]
        if job is None:
            raise RuntimeError(f"salloc failed: {res.stdout} {res.stderr}")
        show = self.run(["scontrol", "show", "job", job, "-o"]).stdout
        fields = dict(item.split("=", 1) for item in show.split() if "=" in item)
        return {"SLURM_CONF": self.conf, "SLURM_JOB_ID": job, "SLURM_JOBID": job,
                "SLURM_JOB_NODELIST": fields["NodeList"], "SLURM_NNODES": fields["NumNodes"].split("-")[0],
                "SLURM_JOB_NUM_NODES": fields["NumNodes"].split("-")[0]}

    def steps(self, job: str) -> list[str]:
        """The job's running steps (``squeue -s``)."""
        out = self.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"]).stdout.split()
        return [s for s in out if not s.endswith((".batch", ".extern", ".interactive"))]

    def release(self, job: str) -> None:
        self.run(["scancel", job])

    def logs(self) -> str:
        text = []
        for name in sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []:
            if name.endswith(".log"):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    text.append(f"--- {name}\n" + "".join(f.readlines()[-20:]))
        return "\n".join(text)

    def stop(self) -> None:
        """Every daemon by PID (slurmd first), their step daemons, then the directory."""
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(alive(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self.pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        # Step daemons of this cluster (a step that outlived its slurmd, then
        # waited for ever for a slurmctld that is gone).  slurmstepd rewrites
        # its command line to "slurmstepd: [job.step]": it is known by the
        # SLURM_CONF in its environment, which names this cluster's directory.
        ours = f"SLURM_CONF={self.conf}".encode()
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read()
                    if not cmd.startswith(b"slurmstepd"):
                        continue
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if ours not in f.read().split(b"\0"):
                            continue
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    continue
        shutil.rmtree(self.dir, ignore_errors=True)
