"""``%distributed_debug``: a post-mortem (pdb) of a failed rank, held as it
failed, in the notebook's input box (issue 47, item 1).

Each test answers the kernel's input_requests as a frontend does
(``KernelSession.run(stdin=...)``).  The failed rank prints its pid, and each
test waits for that process to end where the rank must be let go: a held
rank is kept on purpose, so ``clean_kernel``'s leak check lets it go first
(``%distributed_debug --release``) and cannot tell."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from conftest import LoadedKernel
from kernel_harness import alive, typed, wait_until

pytestmark = pytest.mark.timeout(180)

FAIL_ON_RANK_1 = """%%distributed -n 2 --output text --timeout 60{flags}
import os

def f(x):
    y = x * 2
    raise ValueError("no good")

if os.environ["RANK"] == "1":
    print("pid", os.getpid())
    f(21)
"""


def failing_cell(k, flags: str = "") -> tuple:
    """Run the cell in which rank 1 fails: (its result, rank 1's pid)."""
    res = k.run(FAIL_ON_RANK_1.format(flags=flags), timeout=90)
    assert res.status == "error" and res.error["ename"] == "DistributedRunError", res.error_text + res.stdout
    assert "rank 1 failed: ValueError: no good" in res.error["evalue"], res.error_text
    found = re.search(r"^\[rank 1\] pid (\d+)$", res.stdout, re.M)
    assert found, res.stdout
    return res, int(found.group(1))


def wait_gone(pid: int, timeout: float = 15) -> None:
    wait_until(lambda: not alive(pid), timeout, f"the failed rank (pid {pid}) to end")


def debug_pressed_while_busy(k) -> float:
    """``%distributed_debug`` with a long command of the user's typed at the
    post-mortem's prompt, and the stop button pressed once rank 1 prints that
    it is busy: the magic must end with KeyboardInterrupt.  When the press came."""
    pressed = []

    def press(text):
        if "[rank 1] busy" in text and not pressed:
            pressed.append(time.monotonic())
            k.km.interrupt_kernel()

    res = k.run("%distributed_debug", timeout=60, stdin=typed("print('busy'); import time; time.sleep(120)"),
                on_output=press)
    assert pressed and res.status == "error" and res.error["ename"] == "KeyboardInterrupt", res.error_text + res.stdout
    return pressed[0]


def held_ranks(k) -> str:
    """What the kernel says is held, asked without touching it (a rank no run has)."""
    res = k.run("%distributed_debug --rank 99", timeout=30)
    assert res.status == "error", res.stdout
    return res.error["evalue"]


def test_post_mortem_of_the_failed_rank_shows_its_frame_and_q_ends_it(clean_kernel):
    k = clean_kernel
    res, pid = failing_cell(k)
    assert "%distributed_debug opens a post-mortem (pdb) in rank 1's failing frame" in res.error_text, \
        res.error_text
    assert k.ok("print('an ordinary cell between')").stdout == "an ordinary cell between\n"   # it keeps the rank
    assert alive(pid)
    dbg = k.run("%distributed_debug", timeout=90, stdin=typed("p y", "w", "q"))
    assert dbg.status == "ok", dbg.error_text + dbg.stdout + dbg.stderr
    assert dbg.prompts == ["(Pdb rank 1) "] * 3, dbg.prompts
    lines = dbg.stdout.splitlines()
    assert "[rank 1] 42" in lines, dbg.stdout
    # The failing frame and its caller, named as the notebook names the cell, with their lines.
    cell = re.search(r"^\[rank 1\] > (Cell In\[\d+\])\(6\)f\(\)$", dbg.stdout, re.M)
    assert cell, dbg.stdout
    assert f"[rank 1]   {cell.group(1)}(10)<module>()" in lines and "[rank 1] -> f(21)" in lines, dbg.stdout
    assert '[rank 1] -> raise ValueError("no good")' in lines, dbg.stdout
    assert "rank 1's post-mortem ended" in dbg.stdout, dbg.stdout
    wait_gone(pid)
    again = k.run("%distributed_debug", timeout=30)
    assert again.status == "error" and "no failed rank is held" in again.error["evalue"], again.error_text
    assert k.ok("print('next')").stdout == "next\n"


def test_the_next_distributed_cell_lets_a_held_rank_go(clean_kernel):
    k = clean_kernel
    _, pid = failing_cell(k)
    assert "held: 1." in held_ranks(k)
    started = time.monotonic()
    res = k.ok("%%distributed -n 2 --output text\nprint('after')\n", timeout=60)
    assert "[rank 0] after" in res.stdout and "[rank 1] after" in res.stdout, res.stdout
    assert time.monotonic() - started < 30   # it did not wait out the hold
    wait_gone(pid)
    assert "no failed rank is held" in held_ranks(k)


def test_a_session_cell_lets_a_held_rank_go(clean_kernel):
    """A session cell starts no run (no launcher dispatch that would end the
    old one): the kernel's own word lets the held rank go."""
    k = clean_kernel
    k.ok("%distributed_session start -n 2", timeout=90)
    try:
        _, pid = failing_cell(k)
        assert "held: 1." in held_ranks(k)
        res = k.ok("%%distributed --session --output text\nprint('in the session')\n", timeout=60)
        assert "[rank 0] in the session" in res.stdout, res.stdout
        wait_gone(pid)
        assert "no failed rank is held" in held_ranks(k)
    finally:
        k.ok("%distributed_session stop", timeout=60)


def test_a_held_rank_is_let_go_at_the_end_of_its_hold(clean_kernel):
    k = clean_kernel
    res, pid = failing_cell(k, " --debug_hold 5")
    ended = time.monotonic()   # the hold began before the cell ended (at the rank's failure)
    assert "for the next 5 s (--debug_hold)" in res.error_text, res.error_text
    assert "held: 1." in held_ranks(k) and alive(pid)
    wait_gone(pid, 30)
    assert time.monotonic() - ended > 2, "let go before its hold ended"
    assert "no failed rank is held" in held_ranks(k)


def test_debug_hold_0_holds_nothing(clean_kernel):
    k = clean_kernel
    res, pid = failing_cell(k, " --debug_hold 0")
    assert "%distributed_debug" not in res.error_text, res.error_text
    wait_gone(pid)
    assert "no failed rank is held" in held_ranks(k)


def test_release_lets_it_go_and_it_ends_as_a_script_that_raised(clean_kernel, tmp_path):
    """Held, the rank has not ended: its atexit handlers run once it is let
    go (``%distributed_debug --release``), as a script's after pdb's post-mortem."""
    k = clean_kernel
    mark = tmp_path / "atexit-1"
    _, pid = failing_cell(k, f"\nimport atexit, os\nif os.environ['RANK'] == '1':\n"
                             f"    atexit.register(lambda: open({str(mark)!r}, 'w').write('ran'))")
    assert alive(pid) and not mark.exists()
    assert k.ok("%distributed_debug --release").stdout == ""
    wait_gone(pid)
    assert mark.read_text() == "ran"
    assert "no failed rank is held" in held_ranks(k)


def test_the_view_shows_a_held_rank_as_failed_and_held():
    """A held rank's exit comes after the run: the view takes its failure from
    RankHeld, not a row left "running"."""
    from accel_magics.kernel_ext.kernel import events as ev
    from accel_magics.widgets.progress_view import RunView

    view = RunView(log_dir="")
    view(ev.RunStarted("r", 0, 0, 2, 1, 0, [0, 1], "127.0.0.1", 29500))
    view(ev.RankExited(0, 0, None, False))
    view(ev.RankHeld(1, 300.0, ev.RankFailure(1, "exception", "ValueError: no good")))
    view(ev.RunFinished("r", "failed", 1.0, ev.RankFailure(1, "exception", "ValueError: no good")))
    rows = view.rows.value
    assert "ValueError: no good (held for %distributed_debug)" in rows, rows
    assert "running" not in rows, rows
    view.close()


def test_several_held_ranks_the_root_cause_first_and_the_others_named():
    from accel_magics.kernel_ext.kernel.post_mortem import HeldRun

    held = HeldRun("r", b"k", 1, {0: "ipc://x", 2: "ipc://x"}, root=2, seconds=300)
    assert held.default_rank() == 2
    assert held.hint() == ("%distributed_debug opens a post-mortem (pdb) in rank 2's failing frame, in this notebook's "
                           "input box, for the next 300 s (--debug_hold); %distributed_debug --rank N for rank(s) 0. "
                           "The next %%distributed cell lets the failed rank(s) go.")
    assert HeldRun("r", b"k", 1, {3: "ipc://x"}, root=1, seconds=5).default_rank() == 3   # the root was not held


def test_the_stop_button_in_a_post_mortem_ends_it_and_the_rank(clean_kernel):
    """A press while the post-mortem runs (here a command of the user's that
    takes long) ends %distributed_debug; the rank is let go, and killed a
    grace later if it does not end; the kernel goes on."""
    k = clean_kernel
    _, pid = failing_cell(k)
    pressed = debug_pressed_while_busy(k)
    wait_gone(pid, 15)
    assert time.monotonic() - pressed < 15
    assert "no failed rank is held" in held_ranks(k)
    assert k.ok("print('next')").stdout == "next\n"


def test_a_frontend_that_takes_no_input_holds_nothing(clean_kernel):
    """nbclient, papermill, nbval (allow_stdin off) can never answer a
    post-mortem: the failed rank ends at once, as with --debug_hold 0."""
    k = clean_kernel
    res = k.run(FAIL_ON_RANK_1.format(flags=""), timeout=90, stdin=False)
    assert res.status == "error" and "rank 1 failed: ValueError: no good" in res.error["evalue"], res.error_text
    assert "%distributed_debug" not in res.error_text, res.error_text
    pid = int(re.search(r"^\[rank 1\] pid (\d+)$", res.stdout, re.M).group(1))
    wait_gone(pid)
    assert "no failed rank is held" in held_ranks(k)


def test_a_background_run_s_failed_rank_opens_in_its_handle_s_debug(clean_kernel, tmp_path):
    """A --background run that failed: h.wait() raises its error, which says
    that h.debug() can inspect the held rank; h.debug() opens the post-mortem
    in this cell's input box (the run's own socket, kept open for it)."""
    k = clean_kernel
    pidfile = tmp_path / "pid"
    k.ok("%%distributed -n 2 --output text --background --timeout 60\nimport os\n\n"
         "def f(x):\n    y = x * 2\n    raise ValueError('no good')\n\n"
         f"if os.environ['RANK'] == '1':\n    open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n    f(21)\n",
         timeout=90)
    k.ok("h = _")
    res = k.run("h.wait()", timeout=90)
    assert res.status == "error" and res.error["ename"] == "DistributedRunError", res.error_text
    assert "its handle's .debug() opens a post-mortem (pdb) in rank 1's failing frame" in res.error_text, \
        res.error_text
    pid = int(pidfile.read_text())
    assert alive(pid)
    dbg = k.run("n = h.debug()\nprint('answered', n)", timeout=90, stdin=typed("p y", "q"))
    assert dbg.status == "ok", dbg.error_text + dbg.stdout + dbg.stderr
    assert "[rank 1] 42" in dbg.stdout.splitlines() and "answered 2" in dbg.stdout, dbg.stdout
    wait_gone(pid)
    assert k.ok("h.debug()").stdout.endswith("no rank waits at a prompt\n")


def test_release_lets_a_background_run_s_held_rank_go(clean_kernel, tmp_path):
    """What the next cell does for a foreground run's held rank it does for a
    background run's (``%distributed_debug --release`` is that step alone)."""
    k = clean_kernel
    pidfile = tmp_path / "pid"
    k.ok("%%distributed -n 2 --output text --background --timeout 60\nimport os\n"
         f"if os.environ['RANK'] == '1':\n    open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
         "    raise ValueError('no good')\n", timeout=90)
    k.ok("h = _")
    assert k.run("h.wait()", timeout=90).status == "error"
    pid = int(pidfile.read_text())
    assert alive(pid)
    k.ok("%distributed_debug --release")
    wait_gone(pid)


def test_stop_on_a_failed_background_run_lets_its_held_rank_go(clean_kernel, tmp_path):
    k = clean_kernel
    pidfile = tmp_path / "pid"
    k.ok("%%distributed -n 2 --output text --background --timeout 60\nimport os\n"
         f"if os.environ['RANK'] == '1':\n    open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
         "    raise ValueError('no good')\n", timeout=90)
    k.ok("h = _")
    assert k.run("h.wait()", timeout=90).status == "error"
    pid = int(pidfile.read_text())
    assert alive(pid)
    assert "held for .debug() were let go" in k.ok("h.stop()").stdout
    wait_gone(pid)


def test_a_held_rank_never_outlives_its_kernel():
    """The kernel killed (as a crash or a restart does) while a rank is held:
    the launcher sees its kernel gone and ends every run, the held one too."""
    k = LoadedKernel()
    try:
        _, pid = failing_cell(k)
        assert alive(pid)
        os.kill(k.pid, signal.SIGKILL)
        wait_gone(pid, 30)
    finally:
        k.shutdown()


# Rank 1 fails at once; rank 0 may be stopped before its first line runs
# (under load it starts later), so a later cell imports what it uses.
SESSION_FAIL = """%%distributed --session --output text --timeout 60
import os

def f(x):
    y = x * 2
    raise ValueError("no good")

if os.environ["RANK"] == "1":
    f(21)
"""


def test_a_session_cell_s_failed_rank_opens_its_post_mortem_until_the_next_cell(clean_kernel):
    """A session's ranks live on at their prompt: the one that failed keeps
    the cell's frames until the session's next cell; %distributed_debug opens
    them; q ends the post-mortem, not the rank (the session goes on)."""
    k = clean_kernel
    k.ok("%distributed_session start -n 2", timeout=90)
    try:
        res = k.run(SESSION_FAIL, timeout=90)
        assert res.status == "error" and res.error["ename"] == "DistributedRunError", res.error_text
        assert ("%distributed_debug opens a post-mortem (pdb) in rank 1's failing frame, in this notebook's input "
                "box, until the session's next cell") in res.error_text, res.error_text
        dbg = k.run("%distributed_debug", timeout=90, stdin=typed("p y", "q"))
        assert dbg.status == "ok", dbg.error_text + dbg.stdout + dbg.stderr
        assert dbg.prompts == ["(Pdb rank 1) "] * 2, dbg.prompts
        assert "[rank 1] 42" in dbg.stdout.splitlines(), dbg.stdout
        assert "no failed rank is held" in held_ranks(k)   # it was the only one
        res = k.ok("%%distributed --session --output text\nimport os\nprint('alive', os.environ['RANK'])\n", timeout=60)
        assert "[rank 0] alive 0" in res.stdout and "[rank 1] alive 1" in res.stdout, res.stdout
        k.run(SESSION_FAIL, timeout=90)
        assert "held: 1." in held_ranks(k)
        k.ok("%%distributed --session --output text\nprint('next')\n", timeout=60)   # the next cell ends the hold
        assert "no failed rank is held" in held_ranks(k)
    finally:
        k.ok("%distributed_session stop", timeout=60)


def test_a_background_session_cell_s_failed_rank_opens_in_its_handle_s_debug(clean_kernel):
    """A --background session cell that failed: its error names the handle's
    .debug(), which opens the rank's kept frames in the calling cell's input
    box; q brings the rank back to its prompt and the session goes on."""
    k = clean_kernel
    k.ok("%distributed_session start -n 2", timeout=90)
    try:
        k.ok(SESSION_FAIL.replace("--session", "--session --background", 1), timeout=90)
        k.ok("h = _")
        res = k.run("h.wait()", timeout=90)
        assert res.status == "error" and res.error["ename"] == "DistributedRunError", res.error_text
        assert ("its handle's .debug() opens a post-mortem (pdb) in rank 1's failing frame, in this notebook's "
                "input box, until the session's next cell") in res.error_text, res.error_text
        dbg = k.run("n = h.debug()\nprint('answered', n)", timeout=90, stdin=typed("p y", "q"))
        assert dbg.status == "ok", dbg.error_text + dbg.stdout + dbg.stderr
        assert dbg.prompts == ["(Pdb rank 1) "] * 2, dbg.prompts
        assert "[rank 1] 42" in dbg.stdout.splitlines() and "answered 2" in dbg.stdout, dbg.stdout
        assert "the rank is back at the session's prompt" in dbg.stdout, dbg.stdout
        assert k.ok("h.debug()").stdout.endswith("no rank waits at a prompt\n")
        # (rank 0 may have been recalled before the failed cell's import: its own import here)
        res = k.ok("%%distributed --session --output text\nimport os\nprint('alive', os.environ['RANK'])\n",
                   timeout=60)
        assert "[rank 0] alive 0" in res.stdout and "[rank 1] alive 1" in res.stdout, res.stdout
    finally:
        k.ok("%distributed_session stop", timeout=60)


def test_the_stop_button_in_a_session_rank_s_post_mortem_brings_it_back_to_its_prompt(clean_kernel):
    """A press while a session rank's post-mortem runs a long command: the
    command is interrupted (SIGINT, as at a terminal), the post-mortem reads
    end of input, the rank is back at its prompt and the session goes on."""
    k = clean_kernel
    k.ok("%distributed_session start -n 2", timeout=90)
    try:
        k.run(SESSION_FAIL, timeout=90)
        pressed = debug_pressed_while_busy(k)
        assert time.monotonic() - pressed < 15
        res = k.ok("%%distributed --session --output text\nimport os\nprint('alive', os.environ['RANK'])\n", timeout=60)
        assert "[rank 0] alive 0" in res.stdout and "[rank 1] alive 1" in res.stdout, res.stdout
    finally:
        k.ok("%distributed_session stop", timeout=60)


def test_release_lets_a_session_rank_drop_the_failed_cell_s_frames(clean_kernel, tmp_path):
    """The frames a failed session cell's rank keeps (their memory, GPU memory
    too) go at ``%distributed_debug --release``, not only at the next cell:
    the object the failing frame held is finalized then."""
    k = clean_kernel
    mark = tmp_path / "finalized"
    k.ok("%distributed_session start -n 2", timeout=90)
    try:
        res = k.run("%%distributed --session --output text --timeout 60\nimport os\n"
                    "class Big:\n"
                    f"    def __del__(self):\n        open({str(mark)!r}, 'w').write('gone')\n\n"
                    "def f():\n    big = Big()\n    raise ValueError('no good')\n\n"
                    "if os.environ['RANK'] == '1':\n    f()\n", timeout=90)
        assert res.status == "error" and "held: 1." in held_ranks(k), res.error_text
        assert not mark.exists()   # kept with the failing frame
        k.ok("%distributed_debug --release")
        wait_until(mark.exists, 15, "the failing frame's object to be finalized")
    finally:
        k.ok("%distributed_session stop", timeout=60)
