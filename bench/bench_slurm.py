"""The kernel's own CPU per warm ``--launcher slurm`` cell, 1 node against 8.

    python bench/bench_slurm.py                   # this tree: 1 and 8 nodes of one rank each
    python bench/bench_slurm.py --base 1261dca    # that commit too, its kernels' cells alternating with the tree's

A real Slurm cluster on this machine (tests/slurm_cluster.py: slurmctld and
8 slurmd, every "node" on this machine's cores), a kernel inside a 1-node
and one inside an 8-node allocation (both at once), an empty
one-rank-per-node cell again and again, 1 s apart, the kernels taking turns.  For each cell: the kernel process's CPU (every thread,
and its main thread alone, from /proc/<pid>/task/*/schedstat) before and
after.  The per-node cost is (8 nodes - 1 node) / 7: on a real cluster the
kernel is the one process that every node talks to, so that is the part of
a cell that grows with the allocation.  With --base, the package at that
commit and the working tree are installed into directories of their own
(bench_launch.build_ab) and each node count gets a kernel of each, all
four taking turns, so every arm sees the same load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from bench_launch import build_ab, settle, timed  # noqa: E402
from kernel_harness import KernelSession  # noqa: E402
from slurm_cluster import SlurmCluster, missing  # noqa: E402

CELL = "%%distributed --launcher slurm -n 1 --output text\npass\n"


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid``: (every thread, its main thread)."""
    total = main = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):   # a thread that just ended
            continue
        total += ns
        if int(task) == pid:
            main = ns
    return total / 1e9, main / 1e9


def kernel(alloc: dict, site: str | None, cwd: str | None) -> KernelSession:
    env = {"PYTHONUNBUFFERED": "1", **alloc}
    if site:
        env["PYTHONPATH"] = site
    k = KernelSession(extra_env=env, cwd=cwd)
    try:
        k.ok("%load_ext accel_magics")
        if site:
            where = k.ok("import accel_magics.kernel_ext as _ke; print(_ke.__file__)").stdout.strip()
            assert where.startswith(site + os.sep), (site, where)
    except BaseException:
        k.shutdown()
        raise
    return k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="a commit to measure beside the working tree")
    ap.add_argument("--cells", type=int, default=15)
    ap.add_argument("--nodes", default="1,8")
    args = ap.parse_args()
    why = missing()
    if why:
        sys.exit(f"slurm: skipped ({why})")
    counts = [int(n) for n in args.nodes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        if args.base:
            site_a, site_b, tree = build_ab(args.base, tmp)
            arms = {args.base: site_a, tree: site_b}
        else:
            arms = {"tree": None}
        cluster = SlurmCluster(nodes=max(counts), cpus=2)
        results = {}   # (arm, nodes) -> (cell seconds, kernel CPU, main thread CPU) medians
        allocs, kernels = [], {}
        try:
            # Every allocation at once (a node has 2 CPUs, an allocation takes one of each of its
            # nodes) and one kernel per arm in each: the cells of all of them take turns, so every
            # kernel's cells see the same load on this shared machine.
            for nodes in sorted(counts, reverse=True):
                alloc = cluster.allocate(nodes)
                allocs.append(alloc)
                for name, site in arms.items():
                    kernels[name, nodes] = kernel(alloc, site, tmp if site else None)
            for k in kernels.values():
                timed(k, CELL, 300), timed(k, CELL), timed(k, CELL)
            settle(4 + 2 * max(counts))
            samples = {key: ([], [], []) for key in kernels}
            for _ in range(args.cells):
                for key, k in kernels.items():
                    time.sleep(1.0)
                    before = thread_cpu(k.pid)
                    wall = timed(k, CELL)
                    after = thread_cpu(k.pid)
                    samples[key][0].append(wall)
                    samples[key][1].append(after[0] - before[0])
                    samples[key][2].append(after[1] - before[1])
            for (name, nodes), (walls, cpus, mains) in sorted(samples.items(), key=lambda kv: kv[0][1]):
                results[name, nodes] = tuple(statistics.median(x) for x in (walls, cpus, mains))
                print(f"{name} {nodes} node(s): cell {results[name, nodes][0] * 1000:.1f} ms, kernel CPU "
                      f"{results[name, nodes][1] * 1000:.2f} ms (main thread "
                      f"{results[name, nodes][2] * 1000:.2f} ms)", flush=True)
        finally:
            for k in kernels.values():
                k.shutdown()
            for alloc in allocs:
                cluster.release(alloc["SLURM_JOB_ID"])
            cluster.stop()
    lo, hi = min(counts), max(counts)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"\nload average at the end: {load}")
    for name in arms:
        per = [(results[name, hi][i] - results[name, lo][i]) / (hi - lo) * 1000 for i in range(3)]
        print(f"{name}: per added node: cell {per[0]:.2f} ms, kernel CPU {per[1]:.2f} ms (main thread "
              f"{per[2]:.2f} ms); {lo} node: {results[name, lo][1] * 1000:.2f} ms, {hi} nodes: "
              f"{results[name, hi][1] * 1000:.2f} ms")


if __name__ == "__main__":
    main()
