"""The CUDA paths on a real GPU (issue 26), marked ``gpu``: ``pytest -m gpu``.

Every test drives a real kernel with real ranks and NCCL.  Where the machine
has no usable GPU (decided in a subprocess: never initialise CUDA in this
process, whose forks the tests do not need, nor in a kernel) the whole module
skips with the reason.  ``scripts/gpu_check.sh`` sets up the CUDA build of
torch and runs this suite with a summary table.  The parts that need no GPU
(how the GPU count becomes the default number of ranks and each rank's device,
reading NVML's answers) are tested on CPU in test_gpu_logic.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _gpus() -> tuple[int, str]:
    probe = ("import json, torch\n"
             "ok = torch.cuda.is_available()\n"
             "print(json.dumps({'n': torch.cuda.device_count() if ok else 0, 'cuda': torch.version.cuda,"
             " 'names': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else []}))")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:   # no torch, a broken driver: say what
        return 0, f"could not ask torch about CUDA ({type(exc).__name__}: {exc})"
    if not info["n"]:
        return 0, (f"torch.cuda.is_available() is False in a subprocess (torch's CUDA: {info['cuda']}); "
                   "on a GPU machine scripts/gpu_check.sh installs the CUDA build")
    return info["n"], ", ".join(info["names"])


GPUS, WHAT = _gpus()
if not GPUS:
    pytest.skip(f"no GPU: {WHAT}", allow_module_level=True)

from conftest import LoadedKernel  # noqa: E402  (after the skip: a CPU machine imports nothing more)

TIMES = os.environ.get("ACCEL_MAGICS_GPU_TIMES")   # gpu_check.sh's table: where the timed rows go


def _record(name: str, seconds: float) -> None:
    if TIMES:
        with open(TIMES, "a") as f:
            f.write(json.dumps({"name": name, "seconds": round(seconds, 2)}) + "\n")


@pytest.fixture(scope="module")
def kernel():
    k = LoadedKernel(ranks=1)   # a machine may have one GPU: more ranks than GPUs is refused
    try:
        yield k
    finally:
        k.shutdown()


def by_rank(text: str) -> dict[int, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("[rank "):
            rank, rest = line[6:].split("] ", 1)
            out.setdefault(int(rank), rest)
    return out


_UNITS = {"B": 1, "kB": 1 << 10, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def gpu_memory_by_rank(status: str) -> dict[int, int]:
    """The rank table of ``%distributed_session status``: rank -> its GPU
    memory in bytes (the second size on the row, after RSS)."""
    out = {}
    for line in status.splitlines():
        fields = line.split()
        if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
            continue            # a rank row starts with its rank and pid
        sizes = re.findall(r"(\d+(?:\.\d+)?) (B|kB|KB|MB|GB|TB)\b", line)
        if len(sizes) >= 2:
            out[int(fields[0])] = int(float(sizes[1][0]) * _UNITS[sizes[1][1]])
    return out


def line_of(text: str, rank: int, prefix: str) -> str:
    """Rank ``rank``'s first line that starts with ``prefix`` (a rank's output
    may hold library warnings before it)."""
    for line in text.splitlines():
        if line.startswith(f"[rank {rank}] {prefix}"):
            return line.split("] ", 1)[1]
    raise AssertionError(f"rank {rank} printed no line starting {prefix!r}:\n{text}")


def test_the_default_is_one_rank_per_gpu_each_on_its_local_rank(kernel):
    res = kernel.ok("%%distributed --output text\nimport os, torch\n"
                    "print(os.environ['LOCAL_RANK'], torch.cuda.current_device(), torch.cuda.device_count())")
    got = by_rank(res.stdout)
    assert sorted(got) == list(range(GPUS)), res.stdout
    for rank, text in got.items():
        local, device, count = map(int, text.split())
        assert local == rank and device == local and count == GPUS, text


def test_cuda_visible_devices_in_the_kernel_is_respected(tmp_path):
    visible = "0" if GPUS == 1 else "1"
    k = LoadedKernel(extra_env={"CUDA_VISIBLE_DEVICES": visible}, ranks=1)
    try:
        res = k.ok("%%distributed --output text\nimport os, torch\n"
                   "print(torch.cuda.device_count(), os.environ.get('CUDA_VISIBLE_DEVICES'))")
        got = by_rank(res.stdout)
        assert list(got) == [0] and got[0] == f"1 {visible}", res.stdout   # one GPU seen: one rank
    finally:
        k.shutdown()


def test_an_nccl_all_reduce_gives_the_sum(kernel):
    res = kernel.ok("%%distributed --output text\nimport torch, torch.distributed as dist\n"
                    "dist.init_process_group('nccl')\n"
                    "t = torch.tensor([dist.get_rank() + 1.0], device='cuda')\ndist.all_reduce(t)\n"
                    "print('sum', t.item(), dist.get_backend())\ndist.destroy_process_group()")
    want = GPUS * (GPUS + 1) / 2
    assert all(text == f"sum {want} nccl" for text in by_rank(res.stdout).values()), res.stdout


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_ddp_trains_with_mixed_precision_through_accelerate(kernel, precision):
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    code = (f"%%distributed --output text --mixed_precision {precision}\n"
            "import torch\nfrom accelerate import Accelerator\n"
            "acc = Accelerator()\ntorch.manual_seed(0)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.05)\nmodel, opt = acc.prepare(model, opt)\n"
            "x = torch.randn(256, 32, device=acc.device)\ny = x.sum(dim=1, keepdim=True)\nlosses = []\n"
            "for step in range(60):\n"
            "    opt.zero_grad()\n"
            "    with acc.autocast():\n"
            "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
            "    acc.backward(loss)\n    opt.step()\n    losses.append(loss.item())\n"
            "print('precision', acc.mixed_precision, 'first', round(losses[0], 3), 'last', round(losses[-1], 3))\n")
    res = kernel.ok(code, timeout=300)
    for text in by_rank(res.stdout).values():
        parts = text.split()
        assert parts[1] == precision, text
        assert float(parts[5]) < 0.5 * float(parts[3]), f"the loss did not fall: {text}"


def test_cuda_initialised_in_the_kernel_blocks_the_next_cell_naming_it():
    k = LoadedKernel(ranks=1)
    try:
        k.ok("import torch\nprint(torch.cuda.is_available(), torch.cuda.device_count())")   # does not initialise
        assert k.ok("%%distributed -n 1 --output text\nprint('still fine')").stdout.count("still fine") == 1
        k.ok("x = torch.ones(1).cuda()   # initialises CUDA in the kernel")
        res = k.run("%%distributed -n 1 --output text\nprint('must not run')")
        assert res.error is not None and "PreflightError" in res.error_text, res.error_text
        assert "must not run" not in res.stdout
        assert "In[" in res.error_text and "cuda" in res.error_text.lower(), res.error_text   # names the cell
    finally:
        k.shutdown()


def test_a_session_shows_gpu_memory_per_rank_and_stop_frees_it(kernel):
    pytest.importorskip("pynvml", reason="pynvml (nvidia-ml-py) is not installed")
    kernel.ok("%distributed_session start")
    try:
        kernel.ok("%%distributed --session --output text\nimport torch\nheld = torch.empty(1 << 28, device='cuda')")
        status = kernel.ok("%distributed_session status").stdout
        gpu_mem = gpu_memory_by_rank(status)
        assert sorted(gpu_mem) == list(range(GPUS)), status      # each rank's GPU memory, from NVML
        assert all(held >= 1 << 30 for held in gpu_mem.values()), status   # the 1 GiB tensor, and CUDA's context
    finally:
        kernel.ok("%distributed_session stop")
    import pynvml
    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))}
    finally:
        pynvml.nvmlShutdown()
    from kernel_harness import descendants
    assert not (pids & descendants(kernel.pid)), "a rank of the stopped session still holds GPU memory"


def test_a_rank_out_of_gpu_memory_is_the_root_cause_and_the_next_cell_works(kernel):
    res = kernel.run("%%distributed --output text\nimport torch, os\n"
                     "if os.environ['RANK'] == '0':\n"
                     "    x = torch.empty(torch.cuda.get_device_properties(0).total_memory * 2, dtype=torch.uint8,"
                     " device='cuda')\n", timeout=300)
    assert res.error is not None and "rank 0 failed" in res.error["evalue"], res.error_text
    assert "OutOfMemoryError" in res.error_text or "out of memory" in res.error_text, res.error_text
    assert "ok" in kernel.ok("%%distributed --output text\nprint('ok')").stdout


def test_the_stop_during_an_nccl_collective_stops_every_rank_within_seconds(kernel):
    if GPUS < 2:
        pytest.skip("needs 2 GPUs: one rank waits in the collective for another")
    fired = []

    def on_output(text):
        if "waiting" in text and not fired:
            fired.append(time.monotonic())
            kernel.interrupt()

    res = kernel.run("%%distributed --output text\nimport torch, torch.distributed as dist, time\n"
                     "dist.init_process_group('nccl')\nt = torch.ones(1, device='cuda')\ndist.all_reduce(t)\n"
                     "if dist.get_rank() == 0:\n    print('waiting', flush=True)\n    dist.all_reduce(t)\n"
                     "    torch.cuda.synchronize()\nelse:\n    time.sleep(600)\n", on_output=on_output, timeout=120)
    took = time.monotonic() - fired[0]
    assert res.error is not None and res.error["ename"] == "RunInterrupted", res.error_text
    assert took < 20, f"the stop took {took:.1f}s"
    _record("stop during an NCCL collective (s)", took)


def test_the_stop_of_a_rank_busy_on_the_gpu_is_quick_and_the_next_cell_gets_its_memory(kernel):
    """One GPU is enough: the rank holds 60% of the device and spins on
    matrix products; the stop must end it within seconds, and the next cell's
    rank must be able to take the same 60% (freed before it starts)."""
    fired = []

    def on_output(text):
        if "busy" in text and not fired:
            fired.append(time.monotonic())
            kernel.interrupt()

    take = ("import torch\n"
            "held = torch.empty(int(torch.cuda.get_device_properties(0).total_memory * 0.6), dtype=torch.uint8,"
            " device='cuda')\n")
    res = kernel.run("%%distributed -n 1 --output text\n" + take +
                     "x = torch.randn(8192, 8192, device='cuda')\nprint('busy', flush=True)\n"
                     "while True:\n    y = x @ x\n    torch.cuda.synchronize()\n",
                     on_output=on_output, timeout=120)
    assert fired, res.stdout + res.error_text
    took = time.monotonic() - fired[0]
    assert res.error is not None and res.error["ename"] == "RunInterrupted", res.error_text
    assert took < 20, f"the stop took {took:.1f}s"
    _record("stop of a rank busy on the GPU (s)", took)
    assert "taken" in kernel.ok("%%distributed -n 1 --output text\n" + take + "print('taken')", timeout=120).stdout


TUTORIAL = """%%distributed --output text {flags}
import torch, timm, time
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
acc = Accelerator(cpu={cpu})
torch.manual_seed(0)
images = torch.randn(512, 3, 64, 64)
labels = (images.mean(dim=(1, 2, 3)) > 0).long()
loader = DataLoader(TensorDataset(images, labels), batch_size=32, shuffle=True)
model = timm.create_model("resnet18", pretrained=False, num_classes=2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt, loader = acc.prepare(model, opt, loader)
started = time.monotonic()
for epoch in range(3):
    model.train()
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
model.eval()
correct = total = 0
for x, y in loader:
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
    pred, y = acc.gather_for_metrics((pred, y))
    correct += (pred == y).sum().item()
    total += y.numel()
print("accuracy", round(correct / total, 3), "seconds", round(time.monotonic() - started, 2))
"""


def test_the_seed_tutorials_training_on_every_gpu_matches_cpu(kernel):
    pytest.importorskip("timm", reason="timm is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    gpu = line_of(kernel.ok(TUTORIAL.format(flags="", cpu=False), timeout=600).stdout, 0, "accuracy").split()
    cpu = line_of(kernel.ok(TUTORIAL.format(flags="-n 2 --oversubscribe", cpu=True), timeout=600).stdout,
                  0, "accuracy").split()
    assert abs(float(gpu[1]) - float(cpu[1])) < 0.15, (gpu, cpu)   # the same task learnt, within noise
    _record("tutorial on every GPU (s)", float(gpu[3]))
    _record("tutorial on 2 CPU ranks (s)", float(cpu[3]))
