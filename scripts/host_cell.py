"""A 2-rank cell in a real kernel of this interpreter's environment (scripts/host_check.sh).

Starts an IPython kernel with jupyter_client, as a notebook frontend does, loads
the installed accel_magics (the kernel runs in a temporary directory, so the
worktree's sources are not what it imports) and runs one all_reduce on 2 ranks,
with the widget view (a frontend's default) and with ``--output text``; then
the pre-flight's refusal once CUDA is (simulated) initialised must name the cell.
"""
from __future__ import annotations

import os
import queue
import sys
import tempfile
import time

from jupyter_client.manager import KernelManager

CELL = """%%distributed -n 2 {flags}
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {{dist.get_rank()}} of {{dist.get_world_size()}}: sum {{t.item():g}}")
"""


def run(kc, code: str, timeout: float = 180) -> tuple[str, str]:
    """The cell's status and all the text it showed (streams, displays' text/plain)."""
    msg_id = kc.execute(code)
    texts, deadline = [], time.monotonic() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise SystemExit(f"host_cell: no answer within {timeout:g} s to:\n{code}\nso far:\n{''.join(texts)}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            texts.append(content["text"])
        elif kind in ("display_data", "update_display_data", "execute_result"):
            texts.append(content["data"].get("text/plain", "") + "\n")
        elif kind == "error":
            texts.append("\n".join(content["traceback"]) + "\n")
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while True:
        reply = kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["status"], "".join(texts)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="accel_magics-host-") as cwd:
        km = KernelManager(kernel_name="python3")
        # (ipykernel 6's debugger warns about frozen modules on stderr at every start)
        km.start_kernel(cwd=cwd, env=dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1"))
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=120)
            status, text = run(kc, "import sys, IPython, ipykernel, ipywidgets, torch, accel_magics\n"
                                   "print(sys.executable, sys.version.split()[0], 'IPython', IPython.__version__,"
                                   " 'ipykernel', ipykernel.__version__, 'ipywidgets', ipywidgets.__version__,"
                                   " 'torch', torch.__version__, accel_magics.__file__)")
            print("host_cell: kernel:", text.strip())
            if status != "ok" or not text.startswith(sys.executable + " "):
                print(f"host_cell: the kernel is not this environment's ({sys.executable})")
                return 1
            status, text = run(kc, "%load_ext accel_magics")
            if status != "ok":
                print("host_cell: %load_ext failed:\n" + text)
                return 1
            for flags in ("", "--output text"):
                t0 = time.monotonic()
                status, text = run(kc, CELL.format(flags=flags))
                want = [f"rank {r} of 2: sum 3" for r in (0, 1)]
                missing = [w for w in want if w not in text]
                label = flags or "the widget view"
                if status != "ok" or missing:
                    print(f"host_cell: the 2-rank cell ({label}) FAILED: status {status}, missing {missing}:\n{text}")
                    return 1
                print(f"host_cell: 2-rank cell ({label}) ok in {time.monotonic() - t0:.1f} s")
            # The pre-flight names the cell that initialised CUDA (IPython 7 has no map of
            # cell names): simulated, as tests/test_magic_e2e.py does, on a machine without a GPU.
            run(kc, "import torch\ntorch.cuda._initialized = True\ntorch.cuda.init()")
            number = int(run(kc, "print(get_ipython().execution_count - 1)")[1].strip())
            status, text = run(kc, CELL.format(flags=""))
            run(kc, "torch.cuda._initialized = False")
            if status != "error" or f"In[{number}], line 3: torch.cuda.init()" not in text:
                print(f"host_cell: the pre-flight did not name In[{number}]: status {status}:\n{text}")
                return 1
            print("host_cell: the pre-flight names the cell that initialised CUDA")
            return 0
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)


if __name__ == "__main__":
    sys.exit(main())
