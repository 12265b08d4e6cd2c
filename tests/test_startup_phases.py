"""Issue 45 item 5: the first cell showed "running" and an empty pane while
its ranks imported and set up.  Each rank says what it is busy with
(rank/startup.py), the launcher what it imports; a plain function of the
main thread's frames, and the rows and lines a user sees."""
from __future__ import annotations

import pytest

from accel_magics.kernel_ext.rank.startup import phase_of

pytestmark = pytest.mark.timeout(120)

SITE = "/venv/lib/python3.11/site-packages"
# Recorded (sampled from another thread): a rank in `import slowpkg`, whose
# __init__ imports slowpkg.inner, which sleeps.
IMPORTING = [("Cell In[3]", "<module>", "__main__"),
             ("<frozen importlib._bootstrap>", "_find_and_load", "importlib._bootstrap"),
             ("<frozen importlib._bootstrap>", "_find_and_load_unlocked", "importlib._bootstrap"),
             ("<frozen importlib._bootstrap>", "_load_unlocked", "importlib._bootstrap"),
             ("<frozen importlib._bootstrap_external>", "exec_module", "importlib._bootstrap_external"),
             ("<frozen importlib._bootstrap>", "_call_with_frames_removed", "importlib._bootstrap"),
             ("/tmp/mods/slowpkg/__init__.py", "<module>", "slowpkg"),
             ("<frozen importlib._bootstrap>", "_handle_fromlist", "importlib._bootstrap"),
             ("<frozen importlib._bootstrap>", "_find_and_load", "importlib._bootstrap"),
             ("/tmp/mods/slowpkg/inner.py", "<module>", "slowpkg.inner")]
# Recorded: Accelerator() waiting for its peer in init_process_group (accelerate 1.15, torch 2.13).
IN_ACCELERATOR = [("Cell In[4]", "<module>", "__main__"),
                  (f"{SITE}/accelerate/accelerator.py", "__init__", "accelerate.accelerator"),
                  (f"{SITE}/accelerate/state.py", "__init__", "accelerate.state"),
                  (f"{SITE}/accelerate/state.py", "__init__", "accelerate.state"),
                  (f"{SITE}/torch/distributed/c10d_logger.py", "wrapper", "torch.distributed.c10d_logger"),
                  (f"{SITE}/torch/distributed/distributed_c10d.py", "init_process_group",
                   "torch.distributed.distributed_c10d"),
                  (f"{SITE}/torch/distributed/rendezvous.py", "_env_rendezvous_handler", "torch.distributed.rendezvous"),
                  (f"{SITE}/torch/distributed/rendezvous.py", "_create_c10d_store", "torch.distributed.rendezvous")]


def test_the_phase_is_read_from_the_main_threads_frames():
    assert phase_of(IMPORTING) == "importing slowpkg"
    assert phase_of(IN_ACCELERATOR) == "in Accelerator(), in init_process_group"
    assert phase_of(IN_ACCELERATOR[:1]) == ""   # the cell's own code: nothing to say
    # an import made inside Accelerator(): both, outer first
    assert phase_of(IN_ACCELERATOR[:2] + IMPORTING[1:]) == "in Accelerator(), importing slowpkg"


def test_the_first_cells_ranks_say_what_they_are_busy_with(clean_kernel, tmp_path):
    (tmp_path / "slow_to_import_pkg").mkdir()
    (tmp_path / "slow_to_import_pkg" / "__init__.py").write_text("import time\ntime.sleep(1.5)   # a heavy import\n")
    res = clean_kernel.ok(
        "%%distributed -n 2 --output text\n"
        f"import os, sys, time\nsys.path.insert(0, {str(tmp_path)!r})\n"
        "import slow_to_import_pkg\n"
        "if os.environ['RANK'] == '1':\n    time.sleep(2)   # a slow peer: rank 0 waits for it in Accelerator()\n"
        "from accelerate import Accelerator\naccelerator = Accelerator()\nprint('ready')\n", timeout=90)
    live = "\n".join(res.live)
    assert "[rank 0] (importing slow_to_import_pkg)" in live and "[rank 1] (importing slow_to_import_pkg)" in live, live
    assert "[rank 0] (in Accelerator(), in init_process_group)" in live, live
    assert "(importing" not in res.stdout and "[rank 0] ready" in res.stdout   # the record keeps what ranks printed


def test_the_view_shows_it_in_the_rank_rows_and_the_launcher_its_imports(tmp_path):
    """A fresh kernel: its first cell's header says what the launcher imports;
    then each rank's row what the rank is busy with."""
    import shutil
    import tempfile

    from kernel_harness import KernelSession

    (tmp_path / "slow_to_import_pkg").mkdir()
    (tmp_path / "slow_to_import_pkg" / "__init__.py").write_text("import time\ntime.sleep(1.5)\n")
    own_tmp = tempfile.mkdtemp(prefix="accel-test-tmp-")
    k = KernelSession(extra_env={"TMPDIR": own_tmp})
    try:
        k.ok("%load_ext accel_magics")
        res = k.ok("%%distributed -n 2\n"
                   f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport slow_to_import_pkg\nprint('ready')\n",
                   timeout=90)
        values = [str(m["content"]["data"].get("state", {}).get("value", "")) for m in res.messages
                  if m["msg_type"] == "comm_msg"]
        assert any("starting the launcher (once per kernel): importing torch" in v for v in values), [v[:200] for v in values if "launcher" in v]
        rows = [v for v in values if "class='accel-magics-row'" in v]
        # before the run: a row for each of its ranks, waiting for the launcher (-n 2: they are known)
        assert any(v.count("class='accel-magics-row'") == 2 and "rank 1 <b" in v and ">starting</b>" in v
                   and "waiting for the launcher: importing torch …" in v for v in rows), rows[:2]
        assert any("rank 0" in v and "importing slow_to_import_pkg …" in v for v in rows), rows
        assert "importing slow_to_import_pkg" not in res.messages[-1]["content"].get("data", {}).get("text/html", "")
    finally:
        k.shutdown()
        shutil.rmtree(own_tmp, ignore_errors=True)


def test_the_rows_before_the_run_are_the_ranks_the_flags_say_and_go_when_it_starts():
    from accel_magics.kernel_ext.kernel import events as ev
    from accel_magics.presenter import expected_ranks
    from accel_magics.widgets.progress_view import RunView

    assert expected_ranks(2, None, None) == (0, 1)
    assert expected_ranks(2, 2, 1) == (2, 3)                    # node 1 of 2
    assert expected_ranks(None, None, None) == ()               # every GPU: counted by the launcher
    assert expected_ranks(2, None, None, "accelerate.yaml") == ()
    view = RunView()
    try:
        view.expect((0, 1, 2), "waiting for the launcher: importing torch")
        view.refresh(force=True)
        rows = view.rows.value
        assert rows.count("class='accel-magics-row'") == 3 and rows.count("importing torch …") == 3, rows
        assert [view.tabs.get_title(i) for i in range(len(view.tabs.children))] == ["all ranks"]   # no pane yet
        view(ev.RunStarted("r", 0, 0, 2, 1, 0, [0, 1], "127.0.0.1", 29500))   # 2 after all
        view.refresh(force=True)
        assert sorted(view.ranks) == [0, 1] and "importing torch" not in view.rows.value
    finally:
        view.close()
