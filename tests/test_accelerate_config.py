"""``--config_file``: an Accelerate config honoured as ``accelerate launch``
honours it (issue 14), compared live with ``accelerate launch`` on the same
machine and the same file.  Real kernel, real ranks."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: false
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: false
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""

# What the ranks see, the same under both launchers. FullyShardedDataParallelPlugin()
# is the plugin Accelerator() builds from the environment.
PROBE = """\
import os
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
acc = Accelerator()
plugin = FullyShardedDataParallelPlugin()
env = sorted(f"{k}={v}" for k, v in os.environ.items()
             if k.startswith(("ACCELERATE_", "FSDP_")) and k != "ACCELERATE_USE_CPU")
line = " ".join(map(str, ("probe", os.environ["RANK"], os.environ["WORLD_SIZE"], acc.mixed_precision,
                           plugin.sharding_strategy, plugin.state_dict_type, getattr(plugin, "fsdp_version", 1), "|".join(env))))
with open(f"probe-{os.environ['RANK']}.txt", "w") as f:   # accelerate launch interleaves the ranks' stdout
    f.write(line)
"""


def _probe_lines(directory) -> list[str]:
    return sorted(p.read_text() for p in directory.glob("probe-*.txt"))


def test_an_fsdp_config_gives_the_ranks_what_accelerate_launch_gives(clean_kernel, tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_CONFIG)
    (tmp_path / "ref").mkdir()
    (tmp_path / "cell").mkdir()
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU",)}
    # accelerate launch runs torch elastic's agent, which keeps a log directory
    # (torchelastic_*) in the temp dir: the test's own, not the user's.
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")
    ref = subprocess.run([accelerate, "launch", "--config_file", str(config), str(script)], env=env,
                         capture_output=True, text=True, timeout=180, cwd=tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = _probe_lines(tmp_path / "ref")
    # Under accelerate launch on a CPU machine each process believes it is alone
    # (no ACCELERATE_USE_CPU): the process count differs, nothing else may.
    assert len(expected) == 2 and all(" 2 bf16 " in line for line in expected), expected
    assert "ACCELERATE_USE_FSDP=true" in expected[0] and "FSDP_SHARDING_STRATEGY=SHARD_GRAD_OP" in expected[0]

    clean_kernel.ok(f"import os\nos.chdir({str(tmp_path / 'cell')!r})")
    try:
        res = clean_kernel.run(f"%%distributed --config_file {config} --output text\n{PROBE}", timeout=120)
    finally:
        clean_kernel.ok("os.chdir(os.path.expanduser('~'))")
    assert res.status == "ok", res.error_text
    got = _probe_lines(tmp_path / "cell")
    assert got == expected, (got, expected)


def test_flags_in_the_cell_win_over_the_config_file(clean_kernel, tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_CONFIG)
    res = clean_kernel.run(f"%%distributed --config_file {config} --mixed_precision no -n 1 --output text\n"
                           "import os\nprint(os.environ['ACCELERATE_MIXED_PRECISION'], os.environ['WORLD_SIZE'],"
                           " os.environ['ACCELERATE_USE_FSDP'])\n", timeout=120)
    assert res.status == "ok", res.error_text
    assert "[rank 0] no 1 true" in res.stdout


def test_the_default_config_written_by_write_basic_config_is_used(tmp_path):
    """``--config_file default``: the file ``write_basic_config()`` (the seed
    tutorial's step) or ``accelerate config`` wrote, in a kernel whose HF_HOME
    is a fresh directory; set once with %distributed_config."""
    from conftest import LoadedKernel

    k = LoadedKernel(extra_env={"HF_HOME": str(tmp_path / "hf")})
    try:
        res = k.run("%%distributed --config_file default\npass", timeout=60)
        assert res.error["ename"] == "UsageError"
        assert "Accelerate has no default config" in res.error["evalue"] and "write_basic_config" in \
            res.error["evalue"]
        k.ok("from accelerate.utils import write_basic_config\nwrite_basic_config(mixed_precision='bf16')")
        k.ok("%distributed_config --config_file default")
        res = k.run("%%distributed --output text\nimport os\nfrom accelerate import Accelerator\n"
                    "acc = Accelerator()\nprint(os.environ['WORLD_SIZE'], acc.mixed_precision, acc.device)\n",
                    timeout=120)
        assert res.status == "ok", res.error_text
        # write_basic_config on a CPU-only machine asks for one process, as accelerate launch would run.
        assert res.stdout.strip().startswith("[rank 0] 1 bf16 cpu"), res.stdout
        k.assert_no_leaks()
    finally:
        k.shutdown()


def test_a_bad_config_is_a_usage_error_before_anything_starts(clean_kernel, tmp_path):
    k = clean_kernel
    res = k.run(f"%%distributed --config_file {tmp_path / 'nope.yaml'}\npass", timeout=30)
    assert res.error["ename"] == "UsageError" and "no such file" in res.error["evalue"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(FSDP_CONFIG.replace("mixed_precision: bf16", "mixed_precision: fp12"))
    res = k.run(f"%%distributed --config_file {bad}\npass", timeout=120)
    assert res.error["ename"] == "UsageError"
    assert "Accelerate cannot launch" in res.error["evalue"] and "fp12" in res.error["evalue"], res.error["evalue"]
    assert "Nothing was launched" in res.error["evalue"]
    k.ok("%%distributed -n 2 --output text\nprint('still fine')")


def test_an_edit_that_keeps_size_and_time_is_read_and_a_huge_file_fails_at_once(tmp_path):
    """Issue 24 item 8: the cache was keyed on path, mtime and size, so `cp -p` of a
    same-size edit ran the old settings; a 200 MB "config" blocked the cell 120 s."""
    import time as _time

    from accel_magics.kernel_ext.environment import ConfigError
    from accel_magics.kernel_ext.kernel import accelerate_config

    config = tmp_path / "a.yaml"
    config.write_text(FSDP_CONFIG)
    first = accelerate_config.load(str(config), {})
    assert first.env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    st = os.stat(config)
    config.write_text(FSDP_CONFIG.replace("mixed_precision: bf16", "mixed_precision: fp16"))   # same size
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(config).st_size == st.st_size and os.stat(config).st_mtime_ns == st.st_mtime_ns
    assert accelerate_config.load(str(config), {}).env["ACCELERATE_MIXED_PRECISION"] == "fp16"

    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as f:
        f.truncate(200 * 2**20)   # sparse: 200 MB to read, none on disk
    started = _time.monotonic()
    with pytest.raises(ConfigError) as info:
        accelerate_config.load(str(huge), {})
    assert _time.monotonic() - started < 2
    assert "200.0 MiB, not an Accelerate config" in str(info.value)
