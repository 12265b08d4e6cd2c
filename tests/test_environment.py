"""Launch topology: validation messages and the torchrun environment."""
from __future__ import annotations

import os
import socket

import pytest

from accel_magics.kernel_ext.environment import (ConfigError, EnvironmentReads, LaunchConfig, cpu_count, error_dir,
                                                 error_file, free_port, import_time_changes, rank_base_environment,
                                                 rank_environment, validate, visible_gpus)

pytestmark = pytest.mark.timeout(30)


def test_torchrun_variables_for_a_multi_node_rank():
    cfg = LaunchConfig(num_processes=2, num_nodes=3, node_rank=1, master_addr="10.0.0.5",
                       master_port=29500, mixed_precision="bf16")
    env = rank_environment(cfg, 1, 29500, run_id="r", attempt=2, gpu_count=0)
    assert env["RANK"] == "3"
    assert env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "6"
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.5" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_USE_CPU"] == "true"


def test_cpu_threads_are_divided_between_local_ranks(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = rank_environment(LaunchConfig(num_processes=2), 0, 1, run_id="r", attempt=0, gpu_count=0)
    assert env["OMP_NUM_THREADS"] == str(max(1, cpu_count() // 2))


@pytest.mark.parametrize("gpu_count", [0, 1, 8])
def test_threads_are_divided_between_local_ranks_on_gpu_machines_too(monkeypatch, gpu_count):
    """A one-GPU machine with 2 oversubscribed CPU ranks ran DDP 20x slower
    than torchrun when each rank kept a thread per core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for n in (1, 2, 8):
        env = rank_environment(LaunchConfig(num_processes=n), 0, 1, run_id="r", attempt=0, gpu_count=gpu_count)
        assert env["OMP_NUM_THREADS"] == str(max(1, cpu_count() // n))


def test_the_users_thread_count_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = rank_environment(LaunchConfig(num_processes=2), 0, 1, run_id="r", attempt=0, gpu_count=1)
    assert "OMP_NUM_THREADS" not in env    # the kernel's own value reaches the ranks as it is
    env = rank_environment(LaunchConfig(num_processes=2, extra_env={"OMP_NUM_THREADS": "5"}), 0, 1, run_id="r",
                           attempt=0, gpu_count=1)
    assert env["OMP_NUM_THREADS"] == "5"


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_thread_count_counts_as_none(monkeypatch, value):
    """`OMP_NUM_THREADS=` (set, empty) made libgomp warn in every rank and
    start a thread per core in each: the cores are divided as if unset."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    env = rank_environment(LaunchConfig(num_processes=2), 0, 1, run_id="r", attempt=0, gpu_count=1)
    assert env["OMP_NUM_THREADS"] == str(max(1, cpu_count() // 2))
    monkeypatch.delenv("OMP_NUM_THREADS")
    env = rank_environment(LaunchConfig(num_processes=2, extra_env={"OMP_NUM_THREADS": value}), 0, 1, run_id="r",
                           attempt=0, gpu_count=1)
    assert env["OMP_NUM_THREADS"] == str(max(1, cpu_count() // 2))


def test_gpu_machine_does_not_force_cpu():
    env = rank_environment(LaunchConfig(num_processes=2), 0, 1, run_id="r", attempt=0, gpu_count=2)
    assert "ACCELERATE_USE_CPU" not in env


@pytest.mark.parametrize("kwargs,message", [
    ({"num_processes": 0}, "--num_processes must be at least 1"),
    ({"num_processes": 10_000}, "more than 4x"),
    ({"num_processes": 1, "num_nodes": 0}, "--num_nodes must be at least 1"),
    ({"num_processes": 1, "num_nodes": 2, "node_rank": 2}, "--node_rank must be between 0 and"),
    ({"num_processes": 1, "master_port": 70000}, "between 1 and 65535"),
    ({"num_processes": 1, "max_restarts": -1}, "--max_restarts must be between 0 and 1000"),
    ({"num_processes": 1, "timeout": 0}, "--timeout must be a positive"),
    ({"num_processes": 1, "master_addr": "no-such-host.invalid"}, "does not resolve"),
])
def test_invalid_configs_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        validate(LaunchConfig(**kwargs))


def test_more_processes_than_gpus_needs_oversubscribe():
    with pytest.raises(ConfigError, match="more than the 2 GPU"):
        validate(LaunchConfig(num_processes=3), gpu_count=2)
    validate(LaunchConfig(num_processes=3), gpu_count=2, allow_oversubscribe=True)


@pytest.mark.parametrize("value,seen", [
    ("0,1,2,3", 4), ("2", 1), ("1,3", 2), (" 1 , 0 ", 2),
    ("", 0), ("-1", 0), ("0,-1,2", 1), ("0,,1", 1),   # CUDA: the devices before the first invalid entry
    ("GPU-5d3f9e2a-0000", 1),                          # a UUID counts as one device
    ("0,1,2,3,4,5,6,7", 4),                            # never more than the launcher counted
])
def test_the_gpus_ranks_see_follow_their_cuda_visible_devices(value, seen):
    assert visible_gpus(4, LaunchConfig(num_processes=1), {"CUDA_VISIBLE_DEVICES": value}) == seen
    # The run's own (an Accelerate config's gpu_ids) wins over the kernel's.
    cfg = LaunchConfig(num_processes=1, extra_env={"CUDA_VISIBLE_DEVICES": value})
    assert visible_gpus(4, cfg, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == seen
    assert visible_gpus(4, LaunchConfig(num_processes=1), {}) == 4
    assert visible_gpus(0, cfg, {}) == 0


def test_ranks_that_see_fewer_gpus_are_refused_before_launch_with_the_reason():
    """An Accelerate config with gpu_ids: 1 on a 2-GPU machine: 2 ranks would
    put rank 1 on a GPU it cannot see (invalid device ordinal)."""
    cfg = LaunchConfig(num_processes=2, extra_env={"CUDA_VISIBLE_DEVICES": "1"})
    with pytest.raises(ConfigError, match=r"the 1 GPU\(s\) the ranks see \(of 2 on this machine: "
                                          r"CUDA_VISIBLE_DEVICES=1\)"):
        validate(cfg, gpu_count=2)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=0"):
        validate(LaunchConfig(num_processes=2), gpu_count=2, kernel_env={"CUDA_VISIBLE_DEVICES": "0"})
    validate(LaunchConfig(num_processes=2), gpu_count=2, kernel_env={"CUDA_VISIBLE_DEVICES": "0,1"})


def test_gpus_hidden_from_the_ranks_make_a_cpu_run():
    """`CUDA_VISIBLE_DEVICES=` in the kernel on a one-GPU machine: 2 CPU ranks
    are a CPU run (Accelerate's MULTI_CPU, not two independent copies), and
    the CPU cap applies instead of one rank per GPU."""
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    validate(LaunchConfig(num_processes=2), gpu_count=1, kernel_env=hidden)
    cfg = LaunchConfig(num_processes=2)
    env = rank_environment(cfg, 0, 1, run_id="r", attempt=0, gpu_count=visible_gpus(1, cfg, hidden))
    assert env["ACCELERATE_USE_CPU"] == "true"


def test_explicit_port_in_use_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--master_port {port} is already in use"):
            validate(LaunchConfig(num_processes=1, master_port=port))


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# -- the environment the launcher imported under (issue 44, item 3) ------------------------

def test_the_names_imports_look_up_are_recorded_and_the_class_restored():
    reads = EnvironmentReads()
    plain = type(os.environ)
    reads.start()
    try:
        os.environ.get("ACCEL_TEST_MISSING_A")
        "ACCEL_TEST_MISSING_B" in os.environ   # noqa: B015
        os.getenv("HOME")
        os.environb.get(b"ACCEL_TEST_BYTES")
        assert type(os.environ) is not plain
    finally:
        reads.stop()
    assert type(os.environ) is plain and type(os.environb) is plain
    os.environ.get("ACCEL_TEST_AFTER")
    names, _ = reads.take()
    assert {"ACCEL_TEST_MISSING_A", "ACCEL_TEST_MISSING_B", "HOME", "ACCEL_TEST_BYTES"} <= names
    assert "ACCEL_TEST_AFTER" not in names


def test_a_scan_of_the_environment_is_not_a_lookup_of_each_variable(monkeypatch):
    """tqdm scans every variable at import for its TQDM_* ones: a variable that
    changes by itself (pytest's PYTEST_CURRENT_TEST) must not count as read."""
    monkeypatch.setenv("ACCEL_TEST_SCANNED", "1")
    reads = EnvironmentReads()
    reads.start()
    try:
        {k: v for k, v in os.environ.items() if k.startswith("TQDM_")}   # noqa: B018
        os.environ.copy()
        list(os.environ.values())
    finally:
        reads.stop()
    names, scans = reads.take()
    assert "ACCEL_TEST_SCANNED" not in names and not names
    assert any(site.startswith(__file__) for site in scans), scans


@pytest.mark.parametrize("then,now,read,changed", [
    ({}, {"TORCH_CPP_LOG_LEVEL": "INFO"}, set(), ["TORCH_CPP_LOG_LEVEL"]),
    ({"NCCL_DEBUG": "INFO"}, {}, set(), ["NCCL_DEBUG"]),
    ({}, {"CUDA_VISIBLE_DEVICES": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, set(),
     ["CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF"]),
    ({}, {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "ACCEL_MAGICS_DISABLE": "tqdm"}, set(),
     ["ACCEL_MAGICS_DISABLE", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"]),
    ({"HF_HOME": "/a"}, {"HF_HOME": "/b"}, {"HF_HOME"}, ["HF_HOME"]),      # a library's import looked it up
    ({}, {"WANDB_PROJECT": "x"}, set(), []),                              # nothing did
    ({"MY_DATA": "1"}, {"MY_DATA": "1"}, {"MY_DATA"}, []),                # unchanged
    ({}, {"ACCEL_MAGICS_DISABLE": ""}, set(), []),                        # turns no hook off, as unset
    ({}, {"ACCEL_MAGICS_DISABLE": "tqmd"}, set(), []),                    # no hook: refused before a run
    ({"ACCEL_MAGICS_DISABLE": "tqdm"}, {"ACCEL_MAGICS_DISABLE": " tqdm, "}, set(), []),
    ({"ACCEL_MAGICS_DISABLE": "tqdm"}, {"ACCEL_MAGICS_DISABLE": "tqdm,store"}, set(), ["ACCEL_MAGICS_DISABLE"]),
])
def test_which_changes_count(then, now, read, changed):
    assert import_time_changes(then, now, read) == changed


def test_a_terminal_variable_the_ranks_never_get_does_not_count():
    """The kernel's FORCE_COLOR and friends are not a rank's (rank_base_environment)."""
    then = rank_base_environment({"FORCE_COLOR": "1", "TERM": "xterm-color"})
    now = rank_base_environment({"FORCE_COLOR": "0", "TERM": "xterm-256color"})
    assert import_time_changes(then, now, {"FORCE_COLOR", "TERM"}) == []


def test_error_files_are_laid_out_as_torchruns():
    assert error_dir("/p", "abc") == "/p/torchelastic_abc"
    assert error_file("/p", "abc", 2, 1) == "/p/torchelastic_abc/attempt_2/1/error.json"


def test_a_rank_gets_its_error_file_whatever_a_config_file_says():
    cfg = LaunchConfig(num_processes=2, extra_env={"TORCHELASTIC_ERROR_FILE": "/elsewhere"})
    env = rank_environment(cfg, 1, 1, run_id="r", attempt=0, gpu_count=0, error_file=error_file("/p", "r", 0, 1))
    assert env["TORCHELASTIC_ERROR_FILE"] == "/p/torchelastic_r/attempt_0/1/error.json"
    assert "TORCHELASTIC_ERROR_FILE" not in rank_environment(LaunchConfig(num_processes=2), 1, 1, run_id="r",
                                                             attempt=0, gpu_count=0)


def test_the_environment_snapshot_sees_every_change_between_calls_and_decodes_as_os_environ_does(monkeypatch):
    """environ_now() is a cached decode of os.environ: it must still be the
    kernel's environment at each call (set, changed, deleted, bytes that are
    not UTF-8), and its raw half is the same snapshot as its decoded half."""
    from accel_magics.kernel_ext.environment import environ_now, environ_snapshot

    assert environ_now() == dict(os.environ)
    monkeypatch.setenv("ACCEL_MAGICS_TEST_SNAPSHOT", "1")
    assert environ_now()["ACCEL_MAGICS_TEST_SNAPSHOT"] == "1"
    monkeypatch.setenv("ACCEL_MAGICS_TEST_SNAPSHOT", "caf\udce9")   # a byte 0xe9 alone: surrogate-escaped
    assert environ_now()["ACCEL_MAGICS_TEST_SNAPSHOT"] == "caf\udce9"
    monkeypatch.delenv("ACCEL_MAGICS_TEST_SNAPSHOT")
    assert "ACCEL_MAGICS_TEST_SNAPSHOT" not in environ_now()
    raw, decoded = environ_snapshot()
    assert decoded == dict(os.environ) and len(raw) == len(decoded)
    assert raw is not getattr(os.environ, "_data", None)   # a copy: a later change cannot reach it
