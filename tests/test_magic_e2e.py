"""End to end: a real kernel, real ranks, real gloo, driven over the Jupyter protocol."""
from __future__ import annotations

import os
import time

import pytest

from kernel_harness import descendants, wait_until

pytestmark = pytest.mark.timeout(180)


def test_all_reduce_uses_notebook_function_and_constant(clean_kernel):
    k = clean_kernel
    k.ok("SCALE = 10\ndef contribution(rank):\n    return (rank + 1) * SCALE")
    res = k.ok(
        "%%distributed --num_processes 2 --output text\n"
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(contribution(dist.get_rank()))])\n"
        "dist.all_reduce(t)\n"
        "print(f\"sum={t.item():g} world={dist.get_world_size()} rank={os.environ['RANK']}\")\n"
        "dist.destroy_process_group()\n"
    )
    assert "[rank 0] sum=30 world=2 rank=0" in res.stdout
    assert "[rank 1] sum=30 world=2 rank=1" in res.stdout
    # The kernel itself never needed torch (this module's first torch use is below).
    assert k.ok("import sys\nprint('torch' in sys.modules)").stdout == "False\n"


def test_last_expression_and_return_come_back(clean_kernel):
    k = clean_kernel
    res = k.ok(
        "%%distributed -n 2 --return weights,label --output text\n"
        "import os, torch\n"
        "rank = int(os.environ['RANK'])\n"
        "weights = torch.full((3,), float(rank + 1), requires_grad=True) * 2\n"
        "label = f'from rank {rank}'\n"
        "rank * 100 + 7\n"
    )
    assert res.result == "7"
    check = k.ok("print(type(weights).__name__, weights.tolist(), weights.device, weights.requires_grad, label)")
    assert check.stdout.strip() == "Tensor [2.0, 2.0, 2.0] cpu False from rank 0"


def test_output_is_tagged_live_and_in_order_per_rank(clean_kernel):
    k = clean_kernel
    res = k.ok(
        "%%distributed -n 2 --output text\n"
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        "for i in range(200):\n"
        "    print(f'line {i} of rank {r}')\n"
        "    if i % 50 == 0:\n"
        "        print(f'err {i} of rank {r}', file=sys.stderr)\n"
        "os.write(1, f'native fd write from rank {r}\\n'.encode())\n"
    )
    for rank in (0, 1):
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(f"[rank {rank}] ")]
        seen = [ln[len(f"[rank {rank}] "):] for ln in lines]
        expected = []
        for i in range(200):
            expected.append(f"line {i} of rank {rank}")
            if i % 50 == 0:
                expected.append(f"err {i} of rank {rank}")
        expected.append(f"native fd write from rank {rank}")
        assert seen == expected
    # The record is grouped by rank (deterministic) and shown once: the live
    # display that showed the lines during the run is emptied at the end.
    tags = [ln.split("]")[0] for ln in res.stdout.splitlines()]
    assert tags == sorted(tags)
    assert res.live[-1] == ""                          # emptied at the end: shown once
    assert any("] line" in text for text in res.live)     # shown live first (throttled)


def test_tqdm_becomes_throttled_progress_not_a_flood(clean_kernel):
    res = clean_kernel.ok(
        "%%distributed -n 2 --output text\n"
        "from tqdm import tqdm\n"
        "import time\n"
        "for i in tqdm(range(300), desc='train', mininterval=0, ascii=True):\n"
        "    time.sleep(0.002)\n"
    )
    for rank in (0, 1):
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(f"[rank {rank}]")]
        assert len(lines) == 1, lines                    # only the final state stays in the record
        assert "train: 100%" in lines[0] and "300/300" in lines[0]
    live_states = [t for t in res.live if "train:" in t]
    assert 0 < len(live_states) < 60                      # throttled, not 600 updates


def test_live_output_arrives_before_the_cell_ends(clean_kernel):
    """A line printed before a rank blocks reaches the frontend while it is blocked."""
    k = clean_kernel
    k.ok("import tempfile, os\ngate = tempfile.mktemp(prefix='accel-gate-')")
    arrived_while_running = []

    def on_output(text):
        if "before the wait" in text and not arrived_while_running:
            arrived_while_running.append(True)
            open(k_gate, "w").close()  # let the ranks finish only after we saw the line
        return False

    k_gate = k.ok("print(gate)").stdout.strip()
    res = k.run(
        "%%distributed -n 2 --output text --timeout 60\n"
        "import os\n"
        "print('before the wait', flush=True)\n"
        "while not os.path.exists(gate):\n"
        "    pass\n",
        on_output=on_output,
    )
    assert res.status == "ok", res.error_text
    assert arrived_while_running
    os.unlink(k_gate)


def test_seed_workflow_with_accelerate(clean_kernel):
    k = clean_kernel
    k.ok(
        "import torch\n"
        "from torch.utils.data import Dataset, DataLoader\n"
        "from accelerate import Accelerator\n"
        "class SyntheticDataset(Dataset):\n"
        "    def __init__(self, n=64, dim=8, seed=0):\n"
        "        g = torch.Generator().manual_seed(seed)\n"
        "        self.x = torch.randn(n, dim, generator=g)\n"
        "        self.y = (self.x.sum(1) > 0).long()\n"
        "    def __len__(self):\n"
        "        return len(self.x)\n"
        "    def __getitem__(self, i):\n"
        "        return self.x[i], self.y[i]\n"
        "def get_dataloaders(batch_size=8):\n"
        "    return DataLoader(SyntheticDataset(), batch_size=batch_size, shuffle=True), "
        "DataLoader(SyntheticDataset(seed=1), batch_size=batch_size)\n"
        "def training_loop(epochs=3, lr=0.05, seed=42):\n"
        "    torch.manual_seed(seed)\n"
        "    accelerator = Accelerator()\n"
        "    accelerator.print(f'num_processes={accelerator.num_processes} type={accelerator.distributed_type.name}')\n"
        "    train_dl, eval_dl = get_dataloaders()\n"
        "    model = torch.nn.Linear(8, 2)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=lr)\n"
        "    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)\n"
        "    for epoch in range(epochs):\n"
        "        model.train()\n"
        "        for x, y in train_dl:\n"
        "            loss = torch.nn.functional.cross_entropy(model(x), y)\n"
        "            accelerator.backward(loss)\n"
        "            optimizer.step(); optimizer.zero_grad()\n"
        "        model.eval(); correct = total = 0\n"
        "        for x, y in eval_dl:\n"
        "            with torch.no_grad():\n"
        "                pred = model(x).argmax(1)\n"
        "            pred, y = accelerator.gather_for_metrics((pred, y))\n"
        "            correct += (pred == y).sum().item(); total += len(y)\n"
        "        accelerator.print(f'epoch {epoch}: accuracy {correct / total:.2f} on {total} samples')\n"
    )
    res = k.ok("%%distributed --num_processes 2 --output text\ntraining_loop(epochs=3)\n", timeout=120)
    out = res.stdout
    assert "[rank 0] num_processes=2 type=MULTI_CPU" in out
    for epoch in range(3):
        epoch_lines = [ln for ln in out.splitlines() if f"epoch {epoch}: accuracy" in ln]
        assert len(epoch_lines) == 1, out           # accelerator.print: main process only
        assert epoch_lines[0].startswith("[rank 0] ")
        assert "on 64 samples" in epoch_lines[0]     # gathered from both ranks: the whole eval set


def _marker_cell(flags: str = "") -> str:
    return (
        f"%%distributed -n 2 --output text {flags}\n"
        "open(marker, 'w').write('launched')\n"
    )


@pytest.fixture
def marker(clean_kernel):
    path = clean_kernel.ok("import tempfile\nmarker = tempfile.mktemp(prefix='accel-marker-')\nprint(marker)").stdout.strip()
    yield path
    assert not os.path.exists(path), "a rank ran although the cell should have been refused"


@pytest.mark.parametrize("runtime,name", [("cuda", "CUDA"), ("xpu", "XPU")])
def test_preflight_refuses_initialised_runtime_and_names_the_cell(clean_kernel, marker, runtime, name):
    k = clean_kernel
    # Simulate the initialised state on this CPU-only machine, through the same
    # entry point real code reaches (torch.<rt>._lazy_init via torch.<rt>.init()).
    init = k.ok(f"import torch\ntorch.{runtime}._initialized = True\ntorch.{runtime}.init()\n")
    cell_no = init.execution_count
    res = k.run(_marker_cell())
    k.ok(f"torch.{runtime}._initialized = False")
    assert res.status == "error"
    assert res.error["ename"] == "PreflightError"
    assert f"{name} is already initialised in this kernel" in res.error["evalue"]
    assert f"In[{cell_no}], line 3: torch.{runtime}.init()" in res.error["evalue"]
    assert "restart the kernel" in res.error["evalue"]
    assert "Nothing was launched" in res.error["evalue"]
    assert "magics.py" not in res.error_text   # the message alone, not our internals


@pytest.mark.parametrize("cell,ename,needle", [
    ("%%distributed -n 2\nprint(lock)", "UsageError", "cannot send variable 'lock' (_thread.lock)"),
    ("%%distributed -n 2\nx = (1,\nopen(marker,'w')", "UsageError", "the cell has a syntax error"),
    ("%%distributed --num_processes 0\nopen(marker,'w')", "UsageError", "--num_processes must be at least 1"),
    ("%%distributed --num_processes two\nopen(marker,'w')", "UsageError", "invalid int value: 'two'"),
    ("%%distributed -n 2\nopen(marker,'w')\nprint(not_defined_anywhere)", "UsageError",
     "'not_defined_anywhere' is not defined"),
    ("%%distributed -n 2 --bogus\nopen(marker,'w')", "UsageError", "unrecognized arguments: --bogus"),
    ("%%distributed -n 2 --node_rank 2 --num_nodes 2\nopen(marker,'w')", "UsageError",
     "--node_rank must be between 0 and --num_nodes - 1"),
    ("%%distributed -n 2\n!ls\nopen(marker,'w')", "UsageError", "magics and shell escapes"),
])
def test_bad_input_is_refused_before_launch(clean_kernel, marker, cell, ename, needle):
    k = clean_kernel
    k.ok("import threading\nlock = threading.Lock()")
    res = k.run(cell)
    assert res.status == "error"
    assert res.error["ename"] == ename, res.error_text
    assert needle in res.error["evalue"]
    if ename == "UsageError" and "lock" in cell:
        assert "Create 'lock' inside the %%distributed cell" in res.error["evalue"]
    assert k.ok("print(1 + 1)").stdout == "2\n"   # the kernel is still usable


def test_syntax_error_points_at_the_cell_line(clean_kernel):
    res = clean_kernel.run("%%distributed -n 2\nx = 1\ny = = 2\n")
    assert res.error["ename"] == "UsageError"
    assert "line 3" in res.error["evalue"] and "y = = 2" in res.error["evalue"]
    assert "SyntaxError: invalid syntax" in res.error["evalue"]
    assert "magics.py" not in res.stderr + res.error_text   # no traceback of our internals


def test_rank_failure_names_the_failing_rank_every_time(clean_kernel):
    k = clean_kernel
    for attempt in range(5):
        started = time.monotonic()
        res = k.run(
            "%%distributed -n 2 --output text\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "if dist.get_rank() == 1:\n"
            "    raise ValueError('rank one exploded')\n"
            "dist.barrier()\n",
            timeout=60,
        )
        elapsed = time.monotonic() - started
        assert res.status == "error"
        assert res.error["ename"] == "DistributedRunError"
        assert res.error["evalue"].startswith("rank 1 failed: ValueError: rank one exploded"), res.error_text
        text = res.error_text
        assert "rank 1 traceback (root cause)" in text
        assert "line 5" in text and "raise ValueError('rank one exploded')" in text
        assert elapsed < 15, elapsed
        k.assert_no_leaks()


def test_rank_killed_by_signal_is_reported_as_such(clean_kernel):
    res = clean_kernel.run(
        "%%distributed -n 2 --output text\n"
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(30)\n"
    )
    assert res.error["ename"] == "DistributedRunError"
    assert res.error["evalue"].startswith("rank 1 failed: killed by SIGKILL")


def test_interrupt_stops_ranks_blocked_in_a_collective(clean_kernel):
    k = clean_kernel
    k.ok("import signal\nhandlers_before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}")
    seen = set()

    def on_output(text):
        for rank in (0, 1):
            if f"[rank {rank}] blocked" in text and rank not in seen:
                seen.add(rank)
                if seen == {0, 1}:
                    k.interrupt()
        return False

    started = time.monotonic()
    res = k.run(
        "%%distributed -n 2 --output text\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('blocked', flush=True)\n"
        "if dist.get_rank() == 0:\n"
        "    dist.barrier()\n"
        "else:\n"
        "    t = torch.zeros(1); dist.recv(t, src=0)\n",
        on_output=on_output, timeout=60,
    )
    assert seen == {0, 1}
    assert res.status == "error"
    assert res.error["ename"] == "RunInterrupted" or res.error["ename"] == "KeyboardInterrupt"
    assert isinstance(res.error["ename"], str)
    text = res.error_text
    assert "RunInterrupted" in text   # a KeyboardInterrupt (its subclass), headed with its own name
    assert "rank 0:" in text and "rank 1:" in text        # where each rank was
    assert "barrier" in text and "recv" in text
    assert time.monotonic() - started < 30
    k.wait_quiet()
    assert k.ok("print(handlers_before == {s: signal.getsignal(s) for s in handlers_before})").stdout == "True\n"
    assert "[rank 1] ok" in k.ok("%%distributed -n 2 --output text\nprint('ok')").stdout


def test_help_lists_the_options(kernel):
    res = kernel.ok("%%distributed?\n")
    pages = [p["data"]["text/plain"] for p in res.reply.get("payload", []) if "data" in p]
    assert pages, res.reply
    for flag in ("--num_processes", "--num_nodes", "--node_rank", "--master_addr", "--master_port",
                 "--max_restarts", "--mixed_precision", "--output", "--timeout", "--return"):
        assert flag in pages[0]


def test_workers_die_with_the_kernel():
    from kernel_harness import KernelSession
    k = KernelSession()
    try:
        k.ok("%load_ext accel_magics")
        msg_id = k.kc.execute("%%distributed -n 2 --output text\nprint('up', flush=True)\nimport time\ntime.sleep(600)\n")
        seen = []
        while not seen:
            msg = k.kc.get_iopub_msg(timeout=120)
            if msg["msg_type"] in ("display_data", "update_display_data") and \
                    "[rank 1] up" in msg["content"]["data"].get("text/plain", ""):
                seen.append(msg)
        del msg_id
        tree = descendants(k.pid)
        assert len(tree) >= 4   # launcher, supervisor, two ranks
        os.kill(k.pid, 9)
        wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in tree), 15,
                   "launcher, supervisor and ranks to exit after kill -9 of the kernel")
    finally:
        k.kc.stop_channels()
        k.km.cleanup_resources()


def test_a_cell_ends_as_a_script_does_its_threads_then_its_atexit_handlers(clean_kernel, tmp_path):
    """Under torchrun the cell is a script: its end waits for the threads it
    started and runs its atexit handlers.  A rank ended with os._exit right
    after the cell: an async checkpoint writer was killed mid-write, an
    atexit handler (wandb.finish) never ran, a TemporaryDirectory stayed."""
    res = clean_kernel.run(f"""%%distributed -n 2 --output text
import os, threading, time, atexit, tempfile, concurrent.futures
rank = os.environ['RANK']
def save():
    time.sleep(0.3)
    open(f'{tmp_path}/thread-{{rank}}', 'w').write('saved')
    print('checkpoint saved', flush=True)
threading.Thread(target=save).start()
atexit.register(lambda: open(f'{tmp_path}/atexit-{{rank}}', 'w').write(str(os.path.exists(f'{tmp_path}/thread-{{rank}}'))))
kept = tempfile.TemporaryDirectory(dir='{tmp_path}')
pool = concurrent.futures.ThreadPoolExecutor(2)   # left open: its idle workers must not hold the end
pool.submit(print, 'pool ran', flush=True).result()
""", timeout=60)
    assert res.status == "ok", res.error_text
    for rank in (0, 1):
        assert (tmp_path / f"thread-{rank}").read_text() == "saved"
        assert (tmp_path / f"atexit-{rank}").read_text() == "True"   # after the threads, as at a script's end
        assert f"[rank {rank}] checkpoint saved" in res.stdout, res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit-0", "atexit-1", "thread-0", "thread-1"]


def test_a_rank_that_raised_ends_as_a_script_that_raised_and_its_peers_are_stopped(clean_kernel, tmp_path):
    """Under torchrun a rank that raised still waits for its threads and runs
    its atexit handlers (wandb marks the run failed, a checkpoint writer
    finishes) before it exits; its peers are then stopped.  Here the failure
    is reported first, so the peers stop at once, and the rank that raised
    ends as a script does.  A thread that never ends cannot hold the run:
    the stop's grace bounds it.  (--debug_hold 0: not held for a
    post-mortem, which comes before that end, as under ``python -m pdb``;
    test_postmortem.py lets a held rank go and sees the same end.)"""
    started = time.monotonic()
    res = clean_kernel.run(f"""%%distributed -n 2 --output text --debug_hold 0
import os, threading, time, atexit
rank = os.environ['RANK']
def save():
    time.sleep(0.3)
    open(f'{tmp_path}/thread-{{rank}}', 'w').write('saved')
threading.Thread(target=save).start()
atexit.register(lambda: open(f'{tmp_path}/atexit-{{rank}}', 'w').write(str(os.path.exists(f'{tmp_path}/thread-{{rank}}'))))
if rank == '1':
    raise ValueError('boom')
time.sleep(60)
""", timeout=60)
    assert res.error and res.error["ename"] == "DistributedRunError", res.error_text
    assert "rank 1 failed: ValueError: boom" in res.error_text, res.error_text
    assert (tmp_path / "thread-1").read_text() == "saved"
    assert (tmp_path / "atexit-1").read_text() == "True"
    assert not (tmp_path / "atexit-0").exists()   # stopped with SIGTERM, as torchrun stops a failed run's peers
    assert time.monotonic() - started < 30
    # A thread that never ends: the rank is killed after the grace, the run ends, the error is the same.
    started = time.monotonic()
    res = clean_kernel.run("%%distributed -n 2 --output text --debug_hold 0\nimport os, threading, time\n"
                           "if os.environ['RANK'] == '1':\n"
                           "    threading.Thread(target=threading.Event().wait, name='never-ends').start()\n"
                           "    raise ValueError('boom')\ntime.sleep(60)\n", timeout=60)
    assert res.error and "rank 1 failed: ValueError: boom" in res.error_text, res.error_text
    assert time.monotonic() - started < 30
    assert "'never-ends'" in res.stdout + res.stderr, res.stdout + res.stderr   # it said what it waited for


def test_unloading_the_extension_ends_its_processes_and_frees_the_kept_globals():
    """`%unload_ext accel_magics`: the launcher (torch-sized) and its spare
    are gone and the big globals kept in shared memory for the next cells
    are freed, the kernel's own array untouched; loading it again works."""
    from cases import memfds
    from kernel_harness import KernelSession
    k = KernelSession()
    try:
        k.ok("%load_ext accel_magics")
        k.ok("import numpy as np\nbig = np.arange(4 << 20, dtype=np.float64)")   # 32 MB: kept in shared memory
        cell = "%%distributed -n 2 --output text\nprint(float(big[-1]))"
        assert k.ok(cell, timeout=120).stdout.count("4194303.0") == 2
        assert memfds(k.pid) == 1 and descendants(k.pid)
        k.ok("%unload_ext accel_magics")
        assert memfds(k.pid) == 0
        wait_until(lambda: not descendants(k.pid), 15, "the launcher and its spare to exit after %unload_ext")
        assert k.ok("float(big[-1])").result == "4194303.0"
        for gone in (cell, "%distributed_session status", "%distributed_config"):   # IPython's own "not found"
            res = k.run(gone, timeout=30)
            assert res.error and res.error["ename"] == "UsageError" and "not found" in res.error_text, res.error_text
        assert not descendants(k.pid)   # nothing was started by them
        k.ok("%load_ext accel_magics")
        assert k.ok(cell, timeout=120).stdout.count("4194303.0") == 2
    finally:
        k.shutdown()


@pytest.mark.parametrize("code,summary", [
    ("import sys\nsys.exit(3)", "rank 1 failed: SystemExit: sys.exit(3)"),
    ("import os\nos._exit(4)", "rank 1 failed: exited with code 4 without an exception"),
])
def test_exit_on_one_rank_is_a_clear_failure(clean_kernel, code, summary):
    body = "\n".join("    " + line for line in code.splitlines())
    res = clean_kernel.run(
        "%%distributed -n 2 --output text\nimport os, time\nif os.environ['RANK'] == '1':\n"
        f"{body}\ntime.sleep(30)\n", timeout=60)
    assert res.error["ename"] == "DistributedRunError"
    assert res.error["evalue"].startswith(summary), res.error["evalue"]


def test_return_of_an_undefined_name_keeps_the_output(clean_kernel):
    res = clean_kernel.run("%%distributed -n 2 --output text --return never_set\nprint('ran')\n")
    assert res.error["ename"] == "ReturnNameError"
    assert "'never_set'" in res.error["evalue"]
    assert "[rank 0] ran" in res.stdout and "[rank 1] ran" in res.stdout
