"""Two kernels act as two nodes: one world, torch's rendezvous, clear failures."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kernel_harness import KernelSession, alive, descendants, typed, wait_until

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node(KernelSession):
    def __init__(self, extra_env=None, km=None) -> None:
        super().__init__(extra_env={"PYTHONUNBUFFERED": "1", **(extra_env or {})}, km=km)
        self.ok("%load_ext accel_magics")

    def start(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 120) -> dict:
        """stdout text, error (if any) and live texts of one cell started with start()."""
        out = {"stdout": "", "error": None, "live": []}
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out["stdout"] += content["text"]
            elif kind in ("display_data", "update_display_data"):
                out["live"].append(content["data"].get("text/plain", ""))
            elif kind == "error":
                out["error"] = content
            elif kind == "status" and content["execution_state"] == "idle":
                reply = self.reply_to(msg_id, time.monotonic() + 30)["content"]
                if reply["status"] == "error" and out["error"] is None:
                    out["error"] = reply
                return out


@pytest.fixture(scope="module")
def nodes():
    pair = [Node(), Node()]
    for node in pair:   # warm: the launcher has loaded torch
        node.ok("%%distributed -n 2 --output text\npass", timeout=120)
    yield pair
    for node in pair:
        node.shutdown()


def _quiet(node: Node) -> None:
    """Nothing of the runs left: only the launcher and its spare (idle ranks).
    A rank that failed is held for %distributed_debug: let go first, as a user would."""
    node.ok("%distributed_debug --release")

    def idle():
        kids = descendants(node.pid)
        return len(kids) <= 4
    wait_until(idle, 15, "the runs' processes to exit")


def _both(nodes, port: int, extra: str) -> list:
    """The cell (with ``extra``) on both nodes at once: each node's collected result."""
    msgs = [nodes[i].start(CELL.format(node=i, port=port, rdzv=60, extra=extra)) for i in (0, 1)]
    return [nodes[i].collect(msgs[i]) for i in (0, 1)]


CELL = (
    "%%distributed -n 2 --num_nodes 2 --node_rank {node} --master_addr 127.0.0.1 --master_port {port} "
    "--output text --rendezvous_timeout {rdzv}\n"
    "import os, torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "t = torch.tensor([dist.get_rank() + 1.0])\n"
    "dist.all_reduce(t)\n"
    "print(f\"sum={{t.item():g}} rank={{dist.get_rank()}} local={{os.environ['LOCAL_RANK']}} "
    "node={{os.environ['NODE_RANK']}} world={{dist.get_world_size()}}\")\n"
    "{extra}"
    "dist.destroy_process_group()\n"
)


def test_two_kernels_form_one_world_of_four(nodes):
    port = _free_port()
    # Node 1 first: it waits, visibly, for node 0.
    second = nodes[1].start(CELL.format(node=1, port=port, rdzv=60, extra=""))
    first = nodes[0].start(CELL.format(node=0, port=port, rdzv=60, extra=""))
    out0, out1 = nodes[0].collect(first), nodes[1].collect(second)
    assert out0["error"] is None and out1["error"] is None, (out0, out1)
    for rank, node, text in [(0, 0, out0), (1, 0, out0), (2, 1, out1), (3, 1, out1)]:
        assert f"[rank {rank}] sum=10 rank={rank} local={rank % 2} node={node} world=4" in text["stdout"]
    for node in nodes:
        _quiet(node)


def test_a_breakpoint_on_node_1_asks_in_node_1s_notebook_while_node_0_waits(nodes):
    """Kernel per node: rank 3 stops at breakpoint(); its prompt comes to node
    1's notebook (each kernel debugs its own ranks), node 0's ranks wait for it
    in their all_reduce, and after c both cells end with the sum."""
    port = _free_port()
    pause = ("if dist.get_rank() == 3:\n    breakpoint()\n"
             "dist.all_reduce(t)\nprint('again', t.item())\n")
    second = nodes[1].submit(CELL.format(node=1, port=port, rdzv=60, extra=pause), allow_stdin=True)
    first = nodes[0].start(CELL.format(node=0, port=port, rdzv=60, extra=pause))
    out1 = nodes[1].result_of(second, timeout=120, stdin=typed("p dist.get_rank()", "c"))
    out0 = nodes[0].collect(first)
    assert out0["error"] is None and out1.status == "ok", (out0, out1.error_text)
    assert out1.prompts == ["(Pdb rank 3) "] * 2, out1.prompts
    assert "[rank 3] 3" in out1.stdout.splitlines(), out1.stdout
    assert out0["stdout"].count("again 40.0") == 2 and out1.stdout.count("again 40.0") == 2, (out0, out1.stdout)
    for node in nodes:
        _quiet(node)


def test_post_mortem_of_a_rank_that_failed_on_node_1_in_node_1s_notebook(nodes):
    """Kernel per node: rank 3 fails in f(21) on node 1; both cells end with
    its error, and node 1's kernel (each kernel debugs its own ranks) opens the
    post-mortem in its failing frame: p y shows 42, q ends it and the rank."""
    port = _free_port()
    extra = ("def f(x):\n    y = x * 2\n    raise ValueError('no good')\n\n"
             "if dist.get_rank() == 3:\n    print('pid', os.getpid())\n    f(21)\n"
             "dist.barrier()\n")
    outs = _both(nodes, port, extra)
    for out in outs:
        assert out["error"]["ename"] == "DistributedRunError" and "rank 3 failed: ValueError: no good" in \
            out["error"]["evalue"], out
    assert "%distributed_debug opens a post-mortem (pdb) in rank 3's failing frame" in \
        "\n".join(outs[1]["error"]["traceback"]), outs[1]["error"]
    pid = int(outs[1]["stdout"].split("[rank 3] pid ", 1)[1].split()[0])
    dbg = nodes[1].run("%distributed_debug", timeout=60, stdin=typed("p y", "q"))
    assert dbg.status == "ok" and dbg.prompts == ["(Pdb rank 3) "] * 2, dbg.error_text + str(dbg.prompts)
    assert "[rank 3] 42" in dbg.stdout.splitlines(), dbg.stdout
    wait_until(lambda: not alive(pid), 15, "the held rank to end after q")
    for node in nodes:
        _quiet(node)


def test_a_node_without_node_0_times_out_clearly(nodes):
    port = _free_port()
    started = time.monotonic()
    msg = nodes[1].start(CELL.format(node=1, port=port, rdzv=4, extra=""))
    out = nodes[1].collect(msg)
    assert time.monotonic() - started < 30
    assert out["error"]["ename"] == "RendezvousError"
    text = out["error"]["evalue"]
    assert f"127.0.0.1:{port} timed out after 4s" in text
    assert "node 0's cell was started" in text and "same --num_nodes" in text
    assert any("waiting for" in t and f"127.0.0.1:{port}" in t for t in out["live"])
    _quiet(nodes[1])


def test_a_failing_rank_on_one_node_ends_both_cells(nodes):
    port = _free_port()
    extra = ("if dist.get_rank() == 3:\n"
             "    raise RuntimeError('rank 3 ran out of data')\n"
             "dist.barrier()\n")
    outs = _both(nodes, port, extra)
    for out in outs:
        assert out["error"]["ename"] == "DistributedRunError", out
        assert "rank 3" in out["error"]["evalue"] and "rank 3 ran out of data" in out["error"]["evalue"]
    assert "(on node 1)" in outs[0]["error"]["evalue"]      # node 0 learns the remote root cause
    for node in nodes:
        _quiet(node)


@pytest.mark.parametrize("per_node", [2, 1])
def test_a_rank_on_node_1_that_leaves_before_init_process_group_ends_both_cells_naming_it(nodes, per_node):
    """Node 1's first rank finishes the cell (sys.exit(0)) before init_process_group,
    where every other rank waits for it: each kernel sees only its own node, so
    node 1 says it in node 0's store and node 0's kernel stops its waiting ranks
    too, naming the rank and its node (one rank per node: node 1 has no one
    waiting, and ends as its rank did)."""
    port = _free_port()
    cell = (f"%%distributed -n {per_node} --num_nodes 2 --node_rank {{node}} --master_addr 127.0.0.1 "
            f"--master_port {port} --output text --rendezvous_timeout 60\n"
            "import os, sys, torch.distributed as dist\n"
            f"if os.environ['RANK'] == '{per_node}':\n    sys.exit(0)\n"
            "dist.init_process_group('gloo')\ndist.barrier()\n")
    started = time.monotonic()
    msgs = [nodes[i].start(cell.format(node=i)) for i in (0, 1)]
    outs = [nodes[i].collect(msgs[i]) for i in (0, 1)]
    assert time.monotonic() - started < 30, outs
    error = outs[0]["error"]
    assert error is not None and error["ename"] == "DistributedStallError", outs[0]
    waiting = ", ".join(map(str, range(per_node)))
    assert error["evalue"].startswith(f"rank(s) {waiting} wait in init_process_group for rank {per_node} "
                                      "(on node 1), which had already finished the cell (sys.exit(0))"), error
    if per_node == 2:
        assert outs[1]["error"]["ename"] == "DistributedStallError", outs[1]
        assert outs[1]["error"]["evalue"].startswith("rank(s) 3 wait in init_process_group for rank 2,"), outs[1]
    else:
        assert outs[1]["error"] is None, outs[1]
    for node in nodes:
        _quiet(node)


def test_max_restarts_with_a_kernel_per_node_a_failure_on_node_1_restarts_both_nodes(nodes):
    """A rank on node 1 fails in the first attempt only: both kernels' cells go
    to a second attempt on a fresh rendezvous round and succeed, one world of 4."""
    port = _free_port()
    extra = ("if dist.get_rank() == 3 and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
             "    raise RuntimeError('flaky on node 1')\n"
             "dist.barrier()\n"
             "print('attempt', os.environ['TORCHELASTIC_RESTART_COUNT'], 'done')\n")
    def cell(node: int) -> str:
        return CELL.format(node=node, port=port, rdzv=60, extra=extra).replace(
            "--output text", "--output text --max_restarts 1")
    msgs = [nodes[i].start(cell(i)) for i in (1, 0)][::-1]
    outs = [nodes[i].collect(msgs[i]) for i in (0, 1)]
    for i, out in enumerate(outs):
        assert out["error"] is None, (i, out)
        for rank in (2 * i, 2 * i + 1):
            assert f"[rank {rank}] sum=10 rank={rank} local={rank % 2} node={i} world=4" in out["stdout"], out
            assert f"[rank {rank}] attempt 1 done" in out["stdout"], out
        assert "attempt 2 of 2" in out["stdout"] and "flaky on node 1" in out["stdout"], out["stdout"]
    for node in nodes:
        _quiet(node)


def test_max_restarts_with_a_kernel_per_node_the_last_failure_is_each_cells_error(nodes):
    port = _free_port()
    extra = ("if dist.get_rank() == 1:\n"
             "    raise RuntimeError('always on node 0, attempt ' + os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
             "dist.barrier()\n")
    def cell(node: int) -> str:
        return CELL.format(node=node, port=port, rdzv=60, extra=extra).replace(
            "--output text", "--output text --max_restarts 1")
    msgs = [nodes[i].start(cell(i)) for i in (0, 1)]
    outs = [nodes[i].collect(msgs[i]) for i in (0, 1)]
    for out in outs:
        assert out["error"]["ename"] == "DistributedRunError", out
        assert "always on node 0, attempt 1" in out["error"]["evalue"], out["error"]["evalue"]
        assert "[after 2 attempts]" in out["error"]["evalue"]
    for node in nodes:
        _quiet(node)


# -- two nodes with their own network stacks ------------------------------------

def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns_pair(tmp_path):
    """Two network namespaces joined by a veth pair: node 0 at 10.233.N.1, node 1 at .2."""
    tag = f"{os.getpid() % 10000}"
    names, subnet = [f"accel0-{tag}", f"accel1-{tag}"], f"10.233.{os.getpid() % 250}"
    made = []
    try:
        for name in names:
            r = _sh("ip", "netns", "add", name)
            if r.returncode:
                pytest.skip(f"network namespaces cannot be created here: {r.stderr.strip()}")
            made.append(name)
        steps = [
            ("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
            ("ip", "link", "set", f"va{tag}", "netns", names[0]),
            ("ip", "link", "set", f"vb{tag}", "netns", names[1]),
            ("ip", "-n", names[0], "addr", "add", f"{subnet}.1/24", "dev", f"va{tag}"),
            ("ip", "-n", names[1], "addr", "add", f"{subnet}.2/24", "dev", f"vb{tag}"),
            ("ip", "-n", names[0], "link", "set", f"va{tag}", "up"),
            ("ip", "-n", names[1], "link", "set", f"vb{tag}", "up"),
            ("ip", "-n", names[0], "link", "set", "lo", "up"),
            ("ip", "-n", names[1], "link", "set", "lo", "up"),
        ]
        for step in steps:
            r = _sh(*step)
            assert r.returncode == 0, f"{' '.join(step)}: {r.stderr}"
        # One kernelspec per namespace; the frontend talks to the kernels over
        # ipc:// files, which work across network namespaces.
        specs = []
        for name, dev in zip(names, (f"va{tag}", f"vb{tag}")):
            spec_dir = tmp_path / "kernels" / name
            spec_dir.mkdir(parents=True)
            (spec_dir / "kernel.json").write_text(json.dumps({
                "argv": ["ip", "netns", "exec", name, sys.executable, "-m", "ipykernel_launcher",
                         "-f", "{connection_file}"],
                "display_name": name, "language": "python"}))
            specs.append((name, dev))
        yield subnet, specs, tmp_path / "kernels"
    finally:
        for name in made:
            _sh("ip", "netns", "del", name)


def test_two_nodes_in_separate_network_namespaces(netns_pair, tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    subnet, specs, kernel_dir = netns_pair
    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)])
    nodes, pids = [], set()
    try:
        for i, (name, dev) in enumerate(specs):
            km = KernelManager(kernel_name=name, kernel_spec_manager=ksm, transport="ipc",
                               ip=str(tmp_path / f"ipc{i}"))
            # gloo must use the namespace's own interface, as on a real cluster
            nodes.append(Node(extra_env={"GLOO_SOCKET_IFNAME": dev}, km=km))
        probe = ("import socket\ntry:\n    socket.socket().bind(('{addr}', 0)); print('local')\n"
                 "except OSError:\n    print('remote')")
        assert nodes[0].ok(probe.format(addr=f"{subnet}.1")).stdout.strip() == "local"
        assert nodes[1].ok(probe.format(addr=f"{subnet}.1")).stdout.strip() == "remote"   # really elsewhere
        port = 29000 + os.getpid() % 1000
        cells = [CELL.format(node=i, port=port, rdzv=60, extra="").replace("127.0.0.1", f"{subnet}.1")
                 for i in (0, 1)]
        msgs = [nodes[1].start(cells[1]), nodes[0].start(cells[0])]
        out1, out0 = nodes[1].collect(msgs[0], timeout=180), nodes[0].collect(msgs[1], timeout=180)
        assert out0["error"] is None and out1["error"] is None, (out0, out1)
        for rank, node, out in [(0, 0, out0), (1, 0, out0), (2, 1, out1), (3, 1, out1)]:
            assert f"[rank {rank}] sum=10 rank={rank} local={rank % 2} node={node} world=4" in out["stdout"]
        for node in nodes:
            pids |= descendants(node.pid) | {node.pid}
    finally:
        for node in nodes:
            node.shutdown()
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 20,
               "both nodes' kernels, launchers and ranks to exit")


def test_a_two_node_session_whose_other_kernel_dies_is_lost_not_living_on():
    """Issue 24 item 8: with a kernel per node, node 1's kernel killed -9 took
    its part of the session with it, and node 0's next cell failed in gloo and
    said "The session lives on", although its world can never be whole again.
    Each node's part now shows it is there (a count in node 0's store), and a
    node silent for 5 s loses the session on the others, saying which."""
    port = _free_port()
    pair = [Node(), Node()]
    try:
        start = "%distributed_session start -n 1 --num_nodes 2 --node_rank {node} --master_addr 127.0.0.1 " \
                f"--master_port {port} --rendezvous_timeout 60"
        waiting = [node.start(start.format(node=i)) for i, node in enumerate(pair)]
        for node, msg_id in zip(pair, waiting):
            out = node.collect(msg_id, timeout=180)
            assert out["error"] is None, out
        cell = ("%%distributed --session --output text\nimport torch, torch.distributed as dist\n"
                "if not dist.is_initialized():\n    dist.init_process_group('gloo')\n"
                "t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())\n")
        ran = [node.start(cell) for node in pair]
        for node, msg_id in zip(pair, ran):
            out = node.collect(msg_id)
            assert out["error"] is None and "sum 2.0" in out["stdout"], out
        os.kill(pair[1].pid, signal.SIGKILL)          # its launcher and ranks go with it
        res = pair[0].run(cell, timeout=90)
        assert res.error is not None, res.stdout
        text = "\n".join(res.error.get("traceback") or []) + res.error.get("evalue", "")
        assert "lives on" not in text, text
        assert res.error["ename"] == "SessionLostError" and "node 1" in text, text
        # and the kernel stays usable: a fresh session on this node alone
        pair[0].ok("%distributed_session start -n 2")
        assert "[rank 1] 1" in pair[0].ok("%%distributed --session --output text\nimport os\n"
                                          "print(os.environ['RANK'])").stdout
        pair[0].ok("%distributed_session stop")
    finally:
        for node in pair:
            try:
                node.shutdown()
            except Exception:
                pass
