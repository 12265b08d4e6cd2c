"""Cells and checks shared by the hardening tests and the soaks: the hard
cases of issue 12, each as a cell plus what it must show, and helpers that
read the state of the kernel's process tree from /proc."""
from __future__ import annotations

import os
import threading

DDP_TRAIN = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

def train():
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 10), torch.randn(64, 1))
    for x, y in DataLoader(data, batch_size=8):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    total = torch.ones(1)
    dist.all_reduce(total)
    print("done", dist.get_rank(), total.item())
    dist.destroy_process_group()
"""


LEAVE_GROUP = r"""
import os, subprocess
try:
    os.setpgid(0, os.getppid())   # leave my own process group
    print("left my group")
except PermissionError:
    print("refused: it leads its session")
subprocess.run(["sleep", "600"], start_new_session=True)   # wait on a child outside the group
"""


DAEMONS = r"""
import os, time
def start_daemons(depth, report):
    '''A chain: each level setsids and double-forks, so each survivor is an orphan.'''
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(report, b"%d\n" % os.getpid())
            if depth > 1:
                start_daemons(depth - 1, report)
            time.sleep(600)
        os._exit(0)

def read_pids(r, n):
    data = b""
    while data.count(b"\n") < n:
        data += os.read(r, 64)
    return [int(p) for p in data.split()]
"""


STUCK_IN_NATIVE = ("import ctypes\n"
                   "def wait_in_native_code():\n"
                   "    ctypes.PyDLL(None).pause()   # blocks in C, holding the GIL, as a deadlocked destructor does\n")


SETUP = [
    DDP_TRAIN,
    DAEMONS,
    STUCK_IN_NATIVE,
    "import numpy as np, time\nbig = np.ones(2_000_000)   # 16 MB: through shared memory\n"
    "class SlowToSend:\n    def __reduce__(self):\n        time.sleep(60)\n        return (SlowToSend, ())\n"
    "slow = SlowToSend()\n",
]


def alive(pids) -> list:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def memfd_links(pid: int) -> int:
    """How many descriptors of big-globals memfds ``pid`` has open (a run's
    own descriptor of a kept one counts too)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:accel_magics-globals")
        except OSError:
            pass
    return count


def memfds(pid: int) -> int:
    """How many big-globals memfds ``pid`` holds (distinct memory: a kept
    one is open twice, its descriptor and its mapping's)."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:accel_magics-globals"):
                held.add(os.stat(path).st_ino)
        except OSError:
            pass
    return len(held)


def stopped_supervisor(k):
    """The run's supervisor, once it is SIGSTOPped (state T), else None."""
    from kernel_harness import children
    for pid in children(k.launcher_pid()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return pid
        except OSError:
            pass
    return None


def press_stop_when(k, predicate, what: str):
    """Press the stop button (from a thread) once ``predicate()`` holds."""
    from kernel_harness import wait_until

    def press():
        wait_until(predicate, 60, what)
        k.interrupt()

    thread = threading.Thread(target=press, daemon=True)
    thread.start()
    return thread


def run_case(k, kind: str) -> float:
    """Run one case; returns (result, the bound in seconds it had to end within)."""
    if kind == "ok":
        res = k.run("%%distributed -n 2 --output text\nimport os\nprint('ok', os.environ['RANK'])", timeout=60)
        assert res.status == "ok" and "[rank 1] ok 1" in res.stdout, res.error_text
        return 10
    if kind == "fail":
        res = k.run("%%distributed -n 2 --output text\nimport os, time\n"
                    "if os.environ['RANK'] == '0':\n    raise ValueError('soak')\ntime.sleep(30)\n", timeout=60)
        assert res.error["evalue"].startswith("rank 0 failed: ValueError: soak"), res.error_text
        return 10
    if kind == "interrupt":
        def on_output(text, fired=[]):
            if "[rank 0] up" in text and "[rank 1] up" in text and not fired:
                fired.append(True)
                k.interrupt()
        res = k.run("%%distributed -n 2 --output text\nprint('up', flush=True)\nimport time\ntime.sleep(60)\n",
                    on_output=on_output, timeout=60)
        assert res.error["ename"] == "RunInterrupted", res.error_text
        return 15
    if kind == "timeout":
        res = k.run("%%distributed -n 2 --output text --timeout 1\nimport time\ntime.sleep(60)\n", timeout=60)
        assert res.error["ename"] == "DistributedTimeoutError", res.error_text
        return 1 + 10
    if kind == "ddp":
        res = k.run("%%distributed -n 2 --output text --timeout 20\ntrain()\n", timeout=60)
        assert res.status == "ok" and "[rank 1] done 1 2.0" in res.stdout, res.error_text
        return 10
    if kind == "leave":
        res = k.run("%%distributed -n 2 --output text --timeout 30\n"
                    "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                    "if dist.get_rank() == 1:\n    dist.all_reduce(torch.ones(1))\n", timeout=60)
        assert res.error["ename"] == "DistributedRunError" and "already finished" in res.error["evalue"], \
            res.error_text
        return 10
    if kind == "stall":
        res = k.run("%%distributed -n 2 --output text --stall_timeout 2\nimport os\n"
                    "if os.environ['RANK'] == '1':\n    wait_in_native_code()\n", timeout=60)
        assert res.error["ename"] == "DistributedStallError", res.error_text
        return 2 + 10
    if kind == "long_lines":
        res = k.run("%%distributed -n 2 --output widget\nfor i in range(20):\n    print(list(range(3000)))\n"
                    "print('x' * 5_000_000)\n", timeout=60)
        assert res.status == "ok", res.error_text
        return 10
    if kind == "daemons":
        res = k.ok("%%distributed -n 1 --output text\nr, w = os.pipe()\nstart_daemons(2, w)\n"
                   "print('daemons', *read_pids(r, 2))\n")
        pids = [int(p) for p in res.stdout.split("daemons", 1)[1].split()]
        from kernel_harness import wait_until
        wait_until(lambda: not alive(pids), 10, f"the daemons {pids} to be killed")
        return 10
    if kind == "leave_group":
        res = k.run("%%distributed -n 2 --output text --timeout 1\n" + LEAVE_GROUP, timeout=60)
        assert res.error["ename"] == "DistributedTimeoutError", res.error_text
        return 1 + 10
    if kind == "sigstop":
        res = k.run("%%distributed -n 2 --output text --timeout 2\nimport os, signal, time\n"
                    "if os.environ['RANK'] == '0':\n    os.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(120)\n",
                    timeout=60)
        assert res.error["ename"] == "DistributedTimeoutError" and "did not respond" in res.error_text, \
            res.error_text
        return 2 + 10
    if kind == "sigstop_interrupt":
        presser = press_stop_when(k, lambda: stopped_supervisor(k) is not None, "a stopped supervisor")
        res = k.run("%%distributed -n 2 --output text\nimport os, signal, time\n"
                    "if os.environ['RANK'] == '0':\n    os.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(120)\n",
                    timeout=60)
        presser.join()
        assert res.error["ename"] == "RunInterrupted", res.error_text
        return 15
    if kind == "big_global_interrupt":
        # big's memory is kept across cells once a cell sent it: the sign that this
        # run is sending it is the run's own descriptor of it, on top of the kept ones
        kept = memfd_links(k.pid)
        presser = press_stop_when(k, lambda: memfd_links(k.pid) > kept, "the big global in shared memory")
        res = k.run("%%distributed -n 2 --output text\nprint(big.sum(), slow)\n", timeout=60)
        presser.join()
        assert res.error["ename"] == "KeyboardInterrupt", res.error_text
        return 15
    if kind == "huge_error":
        res = k.run("%%distributed -n 2 --output text\nraise ValueError('e' * 5_000_000)\n", timeout=60)
        assert res.error["ename"] == "DistributedRunError", res.error_text
        return 10
    if kind == "session":   # a session's life: start, state across cells, a failing cell, stop
        k.ok("%distributed_session start -n 2")
        try:
            k.ok("%%distributed --session --output text\nimport os\nkept = int(os.environ['RANK']) + 40")
            res = k.run("%%distributed --session --output text\nraise ValueError('soak')", timeout=60)
            assert res.error is not None and "lives on" in res.error_text, res.error_text
            assert "[rank 1] 41" in k.ok("%%distributed --session --output text\nprint(kept)").stdout
        finally:
            k.ok("%distributed_session stop")
        return 30
    if kind == "background":
        k.ok("%%distributed -n 2 --background --output text --return total\nimport torch, torch.distributed as dist\n"
             "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\ntotal = t.item()\n"
             "dist.destroy_process_group()")
        res = k.ok("_bg = _\n_bg.wait()\nprint(total, _bg.returned)\ndel total, _bg", timeout=60)
        assert "2.0 ['total']" in res.stdout, res.stdout
        return 15
    if kind == "reinit":
        res = k.run("%%distributed -n 2 --output text --timeout 30\n" + REINIT, timeout=60)
        assert res.status == "ok" and res.stdout.count("sums [2.0, 4.0, 6.0]") == 2, res.error_text
        return 15
    if kind == "skip_round":   # a rank skips a round of init/destroy: the waiter is stopped at once
        res = k.run("%%distributed -n 2 --output text\nimport os, torch.distributed as dist\n"
                    "for i in range(3):\n    if os.environ['RANK'] == '1' and i == 1:\n        continue\n"
                    "    dist.init_process_group('gloo')\n    dist.destroy_process_group()\n", timeout=60)
        assert res.error is not None and res.error["ename"] == "DistributedStallError", res.error_text
        return 10
    if kind == "quiet":   # a rank that only waits after its peer finished: not a stall
        res = k.run("%%distributed -n 2 --output text --stall_timeout 1\nimport os, time\n"
                    "if os.environ['RANK'] == '0':\n    time.sleep(3)\nprint('done')\n", timeout=60)
        assert res.status == "ok" and "[rank 0] done" in res.stdout, res.error_text
        assert any("not stuck" in text for text in res.live), res.live
        return 3 + 10
    raise AssertionError(kind)


REINIT = ("import torch, torch.distributed as dist\nsums = []\n"
          "for round in range(3):\n"
          "    dist.init_process_group('gloo')\n"
          "    t = torch.ones(1) * (round + 1)\n"
          "    dist.all_reduce(t)\n"
          "    dist.barrier()\n"
          "    sums.append(float(t))\n"
          "    dist.destroy_process_group()\n"
          "print('sums', sums)\n")


# A background session cell stopped the moment it is sent; the cell prints the
# run's status, the error its wait() raised and how long the stop took.
STOP_AS_SENT = ("h = get_ipython().run_cell_magic('distributed', '--session --background --output text',\n"
                "                                 'import time\\ntime.sleep(600)')\n"
                "h.stop()\n"
                "import time as _t\n_began = _t.monotonic()\n"
                "try:\n    h.wait(60)\nexcept Exception as e:\n    _err = type(e).__name__\n"
                "print(h.status, _err, _t.monotonic() - _began)")
