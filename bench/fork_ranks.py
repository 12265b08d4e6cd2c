"""Run a script as N ranks forked from a process that imported torch first.

    python bench/fork_ranks.py [--setsid] NPROC SCRIPT

The bench's third arm for DDP throughput: what a plain ``os.fork()`` of a
torch-loaded interpreter costs compared with torchrun's freshly started
ranks, with none of accel_magics in the way.  ``notebook_launcher`` starts its
ranks the same way (fork), and so does every launcher that starts ranks in
milliseconds; this separates the price of forking from the price of
accel_magics.  Each rank's stdout goes to this process's stdout.

``--setsid``: each rank starts its own session, as torchrun starts its ranks
(``start_new_session``).  Where the kernel groups processes for scheduling
by session (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in
most desktop and cloud kernels), ranks in one session share one group's CPU
share, and DDP trains measurably slower than under torchrun: with and
without it, the bench shows how much.
"""
from __future__ import annotations

import os
import runpy
import sys

import torch
import torch.distributed  # noqa: F401
import torch.nn.parallel  # noqa: F401

from accel_magics.kernel_ext.environment import free_port


def main() -> None:
    args = sys.argv[1:]
    setsid = args[:1] == ["--setsid"]
    nproc, script = int(args[setsid]), args[setsid + 1]
    port = free_port()
    sys.stdout.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if setsid:
                    os.setsid()
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                  LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                                  OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
                torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
                runpy.run_path(script, run_name="__main__")
                code = 0
            finally:
                sys.stdout.flush()
                os._exit(code)
        pids.append(pid)
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
