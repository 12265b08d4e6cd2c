"""The run view and its record read like a terminal running tqdm (issue 13):
what nbval and nbconvert see, in both output modes.  Real kernel, real ranks."""
from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.timeout(180)

NESTED = """%%distributed -n 2 --output {mode}
import os, time
from tqdm.auto import tqdm
rank = os.environ['RANK']
for epoch in tqdm(range(3), desc='epoch'):
    for step in tqdm(range(40), desc='step', leave=False):
        time.sleep(0.002)
    print(f'rank {{rank}} epoch {{epoch}} loss {{0.5 / (epoch + 1):.3f}}')
"""
BAR_DONE = r"epoch: 100%\|██████████\| 3/3 \[\d\d:\d\d<00:00, +[\d.]+it/s\]"   # as tqdm draws it


def _record(res) -> tuple[str, str]:
    """(text/plain, text/html) the notebook keeps: the last display, or the stream."""
    displays = [m["content"]["data"] for m in res.messages if m["msg_type"] == "display_data"]
    final = displays[-1] if displays else {}
    text = final.get("text/plain", "") if "text/html" in final else res.stdout
    return text, final.get("text/html", "")


@pytest.mark.parametrize("mode", ["text", "widget"])
def test_nested_bars_leave_exactly_the_prints_and_the_final_outer_bar(clean_kernel, mode):
    """Nested tqdm (epochs x steps, inner leave=False) made every inner update a
    line, drew cursor-up escapes as boxes and padded prints with bar spaces."""
    res = clean_kernel.ok(NESTED.format(mode=mode), timeout=120)
    text, page = _record(res)
    for rank in (0, 1):
        lines = [line[len(f"[rank {rank}] "):] for line in text.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert lines[:3] == [f"rank {rank} epoch {e} loss {0.5 / (e + 1):.3f}" for e in range(3)], text
        assert len(lines) == 4 and re.fullmatch(BAR_DONE, lines[3]), lines
    everything = text + page + "".join(str(m["content"]) for m in res.messages)
    assert "\x1b" not in everything and "\\x1b" not in everything
    assert "step:" not in text and "step: " not in page           # the inner bars left nothing
    if mode == "widget":
        # The kept record: every print open (short output), the final outer bar, theme colours.
        # (the outer bar's final state is the rank's last line, as a terminal keeps it)
        assert page.count("<details open>") == 2 and "rank 0 output (4 lines)" in page
        assert "epoch: 100% 3/3" in page and "width:100%" in page
        # Theme-aware without CSS variables (an untrusted notebook drops them): a translucent track.
        assert "#eee" not in page and "var(" not in page and "background-color:rgba(128,128,128,0.3)" in page


@pytest.mark.parametrize("mode", ["text", "widget"])
def test_a_print_inside_a_bar_loop_is_a_line_of_its_own(clean_kernel, mode):
    """A print inside a tqdm loop was glued onto the bar text, in the panes and
    the record; the row's latest line only ever showed the tqdm text."""
    res = clean_kernel.ok(f"%%distributed -n 2 --output {mode}\nimport os\nfrom tqdm import tqdm\n"
                          "for i in tqdm(range(300), desc='train', mininterval=0):\n"
                          "    if i % 100 == 0:\n        print(f\"rank {os.environ['RANK']} step {i} loss 0.0196\")\n",
                          timeout=60)
    text, page = _record(res)
    lines = [line for line in text.splitlines() if line.startswith("[rank 1] ")]
    assert lines[:3] == [f"[rank 1] rank 1 step {i} loss 0.0196" for i in (0, 100, 200)], text
    assert re.fullmatch(r"\[rank 1\] train: 100%\|██████████\| 300/300 \[.*\]", lines[3]), lines
    if mode == "widget":
        # The row's latest line is the latest *print*, not the bar text.
        assert re.search(r"<span class='accel-magics-latest' style='[^']*' title='rank 1 step 200 loss 0.0196'>",
                         page), page


def test_an_n_of_m_in_a_print_is_not_progress(clean_kernel):
    res = clean_kernel.ok("%%distributed -n 2 --output widget\nprint('loading shard 3/4')\n", timeout=60)
    _, page = _record(res)
    assert "loading shard 3/4" in page and "class='accel-magics-fill'" not in page
    assert "75%" not in page   # the old view set the bar to 3/4


def test_long_outputs_are_collapsed_with_their_count(clean_kernel):
    res = clean_kernel.ok("%%distributed -n 2 --output widget\nimport os\n"
                          "n = 25 if os.environ['RANK'] == '0' else 1\nfor i in range(n):\n    print('line', i)\n",
                          timeout=60)
    _, page = _record(res)
    assert "<details><summary>rank 0 output (25 lines)</summary>" in page
    assert "<details open><summary>rank 1 output (1 line)</summary>" in page
    assert "full logs (on this machine; the newest 20 runs are kept)" in page


def test_a_carriage_return_progress_line_not_from_tqdm_still_updates_in_place(clean_kernel):
    """Progress printed by hand with carriage returns (the text fallback): one
    line in the record, its final state, no intermediate states."""
    res = clean_kernel.ok("%%distributed -n 2 --output text\nimport sys, time\nfor i in range(1, 6):\n"
                          "    sys.stdout.write(f'\\rdownloading {i * 20}%')\n    sys.stdout.flush()\n"
                          "    time.sleep(0.01)\nprint()\nprint('done')\n", timeout=60)
    text, _ = _record(res)
    assert [line for line in text.splitlines() if line.startswith("[rank 0]")] == \
        ["[rank 0] downloading 100%", "[rank 0] done"], text


def test_the_first_cell_says_the_launcher_is_starting_and_counts_from_the_cells_start():
    """A cold first run showed nothing for 1-2 s, and its header said 0.0 s."""
    import time

    from kernel_harness import KernelSession

    k = KernelSession(extra_env={"PYTHONUNBUFFERED": "1"})
    try:
        k.ok("%load_ext accel_magics")
        started = time.monotonic()
        res = k.ok("%%distributed -n 2\nprint('hi')\n", timeout=120)
        took = time.monotonic() - started
        first = [m["content"]["data"] for m in res.messages if m["msg_type"] == "display_data"][0]
        states = [str(m["content"]["data"].get("state", {}).get("value", "")) for m in res.messages
                  if m["msg_type"] in ("comm_open", "comm_msg")]
        assert any("starting the launcher" in v for v in states), "the view did not say the launcher is starting"
        assert "application/vnd.jupyter.widget-view+json" in first
        _, page = _record(res)
        shown = float(re.search(r"&middot; ([\d.]+) s", page).group(1))
        assert shown >= 0.5 * took - 0.2, (shown, took)   # the launcher's start is counted
    finally:
        k.shutdown()


def test_a_notebook_executed_headless_keeps_no_state_of_closed_views(tmp_path):
    """nbconvert --execute stored 91 dead widget models (78 KB of an 88 KB notebook):
    nbclient saves every model ever opened (it ignores comm_close), so a headless
    executor (it takes no input()) gets the text view; its record is the same text."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "%load_ext accel_magics",
        NESTED.format(mode="widget").replace("--output widget", ""),
        "%%distributed -n 2\nprint('again')\n",
    )])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    assert state == {}, f"{len(state)} widget models saved: {sorted({s['model_name'] for s in state.values()})}"
    saved = nbformat.writes(nb)
    assert len(saved) < 30_000, len(saved)
    outputs = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "[rank 1] rank 1 epoch 2 loss 0.167" in outputs and "[rank 1] epoch: 100%|██████████| 3/3" in outputs, outputs


def test_interrupt_stacks_show_the_users_frames_with_their_lines_and_count_library_threads(clean_kernel):
    """An interrupt's stacks were mostly noise: five threading.py / tqdm/_monitor.py
    frames before the user's frame, which had no source line."""
    k = clean_kernel
    k.ok("def slow_step(i):\n    import time\n    time.sleep(0.5)\n")

    def on_output(text, fired=[]):
        # Both ranks in their loops (a rank that has not begun shows no frames).
        if "[rank 0] up" in text and "[rank 1] up" in text and not fired:
            fired.append(True)
            k.interrupt()

    res = k.run("%%distributed -n 2 --output text\nfrom tqdm.auto import tqdm\nprint('up', flush=True)\n"
                "for i in tqdm(range(100)):\n    slow_step(i)\n", timeout=60, on_output=on_output)
    assert res.error["ename"] == "RunInterrupted"
    text = res.error_text
    rank0 = text[text.index("rank 0:\n"):text.index("rank 1:\n")]
    lines = [line.strip() for line in rank0.splitlines()[1:] if line.strip()]
    assert lines[0] == "the cell's thread:", rank0
    assert lines[1].startswith('File "Cell In[') and lines[1].endswith("line 3, in slow_step"), rank0
    assert lines[2] == "time.sleep(0.5)"
    assert lines[3] == 'File "Cell In[' + lines[3].split("In[")[1].split("]")[0] + ']", line 5, in <module>'
    assert lines[4] == "slow_step(i)"
    assert lines[5] == "(+ 1 other thread in library code only: tqdm/_monitor.py run)", rank0
    assert "threading.py" not in text


@pytest.mark.parametrize("mode", ["text", "widget"])
def test_terminal_escapes_never_reach_the_record(clean_kernel, mode):
    """Colour and cursor escapes a library forces anyway (TERM=dumb stops the
    well-behaved ones) are dropped from what the notebook shows; the log keeps them."""
    res = clean_kernel.ok(f"%%distributed -n 2 --output {mode}\n"
                          "print('\\x1b[1;31mred\\x1b[0m and \\x1b]8;;http://x\\x1b\\\\link\\x1b]8;;\\x1b\\\\ \\x1b[2K\\x1b[Aend')\n",
                          timeout=60)
    text, page = _record(res)
    shown = [m for m in res.messages if m["msg_type"] != "execute_input"]   # not the cell's own source
    everything = text + page + "".join(str(m["content"]) for m in shown)
    assert "\x1b" not in everything and "\\x1b" not in everything and "\\u001b" not in everything
    assert "red and link end" in (text if mode == "text" else page), (text, page)


def test_a_bar_never_closed_keeps_its_last_state_and_tqdm_write_is_a_line(clean_kernel):
    """Hostile cases: a bar the cell never closes (tqdm itself had not drawn its
    last updates), a loop left with break, tqdm.write between bars."""
    res = clean_kernel.ok("%%distributed -n 2 --output text\nfrom tqdm import tqdm\n"
                          "t = tqdm(desc='stream')\nfor i in range(7):\n    t.update(1)\n"
                          "for i, _ in enumerate(tqdm(range(10), desc='unfinished')):\n    if i == 4:\n        break\n"
                          "tqdm.write('written')\n", timeout=60)
    lines = [line for line in res.stdout.splitlines() if line.startswith("[rank 1] ")]
    # The loop left with break: its bar closes when the iterator goes, at once
    # (its final line, in order with what is printed after it).
    assert re.fullmatch(r"\[rank 1\] unfinished:  40%\|████      \| 4/10 \[.*\]", lines[0]), lines
    assert lines[1] == "[rank 1] written", lines
    # Never closed: its last state, below the lines.
    assert re.fullmatch(r"\[rank 1\] stream: 7 \[.*\]", lines[2]), lines


def test_tqdm_notebook_and_many_finished_inner_bars(clean_kernel):
    """Review findings: ``from tqdm.notebook import tqdm`` in a rank printed widget
    reprs; a leave=True inner bar per epoch piled up bars in the row without bound."""
    res = clean_kernel.ok("%%distributed -n 2 --output widget\nfrom tqdm.notebook import tqdm, trange\n"
                          "for epoch in trange(30, desc='epoch'):\n    for step in tqdm(range(3), desc='step'):\n"
                          "        pass\nprint('done')\n", timeout=60)
    text, page = _record(res)
    assert "HBox" not in text + page and "FloatProgress" not in text + page
    rank1 = [line for line in text.splitlines() if line.startswith("[rank 1] ")]
    assert len(rank1) == 32 and rank1[-1] == "[rank 1] done" and "epoch: 100%|██████████| 30/30" in rank1[-2], rank1
    row = page[page.index("rank 1 <b"):].split("class='accel-magics-row'")[0]
    assert row.count("class='accel-magics-bar'") <= 2, row    # the newest finished bar per position


def _header_times(res, while_text: str) -> list[float]:
    """The elapsed times the live view's header showed while it said ``while_text``."""
    times = []
    for m in res.messages:
        if m["msg_type"] in ("comm_open", "comm_msg"):
            data = m["content"].get("data", {})
            value = str(data.get("state", {}).get("value", ""))
            if "accel-magics-header" in value and while_text in value:
                times += [float(t) for t in re.findall(r"&middot; (\d+\.\d) s", value)]
    return times


def test_the_elapsed_time_moves_while_the_first_cell_waits_for_the_launcher(tmp_path):
    """Issue 25 item 5: it froze at 0.1-0.2 s while the first cell of a kernel
    waited for the launcher (seconds: it imports torch), so slow looked stuck.
    The launcher is made slow to start (a sitecustomize that waits in it only)."""
    from kernel_harness import SLOW_LAUNCHER, KernelSession, with_sitecustomize

    env = with_sitecustomize(tmp_path, SLOW_LAUNCHER.format(seconds=3))
    k = KernelSession(extra_env={**env, "TMPDIR": str(tmp_path)})
    try:
        k.ok("%load_ext accel_magics")
        res = k.ok("%%distributed -n 2 --output widget\nprint('ran')\n", timeout=120)
        times = _header_times(res, "starting the launcher")
        assert times and max(times) >= 2.0 and len(set(times)) >= 4, times
    finally:
        k.shutdown()


def test_the_elapsed_time_moves_while_a_session_cell_waits_its_turn(clean_kernel):
    """Issue 25 item 5: it stayed at 0.0 s while a session cell waited for the
    background cell before it."""
    k = clean_kernel
    k.ok("%distributed_session start -n 2")
    try:
        k.ok("%%distributed --session --background --output text\nimport time\ntime.sleep(3)")
        res = k.ok("%%distributed --session --output widget\nprint('my turn')", timeout=60)
        times = _header_times(res, "waiting for In[")
        assert times and max(times) >= 1.5 and len(set(times)) >= 3, times
    finally:
        k.ok("%distributed_session stop", timeout=60)


def test_a_rank_holding_500_mb_shows_it_in_its_row_and_its_peak_in_the_record(clean_kernel):
    """Issue 25 item 7: resources per rank, sampled by the supervisor."""
    res = clean_kernel.ok("%%distributed -n 2 --output widget\nimport os, time\n"
                          "held = bytearray((500 if os.environ['RANK'] == '0' else 1) << 20)\n"
                          "time.sleep(2.5)\nprint('done')\n", timeout=90)
    seen = "".join(str(m["content"]) for m in res.messages if m["msg_type"] in ("comm_open", "comm_msg"))
    live = [float(mb) for mb in re.findall(r"rank 0 <b[^>]*>running</b></span><span class='accel-magics-usage'"
                                           r"[^>]*>cpu \d+% &middot; ([0-9.]+) MB", seen)]
    assert live and max(live) >= 500, live
    record = [m["content"]["data"]["text/html"] for m in res.messages
              if m["msg_type"] in ("display_data", "update_display_data") and "text/html" in m["content"]["data"]]
    peaks = re.findall(r"rank (\d) <b[^>]*>done</b></span><span class='accel-magics-usage'[^>]*>peak ([0-9.]+) MB",
                       record[-1])
    assert {rank: float(mb) for rank, mb in peaks}.get("0", 0) >= 500, peaks


def test_the_first_background_cell_returns_before_the_launcher_is_up_and_a_stop_shows_the_stacks(tmp_path):
    """Issue 25 item 4: the first --background cell of a kernel returned only
    once the launcher had started (3 s: it imports torch), and a stopped
    background run's view showed no stacks.  The launcher is made 6 s slow."""
    from kernel_harness import SLOW_LAUNCHER, KernelSession, wait_until, with_sitecustomize

    env = with_sitecustomize(tmp_path, SLOW_LAUNCHER.format(seconds=6))
    k = KernelSession(extra_env={**env, "TMPDIR": str(tmp_path)})
    try:
        k.ok("%load_ext accel_magics")
        bad = k.run("%%distributed -n 0 --background\npass")   # checked at once, nothing launched
        assert bad.error["ename"] == "UsageError" and "Nothing was launched" in bad.error["evalue"], bad.error
        sent = time.monotonic()
        first = k.ok("%%distributed -n 2 --background --output widget\nimport time\n"
                     "for i in range(600):\n    time.sleep(0.1)\n", timeout=120)
        assert time.monotonic() - sent < 4, "the handle came only after the launcher"
        assert "background run In[" in first.live[-1] or any("background run In[" in t for t in first.live)
        wait_until(lambda: any("rank 1 <b style='color:#1f77b4'>running" in str(m["content"])
                               for m in k.pump() if m["msg_type"] == "comm_msg"), 60, "the ranks to run")
        said = k.ok("h = _\nh.stop()", timeout=60).stdout
        assert said.startswith("stopped In[3]"), said
        record = [d["text/html"] for d in k.updates_of(first) if "text/html" in d]
        assert record and "where each unfinished rank was" in record[-1] and "time.sleep(0.1)" in record[-1], record
        # the next cell (the launcher is up now) goes the usual way
        assert k.ok("%%distributed -n 2 --output text\nprint('next')").stdout.count("next") == 2
    finally:
        k.shutdown()


def test_a_long_runs_html_record_keeps_its_first_and_last_lines(clean_kernel):
    """Issue 25 item 3 over the kernel protocol: the kept HTML record said
    "(50001 lines, the last 100 shown)", so the first lines (the config, the
    first epoch) were only in a local log."""
    res = clean_kernel.ok("%%distributed -n 2 --output widget\nimport os\nr = os.environ['RANK']\n"
                          "print(f'config of rank {r}')\nfor i in range(5000):\n    print(f'rank {r} line {i}')\n",
                          timeout=120)
    record = [m["content"]["data"]["text/html"] for m in res.messages
              if m["msg_type"] in ("display_data", "update_display_data") and "text/html" in m["content"]["data"]][-1]
    for rank in (0, 1):
        assert f"rank {rank} output (5001 lines, the first 50 and the last 100 shown)" in record, record[:2000]
        assert f"config of rank {rank}\nrank {rank} line 0\n" in record and f"rank {rank} line 48<" in record
        assert f"rank {rank} line 4900\n" in record and f"rank {rank} line 4999<" in record
        assert f"rank {rank} line 49\n" not in record and f"rank {rank} line 4899\n" not in record
    assert record.count("... 4851 lines left out; the full log is in ") == 2
