"""A rank's stdin is the notebook's input box: input(), breakpoint() and
pdb.set_trace() on any rank, through the Jupyter stdin channel (issue 47, item 2).

Each test answers the kernel's input_requests as a frontend does
(``KernelSession.run(stdin=...)``)."""
from __future__ import annotations

import re
import time

import pytest

from conftest import LoadedKernel

pytestmark = pytest.mark.timeout(180)

BREAK_ON_RANK_1 = """%%distributed -n 2 --output text --timeout 60
import os
z = 7
if os.environ["RANK"] == "1":
    breakpoint()
print("done", z)
"""


def answers(*lines):
    """A frontend that types ``lines`` one per prompt (then end of input: "")."""
    left = list(lines)
    return lambda prompt: left.pop(0) if left else ""


def test_breakpoint_on_rank_1_prompts_in_the_notebook_and_continues(clean_kernel):
    k = clean_kernel
    res = k.run(BREAK_ON_RANK_1, timeout=90, stdin=answers("p z", "c"))
    assert res.status == "ok", res.error_text + res.stdout + res.stderr
    assert res.prompts == ["(Pdb rank 1) ", "(Pdb rank 1) "], res.prompts
    assert "[rank 1] 7" in res.stdout.splitlines(), res.stdout
    assert "[rank 0] done 7" in res.stdout and "[rank 1] done 7" in res.stdout, res.stdout
    # The record keeps the debugger session, in order with the rank's output (issue 47, item 3).
    rank_1 = [line for line in res.stdout.splitlines() if line.startswith("[rank 1] ")]
    asked = rank_1.index("[rank 1] (Pdb) p z")
    assert rank_1[asked:] == ["[rank 1] (Pdb) p z", "[rank 1] 7", "[rank 1] (Pdb) c", "[rank 1] done 7"], rank_1
    assert any(re.fullmatch(r"\[rank 1\] > .+\(5\)<module>\(\).*", line) for line in rank_1[:asked]), rank_1
    assert k.ok("print('next')").stdout == "next\n"


def _widget_rows(res) -> list[str]:
    """Every value the live view's rows took, in order."""
    return [m["content"]["data"]["state"]["value"] for m in res.messages
            if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"
            and "accel-magics-row'" in str(m["content"]["data"].get("state", {}).get("value", ""))]


def test_the_widget_view_shows_the_paused_rank_and_where_and_the_record_the_session(clean_kernel):
    res = clean_kernel.run(BREAK_ON_RANK_1.replace("--output text", "--output widget"), timeout=90,
                           stdin=answers("p z", "c"))
    assert res.status == "ok", res.error_text + res.stdout + res.stderr
    assert res.prompts == ["(Pdb rank 1) ", "(Pdb rank 1) "], res.prompts
    # Shown before the kernel waits in the input box (the second time it looks the same: no update).
    paused = [v for v in _widget_rows(res) if ">paused</b>" in v]
    assert paused, _widget_rows(res)
    rank_1 = paused[0].split("rank 1 ", 1)[1]
    assert re.search(r"waits at its prompt \(Pdb\) in &lt;module&gt; \([^/()]+:5\)", rank_1), rank_1
    assert ">paused</b>" not in paused[0].split("rank 1 ", 1)[0]   # rank 0 is not
    final = [m for m in res.messages if m["msg_type"] == "display_data"][-1]["content"]["data"]
    assert "(Pdb) p z\n7\n(Pdb) c\ndone 7" in final["text/html"] and ">paused</b>" not in final["text/html"]
    assert "[rank 1] (Pdb) p z" in final["text/plain"].splitlines(), final["text/plain"]


def test_input_on_a_rank_returns_what_was_typed(clean_kernel):
    res = clean_kernel.run("%%distributed -n 2 --output text --timeout 60\nimport os\n"
                           "name = input('name? ') if os.environ['RANK'] == '0' else 'peer'\nprint('got', name)\n",
                           timeout=90, stdin=answers("Ada"))
    assert res.status == "ok", res.error_text
    assert res.prompts == ["[rank 0] name? "]
    assert "[rank 0] got Ada" in res.stdout and "[rank 1] got peer" in res.stdout, res.stdout


def test_pythonbreakpoint_0_in_the_kernel_disables_it_as_in_python():
    k = LoadedKernel(extra_env={"PYTHONBREAKPOINT": "0"})
    try:
        res = k.run(BREAK_ON_RANK_1, timeout=90, stdin=answers("c"))
        assert res.status == "ok", res.error_text
        assert res.prompts == [], res.prompts
        assert "[rank 1] done 7" in res.stdout, res.stdout
        k.assert_no_leaks()
    finally:
        k.shutdown()


def test_q_at_a_breakpoint_ends_every_rank_at_once(clean_kernel):
    k = clean_kernel
    started = time.monotonic()
    res = k.run(BREAK_ON_RANK_1.replace("--timeout 60", "--timeout 120")
                + "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n",
                timeout=90, stdin=answers("q"))
    took = time.monotonic() - started
    assert res.status == "error" and res.prompts == ["(Pdb rank 1) "], res.error_text
    assert "quit" in res.error["evalue"].lower() and "rank 1" in res.error["evalue"], res.error_text
    assert took < 30, took
    assert k.ok("print('next')").stdout == "next\n"


def test_a_paused_rank_outlasts_timeout_and_its_peer_waits_in_a_collective(clean_kernel):
    """--timeout and the stall check do not count a pause at the prompt, and a
    gloo collective pending on the other rank does not time out meanwhile."""
    k = clean_kernel
    paused = {}

    def slow(prompt):
        paused.setdefault("at", time.monotonic())
        if time.monotonic() - paused["at"] < 8:   # the pause under test: longer than --timeout
            time.sleep(8 - (time.monotonic() - paused["at"]))
        return "c"

    res = k.run("%%distributed -n 2 --output text --timeout 4\nimport os, torch, torch.distributed as dist\n"
                "dist.init_process_group('gloo')\nif dist.get_rank() == 1:\n    breakpoint()\n"
                "t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())\n", timeout=120, stdin=slow)
    assert res.status == "ok", res.error_text + res.stdout
    assert res.stdout.count("sum 2.0") == 2, res.stdout


def test_two_ranks_at_a_breakpoint_queue_their_prompts(clean_kernel):
    """Both ranks stop; the prompts come one at a time, each tagged, and each
    rank gets its own answers (first ``p r``, then ``c``)."""
    asked: dict = {}

    def by_rank(prompt):
        asked[prompt] = asked.get(prompt, 0) + 1
        return "p r" if asked[prompt] == 1 else "c"

    res = clean_kernel.run("%%distributed -n 2 --output text --timeout 60\nimport os\nr = os.environ['RANK']\n"
                           "breakpoint()\nprint('after', r)\n", timeout=90, stdin=by_rank)
    assert res.status == "ok", res.error_text
    assert sorted(res.prompts) == ["(Pdb rank 0) "] * 2 + ["(Pdb rank 1) "] * 2, res.prompts
    assert "[rank 0] '0'" in res.stdout and "[rank 1] '1'" in res.stdout, res.stdout


def test_a_session_cell_breakpoint_keeps_the_session(clean_kernel):
    k = clean_kernel
    k.ok("%distributed_session start -n 2")
    try:
        res = k.run("%%distributed --session --output text --timeout 60\nimport os\nz = 7\n"
                    "if os.environ['RANK'] == '1':\n    breakpoint()\n", timeout=90, stdin=answers("p z", "z = 8", "c"))
        assert res.status == "ok", res.error_text
        assert "[rank 1] 7" in res.stdout.splitlines(), res.stdout
        res = k.run("%%distributed --session --output text\nprint('z', z)\n", timeout=60)
        assert "[rank 0] z 7" in res.stdout and "[rank 1] z 8" in res.stdout, res.stdout
    finally:
        k.ok("%distributed_session stop")
