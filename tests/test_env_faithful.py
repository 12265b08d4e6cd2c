"""The environment at the cell's start, as a process torchrun starts sees it (issue 44, item 3).

Ranks are forked from a launcher that imported torch (and the modules cells
use) once; what torch and those modules read from the environment as they
loaded must still be what a new process would read.  Here, in real kernels
with real gloo ranks: a variable changed in the kernel after earlier cells
takes effect in the next cell (a fresh launcher), one that no import depends
on leaves the launcher alone, and torch elastic's ``TORCHELASTIC_ERROR_FILE``
is there, as torchrun sets it, with what ``@record`` writes feeding the root
cause.  The torchrun references run torchrun itself on this torch.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from accel_magics.kernel_ext.kernel.fold import failure_of_exit
from conftest import LoadedKernel
from kernel_harness import KernelSession, descendants, listening_ports, temp_entries, wait_until

pytestmark = pytest.mark.timeout(240)

LAUNCHER = "launcher = get_ipython().magics_manager.registry['DistributedMagics'].state.launcher"

MISMATCH = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(2 if dist.get_rank() == 0 else 3)\n"
            "dist.all_reduce(t)\n"
            "print('sum', t.tolist())\n")

#: Each rank prints what it caught: the same two lines under torchrun and in a cell.
MISMATCH_CAUGHT = MISMATCH.replace("dist.all_reduce(t)\n", "try:\n    dist.all_reduce(t)\nexcept RuntimeError as e:\n"
                                   "    print('caught', str(e).splitlines()[0])\n")

LEVEL = "%%distributed -n 2 --output text\nimport torch.distributed as dist\nprint('level', dist.get_debug_level())\n"

INIT = ("%%distributed -n 2 --output text\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\ndist.barrier()\ndist.destroy_process_group()\nprint('done')\n")


def by_rank(text: str) -> dict[int, list[str]]:
    ranks: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"\[rank (\d+)\] ?(.*)$", line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return ranks


@pytest.fixture(scope="module")
def kernel():
    k = LoadedKernel()
    k.ok("import os\n" + LAUNCHER)
    try:
        yield k
    finally:
        k.shutdown()


def replaced(k: LoadedKernel, before: int) -> int:
    """The kernel's launcher is a new one (the old one and its directory gone):
    its pid, taken as the kernel's baseline from now on."""
    now = k.launcher_pid()
    assert now != before, "the launcher was not replaced"
    k.wait_quiet()
    k.zygote = now
    dirs = {e for e in temp_entries(k.tmpdir) if e.startswith("accel_magics-")}
    assert len(dirs) == 1, f"one launcher directory, the new one's: {dirs}"
    k.base_temp = {e for e in k.base_temp if not e.startswith("accel_magics-")} | dirs
    k.base_ports = listening_ports({k.pid} | descendants(k.pid))
    return now


@pytest.fixture
def env_kernel(kernel):
    """The module's kernel; after the test, the variables it set are unset again
    (a fresh launcher then, if they mattered) and nothing is left behind."""
    yield kernel
    before = kernel.launcher_pid()
    out = kernel.ok("print(sorted(n for n in ('TORCH_DISTRIBUTED_DEBUG', 'TORCH_CPP_LOG_LEVEL', 'ACCEL_MAGICS_DISABLE',"
                    " 'ACCEL_TEST_PLAIN') if os.environ.pop(n, None) is not None))").stdout
    if out.strip() != "[]":
        kernel.ok("%%distributed -n 2 --output text\npass", timeout=120)
        if out.strip() != "['ACCEL_TEST_PLAIN']":
            replaced(kernel, before)
    kernel.assert_no_leaks()


def torchrun(script: str, tmp_path, env: dict) -> dict[int, list[str]]:
    """What each of torchrun's 2 ranks printed (stdout and stderr) for ``script``."""
    path = tmp_path / "script.py"
    path.write_text(script)
    (tmp_path / "tmp").mkdir(exist_ok=True)   # torch elastic's agent keeps a torchelastic_* folder there
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--tee", "3",
                           "--master_port", str(port), str(path)], capture_output=True, text=True, timeout=200,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", **env,
                                             "TMPDIR": str(tmp_path / "tmp")})
    ranks: dict[int, list[str]] = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"\[default(\d+)\]:(.*)$", line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return ranks


# -- a variable torch reads as it loads, changed after earlier cells --------------------------

def test_a_debug_level_set_after_earlier_cells_detects_a_mismatched_collective_as_torchrun(env_kernel, tmp_path):
    """`%env TORCH_DISTRIBUTED_DEBUG=DETAIL` after cells ran: torch read the
    variable when the launcher imported it, and a shape-mismatched all_reduce
    returned a wrong sum on rank 0 without a word.  Now the next cell's ranks
    are at DETAIL and fail with torch's own message, the one torchrun's
    ranks print on this torch; unsetting it goes back to OFF."""
    k = env_kernel
    reference = {rank: [line for line in lines if line.startswith("caught")]
                 for rank, lines in torchrun(MISMATCH_CAUGHT, tmp_path, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).items()}
    assert all(lines and "Detected mismatch between collectives on ranks" in lines[0] for lines in reference.values()) \
        and sorted(reference) == [0, 1], reference
    assert by_rank(k.ok(LEVEL).stdout) == {0: ["level DebugLevel.OFF"], 1: ["level DebugLevel.OFF"]}
    before = k.launcher_pid()
    k.ok("import logging\n_records = []\n_h = logging.Handler()\n_h.emit = _records.append\n"
         "logging.getLogger('accel_magics.launcher').addHandler(_h)\n"
         "logging.getLogger('accel_magics.launcher').setLevel(logging.INFO)")
    k.ok("%env TORCH_DISTRIBUTED_DEBUG=DETAIL")
    assert by_rank(k.ok(LEVEL, timeout=120).stdout) == {0: ["level DebugLevel.DETAIL"], 1: ["level DebugLevel.DETAIL"]}
    replaced(k, before)
    said = k.ok("logging.getLogger('accel_magics.launcher').removeHandler(_h)\n"
                "print([r.getMessage() for r in _records])").stdout
    assert "replacing the launcher process" in said and "TORCH_DISTRIBUTED_DEBUG changed" in said, said

    caught = by_rank(k.ok("%%distributed -n 2 --output text\n" + MISMATCH_CAUGHT).stdout)
    assert {rank: [line for line in lines if line.startswith("caught")] for rank, lines in caught.items()} == reference
    res = k.run("%%distributed -n 2 --output text\n" + MISMATCH, timeout=120)
    assert res.status == "error"
    assert "sum" not in res.stdout, "a rank went on with a wrong sum"
    root = re.search(r"DistributedRunError: rank ([01]) failed: RuntimeError: (Detected mismatch between .*?) "
                     r"\(ranks that failed|DistributedRunError: rank ([01]) failed: RuntimeError: (Detected .*)$",
                     res.error_text, re.M)
    assert root, res.error_text[-3000:]
    rank, message = (root.group(1), root.group(2)) if root.group(1) else (root.group(3), root.group(4))
    assert f"caught {message}" == reference[int(rank)][0], (message, reference)

    before = k.launcher_pid()
    k.ok("del os.environ['TORCH_DISTRIBUTED_DEBUG']")
    assert by_rank(k.ok(LEVEL, timeout=120).stdout) == {0: ["level DebugLevel.OFF"], 1: ["level DebugLevel.OFF"]}
    replaced(k, before)


def test_cpp_log_level_set_in_the_kernel_makes_c10d_log_as_under_torchrun(env_kernel, tmp_path):
    """TORCH_CPP_LOG_LEVEL is read by libtorch as it loads: INFO set in the
    kernel after the launcher imported torch made no c10d line appear.  Now
    each rank logs its store connection, as torchrun's ranks do; unset, none."""
    k = env_kernel
    reference = torchrun(INIT[INIT.index("\n") + 1:], tmp_path, {"TORCH_CPP_LOG_LEVEL": "INFO"})
    line = re.compile(r"\[I\d{4} [\d:. ]+\S+\] \[c10d\] The client socket has connected to")
    for rank in (0, 1):
        assert any(line.search(text) for text in reference.get(rank, [])), reference
    quiet = by_rank(k.ok(INIT).stdout)
    assert not any(line.search(text) for lines in quiet.values() for text in lines), quiet
    before = k.launcher_pid()
    k.ok("%env TORCH_CPP_LOG_LEVEL=INFO")
    loud = by_rank(k.ok(INIT, timeout=120).stdout)
    for rank in (0, 1):
        assert any(line.search(text) for text in loud.get(rank, [])), loud
    before = replaced(k, before)
    k.ok("del os.environ['TORCH_CPP_LOG_LEVEL']")
    again = by_rank(k.ok(INIT, timeout=120).stdout)
    assert not any(line.search(text) for lines in again.values() for text in lines), again
    replaced(k, before)


def test_only_a_variable_an_import_depends_on_replaces_the_launcher(env_kernel):
    """A new variable no import looked up (and what the kernel does between
    cells: %time, %cd, a shell command) reaches the ranks' os.environ
    with the same launcher; ACCEL_MAGICS_DISABLE, which the launcher's hooks
    read as they install, gets a fresh one."""
    k = env_kernel
    before = k.launcher_pid()
    k.ok("%env ACCEL_TEST_PLAIN=1")
    k.ok("%time _x = 1")
    k.ok("%cd /")
    k.ok("!true")
    k.ok("%cd -")
    out = by_rank(k.ok("%%distributed -n 2 --output text\nimport os\nprint(os.environ['ACCEL_TEST_PLAIN'])").stdout)
    assert out == {0: ["1"], 1: ["1"]}
    assert k.launcher_pid() == before, "a variable no import read replaced the launcher"
    k.ok("%env ACCEL_MAGICS_DISABLE=tqdm")
    out = by_rank(k.ok("%%distributed -n 2 --output text\nimport os\nprint(os.environ['ACCEL_MAGICS_DISABLE'])",
                       timeout=120).stdout)
    assert out == {0: ["tqdm"], 1: ["tqdm"]}
    replaced(k, before)


def test_a_change_right_after_load_ext_reaches_the_first_cell():
    """The issue's case: `%load_ext` starts the launcher (it imports torch
    meanwhile), `%env` follows at once, the first cell runs at DETAIL."""
    k = KernelSession(extra_env={"PYTHONUNBUFFERED": "1"})
    try:
        k.ok("%load_ext accel_magics")
        k.ok("%env TORCH_DISTRIBUTED_DEBUG=DETAIL")
        assert by_rank(k.ok(LEVEL, timeout=120).stdout) == {0: ["level DebugLevel.DETAIL"],
                                                             1: ["level DebugLevel.DETAIL"]}
    finally:
        k.shutdown()


def test_a_session_keeps_its_launcher_and_says_so(env_kernel):
    """A session alive on the launcher would die with it: the cell runs on the
    old launcher, and a warning names the variable and says how to get it;
    once the session is stopped, the next cell has it."""
    k = env_kernel
    before = k.launcher_pid()
    k.ok("%distributed_session start -n 2", timeout=120)
    try:
        k.ok("%env TORCH_DISTRIBUTED_DEBUG=DETAIL")
        res = k.ok(LEVEL)
        assert by_rank(res.stdout) == {0: ["level DebugLevel.OFF"], 1: ["level DebugLevel.OFF"]}
        assert "TORCH_DISTRIBUTED_DEBUG changed in the kernel" in res.stderr, res.stderr
        assert "%distributed_session stop" in res.stderr and "fresh launcher" in res.stderr, res.stderr
        assert k.launcher_pid() == before
    finally:
        k.ok("%distributed_session stop", timeout=60)
    assert by_rank(k.ok(LEVEL, timeout=120).stdout) == {0: ["level DebugLevel.DETAIL"], 1: ["level DebugLevel.DETAIL"]}
    replaced(k, before)


# -- TORCHELASTIC_ERROR_FILE -------------------------------------------------------------

RECORDED = (
    "%%distributed -n 2 --output text\n"
    "import os\n"
    "from torch.distributed.elastic.multiprocessing.errors import record\n"
    "path = os.environ['TORCHELASTIC_ERROR_FILE']\n"
    "print('file', path, os.path.isdir(os.path.dirname(path)), os.path.exists(path))\n"
    "import torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "dist.barrier()   # both have printed\n"
    "@record\n"
    "def main():\n"
    "    if os.environ['RANK'] == '1':\n"
    "        raise KeyError('recorded boom')\n"
    "try:\n"
    "    main()\n"
    "except KeyError:\n"
    "    os._exit(3)   # the exception never reaches the run: only its error file tells\n"
)


def test_record_writes_the_error_file_and_the_root_cause_is_its_exception(env_kernel):
    """Each rank has TORCHELASTIC_ERROR_FILE, laid out as torchrun's
    (<run>/attempt_<n>/<local rank>/error.json, the folder made, no file yet);
    a rank that ends with os._exit after @record recorded its exception fails
    with that exception and its traceback, as torchrun reports it; the run's
    folder is gone afterwards."""
    k = env_kernel
    res = k.run(RECORDED, timeout=120)
    assert res.status == "error"
    files = {rank: lines[0].split() for rank, lines in by_rank(res.stdout).items()}
    assert sorted(files) == [0, 1], res.stdout
    for rank, (_, path, folder_made, exists) in files.items():
        assert re.search(rf"/torchelastic_[0-9a-f]+/attempt_0/{rank}/error\.json$", path), path
        assert (folder_made, exists) == ("True", "False")
        run_dir = os.path.dirname(os.path.dirname(os.path.dirname(path)))
        wait_until(lambda: not os.path.exists(run_dir), 10, "the run's folder of error files to be removed")
    assert "DistributedRunError: rank 1 failed: KeyError: 'recorded boom' (recorded by @record in its " \
           "TORCHELASTIC_ERROR_FILE; the rank then exited with code 3)" in res.error_text, res.error_text
    assert "--- rank 1 traceback (root cause) ---" in res.error_text
    assert "raise KeyError('recorded boom')" in res.error_text, res.error_text
    k.wait_quiet()
    private = next(os.path.join(k.tmpdir, e) for e in os.listdir(k.tmpdir) if e.startswith("accel_magics-"))
    assert not [e for e in os.listdir(private) if e.startswith("torchelastic")], os.listdir(private)


def test_an_error_file_of_each_attempt(env_kernel):
    """--max_restarts: each attempt's ranks have the file of their attempt
    (attempt_<restart count>), as torchrun's restarted workers do."""
    k = env_kernel
    res = k.ok("%%distributed -n 2 --max_restarts 1 --output text\nimport os\n"
               "print('file', os.environ['TORCHELASTIC_RESTART_COUNT'], os.environ['TORCHELASTIC_ERROR_FILE'])\n"
               "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '0':\n"
               "    raise ValueError('first attempt')\n", timeout=120)
    seen = [line.split()[1:] for lines in by_rank(res.stdout).values() for line in lines if line.startswith("file")]
    assert len(seen) == 2 and {count for count, _ in seen} == {"1"}, res.stdout   # the view shows the last attempt
    for count, path in seen:
        assert re.search(r"/torchelastic_[0-9a-f]+/attempt_1/[01]/error\.json$", path), path


def _spec_of(private: str, run_id: str, attempt: int = 0, ranks: int = 2) -> dict:
    from accel_magics.kernel_ext.environment import error_dir, error_file as error_path

    return {"error_dir": error_dir(private, run_id), "attempt": attempt,
            "rank_env": [{"TORCHELASTIC_ERROR_FILE": error_path(private, run_id, attempt, i)} for i in range(ranks)]}


def _folders_made(spec: dict) -> bool:
    return all(os.path.isdir(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"])) for env in spec["rank_env"])


def test_an_idle_supervisors_error_folders_become_its_runs(tmp_path):
    """A spare makes its next run's folders ahead; the run takes them by a
    rename, and makes only what they lack (a restart's attempt, more ranks);
    a run whose folder is elsewhere makes its own and the spare's go."""
    from accel_magics.kernel_ext.supervisor import error_file

    private = str(tmp_path)
    ahead = error_file.make_ahead(private, 2)
    assert ahead is not None and os.path.isdir(os.path.join(ahead, "attempt_0", "1"))
    spec = _spec_of(private, "a1")
    error_file.prepare(spec, ahead)
    assert _folders_made(spec) and not os.path.exists(ahead)
    for run_id, attempt, ranks in (("a2", 1, 2), ("a3", 0, 3)):
        spec = _spec_of(private, run_id, attempt, ranks)
        error_file.prepare(spec, error_file.make_ahead(private, 2))
        assert _folders_made(spec), (run_id, os.listdir(private))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = _spec_of(str(elsewhere), "b1")
    error_file.prepare(spec, error_file.make_ahead(private, 2))
    assert _folders_made(spec)
    assert sorted(os.listdir(private)) == ["elsewhere", "torchelastic_a1", "torchelastic_a2", "torchelastic_a3"]


def test_a_killed_spares_error_folders_are_removed(env_kernel):
    """The launcher removes what an idle supervisor made ahead when it is
    killed before any run took it."""
    import signal

    k = env_kernel
    k.ok("%%distributed -n 2 --output text\npass\n", timeout=120)
    private = next(os.path.join(k.tmpdir, e) for e in os.listdir(k.tmpdir) if e.startswith("accel_magics-"))
    wait_until(lambda: [e for e in os.listdir(private) if e.startswith("errors-ahead-")], 30,
               "the spare's folders made ahead")
    (ahead,) = [e for e in os.listdir(private) if e.startswith("errors-ahead-")]
    os.kill(int(ahead.rsplit("-", 1)[1]), signal.SIGKILL)
    wait_until(lambda: not os.path.exists(os.path.join(private, ahead)), 30, "the killed spare's folders removed")


# -- the fold of a recorded failure (the environment's own parts: test_environment.py) ----

def test_a_recorded_exit_folds_into_the_recorded_exception():
    msg = {"kind": "exit", "rank": 1, "exitcode": 3, "signal": None, "stopped": False, "timestamp": 20.0,
           "recorded": {"exc_type": "KeyError", "message": "'x'", "traceback": "Traceback ...\nKeyError: 'x'\n",
                        "timestamp": 10.5, "secondary": False}}
    failure = failure_of_exit(1, msg)
    assert failure.kind == "exception" and failure.timestamp == 10.5 and failure.traceback.endswith("KeyError: 'x'\n")
    assert failure.summary.startswith("KeyError: 'x' (recorded by @record")
    plain = failure_of_exit(1, {**msg, "recorded": None})
    assert plain.kind == "exit" and plain.timestamp == 20.0


def test_a_rank_finds_its_temp_directory_in_the_kernels_environment(env_kernel):
    """The launcher imports with a temp directory of its own (what a module
    makes there at import is the launcher's, gone with its private directory);
    a rank, as a new process, finds the kernel's TMPDIR."""
    res = env_kernel.run("%%distributed -n 2 --output text\nimport os, tempfile\n"
                         "made = tempfile.mkdtemp()\nos.rmdir(made)\n"
                         "print('tmp', tempfile.gettempdir() == os.environ['TMPDIR'] == "
                         f"{env_kernel.tmpdir!r}, made.startswith({env_kernel.tmpdir!r}))\n", timeout=120)
    assert "[rank 0] tmp True True" in res.stdout and "[rank 1] tmp True True" in res.stdout, res.error_text
