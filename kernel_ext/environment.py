"""The launch topology and the environment each rank sees (torchrun's contract).

Pure functions: no processes, no torch import.  ``LaunchConfig`` is validated
here so every caller (the magic, the config form, tests) gets the same rules
and the same messages, before anything is launched.
"""
from __future__ import annotations

import collections.abc
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from .cpu_quota import effective_cpus
from .options import DEFAULT_MULTINODE_PORT, DEFAULTS, MIXED_PRECISION_CHOICES  # noqa: F401 (re-exported)

MAX_RESTARTS = 1000
MAX_SECONDS = 10_000_000          # ~116 days: longer "timeouts" are mistakes (and overflow timers)


class ConfigError(ValueError):
    """A launch option that cannot work; the message says what to do."""


@dataclass
class LaunchConfig:
    num_processes: int
    # The defaults are the options table's (options.py), the one place they are written.
    num_nodes: int = DEFAULTS["num_nodes"]
    node_rank: int = DEFAULTS["node_rank"]
    master_addr: str = DEFAULTS["master_addr"]
    master_port: Optional[int] = None     # None: a fresh free port per run
    max_restarts: int = DEFAULTS["max_restarts"]
    mixed_precision: Optional[str] = None
    timeout: Optional[float] = None
    rendezvous_timeout: float = DEFAULTS["rendezvous_timeout"]   # how long nodes wait for each other
    stall_timeout: float = DEFAULTS["stall_timeout"]   # idle this long after another rank finished: stuck
    debug_hold: float = DEFAULTS["debug_hold"]   # a failed rank is kept this long for %distributed_debug (0: not)
    rendezvous_key: Optional[str] = None   # kernel per node: signs the failures the nodes tell each other
    extra_env: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.num_processes + local_rank

    @property
    def local_ranks(self) -> range:
        return range(self.num_processes)


def cpu_count() -> int:
    """The CPUs this process may use: its affinity capped by its cgroup's CPU
    quota (a container's ``--cpus``), not the host's cores (cpu_quota)."""
    return effective_cpus()


def _visible_devices(cfg: LaunchConfig, kernel_env=None) -> Optional[str]:
    """The ``CUDA_VISIBLE_DEVICES`` the ranks will have, or None where unset:
    the run's own (an Accelerate config file's ``gpu_ids``) wins over the
    kernel's current environment, which the ranks inherit."""
    if "CUDA_VISIBLE_DEVICES" in cfg.extra_env:
        return str(cfg.extra_env["CUDA_VISIBLE_DEVICES"])
    return (kernel_env or {}).get("CUDA_VISIBLE_DEVICES")


def visible_gpus(gpu_count: int, cfg: LaunchConfig, kernel_env=None) -> int:
    """How many of the ``gpu_count`` GPUs the launcher counted the ranks see.

    The launcher counts once, at its start, with the kernel's environment of
    then.  A ``CUDA_VISIBLE_DEVICES`` the ranks get later (set in the kernel
    afterwards, or from an Accelerate config's ``gpu_ids``) can hide some or
    all of them: rank i must not be put on GPU i it cannot see (CUDA's
    "invalid device ordinal"), and with none visible the run is a CPU run
    (``ACCELERATE_USE_CPU``).  CUDA's rule: the devices listed before the
    first invalid entry (empty, or negative such as ``-1``); never more than
    the launcher counted (it cannot tell more from an index list).
    """
    value = _visible_devices(cfg, kernel_env)
    if value is None or not gpu_count:
        return gpu_count
    listed = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        listed += 1
    return min(listed, gpu_count)


def validate(cfg: LaunchConfig, *, gpu_count: int = 0, allow_oversubscribe: bool = False,
             check_port: bool = True, kernel_env=None) -> None:
    """Raise ConfigError for a configuration that cannot run here.

    Checks are cheap and local: nothing is bound except when a port is given
    explicitly for a single-node run (then it must be free now).  ``gpu_count``
    is what the launcher counted; what the ranks see of it counts
    (:func:`visible_gpus`, ``kernel_env``: the environment they inherit).
    """
    if cfg.num_processes < 1:
        raise ConfigError(f"--num_processes must be at least 1 (got {cfg.num_processes}).")
    visible = visible_gpus(gpu_count, cfg, kernel_env)
    if not allow_oversubscribe:
        if visible:
            if cfg.num_processes > visible:
                seen = (f"the {visible} GPU(s) the ranks see (of {gpu_count} on this machine: "
                        f"CUDA_VISIBLE_DEVICES={_visible_devices(cfg, kernel_env)})"
                        if visible < gpu_count else f"the {gpu_count} GPU(s) on this machine")
                raise ConfigError(
                    f"--num_processes {cfg.num_processes} is more than {seen}; use at most one process "
                    "per GPU, or pass --oversubscribe to allow it."
                )
        elif cfg.num_processes > 4:   # never more than 4x the cores (at least one): the quota is read only here
            cap = 4 * cpu_count()
            if cfg.num_processes > cap:
                raise ConfigError(
                    f"--num_processes {cfg.num_processes} is more than 4x the {cpu_count()} CPU core(s) "
                    f"of this machine (at most {cap}); use fewer, or pass --oversubscribe to allow it."
                )
    if cfg.num_nodes < 1:
        raise ConfigError(f"--num_nodes must be at least 1 (got {cfg.num_nodes}).")
    if not 0 <= cfg.node_rank < cfg.num_nodes:
        raise ConfigError(
            f"--node_rank must be between 0 and --num_nodes - 1 = {cfg.num_nodes - 1} (got {cfg.node_rank})."
        )
    if cfg.master_port is not None and not 1 <= cfg.master_port <= 65535:
        raise ConfigError(f"--master_port must be between 1 and 65535 (got {cfg.master_port}).")
    if not 0 <= cfg.max_restarts <= MAX_RESTARTS:
        raise ConfigError(f"--max_restarts must be between 0 and {MAX_RESTARTS} (got {cfg.max_restarts}).")
    check_seconds("--rendezvous_timeout", cfg.rendezvous_timeout)
    if cfg.stall_timeout != 0:
        check_seconds("--stall_timeout", cfg.stall_timeout)
    if cfg.debug_hold != 0:
        check_seconds("--debug_hold", cfg.debug_hold)
    if cfg.timeout is not None:
        check_seconds("--timeout", cfg.timeout)
    if cfg.mixed_precision is not None and cfg.mixed_precision not in MIXED_PRECISION_CHOICES:
        raise ConfigError(
            f"--mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)} (got {cfg.mixed_precision!r})."
        )
    resolve_host(cfg.master_addr)   # one that does not resolve: said here, for every node
    if cfg.node_rank == 0 and not is_this_machine(cfg.master_addr):
        raise ConfigError(not_this_machine(cfg.master_addr, cfg.num_nodes))
    # Several nodes: a port already held is told by node 0's supervisor, which
    # can see whether another node 0 of this rendezvous holds it (--node_rank).
    if check_port and cfg.master_port is not None and cfg.node_rank == 0 and cfg.num_nodes == 1:
        if not port_is_free(cfg.master_addr, cfg.master_port):
            raise ConfigError(
                f"--master_port {cfg.master_port} is already in use on {cfg.master_addr}; "
                "leave --master_port out to get a fresh free port per run, or choose another."
            )


def not_this_machine(host: str, num_nodes: int) -> str:
    """Why node 0 cannot run here with ``--master_addr host`` (not one of this machine's addresses)."""
    if num_nodes == 1:
        return (f"--master_addr {host} is not an address of this machine, and a one-node run's "
                "rendezvous listens on it. Leave --master_addr out (127.0.0.1), or for several nodes also "
                "pass --num_nodes and --node_rank.")
    others = "" if num_nodes == 2 else f" (each other machine its own, 1 .. {num_nodes - 1})"
    return (f"--master_addr {host} is not an address of this machine, but this cell is node 0 (--node_rank 0, "
            f"the default), which hosts the rendezvous on that address. If node 0 runs on the machine that "
            f"has {host}, this machine is another node: pass --node_rank 1 here{others} with the same "
            "--num_nodes, --master_addr and --master_port. If this machine is node 0, give an address of its "
            "own that every node reaches.")


def is_this_machine(host: str) -> bool:
    """Whether ``host`` (an address, or a name: any of the addresses it
    resolves to) is an address this machine can listen on; ``0.0.0.0`` and
    ``::`` (every address) are."""
    try:
        ipaddress.ip_address(host)
        addresses = [host]
    except ValueError:
        try:
            addresses = list(dict.fromkeys(info[4][0] for info in
                                           socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)))
        except (socket.gaierror, UnicodeError, ValueError):
            return False
    return any(_is_local(address) for address in addresses)


def check_seconds(flag: str, value) -> None:
    """A duration flag: a finite number of seconds, > 0 and at most MAX_SECONDS."""
    import math

    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or not 0 < value <= MAX_SECONDS:
        raise ConfigError(
            f"{flag} must be a positive number of seconds, at most {MAX_SECONDS:,} (got {value!r})."
        )


def resolve_host(host: str) -> str:
    """The address ``host`` resolves to, or ConfigError naming it."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise ConfigError(
            f"--master_addr {host!r} does not resolve ({exc}); give node 0's IP address or a host name "
            "that every node can resolve."
        ) from None


def port_is_free(host: str, port: int) -> bool:
    address = resolve_host(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(("" if family == socket.AF_INET6 else "0.0.0.0", port) if not _is_local(address) else (address, port))
        except OSError:
            return False
    return True


def _is_local(address: str) -> bool:
    """Whether this machine can bind ``address`` (it is one of its own).
    The default loopback addresses are, without a socket each cell."""
    if address in ("127.0.0.1", "::1"):
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now (the OS picks it).

    The socket is closed before torch's store binds the port; the OS does not
    hand the same ephemeral port out again at once, and every run asks anew,
    so a stale store of an earlier run can never be reused.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: Set by ipykernel for its own (terminal-like) output, wrong for a rank's:
#: forced colour and cursor control make rich/click-based progress draw
#: terminal escapes into the run's record.
_TERMINAL_ONLY = ("FORCE_COLOR", "CLICOLOR_FORCE", "PY_COLORS", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


_environ_seen: tuple[dict, dict] = ({}, {})   # (os.environ's encoded dict, its decoded copy) when last read


def environ_snapshot() -> tuple[dict, dict[str, str]]:
    """The kernel's environment now, as one snapshot: ``(raw, decoded)``, where
    ``raw`` is a copy of the dict ``os.environ`` keeps (encoded; compared whole
    without decoding it) and ``decoded`` is that same snapshot decoded (again
    only when it differs from the last one).  Both come from one copy, so a
    thread that changes ``os.environ`` meanwhile never pairs a newer ``raw``
    with an older ``decoded``.  Where ``os.environ`` keeps no such dict, both
    are the decoded copy."""
    global _environ_seen
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict):
        decoded = dict(os.environ)
        return decoded, decoded
    raw = dict(data)
    seen_raw, decoded = _environ_seen
    if raw != seen_raw:
        decoded = {os.environ.decodekey(k): os.environ.decodevalue(v) for k, v in raw.items()}
        _environ_seen = (raw, decoded)
    return raw, decoded


def environ_now() -> dict[str, str]:
    """A copy of the kernel's ``os.environ`` as it is now (see :func:`environ_snapshot`)."""
    return dict(environ_snapshot()[1])


def rank_base_environment(kernel_env: dict) -> dict[str, str]:
    """The kernel's environment as a rank gets it: a rank writes to a pipe
    that the run view shows as plain lines (carriage returns update a bar in
    place), not to a terminal, so it says so (``TERM=dumb``, no forced
    colour), and it has no inline matplotlib display (``MPLBACKEND=Agg``
    unless the user chose a non-inline backend)."""
    env = {k: v for k, v in kernel_env.items() if k not in _TERMINAL_ONLY}
    env["TERM"] = "dumb"
    if env.get("MPLBACKEND", "").startswith("module://"):   # matplotlib_inline: the kernel's display
        env["MPLBACKEND"] = "Agg"
    return env


def rank_environment(
    cfg: LaunchConfig,
    local_rank: int,
    master_port: int,
    *,
    run_id: str,
    attempt: int,
    gpu_count: int,
    error_file: Optional[str] = None,
) -> dict[str, str]:
    """The variables torchrun would set for this rank, plus Accelerate's.

    ``error_file``: the rank's ``TORCHELASTIC_ERROR_FILE`` (see
    :func:`error_file`), where ``torch.distributed.elastic``'s ``@record``
    writes the exception that ends the rank; the run reads it when the rank
    fails without an exception of its own reaching the kernel.

    ``OMP_NUM_THREADS``, where the user set none, is the cores this process
    may use (affinity and CPU quota: :func:`cpu_count`) divided between the local ranks, on GPU machines too: otherwise N ranks
    each start a thread per core.  (torchrun sets 1 whenever it starts more
    than one rank; a share of the cores keeps that guarantee and leaves each
    rank its part of the CPU.  Measured on a 16-core, one-GPU machine before
    this: a 2-rank CPU DDP cell ran 7 steps/s against torchrun's 161, every
    rank's 16 OpenMP threads spinning against the other's.)  An empty value
    counts as none: libgomp rejects it with a warning and starts a thread
    per core.
    ``ACCELERATE_USE_CPU`` makes ``Accelerator()`` really run MULTI_CPU when
    there is no GPU, instead of N independent copies.
    """
    env = {
        "RANK": str(cfg.global_rank(local_rank)),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_WORLD_SIZE": str(cfg.num_processes),
        "GROUP_RANK": str(cfg.node_rank),
        "NODE_RANK": str(cfg.node_rank),
        "ROLE_RANK": str(cfg.global_rank(local_rank)),
        "ROLE_WORLD_SIZE": str(cfg.world_size),
        "ROLE_NAME": "default",
        "GROUP_WORLD_SIZE": str(cfg.num_nodes),
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "PYTHONUNBUFFERED": "1",
        # The supervisor of node 0 hosts the store (as torchrun's agent does):
        # every rank connects to it as a client, none races to bind the port.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if not gpu_count:
        env["ACCELERATE_USE_CPU"] = "true"
    if cfg.mixed_precision:
        env["ACCELERATE_MIXED_PRECISION"] = cfg.mixed_precision
    env.update({k: str(v) for k, v in cfg.extra_env.items()})
    if error_file is not None:   # torchrun's own, whatever a config file says
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if not env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "")).strip():
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // cfg.num_processes))
    return env


def host_address(override: str) -> str:
    """This host's address on the cluster network: ``$override`` if set, else what
    its name resolves to (how Slurm and torchrun name a node), else loopback."""
    given = os.environ.get(override)
    if given:
        return given
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# -- the error files of torch elastic's @record ----------------------------------

def error_dir(private_dir: str, run_id: str) -> str:
    """The run's folder of error files, in the launcher's private directory
    (torchrun's is ``torchelastic_*`` in the temp directory): made by the
    run's supervisor before the ranks start, removed when it ends (and by the
    launcher if the supervisor is killed)."""
    return os.path.join(private_dir, f"torchelastic_{run_id}")


def make_dirs_below(root: str, path: str) -> bool:
    """Make ``path``'s folders below ``root`` (private, 0700), never ``root``
    itself: a folder of the launcher's private directory made while the
    kernel removes that directory (a launcher still importing as it is
    closed) must not bring the directory back.  False if ``root`` is gone."""
    rel = os.path.relpath(path, root)
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        raise ValueError(f"{path} is not below {root}")
    current = root
    for part in ([] if rel == os.curdir else rel.split(os.sep)):
        current = os.path.join(current, part)
        try:
            os.mkdir(current, 0o700)
        except FileExistsError:
            continue
        except FileNotFoundError:   # root (or a folder below it) was removed meanwhile
            return False
    return os.path.isdir(path)


def error_file(private_dir: str, run_id: str, attempt: int, local_rank: int) -> str:
    """A rank's ``TORCHELASTIC_ERROR_FILE``, laid out as torchrun's
    (``<run>/attempt_<restart count>/<local rank>/error.json``, see
    ``torch.distributed.elastic.multiprocessing.DefaultLogsSpecs.reify``); the
    file itself is written only by ``@record``, if at all."""
    return os.path.join(error_dir(private_dir, run_id), f"attempt_{attempt}", str(local_rank), "error.json")


# -- which variables the launcher's imports depend on ----------------------------

#: Prefixes of the variables that native code reads when it is loaded or
#: initialised, where no Python lookup shows it: the interpreter at its start
#: (PYTHON*), libtorch and c10d (TORCH_CPP_LOG_LEVEL, TORCH_SHOW_CPP_STACKTRACES,
#: TORCH_DISTRIBUTED_DEBUG, PYTORCH_CUDA_ALLOC_CONF...), NCCL, gloo, the CUDA
#: and ROCm libraries, the OpenMP / MKL / OpenBLAS runtimes (their thread
#: pools are sized at load), the dynamic loader and the allocators, and this
#: package's own (ACCEL_MAGICS_DISABLE turns hooks off in the launcher).
#: TQDM_: tqdm reads every TQDM_* variable at import by scanning the
#: environment, so one set later is not a lookup the launcher made.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "TORCH", "PYTORCH_", "NCCL_", "GLOO_", "UCC_", "UCX_",
    "CUDA_", "CUBLAS", "CUDNN_", "NVIDIA_", "HIP_", "ROCM_", "HSA_", "MIOPEN_", "ROCBLAS_",
    "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GOTO", "BLIS_", "ONEDNN_", "DNNL_",
    "LD_", "MALLOC_", "GLIBC_TUNABLES", "TCMALLOC_", "XLA_", "PJRT_", "TRITON_", "KINETO_",
    "ACCEL_MAGICS_", "TQDM_",
)


def import_time_changes(then: Mapping[str, str], now: Mapping[str, str], read: Iterable[str]) -> list[str]:
    """The variables that differ between ``then`` (the environment the
    launcher imported its modules under) and ``now`` (what a rank started now
    would import under) and that an import may have depended on: a name
    Python code looked up (``read``, found or not) or one native code reads
    (:data:`IMPORT_TIME_PREFIXES`).  Sorted; [] when the launcher is as a
    fresh process would be."""
    read = set(read)
    then, now = _as_read(then), _as_read(now)
    changed = [name for name in then.keys() | now.keys() if then.get(name) != now.get(name)]
    return sorted(name for name in changed if name in read or name.startswith(IMPORT_TIME_PREFIXES))


#: The code that reads every value of a mapping in turn (a scan, not a lookup by name).
_SCANS = frozenset(code for code in (
    getattr(collections.abc.ItemsView.__iter__, "__code__", None),
    getattr(collections.abc.ValuesView.__iter__, "__code__", None),
    getattr(getattr(type(os.environ), "copy", None), "__code__", None),
) if code is not None)


def _as_read(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` as what reads it makes of it: ACCEL_MAGICS_DISABLE is the hooks
    it turns off (unset, empty or a name that is no hook turn none off; the
    kernel refuses the last before a run, see hooks.check_names)."""
    from . import hooks

    if hooks.ENV not in env:
        return env
    env = dict(env)
    off = ",".join(sorted(hooks.disabled(env) & set(hooks.HOOKS)))
    if off:
        env[hooks.ENV] = off
    else:
        del env[hooks.ENV]
    return env


#: The files of os.environ's own frames (_collections_abc is frozen from 3.11, a file on 3.10).
_MAPPING_FILES = {os.__file__, getattr(sys.modules.get("_collections_abc"), "__file__", None)} - {None}


class EnvironmentReads:
    """Record the names Python code looks up in ``os.environ`` (and
    ``os.environb``) between :meth:`start` and :meth:`stop`.

    The launcher records while it imports torch and the modules payloads use:
    a module that read a variable at import (``torch.distributed``'s
    TORCH_DISTRIBUTED_DEBUG, a library's cache path) keeps what it read, and
    forked ranks inherit it, so a change of that variable in the kernel needs
    a fresh launcher.  Every lookup goes through ``__getitem__`` (``get``,
    ``in``, ``os.getenv``, ``items()``, ``copy()``), so the mapping's class is
    swapped for a subclass that notes the name, and swapped back by
    :meth:`stop`: what the launcher forks has the plain ``os._Environ``.

    A scan of every variable (``os.environ.items()``, ``.copy()``: tqdm looks
    for its TQDM_* variables so, this package's py-spy runner keeps a copy)
    is not a lookup of each: counting it so would make every variable count,
    down to those that change by themselves (pytest's PYTEST_CURRENT_TEST
    between tests), and every change would cost a fresh launcher.  Where
    a scan was made is kept in :attr:`scans` for the log; what such a module
    keeps is covered by :data:`IMPORT_TIME_PREFIXES` where it is known.
    """

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.scans: set[str] = set()
        self._swapped: list = []

    def start(self) -> None:
        if self._swapped:
            return
        for mapping in (os.environ, getattr(os, "environb", None)):
            if mapping is not None:
                plain = type(mapping)
                mapping.__class__ = self._recording(plain)
                self._swapped.append((mapping, plain))

    def stop(self) -> None:
        for mapping, plain in self._swapped:
            mapping.__class__ = plain
        self._swapped = []

    def take(self) -> tuple[set[str], set[str]]:
        """The names and scan sites noted since the last take."""
        names, scans = self.names, self.scans
        self.names, self.scans = set(), set()
        return names, scans

    def _recording(self, plain: type) -> type:
        reads = self

        class Recording(plain):
            def __getitem__(self, key):
                if sys._getframe(1).f_code not in _SCANS:
                    reads.names.add(key if isinstance(key, str) else os.fsdecode(key))
                return super().__getitem__(key)

            def __iter__(self):
                frame = sys._getframe(1)
                # The mapping's own frames (os, and _collections_abc: frozen from 3.11, a file on 3.10).
                while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                             or frame.f_code.co_filename in _MAPPING_FILES):
                    frame = frame.f_back
                if frame is not None:
                    reads.scans.add(f"{frame.f_code.co_filename}:{frame.f_lineno}")
                return super().__iter__()

        Recording.__name__ = Recording.__qualname__ = f"Recording{plain.__name__}"
        return Recording
