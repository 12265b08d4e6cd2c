"""An Accelerate config file, as the environment ``accelerate launch`` gives ranks.

``%%distributed --config_file PATH`` (or ``default``: the file ``accelerate
config`` / ``write_basic_config()`` writes) must mean what ``accelerate
launch --config_file PATH`` means: mixed precision, the FSDP plugin's
settings, dynamo, DeepSpeed... reach the ranks as the same ``ACCELERATE_*`` /
``FSDP_*`` variables.  So this uses Accelerate's own launch code (its
argument parser, ``_validate_launch_command`` and the ``prepare_*_env``
function its launcher would call), never a copy of its rules.

That code runs in a short-lived subprocess (``python -m
accel_magics.kernel_ext.kernel.accelerate_config``): it imports torch and asks it
about devices, which must not happen in the kernel (the pre-flight check
guards the kernel's CUDA state), and its warnings go to a pipe, not into the
notebook.  The answer is cached per file content and flags, so only the
first cell with a given config pays the ~2 s.

Precedence (decided here, as ``accelerate launch`` does with its flags):
options given in the cell or with ``%distributed_config`` win over the
file, and the file wins over built-in defaults.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

from ..environment import ConfigError
from ..timing import ACCELERATE_CONFIG_WAIT

#: Variables the launcher sets per rank itself (torchrun's contract): never from the file.
_OURS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "PYTHONUNBUFFERED",
})
TIMEOUT = ACCELERATE_CONFIG_WAIT   # seconds for the subprocess (imports torch and accelerate)


@dataclass
class AccelerateLaunch:
    """What the file (plus the flags passed along) makes ``accelerate launch`` do."""
    path: str
    env: dict = field(default_factory=dict)    # set or changed for the ranks
    num_processes: Optional[int] = None        # in total, over all machines (Accelerate's meaning)
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    distributed_type: str = ""

    @property
    def processes_per_node(self) -> Optional[int]:
        if not self.num_processes:
            return None
        return max(1, self.num_processes // max(1, self.num_machines))


def default_config_path() -> str:
    """Where ``accelerate config`` writes (``$HF_HOME/accelerate/default_config.yaml``)."""
    cache = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    base = os.path.join(cache, "accelerate")
    for name in ("default_config.yaml", "default_config.json"):
        if os.path.isfile(os.path.join(base, name)):
            return os.path.join(base, name)
    return os.path.join(base, "default_config.yaml")


def resolve(value: str) -> str:
    """The config file a ``--config_file`` value names, which must exist."""
    if not value.strip():
        raise ConfigError("--config_file needs a path (of an Accelerate config file) or `default`.")
    if value == "default":
        path = default_config_path()
        if not os.path.isfile(path):
            raise ConfigError(
                f"--config_file default: Accelerate has no default config ({path} does not exist). Run "
                "`accelerate config` in a terminal, or `from accelerate.utils import write_basic_config; "
                "write_basic_config()` in a cell, or give a path.")
        return path
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.exists(path):
        raise ConfigError(f"--config_file {value}: no such file ({path}). {_GIVE}")
    _read_config(path, value)   # a special file, a directory, one that cannot be read: said now
    return path


_GIVE = "Give the path of an Accelerate config (YAML or JSON), or `default` for the one `accelerate config` wrote."


_cache: dict = {}
#: An Accelerate config is a few hundred bytes; a file this big is not one (and
#: reading it must not block the cell).
MAX_CONFIG_BYTES = 1 << 20


#: File systems whose "files" are the kernel's views of processes and devices, not files a user wrote.
_SPECIAL_FILE_SYSTEMS = ("/proc/", "/sys/")


def _read_config(path: str, value: str) -> bytes:
    """The file's bytes, read once and bounded; ConfigError (what to do) for
    anything that is not a readable file of a config's size: a directory, a
    device or a FIFO (opened without blocking, checked on the opened file),
    a file of /proc or /sys (``/proc/self/mem`` fails to read, others never
    end), one this user may not read."""
    real = os.path.realpath(path)
    if real.startswith(_SPECIAL_FILE_SYSTEMS):
        raise ConfigError(f"--config_file {value}: {path} is a file of {real[:real.index('/', 1)]} (the system's "
                          f"view of its processes and devices), not a config file. {_GIVE}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"--config_file {value}: cannot open {path} ({exc.strerror or exc}). {_GIVE}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, a FIFO or a socket)"
            raise ConfigError(f"--config_file {value}: {path} is {what}. {_GIVE}")
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"--config_file {value}: cannot read {path} ({exc.strerror or exc}). {_GIVE}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if max(st.st_size, len(data)) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config_file {value}: {path} is {max(st.st_size, len(data)) / 2**20:.1f} MiB, not an "
                          f"Accelerate config (those are a few hundred bytes; the limit is "
                          f"{MAX_CONFIG_BYTES >> 20} MiB). Check the path.")
    return data


def _content_key(path: str, value: str) -> str:
    """What the cache is keyed on: the file's content (an edit that keeps the size
    and the time, ``cp -p``, is still an edit), read once, bounded."""
    return hashlib.sha256(_read_config(path, value)).hexdigest()


def load(value: str, flags: dict, *, python: str = sys.executable, timeout: float = TIMEOUT) -> AccelerateLaunch:
    """Turn the file ``value`` names, with the explicit ``flags`` (Accelerate's
    names: num_processes in total, num_machines, machine_rank,
    main_process_ip, main_process_port, mixed_precision), into the ranks'
    environment.  ConfigError with Accelerate's own message if it refuses."""
    path = resolve(value)
    key = (path, _content_key(path, value), json.dumps(flags, sort_keys=True))
    if key in _cache:
        return _cache[key]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP",)}
    env["PYTHONWARNINGS"] = "ignore"
    try:
        proc = subprocess.run([python, "-m", __name__, path, json.dumps(flags)], env=env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--config_file {value}: Accelerate took over {timeout:g}s to read it.") from None
    answer = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            answer = json.loads(line)
            break
    if proc.returncode != 0 or answer is None or "error" in answer:
        why = (answer or {}).get("error") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"--config_file {value}: Accelerate cannot launch with {path}: {why}")
    launch = AccelerateLaunch(path=path, **answer)
    _cache[key] = launch
    return launch


def _accelerate_environment(path: str, flags: dict) -> dict:
    """In the subprocess: what ``accelerate launch --config_file path`` would set."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as accelerate_launch

    argv = ["--config_file", path]
    for name in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                 "mixed_precision"):
        if flags.get(name) is not None:
            argv += [f"--{name}", str(flags[name])]
    argv.append("accel_magics_cell.py")    # the "script": the cell
    args = launch_command_parser().parse_args(argv)
    args, defaults, _ = _validate_launch_command(args)
    before = dict(os.environ)
    if getattr(args, "tpu", False) or (defaults is not None and str(defaults.compute_environment).endswith(
            "AMAZON_SAGEMAKER")):
        raise ValueError("TPU and SageMaker configs are not supported by %%distributed")
    # The same choice as accelerate.commands.launch.launch_command.
    if args.use_deepspeed and not args.cpu:
        _, env = accelerate_launch.prepare_deepspeed_cmd_env(args)
    elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
        env = accelerate_launch.prepare_multi_gpu_env(args)
    else:
        _, env = accelerate_launch.prepare_simple_launcher_cmd_env(args)
    changed = {k: str(v) for k, v in env.items() if before.get(k) != v and k not in _OURS}
    return {
        "env": changed,
        "num_processes": args.num_processes,
        "num_machines": int(args.num_machines or 1),
        "machine_rank": int(args.machine_rank or 0),
        "main_process_ip": args.main_process_ip,
        "main_process_port": int(args.main_process_port) if args.main_process_port else None,
        "distributed_type": str(getattr(defaults, "distributed_type", "") or ""),
    }


def main(argv: list[str]) -> int:
    path, flags = argv[0], json.loads(argv[1])
    try:
        answer = _accelerate_environment(path, flags)
    except BaseException as exc:   # SystemExit from argparse too: say what Accelerate said
        text = str(exc) or type(exc).__name__
        answer = {"error": f"{type(exc).__name__}: {text}" if not isinstance(exc, SystemExit) else text}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
