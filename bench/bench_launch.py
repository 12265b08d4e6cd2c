"""accel_magics vs accelerate.notebook_launcher, side by side, in real kernels.

Two kernels are started: one runs ``%%distributed`` cells, the other runs the
same work through ``notebook_launcher``.  Each benchmark alternates A/B cell by
cell (so drift hits both), times each cell as a frontend sees it (execute
request to idle, over the Jupyter protocol), and reports medians and ratios.

    python bench/bench_launch.py            # prints the table, writes bench/RESULTS.md
    python bench/bench_launch.py --quick    # fewer repetitions

Both sides run the training really distributed: the notebook_launcher kernel
gets ACCELERATE_USE_CPU=1 (without it, Accelerate on CPU runs N independent
copies and would be measured doing less work).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from kernel_harness import KernelSession  # noqa: E402

TRAINING_DEFS = '''
import torch
from torch.utils.data import Dataset, DataLoader
from accelerate import Accelerator

class SyntheticImages(Dataset):
    """Small synthetic 'images': class = which quadrant is brightest."""
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

def training_loop(epochs=5, lr=3e-3, batch_size=32, seed=42):
    torch.manual_seed(seed)
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4))
    train = DataLoader(SyntheticImages(), batch_size=batch_size, shuffle=True)
    evald = DataLoader(SyntheticImages(128, seed=1), batch_size=batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=epochs, steps_per_epoch=len(train))
    model, opt, train, evald, sched = accelerator.prepare(model, opt, train, evald, sched)
    for epoch in range(epochs):
        model.train()
        for x, y in train:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
        model.eval(); correct = total = 0
        for x, y in evald:
            with torch.no_grad():
                pred = model(x).argmax(1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item(); total += len(y)
        accelerator.print(f"epoch {epoch}: {100 * correct / total:.1f}%")

def empty():
    pass
'''

BENCHMARKS = {
    "empty cell, 2 ranks": (
        "%%distributed -n 2 --output text\npass\n",
        "notebook_launcher(empty, num_processes=2)\n",
    ),
    "Accelerate training (5 epochs), 2 ranks": (
        "%%distributed -n 2 --output text\ntraining_loop()\n",
        "notebook_launcher(training_loop, num_processes=2)\n",
    ),
}


def timed(k: KernelSession, code: str) -> float:
    start = time.perf_counter()
    k.ok(code, timeout=300)
    return time.perf_counter() - start


def machine() -> str:
    import torch
    import accelerate
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), Python "
            f"{platform.python_version()}, torch {torch.__version__}, accelerate {accelerate.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    args = parser.parse_args()
    reps = 5 if args.quick else args.reps

    ours = KernelSession(extra_env={"PYTHONUNBUFFERED": "1"})
    theirs = KernelSession(extra_env={"PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1"})
    try:
        first_start = time.perf_counter()
        ours.ok("%load_ext accel_magics")
        ours.ok("%%distributed -n 2 --output text\npass\n", timeout=300)
        first = time.perf_counter() - first_start
        ours.ok(TRAINING_DEFS)
        theirs.ok(TRAINING_DEFS + "\nfrom accelerate import notebook_launcher\n")
        rows = []
        for name, (a_code, b_code) in BENCHMARKS.items():
            timed(ours, a_code)     # warm both (first-use imports)
            timed(theirs, b_code)
            a, b = [], []
            for _ in range(reps):
                a.append(timed(ours, a_code))
                b.append(timed(theirs, b_code))
            ma, mb = statistics.median(a), statistics.median(b)
            rows.append((name, ma, mb, ma / mb, max(a)))
            print(f"{name}: accel_magics {ma * 1000:.1f} ms, notebook_launcher {mb * 1000:.1f} ms, "
                  f"ratio {ma / mb:.2f}x", flush=True)
    finally:
        ours.shutdown()
        theirs.shutdown()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    lines = [
        "# Benchmarks: accel_magics vs accelerate.notebook_launcher",
        "",
        f"Machine: {machine()}.  Commit {commit}.  {reps} alternating repetitions per row, medians,",
        "timed per cell as a Jupyter frontend sees it (execute request to idle). Ratio < 1: accel_magics is faster.",
        "",
        "| benchmark | accel_magics | notebook_launcher | ratio | accel_magics worst |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, ma, mb, ratio, worst in rows:
        lines.append(f"| {name} | {ma * 1000:.1f} ms | {mb * 1000:.1f} ms | {ratio:.2f}x | {worst * 1000:.1f} ms |")
    lines += ["", f"First `%%distributed` cell in a fresh kernel (load_ext + launcher start + run): {first:.2f} s.", ""]
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
