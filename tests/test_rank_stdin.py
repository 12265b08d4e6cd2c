"""A rank's stdin is the notebook's input box: input(), breakpoint() and
pdb.set_trace() on any rank, through the Jupyter stdin channel (issue 47, item 2).

Each test answers the kernel's input_requests as a frontend does
(``KernelSession.run(stdin=...)``)."""
from __future__ import annotations

import html
import re
import sys
import time

import pytest

from conftest import LoadedKernel
from kernel_harness import typed

pytestmark = pytest.mark.timeout(180)

BREAK_ON_RANK_1 = """%%distributed -n 2 --output text --timeout 60
import os
z = 7
if os.environ["RANK"] == "1":
    breakpoint()
print("done", z)
"""


#: Where pdb stops after BREAK_ON_RANK_1's breakpoint(), as in a script: the
#: next line before Python 3.13, the breakpoint() line itself from 3.13 on
#: (pdb.set_trace() stops at its caller's line there).
STOP_LINE = (5, "breakpoint()") if sys.version_info >= (3, 13) else (6, 'print("done", z)')


def test_breakpoint_on_rank_1_prompts_in_the_notebook_and_continues(clean_kernel):
    k = clean_kernel
    res = k.run(BREAK_ON_RANK_1, timeout=90, stdin=typed("p z", "c"))
    assert res.status == "ok", res.error_text + res.stdout + res.stderr
    assert res.prompts == ["(Pdb rank 1) ", "(Pdb rank 1) "], res.prompts
    assert "[rank 1] 7" in res.stdout.splitlines(), res.stdout
    assert "[rank 0] done 7" in res.stdout and "[rank 1] done 7" in res.stdout, res.stdout
    # The record keeps the debugger session, in order with the rank's output (issue 47, item 3).
    rank_1 = [line for line in res.stdout.splitlines() if line.startswith("[rank 1] ")]
    asked = rank_1.index("[rank 1] (Pdb) p z")
    assert rank_1[asked:] == ["[rank 1] (Pdb) p z", "[rank 1] 7", "[rank 1] (Pdb) c", "[rank 1] done 7"], rank_1
    # Stopped where a script would be (STOP_LINE: Python's own choice of line).
    line, source = STOP_LINE
    assert rank_1[asked - 1] == f"[rank 1] -> {source}", rank_1
    assert re.fullmatch(rf"\[rank 1\] > .*Cell In\[\d+\]\({line}\)<module>\(\)", rank_1[asked - 2]), rank_1
    assert k.ok("print('next')").stdout == "next\n"


def _widget_rows(res) -> list[str]:
    """Every value the live view's rows took, in order."""
    return [m["content"]["data"]["state"]["value"] for m in res.messages
            if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"
            and "accel-magics-row'" in str(m["content"]["data"].get("state", {}).get("value", ""))]


def test_the_widget_view_shows_the_paused_rank_and_where_and_the_record_the_session(clean_kernel):
    res = clean_kernel.run(BREAK_ON_RANK_1.replace("--output text", "--output widget"), timeout=90,
                           stdin=typed("p z", "c"))
    assert res.status == "ok", res.error_text + res.stdout + res.stderr
    assert res.prompts == ["(Pdb rank 1) ", "(Pdb rank 1) "], res.prompts
    # Shown before the kernel waits in the input box (the second time it looks the same: no update).
    paused = [v for v in _widget_rows(res) if ">paused</b>" in v]
    assert paused, _widget_rows(res)
    rank_1 = paused[0].split("rank 1 ", 1)[1]
    line, source = STOP_LINE
    assert re.search(rf"waits at its prompt \(Pdb\) in &lt;module&gt; \([^/()]+:{line}\): "
                     + re.escape(html.escape(source)), rank_1), rank_1
    assert ">paused</b>" not in paused[0].split("rank 1 ", 1)[0]   # rank 0 is not
    final = [m for m in res.messages if m["msg_type"] == "display_data"][-1]["content"]["data"]
    assert "(Pdb) p z\n7\n(Pdb) c\ndone 7" in final["text/html"] and ">paused</b>" not in final["text/html"]
    assert "[rank 1] (Pdb) p z" in final["text/plain"].splitlines(), final["text/plain"]


def test_input_on_a_rank_returns_what_was_typed(clean_kernel):
    res = clean_kernel.run("%%distributed -n 2 --output text --timeout 60\nimport os\n"
                           "name = input('name? ') if os.environ['RANK'] == '0' else 'peer'\nprint('got', name)\n",
                           timeout=90, stdin=typed("Ada"))
    assert res.status == "ok", res.error_text
    assert res.prompts == ["[rank 0] name? "]
    assert "[rank 0] got Ada" in res.stdout and "[rank 1] got peer" in res.stdout, res.stdout


def test_pythonbreakpoint_0_in_the_kernel_disables_it_as_in_python():
    k = LoadedKernel(extra_env={"PYTHONBREAKPOINT": "0"})
    try:
        res = k.run(BREAK_ON_RANK_1, timeout=90, stdin=typed("c"))
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
                timeout=90, stdin=typed("q"))
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
                    "if os.environ['RANK'] == '1':\n    breakpoint()\n", timeout=90, stdin=typed("p z", "z = 8", "c"))
        assert res.status == "ok", res.error_text
        assert "[rank 1] 7" in res.stdout.splitlines(), res.stdout
        res = k.run("%%distributed --session --output text\nprint('z', z)\n", timeout=60)
        assert "[rank 0] z 7" in res.stdout and "[rank 1] z 8" in res.stdout, res.stdout
    finally:
        k.ok("%distributed_session stop")


def test_the_stop_button_at_a_prompt_stops_the_run(clean_kernel):
    """The input box is open for rank 1; the stop button ends the run on every
    rank (the kernel's input() raises KeyboardInterrupt: the run's stop)."""
    k = clean_kernel
    stopped = {}

    def press_stop(prompt):
        stopped["prompt"] = prompt
        k.interrupt()   # the frontend's stop button while its input box waits
        return None

    res = k.run(BREAK_ON_RANK_1, timeout=90, stdin=press_stop)
    assert stopped.get("prompt") == "(Pdb rank 1) "
    assert res.status == "error" and res.error["ename"] in ("RunInterrupted", "KeyboardInterrupt"), res.error_text
    assert k.ok("print('next')").stdout == "next\n"


def test_a_peer_failing_while_a_rank_waits_at_its_prompt_ends_the_run(clean_kernel):
    """Rank 0 fails while rank 1 is at its prompt: when the answer comes the
    run has ended with rank 0's failure; the late answer goes nowhere."""
    k = clean_kernel

    def late(prompt):
        return "c"

    res = k.run("%%distributed -n 2 --output text --timeout 60\nimport os\n"
                "if os.environ['RANK'] == '1':\n    breakpoint()\nelse:\n    raise ValueError('rank 0 fails')\n",
                timeout=90, stdin=late)
    assert res.status == "error" and "rank 0 failed: ValueError: rank 0 fails" in res.error["evalue"], res.error_text
    assert k.ok("print('next')").stdout == "next\n"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_breakpoint_held_120_s_with_a_gloo_collective_pending_does_not_time_out(clean_kernel):
    """Issue 47's acceptance: rank 1 paused 120 s at its prompt while rank 0
    waits in an all_reduce (gloo), under --timeout 30 and the stall check;
    then c, and both ranks finish with the sum."""
    k = clean_kernel
    paused = {}

    def hold(prompt):
        paused.setdefault("at", time.monotonic())
        left = 120 - (time.monotonic() - paused["at"])
        if left > 0:
            time.sleep(left)   # the pause under test: a user reading the frames for two minutes
        return "c"

    res = k.run("%%distributed -n 2 --output text --timeout 30 --stall_timeout 10\n"
                "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                "if dist.get_rank() == 1:\n    breakpoint()\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())\n",
                timeout=300, stdin=hold)
    assert res.status == "ok", res.error_text + res.stdout
    assert res.stdout.count("sum 2.0") == 2 and res.prompts == ["(Pdb rank 1) "], res.stdout


def test_a_background_runs_breakpoint_is_answered_by_its_handles_debug(clean_kernel):
    """A --background cell returns at once; rank 1 stops at breakpoint();
    the handle's repr says so, h.debug() asks in its own cell's input box,
    and h.wait() then gives rank 0's value."""
    k = clean_kernel
    k.ok("%%distributed -n 2 --background --output text\nimport os\nz = 7\n"
         "if os.environ['RANK'] == '1':\n    breakpoint()\nz * 6")
    k.ok("h = _")
    res = k.run("h.debug()", timeout=90, stdin=typed("p z", "c"))
    assert res.status == "ok" and res.result == "2", res.error_text + res.stdout
    assert res.prompts == ["(Pdb rank 1) "] * 2, res.prompts
    assert k.ok("h.wait()").result == "42"
    assert "has ended (done)" in k.ok("h.debug()").stdout


def test_stopping_a_background_run_at_a_prompt_ends_it(clean_kernel):
    k = clean_kernel
    k.ok("%%distributed -n 2 --background --output text\nimport os\n"
         "if os.environ['RANK'] == '1':\n    breakpoint()\nprint('after')")
    k.ok("h = _")
    wait_for = time.monotonic() + 60
    while "waits at its prompt" not in (k.ok("repr(h)").result or ""):
        assert time.monotonic() < wait_for, "rank 1's prompt was never shown in the handle's repr"
    assert "stopped In[" in k.ok("h.stop()").stdout
    assert k.ok("h.status").result == "'stopped'"


def test_pdb_lists_the_cell_and_stops_at_a_line_breakpoint_set_in_it(clean_kernel):
    """l shows the notebook cell's lines; b 8 sets a breakpoint on a line of
    the cell, c stops there (the cell is in linecache under pdb's name for it)."""
    res = clean_kernel.run(BREAK_ON_RANK_1 + "w = z + 1\nprint('w', w)\n", timeout=90,
                           stdin=typed("l", "b 8", "c", "p w", "c"))
    assert res.status == "ok", res.error_text + res.stdout
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[rank 1] ")]
    assert any(re.fullmatch(r"\[rank 1\]   5  (->)?\t    breakpoint\(\)", ln) for ln in lines), res.stdout   # l
    assert any(re.fullmatch(r"\[rank 1\] Breakpoint 1 at .*Cell In\[\d+\]:8", ln) for ln in lines), res.stdout
    assert "[rank 1] 8" in lines and "[rank 1] w 8" in lines, res.stdout
