"""Two machines, kernel per node: set-up mistakes are told at once (issue 45, item 3).

End to end over the Jupyter protocol (two real kernels on loopback, or in two
network namespaces the test creates), and the message-forming functions with
recorded inputs.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import pytest

from kernel_harness import KernelSession, descendants, wait_until
from test_multinode import Node, _free_port, netns_pair  # noqa: F401 (a fixture)

from accel_magics.kernel_ext.environment import ConfigError, LaunchConfig, validate
from accel_magics.kernel_ext.supervisor import node_notes
from accel_magics.kernel_ext.kernel.events import Waiting
from accel_magics.magics import command_line
from accel_magics.node_lines import other_node_lines

pytestmark = pytest.mark.timeout(240)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, never listened: refused)."""
    return _free_port()


class Timed:
    """When the first output containing each needle came (seconds after start)."""

    def __init__(self, *needles: str) -> None:
        self.start = time.monotonic()
        self.seen: dict[str, float] = {}
        self.needles = needles

    def __call__(self, text: str) -> None:
        for needle in self.needles:
            if needle not in self.seen and needle in text:
                self.seen[needle] = time.monotonic() - self.start


def _run(node: KernelSession, code: str, timeout: float = 120, timed: Timed = None):
    return node.run(code, timeout=timeout, on_output=timed)


# -- end to end: loopback -----------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    nodes = [Node(), Node()]
    for node in nodes:   # warm: the launcher has loaded torch
        node.ok("%%distributed -n 1 --output text\npass", timeout=120)
    yield nodes
    for node in nodes:
        node.shutdown()


def _cell(port: int, rdzv: float, rank: str = "", body: str = "pass\n") -> str:
    return (f"%%distributed -n 1 --num_nodes 2 {rank}--master_addr 127.0.0.1 --master_port {port} "
            f"--output text --rendezvous_timeout {rdzv:g}\n{body}")


def test_two_kernels_both_node_0_the_second_is_told_to_pass_node_rank_and_the_first_learns_it(pair):
    port = _free_port()
    timed = Timed("a second node 0")
    box = {}
    first = threading.Thread(target=lambda: box.update(res=_run(pair[0], _cell(port, 20), timed=timed)))
    first.start()
    try:
        # The second kernel, started once the first one waits at its port.
        wait_until(lambda: _listening(port), 60, "node 0's store to listen")
        started = time.monotonic()
        res = pair[1].run(_cell(port, 20), timeout=60)
        took = time.monotonic() - started
    finally:
        first.join(90)
    assert res.error is not None and res.error["ename"] == "RendezvousError", res.error_text
    text = res.error["evalue"]
    assert took < 30, took
    print(f"the second node 0's cell ended {took:.1f}s after it started; the first was told after "
          f"{timed.seen.get('a second node 0')}s of its cell")
    assert f"another node 0 already holds 127.0.0.1:{port}" in text and "--node_rank 1" in text, text
    # The first node 0 was told within seconds of the second one's try, and kept waiting.
    assert "a second node 0" in timed.seen and timed.seen["a second node 0"] < 20, timed.seen
    first_res = box["res"]
    assert first_res.error["ename"] == "RendezvousError", first_res.error_text
    assert "only 1 of 2 nodes joined" in first_res.error["evalue"]
    assert "a second node 0" in first_res.error["evalue"] and "--node_rank" in first_res.error["evalue"]


def _launcher_dirs() -> set:
    base = tempfile.gettempdir()
    return {os.path.join(base, e) for e in os.listdir(base) if e.startswith("accel_magics-")}


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_node_1_pointed_at_a_closed_port_says_node_0_refuses_within_seconds_and_counts_itself(pair):
    port = _closed_port()
    address = f"127.0.0.1:{port}"
    timed = Timed(f"node 0 at {address} refuses connections")
    res = _run(pair[1], _cell(port, 8, "--node_rank 1 "), timed=timed)
    assert timed.seen, res.stdout
    assert timed.seen[f"node 0 at {address} refuses connections"] < 20, timed.seen
    print(f"'refuses' shown {timed.seen[f'node 0 at {address} refuses connections']:.1f}s after the cell started")
    # this node is there: one of two nodes is missing, not both
    shown = "\n".join(res.live)
    assert f"waiting for 1 of 2 nodes at {address}: node 0 at {address} refuses connections" in shown, shown
    assert res.error["ename"] == "RendezvousError", res.error_text
    assert f"node 0 at {address} refused every connection" in res.error["evalue"]


def test_distributed_config_with_two_nodes_shows_the_line_to_run_on_node_1(pair):
    out = pair[0].ok("%distributed_config -n 2 --num_nodes 2 --master_addr 127.0.0.1").stdout
    try:
        assert ("on node 1, run: %%distributed --num_processes 2 --num_nodes 2 --master_port 29500 "
                "--master_addr 127.0.0.1 --node_rank 1") in out, out
        assert "reaches node 0 from its own machine only" in out, out
    finally:
        pair[0].ok("%distributed_config --reset")


def test_node_0_with_this_machines_names_is_no_usage_error():
    """localhost and 0.0.0.0 are this machine: node 0 may host there."""
    for host in ("localhost", "0.0.0.0", "127.0.0.1"):
        validate(LaunchConfig(num_processes=1, num_nodes=2, master_addr=host, master_port=_free_port()))


@pytest.mark.parametrize("gone", [1, 0])
def test_a_node_whose_kernel_is_killed_mid_run_is_named_in_the_other_nodes_root_cause(pair, gone):
    """kill -9 of one node's kernel and every process of it at once (its
    machine switched off: all stopped first, so none of them acts on another's
    death): the other node's cell names that node and where it was, not gloo's
    lost connection (node 1 gone: node 0's store says no more of it; node 0
    gone: its store stops answering)."""
    _kill_one_node_mid_run(pair, gone, machine=True)


def test_a_node_whose_kernel_alone_dies_mid_run_is_named_as_having_left(pair):
    """kill -9 of node 1's kernel only (an OOM kill, a crash): its launcher
    ends the run there, and node 0's root cause names node 1 and why it left,
    not gloo's lost connection (before: node 1 ended its part as if done, and
    node 0's error was "Connection closed by peer", 1 run in 7 under load)."""
    _kill_one_node_mid_run(pair, 1, machine=False)


def _kill_one_node_mid_run(pair, gone: int, machine: bool) -> None:
    port = _free_port()
    body = ("import time, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.ones(1)\n"
            "for step in range(3000):\n"
            "    dist.all_reduce(t)\n"
            "    if step == 5:\n"
            "        print('both in', flush=True)\n"
            "    time.sleep(0.05)\n")
    before, its_dirs = _launcher_dirs(), set()
    victim = Node()
    try:
        victim.ok("%%distributed -n 1 --output text\npass", timeout=120)
        its_dirs = _launcher_dirs() - before   # killed -9, its kernel cannot remove them: the test does
        waiting = victim.start(_cell(port, 60, f"--node_rank {gone} ", body))
        box = {}
        seen = threading.Event()
        first = threading.Thread(target=lambda: box.update(res=pair[0].run(
            _cell(port, 60, f"--node_rank {1 - gone} ", body), timeout=120,
            on_output=lambda text: "both in" in text and seen.set())))
        first.start()
        assert seen.wait(90), "the two nodes never ran together"
        doomed = descendants(victim.pid) | {victim.pid} if machine else {victim.pid}
        for sig in (signal.SIGSTOP, signal.SIGKILL) if machine else (signal.SIGKILL,):
            for pid in doomed:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        killed = time.monotonic()
        first.join(90)
        del waiting
    finally:
        try:
            victim.shutdown()
        except Exception:
            pass
        for path in its_dirs:
            shutil.rmtree(path, ignore_errors=True)
    res = box["res"]
    took = time.monotonic() - killed
    assert res.error is not None and res.error["ename"] == "DistributedRunError", res.error_text
    if machine:
        where = "(at 127.0.0.1, host " if gone else "(at 127.0.0.1) went away"
        assert res.error["evalue"].startswith(f"node {gone} {where}"), res.error["evalue"]
        assert "went away" in res.error["evalue"], res.error["evalue"]
    else:
        assert res.error["evalue"].startswith(f"node 1 (host {socket.gethostname()}) left the run: its kernel "
                                              "shut down, restarted or died"), res.error["evalue"]
        assert "Connection closed" not in res.error["evalue"].split("\n")[0], res.error["evalue"]
    assert took < 30, took
    print(f"node {1 - gone}'s cell ended {took:.1f}s after node {gone} was killed:\n{res.error['evalue']}")
    wait_until(lambda: len(descendants(pair[0].pid)) <= 4, 20, "node 0's run to end")


# -- end to end: two network namespaces ---------------------------------------------------

def test_in_separate_namespaces_node_0_elsewhere_is_a_usage_error_and_node_1_says_what_is_wrong(
        netns_pair, tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    subnet, specs, kernel_dir = netns_pair
    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)])
    nodes, pids = [], set()
    try:
        for i, (name, dev) in enumerate(specs):
            km = KernelManager(kernel_name=name, kernel_spec_manager=ksm, transport="ipc",
                               ip=str(tmp_path / f"ipc{i}"))
            nodes.append(Node(extra_env={"GLOO_SOCKET_IFNAME": dev}, km=km))
        port = 29000 + os.getpid() % 1000
        # Node 1's user copied node 0's line (no --node_rank): its address is not this machine's.
        started = time.monotonic()
        res = nodes[1].run(f"%%distributed -n 1 --num_nodes 2 --master_addr {subnet}.1 --master_port {port}\n"
                           "raise SystemExit('must not run')\n", timeout=120)
        assert res.error["ename"] == "UsageError", res.error_text
        assert f"--master_addr {subnet}.1 is not an address of this machine" in res.error["evalue"]
        assert "pass --node_rank 1 here" in res.error["evalue"]
        assert "must not run" not in res.stdout + res.stderr
        # Node 1 pointed at node 0's machine, where nothing listens yet: refused, said within seconds.
        timed = Timed(f"node 0 at {subnet}.1:{port} refuses connections")
        res = _run(nodes[1], f"%%distributed -n 1 --num_nodes 2 --node_rank 1 --master_addr {subnet}.1 "
                             f"--master_port {port} --output text --rendezvous_timeout 6\npass\n", timed=timed)
        assert timed.seen and min(timed.seen.values()) < 20, (timed.seen, res.stdout)
        # ... and at an address of the subnet where no machine answers: "does not answer".
        timed = Timed(f"node 0 at {subnet}.3:{port} does not answer")
        res = _run(nodes[1], f"%%distributed -n 1 --num_nodes 2 --node_rank 1 --master_addr {subnet}.3 "
                             f"--master_port {port} --output text --rendezvous_timeout 8\npass\n", timed=timed)
        assert timed.seen and min(timed.seen.values()) < 20, (timed.seen, res.stdout)
        assert "waiting for 1 of 2 nodes" in "\n".join(res.live), res.live
        assert res.error["ename"] == "RendezvousError", res.error_text
        for node in nodes:
            pids |= descendants(node.pid) | {node.pid}
    finally:
        for node in nodes:
            node.shutdown()
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 20,
               "both nodes' kernels, launchers and ranks to exit")


# -- the messages, from recorded values -----------------------------------------------------

def test_how_unreachable_reads_real_connect_errors():
    port = _closed_port()
    with pytest.raises(OSError) as refused:
        socket.create_connection(("127.0.0.1", port), timeout=1)
    assert node_notes.how_unreachable(refused.value) == "refused"
    assert node_notes.how_unreachable(socket.timeout("timed out")) == "timeout"
    assert node_notes.how_unreachable(OSError(113, "No route to host")) == "No route to host"


@pytest.mark.parametrize("how, said", [
    ("refused", "node 0 at 10.1.2.3:29500 refuses connections (nothing listens there), retrying"),
    ("timeout", "node 0 at 10.1.2.3:29500 does not answer, retrying"),
    ("No route to host", "node 0 at 10.1.2.3:29500 does not answer (No route to host), retrying"),
    ("silent", "node 0 at 10.1.2.3:29500 accepts connections but its store does not answer, retrying"),
    (None, ""),
])
def test_reach_problem(how, said):
    assert node_notes.reach_problem("10.1.2.3:29500", how) == said


def test_the_waiting_line_carries_the_problem():
    plain = Waiting(1, 2, "10.1.2.3:29500")
    assert plain.text() == "waiting for 1 of 2 nodes at 10.1.2.3:29500"
    told = Waiting(1, 2, "10.1.2.3:29500", node_notes.reach_problem("10.1.2.3:29500", "refused"))
    assert told.text() == ("waiting for 1 of 2 nodes at 10.1.2.3:29500: node 0 at 10.1.2.3:29500 refuses "
                           "connections (nothing listens there), retrying")


def test_timeout_messages_say_what_happened():
    def message(**kw):
        args = dict(address="10.1.2.3:29500", host="10.1.2.3", port=29500, timeout=300, nodes=2, joined=1,
                    reached=False, how=None)
        return node_notes.timeout_message(**{**args, **kw})
    assert "only 1 of 2 nodes joined" in message(reached=True)
    assert "node 0 at 10.1.2.3:29500 refused every connection: nothing listens there" in message(how="refused")
    assert "node 0 at 10.1.2.3:29500 never answered" in message(how="timeout")
    assert "could not be reached (No route to host)" in message(how="No route to host")
    claimed = message(reached=True, claims=({"host": "b", "pid": 7},))
    assert ("timed out after 300s: only 1 of 2 nodes joined; a second node 0 (host b, pid 7) tried to host this "
            "rendezvous and was told to pass --node_rank. Check that") in claimed, claimed


def test_second_node_0_messages():
    node0 = node_notes.second_node0_message("10.1.2.3:29500", 29500, 3, {"kind": "node0", "joined": 1})
    assert node0.startswith("another node 0 already holds 10.1.2.3:29500: its rendezvous answers there (1 of its "
                            "nodes joined so far).")
    assert "--node_rank 1 (each other node its own rank, 1 .. 2), the same --num_nodes" in node0
    two = node_notes.second_node0_message("10.1.2.3:29500", 29500, 2, {"kind": "node0", "joined": 1})
    assert "run it with --node_rank 1, the same --num_nodes" in two, two
    store = node_notes.second_node0_message("10.1.2.3:29500", 29500, 2, {"kind": "store"})
    assert "not an accel_magics rendezvous" in store and "another --master_port" in store
    other = node_notes.second_node0_message("10.1.2.3:29500", 29500, 2, {"kind": "other", "why": "x"})
    assert "already in use by another program" in other and "(x)" in other


def test_node_0_elsewhere_asks_for_node_rank_1_and_a_range_only_beyond_two_nodes():
    from accel_magics.kernel_ext.environment import not_this_machine
    two = not_this_machine("10.1.2.3", 2)
    assert "pass --node_rank 1 here with the same --num_nodes" in two and " .. " not in two, two
    three = not_this_machine("10.1.2.3", 3)
    assert "pass --node_rank 1 here (each other machine its own, 1 .. 2) with the same" in three, three
    assert "Leave --master_addr out" in not_this_machine("10.1.2.3", 1)


def test_gone_summaries_name_the_node_and_where_it_was():
    one = node_notes.gone_summary(1, {"addr": "10.1.2.4", "host": "b"}, 3.2, "10.1.2.3:29500")
    assert one.startswith("node 1 (at 10.1.2.4, host b) went away: it has not counted itself in node 0's store "
                          "for 3s"), one
    zero = node_notes.gone_summary(0, {"addr": "10.1.2.3"}, 4, "10.1.2.3:29500")
    assert zero.startswith("node 0 (at 10.1.2.3) went away: its store at 10.1.2.3:29500 has not answered for 4s")
    assert node_notes.gone_summary(2, None, 3, "a:1").startswith("node 2 went away")


def test_node_watch_judges_a_node_still_after_it_was_seen():
    watch = node_notes.NodeWatch(3, 0, now=0.0)
    watch.feed({1: 0, 2: 0}, 0.0)
    watch.feed({1: 1, 2: 1}, 0.5)
    watch.feed({1: 2, 2: 1}, 1.0)     # node 2 stops after its first beat
    assert watch.gone(2.0, 3.0) is None
    watch.feed({1: 6, 2: 1}, 3.5)
    assert watch.gone(3.6, 3.0) == (2, pytest.approx(3.1))
    lost = node_notes.NodeWatch(2, 1, now=0.0)
    lost.feed({0: 4}, 0.5)
    lost.feed(None, 1.0)              # node 0's store stopped answering
    assert lost.gone(3.0, 3.0) is None and lost.gone(3.6, 3.0) == (0, pytest.approx(3.1))


def test_records_signed_with_the_key_and_only_those_count_with_one():
    record = {"host": "b", "pid": 7}
    signed = node_notes.sign("k", 0, "a:1", record)
    assert node_notes.verified("k", 0, "a:1", signed) == record
    assert node_notes.verified("other", 0, "a:1", signed) is None
    assert node_notes.verified("k", 1, "a:1", signed) is None   # another round's
    assert node_notes.verified("k", 0, "a:1", record) is None    # unsigned
    assert node_notes.verified(None, 0, "a:1", record) == record


def test_other_node_lines():
    values = {"num_processes": 2, "num_nodes": 3, "master_addr": "10.1.2.3", "rendezvous_key": "s3cret"}
    lines = other_node_lines(values, command_line, "a")
    assert lines == [
        "on node 1, run: %%distributed --num_processes 2 --num_nodes 3 --master_addr 10.1.2.3 --master_port 29500 "
        "--rendezvous_key <the same key> --node_rank 1",
        "on node 2, run: %%distributed --num_processes 2 --num_nodes 3 --master_addr 10.1.2.3 --master_port 29500 "
        "--rendezvous_key <the same key> --node_rank 2"]
    assert not any("s3cret" in line for line in lines)
    on_node_1 = other_node_lines({**values, "node_rank": 1, "num_nodes": 2}, command_line, "a")
    assert [line.split(",")[0] for line in on_node_1] == ["on node 0"] and on_node_1[0].endswith("--node_rank 0")
    assert other_node_lines({"num_processes": 2}, command_line) == []
    assert other_node_lines({**values, "launcher": "slurm"}, command_line) == []
    here = other_node_lines({"num_processes": 1, "num_nodes": 2}, command_line, "a")
    assert here[-1].startswith("note: --master_addr 127.0.0.1 reaches node 0 from its own machine only") \
        and "(this machine is a)" in here[-1]


def test_the_documented_numbers_are_the_packages():
    import pathlib

    from accel_magics.kernel_ext import timing

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "how-to" / "two-machines.md").read_text()
    assert f"itself in node 0's store for {timing.NODE_GONE_AFTER:g}s" in page
    assert node_notes.gone_summary(1, None, timing.NODE_GONE_AFTER, "a:1").startswith(
        f"node 1 went away: it has not counted itself in node 0's store for {timing.NODE_GONE_AFTER:g}s")


def test_the_config_form_shows_each_other_nodes_line_on_a_row_of_its_own():
    from accel_magics.magics import describe_nodes
    from accel_magics.widgets.config_form import ConfigForm

    form = ConfigForm({"num_processes": 2, "num_nodes": 2, "master_addr": "10.1.2.3"}, check=lambda values: "",
                      apply=lambda values: None, describe=describe_nodes)
    rows = form.command.value.split("<br>")
    assert rows == ["<code>%%distributed --num_processes 2 --num_nodes 2 --master_addr 10.1.2.3</code>",
                    "<code>on node 1, run: %%distributed --num_processes 2 --num_nodes 2 --master_addr 10.1.2.3 "
                    "--master_port 29500 --node_rank 1</code>"], rows


# Node 0's messages when node 1's kernel was killed mid-run (one rank a node; as
# test_a_node_whose_kernel_is_killed_mid_run_... recorded them, tracebacks cut).
NODE_1_GONE = [
    {"kind": "started", "pids": {0: 11}, "supervisor": 10},
    {"kind": "released"},
    {"kind": "rank_event", "rank": 0, "event": {
        "kind": "failed", "exc_type": "RuntimeError", "secondary": True, "timestamp": 50.0, "traceback": "...",
        "message": "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                   "[127.0.0.1]:37782: Connection reset by peer. This is typically caused by a remote worker "
                   "hanging or bugs in the application."}},
    {"kind": "exit", "rank": 0, "exitcode": 1, "signal": None, "stopped": False, "timestamp": 50.1},
    {"kind": "remote_failure", "rank": 1, "node": 1, "gone": True, "summary": (
        "node 1 (at 127.0.0.1, host vm) went away: it has not counted itself in node 0's store for 3s and "
        "reported no failure (its kernel died, was restarted or shut down, or its machine is unreachable), so this "
        "node's ranks lost their connections to it")},
    {"kind": "finished", "reason": "failed", "forced": None, "terminated_on": []},
]


def test_a_gone_node_is_the_root_cause_and_the_lost_connection_its_consequence():
    from accel_magics.kernel_ext.kernel.errors import DistributedRunError
    from accel_magics.kernel_ext.kernel.fold import RunFold
    from accel_magics.kernel_ext.kernel.run import conclude

    _, outcome = RunFold.replay(NODE_1_GONE, run_id="r1", ranks=[0])
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, LaunchConfig(num_processes=1, num_nodes=2), attempt=0, started=0.0)
    assert str(info.value).startswith("node 1 (at 127.0.0.1, host vm) went away: it has not counted itself")
    assert "rank 0: RuntimeError: " in info.value.report() and "(a consequence of the failure above)" in \
        info.value.report(), info.value.report()


def test_whose_port_tells_a_node_0_from_a_torch_store_from_another_program():
    """What holds node 0's port, asked for real (torch's store on loopback): a
    node 0 of accel_magics (which then has the claim, signed), another torch
    store, or another program."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from accel_magics.kernel_ext.supervisor.rendezvous import NodeRendezvous

    port = _free_port()
    first = NodeRendezvous("127.0.0.1", port, 2, 0, 30)
    first.host_store()
    try:
        # The second spells node 0's address otherwise (0.0.0.0): its signed claim still counts.
        second = NodeRendezvous("0.0.0.0", port, 2, 0, 30)
        assert second.whose_port("k") == {"kind": "node0", "joined": 0}
        seen, claims = first.claims(0, "k")
        assert seen == 1 and len(claims) == 1 and claims[0]["pid"] == os.getpid(), claims
        assert first.claims(0, "another key") == (1, [])   # not signed with the run's key: not said
        assert first.claims(1, "k") == (1, [])
    finally:
        first.close()
    port = _free_port()
    plain = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5), wait_for_workers=False)
    try:
        assert NodeRendezvous("127.0.0.1", port, 2, 0, 30).whose_port() == {"kind": "store"}
    finally:
        del plain
    with socket.socket() as other:   # a program that accepts and says nothing a store would
        other.bind(("127.0.0.1", 0))
        other.listen(8)
        found = NodeRendezvous("127.0.0.1", other.getsockname()[1], 2, 0, 30).whose_port()
    assert found["kind"] == "other", found
    assert "already in use by another program" in node_notes.second_node0_message("a:1", 1, 2, found)
