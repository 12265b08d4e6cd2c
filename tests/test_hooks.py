"""The hooks (kernel_ext/hooks.py): every way a rank differs from a plain
torchrun process is named, checks the feature it relies on against the
installed torch, can be turned off by name, and says in the log what
became of it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from accel_magics.kernel_ext import PACKAGE_DIR, hooks
from accel_magics.kernel_ext.environment import LaunchConfig
from accel_magics.kernel_ext.kernel.launcher import Launcher
from accel_magics.kernel_ext.kernel.run import execute
from accel_magics.kernel_ext.wire.payload import build_payload

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch_version() -> tuple[int, int]:
    import torch

    return tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


# -- the table ----------------------------------------------------------------------------------------

def _sources() -> str:
    texts = []
    for base in (PACKAGE_DIR, os.path.join(ROOT, "accel_magics")):
        for folder, _, files in os.walk(base):
            texts += [open(os.path.join(folder, f), encoding="utf-8").read() for f in files if f.endswith(".py")
                      and f != "hooks.py"]
    return "\n".join(texts)


def test_the_table_names_every_hook_the_code_installs_and_the_code_installs_every_hook_of_the_table():
    used = set(re.findall(r'hooks\.(?:install|preview|enabled|step_aside)\(\s*"([a-z_]+)"', _sources()))
    used |= set(re.findall(r'\("([a-z_]+)", [a-z_]+_unsupported\)', _sources()))   # pg_guard's loop
    assert used - set(hooks.HOOKS) == set(), "installed under a name the table lacks"
    assert set(hooks.HOOKS) - used == set(), "in the table, installed nowhere"


def test_the_hooks_page_lists_every_hook():
    page = open(os.path.join(ROOT, "docs", "reference", "hooks.md"), encoding="utf-8").read()
    missing = [name for name in hooks.HOOKS if f"| `{name}` |" not in page]
    assert not missing, f"the hook table of docs/reference/hooks.md lacks {missing}"


def test_disable_reads_names_and_all_and_says_which_names_are_no_hooks():
    assert hooks.disabled({"ACCEL_MAGICS_DISABLE": "tqdm, store"}) == {"tqdm", "store"}
    assert hooks.disabled({"ACCEL_MAGICS_DISABLE": "all"}) == set(hooks.HOOKS)
    assert hooks.disabled({}) == set()
    assert hooks.unknown({"ACCEL_MAGICS_DISABLE": "tqdm,tqmd"}) == ["tqmd"]
    with pytest.raises(hooks.UnknownHook, match="'tqmd'.*the hooks are: .*tqdm"):
        hooks.check_names({"ACCEL_MAGICS_DISABLE": "tqmd"})


# -- each hook's point in the installed torch / Python / platform --------------------------------------

def _guard(name: str):
    """The guard each hook checks when it installs (imported as the product does)."""
    from accel_magics.kernel_ext.kernel.preflight import InitSiteTracker
    from accel_magics.kernel_ext.launcher import dnsfix, hugepages
    from accel_magics.kernel_ext.rank import liveness, pg_guard, rank_bars, script_end, worker
    from accel_magics.kernel_ext.supervisor import native_stacks, rendezvous

    def tqdm_guard():
        import tqdm.std

        return rank_bars.unsupported(tqdm.std.tqdm)

    def shared_globals_guard():
        from accel_magics.kernel_ext.wire import payload

        return getattr(payload, "shared_globals_unsupported", lambda: None)()

    return {
        "store": rendezvous.prebound_store_unsupported,
        "keep_groups": pg_guard.keep_groups_unsupported,
        "join_wait": pg_guard.join_wait_unsupported,
        "round_keys": pg_guard.round_keys_unsupported,
        "world_size_check": pg_guard.world_size_check_unsupported,
        "init_events": pg_guard.init_events_unsupported,
        "tqdm": tqdm_guard,
        "script_end": script_end.unsupported,
        "heartbeat": liveness.unsupported,
        "native_stacks": native_stacks.unsupported,
        "hugepages": hugepages.unsupported,
        "reverse_dns": dnsfix.unsupported,
        "step_stop": worker.step_hook_unsupported,
        "cuda_watch": InitSiteTracker.unsupported,
        "shared_globals": shared_globals_guard,
    }[name]


@pytest.mark.parametrize("name", sorted(hooks.HOOKS))
def test_each_hooks_point_is_where_it_expects_it_in_the_installed_torch(name):
    """Fails when a torch (or Python, or platform) release moves what a hook
    relies on: then its guard steps aside, and this test says to look."""
    import torch.distributed  # noqa: F401  (what the launcher has imported when it installs them)
    import torch.optim  # noqa: F401

    why = _guard(name)()
    if name == "store":
        # torch 2.4-2.7: the default (libuv) backend refuses a bound socket, the other one takes it.
        from accel_magics.kernel_ext.supervisor import rendezvous

        legacy = (2, 4) <= _torch_version() < (2, 8)
        assert rendezvous._prebound_backend == ({"use_libuv": False} if legacy else {}), why
    if name == "hugepages" and why and not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip(f"this machine has no transparent huge pages: {why}")
    assert why is None, f"hook {name} would step aside here: {why}"


# -- each hook turned off by name ----------------------------------------------------------------------

# For each hook: Python run in a fresh interpreter with ACCEL_MAGICS_DISABLE=<name>, installing it
# the way the product does, then printing what a user would see of it.  `seen` is a JSON-able
# value, compared with what it is with the hook on.
_INSTALL = {
    "store": """
        import torch.distributed
        from accel_magics.kernel_ext.supervisor import rendezvous
        rendezvous.install_store_hook()
        seen = rendezvous.prebound
    """,
    "keep_groups": """
        import torch.distributed as dist
        from accel_magics.kernel_ext.rank import pg_guard
        pg_guard.install()
        seen = getattr(dist.destroy_process_group, "_accel_magics_guard", False)
    """,
    "tqdm": """
        from accel_magics.kernel_ext.rank import rank_bars
        rank_bars.install(lambda event: True)
        import tqdm
        seen = getattr(tqdm.std.tqdm, "_accel_patched", False)
    """,
    "script_end": """
        import atexit
        from accel_magics.kernel_ext.rank import script_end
        atexit.register(int)
        script_end.begin()
        seen = atexit._ncallbacks() == 0
    """,
    "heartbeat": """
        from accel_magics.kernel_ext.rank import liveness
        counter = liveness.new_counter()
        liveness.install(counter)
        seen = liveness.read(counter) > 0
    """,
    "native_stacks": """
        import os
        from accel_magics.kernel_ext.supervisor import native_stacks
        native_stacks.install()
        seen = native_stacks.on
    """,
    "hugepages": """
        from accel_magics.kernel_ext.launcher.hugepages import Collapser
        collapser = Collapser()
        collapser.plan()
        seen = bool(collapser.supported)
    """,
    "reverse_dns": """
        import torch.distributed
        from accel_magics.kernel_ext.launcher import dnsfix
        seen = dnsfix.install()
    """,
    "step_stop": """
        import torch.optim
        from accel_magics.kernel_ext.rank import worker
        worker._install_step_hook()
        seen = worker._step_hook is not False
    """,
    "cuda_watch": """
        import torch
        from accel_magics.kernel_ext.kernel.preflight import InitSiteTracker
        tracker = InitSiteTracker()
        hooks.install("cuda_watch", tracker.install, guard=tracker.unsupported)
        seen = getattr(torch.cuda._lazy_init, "_accel_magics_wrapped", False)
    """,
    "shared_globals": """
        import numpy as np
        from accel_magics.kernel_ext.wire.payload import build_payload
        big = np.ones(3_000_000)
        payload = build_payload("big.sum()", {"big": big})
        seen = payload.shared is not None
        payload.release()
    """,
}
for _name in ("round_keys", "join_wait", "world_size_check", "init_events"):
    _INSTALL[_name] = f"""
        import torch.distributed as dist
        from accel_magics.kernel_ext.rank import pg_guard
        pg_guard.install()
        seen = pg_guard.on["{_name}"]
    """


def _install_in_a_fresh_interpreter(name: str, disable: str) -> tuple[object, str, str]:
    code = "\n".join([
        "import json, logging, re, sys",
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr, format='%(name)s: %(message)s')",
        "import torch",
        "torch_version = tuple(int(p) for p in re.match(r'(\\d+)\\.(\\d+)', torch.__version__).groups())",
        "from accel_magics.kernel_ext import hooks",
        textwrap.dedent(_INSTALL[name]),
        f"print(json.dumps([seen, hooks.state({name!r}).value]))",
    ])
    env = {**os.environ, "ACCEL_MAGICS_DISABLE": disable}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    seen, state = json.loads(done.stdout.strip().splitlines()[-1])
    return seen, state, done.stderr


def test_every_hook_has_an_opt_out_case():
    assert set(_INSTALL) == set(hooks.HOOKS)


@pytest.mark.parametrize("name", sorted(hooks.HOOKS))
def test_each_hook_can_be_turned_off_by_name_and_says_so_in_the_log(name):
    seen_on, state_on, log_on = _install_in_a_fresh_interpreter(name, "")
    seen_off, state_off, log_off = _install_in_a_fresh_interpreter(name, f"unrelated_name_is_ignored_here,{name}")
    if name == "hugepages" and state_on != "installed":
        pytest.skip(f"no huge pages here: {log_on.strip()[-200:]}")
    assert (seen_on, state_on) == (True, "installed"), log_on
    assert f"hook {name} installed" in log_on
    assert (seen_off, state_off) == (False, "disabled"), log_off
    assert f"hook {name} disabled: ACCEL_MAGICS_DISABLE" in log_off


def test_a_run_with_every_hook_off_is_a_plain_run_and_the_launcher_log_says_so(monkeypatch):
    """ACCEL_MAGICS_DISABLE=all: the store is created eagerly, torch.distributed is
    torch's own, and a cell with a process group works.  (Not a re-initialised
    world: without round_keys that is racy in torch itself, as under torchrun.)"""
    monkeypatch.setenv("ACCEL_MAGICS_DISABLE", "all")
    src = textwrap.dedent("""
        import torch, torch.distributed as dist
        from accel_magics.kernel_ext import hooks
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        dist.all_reduce(t)
        dist.destroy_process_group()
        wrapped = [f for f in ("init_process_group", "destroy_process_group", "new_group")
                   if getattr(getattr(dist, f), "_accel_magics_guard", False)]
        states = {k: v[0].value for k, v in hooks.states().items()}
        total = t.item()
    """)
    launcher = Launcher()
    try:
        result = execute(launcher, LaunchConfig(num_processes=2),
                         build_payload(src, {}, return_names=["wrapped", "states", "total"]))
        log = open(launcher.log_path).read()
    finally:
        launcher.close()
    assert result.returns["total"] == 6.0
    assert result.returns["wrapped"] == []
    rank_side = {name for name, hook in hooks.HOOKS.items() if hook.process in ("rank", "launcher", "supervisor")}
    assert {k: v for k, v in result.returns["states"].items() if k in rank_side} == \
        {name: "disabled" for name in rank_side}
    for name in rank_side:
        assert f"hook {name} disabled" in log


# -- keep_groups lets its groups go at safe points ------------------------------------------------------

ROUNDS = """
import os, torch, torch.distributed as dist
seen = []
for round_ in range(ROUNDS):
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    seen.append((len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))))
# The least of five rounds, early and late: a socket or thread of the last round may still be
# closing as it is counted (one fd more at round 5, torch 2.6 beside busy loops); a leak is in every round.
print("rounds", min(seen[4:9]), min(seen[-5:]))
"""


def _rounds(kernel, count: int, flags: str = "-n 2") -> list[tuple]:
    res = kernel.run(f"%%distributed --output text {flags}\n" + ROUNDS.replace("ROUNDS", str(count)),
                     timeout=120)
    assert res.status == "ok", res.error_text + res.stderr
    found = re.findall(r"\[rank (\d)\] rounds \((\d+), (\d+)\) \((\d+), (\d+)\)", res.stdout)
    assert len(found) == 2, res.stdout
    return [tuple(map(int, f[1:])) for f in found]


def test_destroy_and_init_rounds_keep_fds_and_threads_flat_in_a_cell_and_a_session(clean_kernel):
    """Kept groups (each holds the sockets and threads of its round) go once the
    next round is set up: 50 rounds in one cell, and two cells of a session,
    end with the fds and threads of rounds 5 to 9 (the least of five rounds each)."""
    for fifth_fds, fifth_threads, last_fds, last_threads in _rounds(clean_kernel, 50):
        assert (last_fds, last_threads) == (fifth_fds, fifth_threads)
    clean_kernel.ok("%distributed_session start -n 2")
    try:
        first = _rounds(clean_kernel, 25, "--session")
        second = _rounds(clean_kernel, 25, "--session")
    finally:
        clean_kernel.run("%distributed_session stop", timeout=60)
    for (f5, t5, f25, t25), (g5, u5, g25, u25) in zip(first, second):
        assert (f25, t25) == (f5, t5) and (g5, u5, g25, u25) == (f5, t5, f5, t5)


def test_a_name_that_is_no_hook_is_a_usage_error_before_anything_runs(clean_kernel):
    clean_kernel.ok("%env ACCEL_MAGICS_DISABLE=tqmd")
    try:
        res = clean_kernel.run("%%distributed -n 2\nprint('ran')")
    finally:
        clean_kernel.ok("%env ACCEL_MAGICS_DISABLE=")
    assert res.error["ename"] == "UsageError" and "'tqmd', which is not a hook" in res.error["evalue"]
    assert "Nothing was launched" in res.error["evalue"] and "ran" not in res.stdout


def test_a_rank_that_skips_a_round_makes_its_peer_fail_at_once_as_under_torchrun(clean_kernel):
    """Rank 0 destroys and re-inits the world; rank 1 goes on with a collective
    on the first round's group.  Nothing else holds that group, so it goes at
    the destroy as torch lets it go: rank 1's all_reduce fails at once
    (connection closed), and no sum is printed.  Kept open, rank 1 waited for
    ever and rank 0 in the next round's set-up."""
    started = time.monotonic()
    res = clean_kernel.run(textwrap.dedent("""\
        %%distributed -n 2 --output text --timeout 60
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dist.barrier()
        if rank == 0:
            dist.destroy_process_group()
            dist.init_process_group("gloo")
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t)
        print("sum", t.item())
        """), timeout=90)
    assert res.status == "error" and time.monotonic() - started < 20, res.error_text
    assert re.search(r"rank 1 failed: .*Connection (closed|reset) by peer", res.error["evalue"]), res.error_text
    assert "sum" not in res.stdout
