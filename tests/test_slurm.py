"""``--launcher slurm`` on a real two-node Slurm cluster (issue 16).

The cluster (tests/slurm_cluster.py) is one slurmctld and two slurmd on this
machine; the kernel runs inside an allocation of both nodes, as after
``salloc -N 2`` or in an sbatch job.  Marked ``slurm`` (``-m slurm``; .ci/run
installs Slurm and runs them).  Without Slurm's packages they skip, saying why.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from cases import STOP_AS_SENT
from kernel_harness import KernelSession, listening_ports, typed, wait_until
from slurm_cluster import SlurmCluster, alive, missing

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

why = missing()
if why:
    pytest.skip(f"no Slurm test cluster: {why}", allow_module_level=True)

WORLD = ("%%distributed --launcher slurm -n 2 --output text\n"
         "import os, torch, torch.distributed as dist\n"
         "dist.init_process_group('gloo')\n"
         "t = torch.tensor([dist.get_rank() + 1.0])\n"
         "dist.all_reduce(t)\n"
         "print(f\"sum={t.item():g} rank={dist.get_rank()} local={os.environ['LOCAL_RANK']} "
         "node={os.environ['NODE_RANK']} world={dist.get_world_size()} on={os.environ['SLURMD_NODENAME']}\")\n"
         "dist.destroy_process_group()\n")


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster(nodes=2, cpus=2)
    try:
        yield c
    finally:
        c.stop()


class AllocKernel(KernelSession):
    """A kernel started inside an allocation of both nodes."""

    def __init__(self, cluster: SlurmCluster) -> None:
        self.cluster = cluster
        self.alloc = cluster.allocate(2)
        self.tmpdir = os.path.join(cluster.dir, f"tmp-{self.alloc['SLURM_JOB_ID']}")
        os.makedirs(self.tmpdir)
        super().__init__(extra_env={"PYTHONUNBUFFERED": "1", "TMPDIR": self.tmpdir, **self.alloc})
        self.ok("%load_ext accel_magics")

    @property
    def job(self) -> str:
        return self.alloc["SLURM_JOB_ID"]

    def processes(self) -> list[int]:
        """Every live process of this job's agents, launchers, supervisors and ranks (on any
        node: they all live on this machine) and srun: what carries the job id and our name."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            ours = b"accel_magics" in cmd or any(e.startswith(b"ACCEL_MAGICS_LAUNCHER=") for e in env)
            if ours and f"SLURM_JOB_ID={self.job}".encode() in env and int(pid) != self.pid:
                found.append(int(pid))
        return found

    def end(self) -> None:
        try:
            self.shutdown()
        finally:
            self.cluster.release(self.job)

    def end_now(self) -> None:
        """After a test that killed or shut the kernel down itself: make sure it is
        gone (whatever state it is in), and release the allocation."""
        try:
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass
        self.cluster.release(self.job)


@pytest.fixture(scope="module")
def kernel(cluster):
    k = AllocKernel(cluster)
    try:
        yield k
    finally:
        k.end()


def by_rank(text: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"\[rank (\d+)\] (.*)$", line)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


def test_a_two_node_cell_is_one_world_of_four_in_one_view(kernel):
    res = kernel.run(WORLD, timeout=240)
    assert res.status == "ok", res.error_text
    ranks = by_rank(res.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], res.stdout
    for rank, lines in ranks.items():
        node, local = divmod(rank, 2)
        assert lines == [f"sum=10 rank={rank} local={local} node={node} world=4 on=n{node + 1}"], lines
    # The record says which node each rank ran on.
    assert "n1" in res.stdout and "n2" in res.stdout


def test_a_breakpoint_on_node_2_prompts_in_the_notebook_through_its_agent(kernel):
    """Rank 3 (on n2) stops at breakpoint(): its prompt reaches the notebook,
    the answers go back through n2's agent; c lets every rank finish."""
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --timeout 120\nimport os\nz = 7\n"
                     "if os.environ['RANK'] == '3':\n    breakpoint()\nprint('done', z)\n",
                     timeout=240, stdin=typed("p z", "c"))
    assert res.status == "ok", res.error_text + res.stdout
    assert res.prompts == ["(Pdb rank 3) "] * 2, res.prompts
    ranks = by_rank(res.stdout)
    assert "7" in ranks[3] and all(ranks[r][-1] == "done 7" for r in range(4)), res.stdout


def test_a_breakpoint_in_a_slurm_session_cell_keeps_the_session(kernel):
    kernel.ok("%distributed_session start --launcher slurm -n 1", timeout=240)
    try:
        res = kernel.run("%%distributed --session --output text --timeout 120\nimport os\nz = 7\n"
                         "if os.environ['RANK'] == '1':\n    breakpoint()\n", timeout=240, stdin=typed("z = 8", "c"))
        assert res.status == "ok" and res.prompts == ["(Pdb rank 1) "] * 2, res.error_text + str(res.prompts)
        res = kernel.ok("%%distributed --session --output text\nprint('z', z)\n", timeout=120)
        assert by_rank(res.stdout) == {0: ["z 7"], 1: ["z 8"]}, res.stdout
    finally:
        kernel.ok("%distributed_session stop", timeout=120)


FAIL_ON_RANK_3 = ("%%distributed --launcher slurm -n 2 --output text --timeout 120\nimport os\n\n"
                  "def f(x):\n    y = x * 2\n    raise ValueError('no good')\n\n"
                  "if os.environ['RANK'] == '3':\n    print('pid', os.getpid())\n    f(21)\n")


def failed_on_node_2(kernel) -> int:
    """Rank 3 (on n2) fails and is held: its pid."""
    res = kernel.run(FAIL_ON_RANK_3, timeout=240)
    assert res.status == "error" and "rank 3 failed: ValueError: no good" in res.error["evalue"], res.error_text
    assert "%distributed_debug opens a post-mortem (pdb) in rank 3's failing frame" in res.error_text, res.error_text
    return int(re.search(r"^\[rank 3\] pid (\d+)$", res.stdout, re.M).group(1))


def test_post_mortem_of_a_failed_rank_on_node_2_through_its_agent(kernel):
    """%distributed_debug after a Slurm cell: pdb in rank 3's failing frame (on
    n2), its prompt and the answers through n2's agent; q ends it and the rank;
    the next cell runs on both nodes."""
    pid = failed_on_node_2(kernel)
    assert alive(pid)
    dbg = kernel.run("%distributed_debug", timeout=120, stdin=typed("p y", "q"))
    assert dbg.status == "ok", dbg.error_text + dbg.stdout + dbg.stderr
    assert dbg.prompts == ["(Pdb rank 3) "] * 2, dbg.prompts
    assert "[rank 3] 42" in dbg.stdout.splitlines() and "rank 3's post-mortem ended" in dbg.stdout, dbg.stdout
    wait_until(lambda: not alive(pid), 30, "the held rank to end after q")
    assert kernel.run("%distributed_debug", timeout=60).status == "error"   # nothing held any more
    assert kernel.run(WORLD, timeout=240).status == "ok"


def test_a_slurm_post_mortem_whose_supervisor_is_killed_ends_saying_so(kernel):
    """The held rank's supervisor on n2 killed (-9) while its post-mortem waits
    at a prompt: its agent says the supervisor exited, and %distributed_debug
    ends with that error instead of waiting; the next cell runs."""
    pid = failed_on_node_2(kernel)
    with open(f"/proc/{pid}/stat") as f:
        supervisor = int(f.read().rsplit(")", 1)[1].split()[1])

    def kill_then_answer(prompt: str) -> str:
        os.kill(supervisor, signal.SIGKILL)
        return "p y"

    dbg = kernel.run("%distributed_debug", timeout=120, stdin=kill_then_answer)
    assert dbg.status == "error" and "its supervisor is gone" in dbg.error["evalue"], dbg.error_text + dbg.stdout
    wait_until(lambda: not alive(pid), 30, "the held rank to end with its supervisor")
    assert kernel.run(WORLD, timeout=240).status == "ok"


def test_the_next_slurm_cell_lets_a_held_rank_go(kernel):
    pid = failed_on_node_2(kernel)
    res = kernel.run(WORLD, timeout=240)
    assert res.status == "ok", res.error_text
    wait_until(lambda: not alive(pid), 30, "the held rank to be let go by the next cell")
    again = kernel.run("%distributed_debug", timeout=60)
    assert again.status == "error" and "no failed rank is held" in again.error["evalue"], again.error_text


def test_post_mortem_in_a_slurm_session_cell_keeps_the_session(kernel):
    """A session on both nodes: rank 1 (on n2) fails in a cell and keeps its
    frames at its prompt; %distributed_debug opens them through n2's agent, q
    ends the post-mortem (not the rank), and the session's next cell runs."""
    kernel.ok("%distributed_session start --launcher slurm -n 1", timeout=240)
    try:
        res = kernel.run("%%distributed --session --output text --timeout 120\nimport os\n\n"
                         "def f(x):\n    y = x * 2\n    raise ValueError('no good')\n\n"
                         "if os.environ['RANK'] == '1':\n    f(21)\n", timeout=240)
        assert res.status == "error" and "rank 1 failed: ValueError: no good" in res.error["evalue"], res.error_text
        assert "%distributed_debug opens a post-mortem (pdb) in rank 1's failing frame" in res.error_text
        dbg = kernel.run("%distributed_debug", timeout=120, stdin=typed("p y", "q"))
        assert dbg.status == "ok" and dbg.prompts == ["(Pdb rank 1) "] * 2, dbg.error_text + str(dbg.prompts)
        assert "[rank 1] 42" in dbg.stdout.splitlines(), dbg.stdout
        assert "rank 1's post-mortem ended; the rank is back at the session's prompt" in dbg.stdout, dbg.stdout
        res = kernel.ok("%%distributed --session --output text\nimport os\nprint('on', os.environ['SLURMD_NODENAME'])\n",
                        timeout=120)
        assert by_rank(res.stdout) == {0: ["on n1"], 1: ["on n2"]}, res.stdout
    finally:
        kernel.ok("%distributed_session stop", timeout=120)


def test_rank_0s_value_and_return_names_come_back(kernel):
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --return where\nimport os\n"
                     "where = os.environ['SLURMD_NODENAME']\nint(os.environ['RANK']) * 10", timeout=120)
    assert res.status == "ok" and res.result == "0", res.error_text
    assert kernel.ok("where").result == "'n1'"


TRAIN = '''
import torch
from torch.utils.data import Dataset, DataLoader
from accelerate import Accelerator

class SyntheticImages(Dataset):
    """Small synthetic 'images': the class is which quadrant is brightest (no downloads)."""
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

def training_function(epochs=4, lr=3e-3, batch_size=16, seed=42):
    torch.manual_seed(seed)
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4))
    train = DataLoader(SyntheticImages(), batch_size=batch_size, shuffle=True)
    evald = DataLoader(SyntheticImages(128, seed=1), batch_size=batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt, train, evald = accelerator.prepare(model, opt, train, evald)
    for epoch in range(epochs):
        model.train()
        for x, y in train:
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step(); opt.zero_grad()
        model.eval(); correct = total = 0
        for x, y in evald:
            with torch.no_grad():
                pred = model(x).argmax(1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item(); total += len(y)
        accelerator.print(f"epoch {epoch}: {100 * correct / total:.1f}% world {accelerator.num_processes}")
    return correct / total
'''


def test_the_seed_tutorials_training_trains_on_two_nodes_as_on_one(kernel):
    kernel.ok(TRAIN)
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --return acc\nacc = training_function()",
                     timeout=240)
    assert res.status == "ok", res.error_text
    on_two = kernel.ok("acc").result
    assert "world 4" in res.stdout, res.stdout
    local = kernel.run("%%distributed --launcher local -n 4 --output text --return acc\nacc = training_function()",
                       timeout=240)
    assert local.status == "ok", local.error_text
    on_one = kernel.ok("acc").result
    assert float(on_two) >= 0.8 and abs(float(on_two) - float(on_one)) <= 0.05, (on_two, on_one)


def test_a_rank_failing_on_node_1_is_named_with_its_node_and_nothing_hangs(kernel):
    started = time.monotonic()
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text\nimport os, torch.distributed as dist\n"
                     "dist.init_process_group('gloo')\nif dist.get_rank() == 2:\n"
                     "    raise ValueError('bad shard on rank 2')\ndist.barrier()", timeout=120)
    assert time.monotonic() - started < 60
    assert res.error["ename"] == "DistributedRunError", res.error_text
    assert res.error["evalue"].startswith("rank 2 failed: ValueError: bad shard on rank 2 (on node n2)"), \
        res.error["evalue"]
    assert "--- rank 2 traceback (root cause) ---" in res.error_text
    assert kernel.run(WORLD, timeout=120).status == "ok"   # the next cell works


def test_a_rank_failing_before_the_rendezvous_stops_the_other_nodes_waiting_in_it(kernel):
    """Rank 0 (node n1) fails before init_process_group; node n2's ranks sit in it
    waiting for rank 0, which never comes (torch would wait 30 minutes): the kernel
    tells node n2 to stop, and the cell names rank 0 on n1 in seconds."""
    started = time.monotonic()
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text\nimport os, torch.distributed as dist\n"
                     "if os.environ['RANK'] == '0':\n    raise KeyError('no shard for rank 0')\n"
                     "dist.init_process_group('gloo')\ndist.barrier()", timeout=120)
    assert time.monotonic() - started < 30
    assert res.error["evalue"].startswith("rank 0 failed: KeyError: 'no shard for rank 0' (on node n1)"), \
        res.error_text
    assert kernel.run(WORLD, timeout=120).status == "ok"


def test_a_session_over_both_nodes_keeps_state_on_all_4_ranks_and_stops_cleanly(kernel):
    """%distributed_session start --launcher slurm: 2 ranks on each node, one world
    of 4 that stays across cells (a tensor and the process group), a failure on n2
    named with its node while the session lives on, then stop: no rank is left."""
    out = kernel.ok("%distributed_session start --launcher slurm -n 2", timeout=240).stdout
    assert "session started: 2 rank(s) on each of 2 node(s)" in out, out
    try:
        res = kernel.ok("%%distributed --session --output text\nimport os, torch, torch.distributed as dist\n"
                        "dist.init_process_group('gloo')\nkept = torch.tensor([dist.get_rank() + 1.0])\n"
                        "print(f\"rank {dist.get_rank()} on {os.environ['SLURMD_NODENAME']} pid {os.getpid()}\")",
                        timeout=120)
        first = by_rank(res.stdout)
        assert sorted(first) == [0, 1, 2, 3], res.stdout
        pids = {r: lines[-1].split()[-1] for r, lines in first.items()}
        assert [first[r][-1].split()[3] for r in range(4)] == ["n1", "n1", "n2", "n2"], first
        res = kernel.ok("%%distributed --session --output text --return total\n"
                        "t = kept.clone()\ndist.all_reduce(t)\ntotal = t.item()\n"
                        "print(f'kept {kept.item():g} sum {total:g} pid {os.getpid()}')", timeout=120)
        again = by_rank(res.stdout)
        for r in range(4):
            assert again[r][-1] == f"kept {r + 1} sum 10 pid {pids[r]}", again[r]   # same processes, same state
        assert kernel.ok("total").result == "10.0"
        bad = kernel.run("%%distributed --session --output text\nif dist.get_rank() == 2:\n"
                         "    raise ValueError('bad batch on n2')\n", timeout=120)
        assert bad.error["ename"] == "DistributedRunError", bad.error_text
        assert bad.error["evalue"].startswith("rank 2 failed: ValueError: bad batch on n2 (on node n2)"), bad.error_text
        assert "The session lives on" in bad.error_text, bad.error_text
        res = kernel.ok("%%distributed --session --output text\nprint('still', kept.item())", timeout=120)
        assert sorted(by_rank(res.stdout)) == [0, 1, 2, 3], res.stdout
        # A one-shot cell on the same agents while the session waits: its own ranks,
        # and the session's are untouched.
        assert kernel.run(WORLD, timeout=120).status == "ok"
        res = kernel.ok("%%distributed --session --output text\nprint('kept', kept.item(), os.getpid())",
                        timeout=120)
        assert [by_rank(res.stdout)[r][-1] for r in range(4)] == [f"kept {r + 1}.0 {pids[r]}" for r in range(4)]
        status = kernel.ok("%distributed_session status").stdout
        assert "4 rank(s), world size 4" in status, status
        assert re.search(r"^\s+2  n2 ", status, re.M), status   # where each rank is
        assert kernel.run("%%distributed --session --launcher local\npass").error["ename"] == "UsageError"
    finally:
        out = kernel.ok("%distributed_session stop", timeout=120).stdout
    assert "session stopped" in out, out
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") and alive(int(pid)) for pid in pids.values()), 15,
               "every session rank on both nodes to be gone")
    assert kernel.run(WORLD, timeout=120).status == "ok"   # the agents serve one-shot cells again


def _session_pids(kernel) -> list[int]:
    res = kernel.ok("%%distributed --session --output text\nimport os\nprint('pid', os.getpid())", timeout=120)
    return [int(lines[-1].split()[-1]) for lines in by_rank(res.stdout).values()]


def test_a_slurm_session_restarts_with_the_configs_cell_defaults_set(kernel):
    """`%distributed_config --launcher slurm --timeout 600 --output text`, then a
    session and `restart`: the session saved the config's defaults as its own
    options, so restart refused them as session options (after stopping the
    running session), leaving none."""
    kernel.ok("%distributed_config --launcher slurm --timeout 600 --output text")
    try:
        kernel.ok("%distributed_session start -n 1", timeout=240)
        before = _session_pids(kernel)
        out = kernel.ok("%distributed_session restart", timeout=240).stdout
        assert "session started: 1 rank(s) on each of 2 node(s)" in out, out
        after = _session_pids(kernel)
        assert len(after) == 2 and not set(after) & set(before), (before, after)   # fresh ranks
        # A refused restart leaves the running session alone.
        res = kernel.run("%distributed_session restart --timeout 5")
        assert res.error["ename"] == "UsageError" and "a cell option" in res.error["evalue"], res.error_text
        assert _session_pids(kernel) == after
    finally:
        kernel.run("%distributed_session stop", timeout=120)
        kernel.ok("%distributed_config --reset")


def test_a_slurm_session_cell_stopped_by_the_button_or_in_the_background_lives_on(kernel):
    """The stop button in a session cell on both nodes: every rank is back at its
    prompt with its state (and a cell's --timeout later is still the cell's: the
    stop's escalation does not outlive its cell); a background session cell returns at once, keeps the
    agents (a one-shot Slurm cell meanwhile is a UsageError) and its handle's
    wait() gives rank 0's value."""
    kernel.ok("%distributed_session start --launcher slurm -n 2", timeout=240)
    try:
        kernel.ok("%%distributed --session\nimport time\nstate = 41", timeout=120)

        def on_output(text, fired=[]):
            if text.count("looping") >= 4 and not fired:
                fired.append(True)
                kernel.interrupt()
        res = kernel.run("%%distributed --session --output text\nprint('looping', flush=True)\n"
                         "while True:\n    time.sleep(0.05)", timeout=120, on_output=on_output)
        assert res.error is not None and res.error["ename"] == "RunInterrupted", res.error_text
        assert all(f"rank {r}:" in res.error_text for r in range(4)), res.error_text   # every node's stacks
        res = kernel.ok("%%distributed --session --output text\nprint('state', state)", timeout=120)
        assert [lines[-1] for lines in by_rank(res.stdout).values()] == ["state 41"] * 4, res.stdout
        res = kernel.run("%%distributed --session --output text --timeout 3\n"
                         "def stuck_in_the_session():\n    time.sleep(3600)\nstuck_in_the_session()", timeout=120)
        assert res.error is not None and res.error["ename"] == "DistributedTimeoutError", res.error_text
        assert "exceeded --timeout 3s" in res.error["evalue"], res.error["evalue"]
        assert all(f"rank {r}:" in res.error_text for r in range(4)), res.error_text   # every node's stacks
        assert "stuck_in_the_session" in res.error_text and "The session lives on" in res.error_text, res.error_text
        kernel.ok("h = None", timeout=10)
        res = kernel.ok("%%distributed --session --background --output text\ntime.sleep(2)\nstate + 1",
                        timeout=60)
        busy = kernel.run("%%distributed --launcher slurm -n 2\npass", timeout=60)
        assert busy.error["ename"] == "UsageError" and "in the background" in busy.error["evalue"], busy.error_text
        kernel.ok("_h = _", timeout=10)
        assert kernel.ok("_h.wait(60)", timeout=90).result == "42"
    finally:
        kernel.ok("%distributed_session stop", timeout=120)


def test_a_stop_right_after_a_slurm_session_cell_was_sent_stops_that_cell_and_keeps_the_session(kernel):
    """As on one node (test_sessions.py): each node's agent passed the cell to its
    session supervisor, then the stop as a signal, which could overtake the cell;
    the supervisor, with no cell yet, dropped it and the kernel's escalation ended
    the session.  The agent now sends the stop after the cell, on the same socket."""
    from accel_magics.kernel_ext.timing import SESSION_STOP_WAIT

    kernel.ok("%distributed_session start --launcher slurm -n 1", timeout=240)
    try:
        for attempt in range(8):
            res = kernel.ok(STOP_AS_SENT, timeout=120)
            status, error, took = res.stdout.split()[-3:]
            assert (status, error) == ("stopped", "RunStopped"), (attempt, res.stdout)
            assert float(took) < SESSION_STOP_WAIT, (attempt, res.stdout)
        res = kernel.ok("%%distributed --session --output text\nprint('alive')", timeout=120)
        assert res.stdout.count("alive") == 2, res.stdout
    finally:
        kernel.ok("%distributed_session stop", timeout=120)


def test_a_slurm_session_lost_on_one_node_ends_on_every_node_and_says_so(kernel):
    """Rank 2 (n2) fails while the ranks of n1 wait for it in an all_reduce: n1's
    ranks cannot be brought back from gloo, so the session is lost, on every node;
    the error names rank 2 on n2, nothing of the session is left, and the next
    session cell says there is no session (and why the last one was lost)."""
    kernel.ok("%distributed_session start --launcher slurm -n 2", timeout=240)
    pids = _session_pids(kernel)
    kernel.ok("%%distributed --session\nimport os, time, torch, torch.distributed as dist\n"
              "dist.init_process_group('gloo')", timeout=120)
    started = time.monotonic()
    res = kernel.run("%%distributed --session --output text\nif dist.get_rank() == 2:\n"
                     "    raise ValueError('bad batch on n2')\ndist.all_reduce(torch.ones(1))\n"
                     "time.sleep(0.5)", timeout=120)
    assert res.error is not None, res.stdout
    assert time.monotonic() - started < 60
    assert "rank 2 failed: ValueError: bad batch on n2 (on node n2)" in res.error_text, res.error_text
    wait_until(lambda: not any(alive(pid) for pid in pids), 20, "every session rank on both nodes to be gone")
    if res.error["ename"] == "SessionLostError":
        again = kernel.run("%%distributed --session\npass", timeout=60)
        assert again.error["ename"] == "UsageError" and "no session is running" in again.error["evalue"], \
            again.error_text
    else:   # the gloo error reached every rank and the session lives on
        assert "The session lives on" in res.error_text, res.error_text
        kernel.ok("%distributed_session stop", timeout=120)
    kernel.ok("%distributed_session stop", timeout=60)   # nothing running: says so, no error
    assert kernel.run(WORLD, timeout=120).status == "ok"


def test_a_slurm_session_with_max_restarts_is_restarted_on_every_node_and_the_cell_runs_again(kernel):
    """`--max_restarts 1` on a Slurm session: rank 2 (n2) dies in a cell while
    the session holds `kept`; the session is lost on every node, its ranks
    start afresh on both nodes (a fresh rendezvous), the output says the state
    is gone, the cell runs again on the fresh ranks, and the session lives on."""
    kernel.ok("%distributed_session start --launcher slurm -n 2 --max_restarts 1", timeout=240)
    try:
        pids = _session_pids(kernel)
        kernel.ok("%%distributed --session\nkept = 1", timeout=120)
        res = kernel.ok("%%distributed --session --output text\nimport os\n"
                        "if 'kept' in globals() and os.environ['RANK'] == '2':\n    os._exit(3)\n"
                        "print('on', os.environ['SLURMD_NODENAME'], 'kept' in globals())", timeout=180)
        assert "restarting it on a fresh rendezvous (restart 1 of 1): its state is gone" in res.stdout, res.stdout
        assert "[rank 0] on n1 False" in res.stdout and "[rank 2] on n2 False" in res.stdout, res.stdout
        wait_until(lambda: not any(alive(pid) for pid in pids), 20, "every first session rank to be gone")
        assert kernel.ok("%%distributed --session\nkept = 2\nkept", timeout=120).result == "2"
    finally:
        kernel.ok("%distributed_session stop", timeout=120)
    assert kernel.run(WORLD, timeout=120).status == "ok"


def test_a_rank_on_node_2_that_leaves_before_init_process_group_ends_the_cell_naming_it(kernel):
    """Rank 2 (node n2) finishes the cell with sys.exit(0) before init_process_group;
    ranks 0, 1 (n1) and 3 (n2) wait in it for rank 2, which will never come: the
    cell ends in seconds naming rank 2 and its node, with where the others waited."""
    started = time.monotonic()
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text\nimport os, sys, torch.distributed as dist\n"
                     "if os.environ['RANK'] == '2':\n    sys.exit(0)\n"
                     "dist.init_process_group('gloo')\ndist.barrier()", timeout=120)
    took = time.monotonic() - started
    assert took < 30, f"the cell took {took:.1f}s"
    assert res.error is not None and res.error["ename"] == "DistributedStallError", res.error_text
    # Those already in init_process_group when the kernel stopped the run (rank 1 may still be importing).
    m = re.match(r"rank\(s\) ([\d, ]+) wait in init_process_group for rank 2 \(on node n2\), which had already "
                 r"finished the cell \(sys.exit\(0\)\)", res.error["evalue"])
    assert m and set(map(int, m.group(1).split(", "))) <= {0, 1, 3}, res.error["evalue"]
    assert "init_process_group" in res.error_text.split("where each unfinished rank was")[1], res.error_text
    assert kernel.run(WORLD, timeout=120).status == "ok"


@pytest.mark.parametrize("how", ["os._exit(0)", "SIGKILL"])
def test_a_rank_on_node_2_that_ends_after_init_while_the_others_wait_is_the_root_cause(kernel, how):
    """Rank 2 (node n2) ends right after init_process_group, with os._exit(0) (no
    exception, exit code 0) or killed, while the others wait in a barrier for it:
    their gloo errors are consequences, rank 2 on n2 is the root cause."""
    leave = "os._exit(0)" if how == "os._exit(0)" else "os.kill(os.getpid(), 9)"
    started = time.monotonic()
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text\nimport os, torch.distributed as dist\n"
                     "dist.init_process_group('gloo')\n"
                     f"if dist.get_rank() == 2:\n    {leave}\n"
                     "dist.barrier()", timeout=120)
    assert time.monotonic() - started < 30
    assert res.error is not None and res.error["ename"] == "DistributedRunError", res.error_text
    said = "exited with code 0 before the cell ended" if how == "os._exit(0)" else "killed by SIGKILL"
    assert res.error["evalue"].startswith(f"rank 2 failed: {said}"), res.error["evalue"]
    assert "(on node n2)" in res.error["evalue"], res.error["evalue"]
    assert kernel.run(WORLD, timeout=120).status == "ok"


def test_max_restarts_a_rank_on_node_2_failing_in_the_first_attempt_only_succeeds_in_the_second(kernel):
    """--max_restarts on the allocation: the failure on n2 ends the first attempt
    on both nodes; the second starts on both, on a fresh rendezvous, and all 4
    ranks finish it.  The record says which attempt."""
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --max_restarts 1 --return attempts\n"
                     "import os, torch, torch.distributed as dist\n"
                     "attempts = int(os.environ['TORCHELASTIC_RESTART_COUNT']) + 1\n"
                     "dist.init_process_group('gloo')\n"
                     "if dist.get_rank() == 3 and attempts == 1:\n"
                     "    raise RuntimeError('flaky node 2')\n"
                     "t = torch.ones(1)\ndist.all_reduce(t)\n"
                     "print(f'attempt {attempts} rank {dist.get_rank()} sum={t.item():g} "
                     "port={os.environ[\"MASTER_PORT\"]}')\n"
                     "dist.destroy_process_group()\nattempts", timeout=240)
    assert res.status == "ok", res.error_text
    assert res.result == "2", res.stdout
    ranks = by_rank(res.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], res.stdout
    for rank in range(4):
        assert any(line.startswith(f"attempt 2 rank {rank} sum=4") for line in ranks[rank]), ranks[rank]
    assert "flaky node 2" in res.stdout and "attempt 2 of 2" in res.stdout, res.stdout
    ports = set(re.findall(r"port=(\d+)", res.stdout))
    assert len(ports) == 1, ports   # only the second attempt reached the print
    assert kernel.ok("attempts").result == "2"


def test_max_restarts_on_the_allocation_the_last_attempts_error_is_the_cells(kernel):
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --max_restarts 1\n"
                     "import os\nif os.environ['RANK'] == '2':\n"
                     "    raise ValueError('attempt ' + os.environ['TORCHELASTIC_RESTART_COUNT'])", timeout=240)
    assert res.error["ename"] == "DistributedRunError", res.error_text
    assert res.error["evalue"].startswith("rank 2 failed: ValueError: attempt 1 (on node n2)"), res.error["evalue"]
    assert "[after 2 attempts]" in res.error["evalue"]


def test_a_background_slurm_run_returns_at_once_and_its_handle_gives_rank_0s_value(kernel):
    kernel.ok("import time as _t; _t0 = _t.monotonic()")
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --background --return where\n"
                     "import os, time, torch, torch.distributed as dist\n"
                     "dist.init_process_group('gloo')\n"
                     "t = torch.ones(1)\ndist.all_reduce(t)\ntime.sleep(2)\n"
                     "where = os.environ['SLURMD_NODENAME']\n"
                     "f\"{t.item():g} ranks\"", timeout=60)
    assert res.status == "ok", res.error_text
    assert any(text.startswith("<background run In[") for text in res.live), res.live   # the cell's value, shown
    # The notebook is free while it runs, and a second cell for the same agents says why it must wait.
    assert kernel.ok("_t.monotonic() - _t0 < 30").result == "True"
    busy = kernel.run("%%distributed --launcher slurm -n 2\npass")
    assert busy.error and busy.error["ename"] == "UsageError", busy.error_text
    assert "in the background" in busy.error["evalue"] and "h.wait()" in busy.error["evalue"]
    kernel.ok("h = _" + str(res.execution_count))
    assert kernel.ok("h.wait(120)", timeout=150).result == "'4 ranks'"
    assert kernel.ok("where").result == "'n1'"
    assert kernel.run(WORLD, timeout=120).status == "ok"   # the agents are free again


def test_a_background_slurm_run_stopped_by_its_handle_shows_every_nodes_stacks(kernel):
    marks = os.path.join(kernel.tmpdir, "bg-stop")
    os.makedirs(marks, exist_ok=True)
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --background\n"
                     "import os, time\ndef waiting_here():\n"
                     f"    open(os.path.join({marks!r}, os.environ['RANK']), 'w').write(str(os.getpid()))\n"
                     "    time.sleep(3600)\nwaiting_here()", timeout=60)
    assert res.status == "ok", res.error_text
    kernel.ok("h = _" + str(res.execution_count))
    wait_until(lambda: len(os.listdir(marks)) == 4, 60, "every rank on both nodes to be in the cell")
    started = time.monotonic()
    kernel.ok("h.stop()", timeout=60)
    assert time.monotonic() - started < 30
    err = kernel.run("h.wait(30)", timeout=60)
    assert err.error and err.error["ename"] == "RunStopped", err.error_text
    assert err.error_text.count("waiting_here") >= 4, err.error_text
    pids = [int(open(os.path.join(marks, name)).read()) for name in os.listdir(marks)]
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") and alive(pid) for pid in pids), 30,
               "every rank on both nodes to be gone")
    assert kernel.run(WORLD, timeout=120).status == "ok"


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_node_whose_supervisor_is_killed_ends_the_cell_naming_it(kernel, sig):
    """kill -9 of node n2's supervisor (rank 2's parent) mid-run: the cell ends with
    an error naming that node (nothing waits for its "finished"), and the next cell
    works (the agents start again).  SIGTERM (someone else's, e.g. a scheduler's):
    that supervisor stops its ranks, the other node is stopped, and the error says
    which node's supervisor it was."""
    def on_output(text, fired=[]):
        m = re.search(r"supervisor=(\d+)", text)
        if m and not fired:
            fired.append(True)
            os.kill(int(m.group(1)), getattr(signal, sig))
    started = time.monotonic()
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text\nimport os, time\n"
                     "if os.environ['RANK'] == '2':\n    print(f'supervisor={os.getppid()}', flush=True)\n"
                     "time.sleep(3600)", timeout=120, on_output=on_output)
    assert time.monotonic() - started < 30
    assert res.error is not None and "node 1 (n2)" in res.error_text, res.error_text
    if sig == "SIGTERM":
        assert res.error["ename"] == "RunTerminated", res.error_text
        assert "the run's supervisor on node 1 (n2) was sent SIGTERM" in res.error["evalue"], res.error_text
    assert kernel.run(WORLD, timeout=240).status == "ok"


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def agent_pid(k: "AllocKernel", node_id: int) -> int:
    for pid in k.processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if b"slurm_agent" in cmdline(pid) and f"SLURM_NODEID={node_id}".encode() in env:
            return pid
    raise AssertionError(f"no agent on node {node_id}")


@pytest.mark.parametrize("when", ["between cells", "during a cell", "as a cell is sent"])
def test_a_dead_agent_is_replaced_by_the_next_cell(kernel, when):
    """kill -9 of node n2's agent (srun may live on: its other task runs): a cell
    running then ends with an error in seconds, and the next cell finds the agent
    gone and starts the agents again, instead of failing.

    "as a cell is sent": killed a moment before the run reached it (CI: the
    kill of "between cells" landed as the next cell was sent), the agent never
    ran its part and never said so; n1's ranks waited in the rendezvous and
    the cell hung.  Made certain here: the agent is SIGSTOPped (its
    connection stays up, so the run is sent to it), then killed once n1's
    ranks run."""
    assert kernel.run(WORLD, timeout=240).status == "ok"
    pid = agent_pid(kernel, 1)
    if when == "between cells":
        os.kill(pid, signal.SIGKILL)
    else:
        expected = 4 if when == "during a cell" else 2   # "as a cell is sent": n1's ranks only
        if when == "as a cell is sent":
            os.kill(pid, signal.SIGSTOP)

        def on_output(text, fired=[]):
            if text.count("sleeping") >= expected and not fired:
                fired.append(True)
                os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        res = kernel.run("%%distributed --launcher slurm -n 2 --output text\nimport time\n"
                         "print('sleeping', flush=True)\ntime.sleep(3600)", timeout=120, on_output=on_output)
        assert res.error is not None and time.monotonic() - started < 30, res.error_text
        assert "the agent on node 1 (n2) ended during the run" in res.error_text, res.error_text
    wait_until(lambda: pid not in kernel.processes(), 10, "the agent to be gone")
    res = kernel.run(WORLD, timeout=240)
    assert res.status == "ok", res.error_text
    assert sorted(by_rank(res.stdout)) == [0, 1, 2, 3], res.stdout


def test_the_stop_button_stops_every_rank_on_every_node_within_seconds(kernel):
    def on_output(text, fired=[]):
        if text.count("entering the barrier") >= 4 and not fired:
            fired.append(True)
            kernel.interrupt()
    started = time.monotonic()
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text\nimport os, time, torch.distributed as dist\n"
                     "dist.init_process_group('gloo')\nprint('entering the barrier', flush=True)\n"
                     "if dist.get_rank() == 3:\n    time.sleep(3600)\ndist.barrier()", timeout=120,
                     on_output=on_output)
    assert res.error is not None and res.error["ename"] == "RunInterrupted", res.error_text
    assert time.monotonic() - started < 30
    assert all(f"rank {r}:" in res.error_text for r in range(4)), res.error_text   # stacks from both nodes
    assert "time.sleep(3600)" in res.error_text and "barrier" in res.error_text


def test_a_timeout_shows_the_stacks_of_both_nodes(kernel):
    res = kernel.run("%%distributed --launcher slurm -n 2 --output text --timeout 4\nimport time\n"
                     "def stuck_on_this_node():\n    time.sleep(3600)\nstuck_on_this_node()", timeout=120)
    assert res.error["ename"] == "DistributedTimeoutError", res.error_text
    assert all(f"rank {r}:" in res.error_text for r in range(4)) and "stuck_on_this_node" in res.error_text


def test_bad_slurm_flags_are_usage_errors_before_anything_starts(kernel):
    for flags, words in (("--num_nodes 3", "has only 2 node(s)"), ("--node_rank 1", "cannot be given"),
                         ("--master_addr 10.0.0.1", "cannot be given"),
                         ("--session", "no session is running")):
        res = kernel.run(f"%%distributed --launcher slurm -n 2 {flags}\npass")
        assert res.error and res.error["ename"] == "UsageError" and words in res.error["evalue"], (flags, res.error_text)
    out = kernel.ok("%distributed_config --launcher slurm").stdout
    assert "n[1-2]" in out and "launcher slurm" in out, out
    kernel.ok("%distributed_config --reset")


def test_no_allocation_is_a_usage_error():
    k = KernelSession(extra_env={"SLURM_JOB_ID": "", "SLURM_JOBID": ""})
    try:
        k.ok("%load_ext accel_magics")
        res = k.run("%%distributed --launcher slurm\npass")
        assert res.error["ename"] == "UsageError" and "needs a Slurm allocation" in res.error["evalue"]
        assert "salloc" in res.error["evalue"]
    finally:
        k.shutdown()


@pytest.mark.parametrize("how", ["kill", "shutdown", "restart"])
def test_nothing_outlives_the_kernel_on_any_node_nor_in_squeue(cluster, how):
    k = AllocKernel(cluster)
    try:
        assert k.run(WORLD, timeout=240).status == "ok"
        k.kc.execute("%%distributed --launcher slurm -n 2 --output text\nimport time\ntime.sleep(3600)")
        # srun, 2 agents, their launchers, 2 supervisors and 4 ranks at least
        wait_until(lambda: len(k.processes()) >= 11, 60, "the agents and a run on both nodes")
        assert cluster.steps(k.job), "the agents' step is not in squeue"
        k.kc.stop_channels()
        if how == "kill":
            os.kill(k.pid, signal.SIGKILL)
        elif how == "restart":   # the kernel menu's Restart: a graceful shutdown, then a fresh kernel
            k.km.restart_kernel(now=False)
        else:
            k.km.shutdown_kernel(now=False)
        wait_until(lambda: not k.processes(), 15, "every process of the run on both nodes to end")
        wait_until(lambda: not cluster.steps(k.job), 15, "the agents' step to leave squeue")
        # No file either: srun's log has no name, the nodes' launchers remove their directories.
        wait_until(lambda: not os.listdir(k.tmpdir), 10, f"the kernel's temp dir to be empty: {os.listdir(k.tmpdir)}")
    finally:
        k.end_now()


def test_a_background_slurm_run_s_failed_rank_opens_in_its_handle_s_debug(kernel):
    """A --background Slurm run in which rank 3 (on n2) fails: h.wait() raises
    its error, which names h.debug(); h.debug() opens the post-mortem through
    n2's agent in the calling cell's input box; q ends it (and the rank: see
    the foreground test)."""
    res = kernel.run(FAIL_ON_RANK_3.replace("--output text", "--output text --background", 1), timeout=240)
    assert res.status == "ok", res.error_text
    kernel.ok("h = _")
    res = kernel.run("h.wait()", timeout=240)
    assert res.status == "error" and "rank 3 failed: ValueError: no good" in res.error["evalue"], res.error_text
    assert "its handle's .debug() opens a post-mortem (pdb) in rank 3's failing frame" in res.error_text, \
        res.error_text
    dbg = kernel.run("n = h.debug()\nprint('answered', n)", timeout=120, stdin=typed("p y", "q"))
    assert dbg.status == "ok" and dbg.prompts == ["(Pdb rank 3) "] * 2, dbg.error_text + str(dbg.prompts)
    assert "[rank 3] 42" in dbg.stdout.splitlines() and "answered 2" in dbg.stdout, dbg.stdout
    assert kernel.run(WORLD, timeout=240).status == "ok"   # the agents are free for the next cell


def test_a_rank_held_for_a_post_mortem_on_node_2_never_outlives_the_kernel(cluster):
    """kill -9 of the kernel while rank 3 (on n2) is held for %distributed_debug:
    its agent sees the kernel gone and ends its launcher with every run of its
    node, the held one too; nothing is left on any node, in squeue or on disk."""
    k = AllocKernel(cluster)
    try:
        pid = failed_on_node_2(k)
        assert alive(pid)
        k.kc.stop_channels()
        os.kill(k.pid, signal.SIGKILL)
        wait_until(lambda: not alive(pid), 20, "the held rank to end with its kernel")
        wait_until(lambda: not k.processes(), 20, "every process of the job on both nodes to end")
        wait_until(lambda: not cluster.steps(k.job), 15, "the agents' step to leave squeue")
        wait_until(lambda: not os.listdir(k.tmpdir), 10, f"the kernel's temp dir to be empty: {os.listdir(k.tmpdir)}")
    finally:
        k.end_now()


def test_a_slurm_session_whose_rank_dies_between_cells_is_lost_and_nothing_outlives_the_kernel(cluster):
    """kill -9 of a session rank on n2 between cells: the next session cell says the
    session was lost (where, and why), a new session starts; a kernel killed with
    -9 while that session lives leaves nothing on any node nor in squeue."""
    k = AllocKernel(cluster)
    try:
        k.ok("%distributed_session start --launcher slurm -n 2", timeout=240)
        res = k.ok("%%distributed --session --output text\nimport os\nprint('pid', os.getpid())", timeout=120)
        pids = {r: int(lines[-1].split()[-1]) for r, lines in by_rank(res.stdout).items()}
        os.kill(pids[3], signal.SIGKILL)
        wait_until(lambda: not alive(pids[3]), 10, "rank 3 to be gone")
        lost = k.run("%%distributed --session\npass", timeout=120)
        assert lost.error is not None and lost.error["ename"] in ("UsageError", "SessionLostError"), lost.error_text
        assert "lost" in lost.error["evalue"] and "n2" in lost.error["evalue"], lost.error_text
        wait_until(lambda: not any(alive(p) for p in pids.values()), 20, "every rank of the lost session to be gone")
        k.ok("%distributed_session restart", timeout=240)
        res = k.ok("%%distributed --session --output text\nimport os\nprint('again', os.getpid())", timeout=120)
        again = {r: int(lines[-1].split()[-1]) for r, lines in by_rank(res.stdout).items()}
        assert sorted(again) == [0, 1, 2, 3]
        # A rank dies again, and the session is stopped before any cell notices: the stop
        # does not wait for a part that is gone (n2's agent says so), and nothing is left.
        os.kill(again[2], signal.SIGKILL)
        wait_until(lambda: not alive(again[2]), 10, "rank 2 to be gone")
        started = time.monotonic()
        k.run("%distributed_session stop", timeout=60)
        assert time.monotonic() - started < 10, time.monotonic() - started
        wait_until(lambda: not any(alive(p) for p in again.values()), 20, "every rank of that session to be gone")
        k.ok("%distributed_session start --launcher slurm -n 2", timeout=240)
        k.kc.stop_channels()
        os.kill(k.pid, signal.SIGKILL)
        wait_until(lambda: not k.processes(), 20, "every process of the session on both nodes to end")
        wait_until(lambda: not cluster.steps(k.job), 15, "the agents' step to leave squeue")
    finally:
        k.end_now()


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_session_cell_sent_as_a_nodes_supervisor_dies_ends_lost_and_the_node_goes_on(kernel):
    """The cell reaches n2's agent after n2's session supervisor died, before the
    agent saw it die (the agent is SIGSTOPped across the death, so it reads the
    cell first).  Its send had no reader and blocked the agent for ever: the
    cell hung, and so did every later start on that node (CI).  Now the agent
    says the supervisor is gone, the cell ends with the session lost, naming
    n2, and the node serves the next session."""
    kernel.ok("%distributed_session start --launcher slurm -n 2", timeout=240)
    res = kernel.ok("%%distributed --session --output text\nimport os\nprint('pid', os.getpid())", timeout=120)
    ranks = {r: int(lines[-1].split()[-1]) for r, lines in by_rank(res.stdout).items()}
    supervisor = _ppid(ranks[3])
    agent = _ppid(_ppid(supervisor))   # the supervisor's parent is n2's launcher, whose parent is its agent
    with open(f"/proc/{agent}/cmdline", "rb") as f:
        assert b"slurm_agent" in f.read()
    os.kill(agent, signal.SIGSTOP)
    try:
        os.kill(supervisor, signal.SIGKILL)
        wait_until(lambda: not alive(ranks[2]) and not alive(ranks[3]), 10, "n2's ranks to die with their supervisor")

        def resume(text: str) -> None:   # n1 runs the cell: the kernel has sent it to n2's agent too
            if "here" in text:
                os.kill(agent, signal.SIGCONT)
        started = time.monotonic()
        lost = kernel.run("%%distributed --session --output text\nprint('here', flush=True)", timeout=120,
                          on_output=resume)
    finally:
        os.kill(agent, signal.SIGCONT)
    assert lost.error is not None and lost.error["ename"] == "SessionLostError", lost.error_text
    assert "the session's supervisor on node 1 (n2) exited during the cell" in lost.error_text, lost.error_text
    assert time.monotonic() - started < 30
    wait_until(lambda: not any(alive(p) for p in ranks.values()), 20, "every rank of the lost session to be gone")
    kernel.ok("%distributed_session start --launcher slurm -n 2", timeout=240)
    res = kernel.ok("%%distributed --session --output text\nprint('again')", timeout=120)
    assert sorted(by_rank(res.stdout)) == [0, 1, 2, 3], res.stdout
    kernel.ok("%distributed_session stop", timeout=60)


def srun_pid(k: "AllocKernel") -> int:
    for pid in k.processes():
        with open(f"/proc/{pid}/stat") as f:
            parent = f.read().rsplit(")", 1)[1].split()[1]
        if cmdline(pid).split(b"\0")[0].endswith(b"srun") and parent == str(k.pid):
            return pid
    raise AssertionError("no srun of the kernel's")


@pytest.mark.parametrize("how", ["srun killed", "step cancelled", "stopped while the agents start"])
def test_agents_ended_from_outside_or_stopped_while_starting_are_started_again(cluster, how):
    """The agents' step ended from outside (srun killed -9, scancel), or the stop
    button while the agents still start (the cell says so, in seconds): the next
    cell starts fresh agents (whose launchers remove the directories the killed
    ones left: Slurm SIGKILLs every process of a cancelled step at once); after
    the kernel's shutdown nothing is left, processes nor files."""
    k = AllocKernel(cluster)
    try:
        if how == "stopped while the agents start":
            def on_output(text, fired=[]):
                if "starting an agent" in text and not fired:
                    fired.append(True)
                    wait_until(lambda: any(b"slurm_agent" in cmdline(p) for p in k.processes()), 30,
                               "the agents to be starting")
                    k.interrupt()
            started = time.monotonic()
            res = k.run("%%distributed --launcher slurm -n 2 --output text\npass", timeout=60, on_output=on_output)
            assert res.error is not None and "the node agents were still starting" in res.error_text, \
                res.error_text
            assert time.monotonic() - started < 20
        else:
            assert k.run(WORLD, timeout=240).status == "ok"
            if how == "srun killed":
                os.kill(srun_pid(k), signal.SIGKILL)
            else:
                for step in cluster.steps(k.job):
                    cluster.run(["scancel", step])
        wait_until(lambda: not cluster.steps(k.job), 20, "the agents' step to end")
        assert k.run(WORLD, timeout=240).status == "ok"   # fresh agents
        k.shutdown()
        wait_until(lambda: not k.processes(), 15, "every process of the job to end")
        wait_until(lambda: not os.listdir(k.tmpdir), 10, "the kernel's temp dir to be empty")
    finally:
        k.end_now()


def step_processes(k: "AllocKernel") -> list[tuple[int, bytes]]:
    """The job's processes that run in a Slurm step (agents, their launchers, supervisors, ranks)."""
    found = []
    for pid in k.processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if any(e.startswith(b"SLURM_STEP_ID=") for e in f.read().split(b"\0")):
                    found.append((pid, cmdline(pid)))
        except OSError:
            pass
    return found


def test_a_job_cancelled_during_a_cell_ends_it_saying_so_and_the_next_cell_says_the_allocation_is_gone(cluster):
    """scancel of the whole job while a cell runs on both nodes: the cell ends within
    10 s saying the job was cancelled (no traceback of ours), the next cell is a
    UsageError saying the allocation is gone, and nothing of the job is left."""
    k = AllocKernel(cluster)
    try:
        def on_output(text, fired=[]):
            if text.count("working") >= 4 and not fired:
                fired.append(time.monotonic())
                cluster.run(["scancel", k.job])
        res = k.run("%%distributed --launcher slurm -n 2 --output text\nimport time\n"
                    "print('working', flush=True)\ntime.sleep(3600)", timeout=120, on_output=on_output)
        assert on_output.__defaults__[0], res.stdout
        took = time.monotonic() - on_output.__defaults__[0][0]
        assert res.error is not None, res.stdout
        assert took < 10, f"the cell took {took:.1f}s to end after scancel"
        assert res.error["ename"] == "SlurmJobGone", res.error_text
        assert f"job {k.job} was cancelled" in res.error["evalue"], res.error_text
        assert "Traceback" not in res.error_text, res.error_text
        again = k.run("%%distributed --launcher slurm -n 2 --output text\npass", timeout=60)
        assert again.error is not None and again.error["ename"] == "UsageError", again.error_text
        assert f"the allocation (job {k.job}) is gone" in again.error["evalue"], again.error_text
        assert k.ok("1 + 1").result == "2"   # the kernel is fine
        wait_until(lambda: not step_processes(k), 20, "every process of the job's steps to end")
    finally:
        k.end_now()


def test_a_connection_that_takes_an_agents_place_first_cannot_stop_the_agents(kernel):
    """Someone on the cluster network connects to the kernel's new ports as the
    agents start, with the identities agents might have: the agents still connect
    (their identities are secret), the cell runs, nothing is unpickled."""
    import threading
    import zmq

    kernel.ok("%distributed_config --reset")
    before = listening_ports({kernel.pid})
    kernel.ok("import accel_magics.magics as _m\n_ip = get_ipython()\n"
              "_mg = _ip.magics_manager.registry['DistributedMagics']\n"
              "_mg.state.drop_agents()")   # the next cell starts agents afresh
    ctx = zmq.Context()
    socks, stop = [], threading.Event()

    def squat():
        while not stop.is_set():
            for port in listening_ports({kernel.pid}) - before:
                # DEALERs with the guessable identities for the agents' ROUTER, a
                # PUSH for the runs' PULL. A socket whose handshake the port
                # refuses (the wrong type) has no pipe, and a blocking send on it
                # would wait for ever: every send has a timeout.
                peers = [(zmq.DEALER, ident) for ident in (b"node0", b"node1", b"0", b"1")]
                for kind, ident in peers + [(zmq.PUSH, None)]:
                    s = ctx.socket(kind)
                    if ident is not None:
                        s.setsockopt(zmq.IDENTITY, ident)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.SNDTIMEO, 200)
                    s.connect(f"tcp://127.0.0.1:{port}")
                    try:
                        s.send_multipart([b"<IDS|MSG>", b"0" * 64, b"{}", b"{}", b"{}", b"garbage"])
                    except zmq.Again:
                        pass
                    socks.append(s)
                before.add(port)
            time.sleep(0.01)

    t = threading.Thread(target=squat, daemon=True)
    t.start()
    try:
        res = kernel.run(WORLD, timeout=240)
    finally:
        stop.set()
        t.join(timeout=30)
        assert not t.is_alive(), "the squatter thread is stuck"
        for s in socks:
            s.close()
        ctx.term()
    assert res.status == "ok", res.error_text
    assert socks, "no port of the kernel's was squatted"


def test_the_multi_node_regression_notebook_runs_a_real_multi_node_cell(cluster, tmp_path):
    """notebooks/multi_node_slurm.ipynb under nbval, in a kernel inside an allocation:
    its stored outputs come from a real two-node run, and must come again."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    alloc = cluster.allocate(2)
    try:
        env = dict(os.environ, **alloc, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                              "--nbval", "--nbval-sanitize-with", os.path.join(root, "notebooks", "sanitize.cfg"),
                              os.path.join(root, "notebooks", "multi_node_slurm.ipynb")],
                             env=env, capture_output=True, text=True, timeout=280, cwd=root)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    finally:
        cluster.release(alloc["SLURM_JOB_ID"])


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_flood_from_the_network_costs_the_kernel_bounded_memory_and_cells_keep_working(kernel):
    """Issue 24 item 1: the kernel's two TCP ports on the cluster network took
    garbage connections and 128 MB frames from anyone (55 -> 1,270 MB, never
    freed).  Now only a peer with the allocation's key gets past the CURVE
    handshake: a flood from a second user, while cells run, grows the kernel by
    under 50 MB, costs it little CPU, and the cells give the right sums."""
    import json
    import subprocess
    import sys
    import threading

    kernel.ok("%distributed_config --reset")
    kernel.ok("_mg = get_ipython().magics_manager.registry['DistributedMagics']\n"
              "_mg.state.drop_agents()")   # no agents: no ports of ours
    jupyters = listening_ports({kernel.pid})                         # ipykernel's own
    assert "sum=10" in kernel.ok(WORLD, timeout=240).stdout          # the agents are up: their ports exist
    ports = sorted(listening_ports({kernel.pid}) - jupyters)
    assert len(ports) == 2, ports                                   # the agents' ROUTER and the events PULL
    kernel.ok("%%distributed --launcher slurm -n 2 --output text\nprint('warm')", timeout=120)
    before, cpu_before = _rss_mb(kernel.pid), _cpu_seconds(kernel.pid)
    peak = [before]
    done = threading.Event()

    def sample():   # a measurement: the kernel's RSS while the flood runs
        while not done.wait(0.2):
            peak.append(_rss_mb(kernel.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    flood_seconds = 12.0
    started = time.monotonic()
    flood = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "flood.py"), "127.0.0.1",
                              str(flood_seconds), *map(str, ports)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(2):
            res = kernel.run(WORLD, timeout=120)
            assert res.status == "ok", res.error_text
            assert sorted(by_rank(res.stdout)) == [0, 1, 2, 3] and "sum=10" in res.stdout, res.stdout
        out, _ = flood.communicate(timeout=flood_seconds + 60)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
        done.set()
        sampler.join(timeout=5)
    elapsed = time.monotonic() - started
    sent = json.loads(out.strip().splitlines()[-1])
    assert sent["connections"] > 1000 and sent["big_frames"] > 0, sent     # the flood really happened
    res = kernel.run(WORLD, timeout=120)
    assert res.status == "ok" and "sum=10" in res.stdout, res.error_text
    after = _rss_mb(kernel.pid)
    cpu = _cpu_seconds(kernel.pid) - cpu_before
    assert max(peak) - before < 50, f"the kernel grew from {before:.0f} to {max(peak):.0f} MB under the flood"
    assert after - before < 50, f"the kernel stayed at {after:.0f} MB (from {before:.0f} MB)"
    # Three 4-rank cells ran meanwhile: that is most of this CPU time.
    assert cpu < 0.5 * elapsed, f"the kernel used {cpu:.1f}s of CPU in {elapsed:.1f}s"
    print(f"flood: {sent}; kernel RSS {before:.0f} -> peak {max(peak):.0f} -> {after:.0f} MB; "
          f"CPU {cpu:.1f}s in {elapsed:.1f}s")


def _fds_opened_since(pid: int, before: set, local_dir: str) -> set:
    """The fds ``pid`` has now and had not in ``before`` (their targets), but
    for the connections its local launcher's runs make to it (a spare
    supervisor connects whenever the launcher forks one)."""
    local = set()
    with open("/proc/net/unix") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(local_dir):
                local.add(f"socket:[{parts[6]}]")
    now = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            now.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return now - before - local


def test_a_job_cancelled_during_a_session_cell_releases_the_kernels_cluster_ports_and_fds(cluster):
    """scancel of the job while a session cell runs on both nodes: the cell ends
    saying so, and the kernel let go of the agents' two cluster ports, srun's
    log and its pipes (they stayed until the next cell or the kernel's end)."""
    k = AllocKernel(cluster)
    try:
        local_dir = k.ok("get_ipython().magics_manager.registry['DistributedMagics'].state.launcher.dir").result
        local_dir = local_dir.strip("'")
        ports = listening_ports({k.pid})
        before = _fds_opened_since(k.pid, set(), local_dir)
        k.ok("%distributed_session start --launcher slurm -n 1", timeout=240)
        assert len(listening_ports({k.pid}) - ports) == 2   # the agents' control and events ports
        assert _fds_opened_since(k.pid, before, local_dir)   # theirs, srun's log, the agents' connections

        def on_output(text, fired=[]):
            if text.count("working") >= 2 and not fired:
                fired.append(time.monotonic())
                cluster.run(["scancel", k.job])
        res = k.run("%%distributed --session --output text\nimport time\n"
                    "print('working', flush=True)\ntime.sleep(3600)", timeout=120, on_output=on_output)
        assert on_output.__defaults__[0], res.stdout
        assert res.error is not None and f"job {k.job} was cancelled" in res.error_text, res.error_text
        assert "Traceback" not in res.error_text, res.error_text
        # Let go of with the cell's end, not at the next cell or the kernel's end.
        assert listening_ports({k.pid}) == ports
        assert not _fds_opened_since(k.pid, before, local_dir), _fds_opened_since(k.pid, before, local_dir)
        again = k.run("%%distributed --session\npass", timeout=60)
        assert again.error is not None and again.error["ename"] == "UsageError", again.error_text
        wait_until(lambda: not step_processes(k), 20, "every process of the job's steps to end")
    finally:
        k.end_now()
