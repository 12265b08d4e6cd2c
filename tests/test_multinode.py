"""Two kernels act as two nodes: one world, torch's rendezvous, clear failures."""
from __future__ import annotations

import os
import socket
import time

import pytest

from kernel_harness import KernelSession, descendants, wait_until

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node(KernelSession):
    def __init__(self) -> None:
        super().__init__(extra_env={"PYTHONUNBUFFERED": "1"})
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
                reply = self.kc.get_shell_msg(timeout=30)["content"]
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
    """Nothing of the runs left: only the launcher and its spare (idle ranks)."""
    def idle():
        kids = descendants(node.pid)
        return len(kids) <= 4
    wait_until(idle, 15, "the runs' processes to exit")


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
    msgs = [nodes[i].start(CELL.format(node=i, port=port, rdzv=60, extra=extra)) for i in (0, 1)]
    outs = [nodes[i].collect(msgs[i]) for i in (0, 1)]
    for out in outs:
        assert out["error"]["ename"] == "DistributedRunError", out
        assert "rank 3" in out["error"]["evalue"] and "rank 3 ran out of data" in out["error"]["evalue"]
    assert "(on node 1)" in outs[0]["error"]["evalue"]      # node 0 learns the remote root cause
    for node in nodes:
        _quiet(node)
