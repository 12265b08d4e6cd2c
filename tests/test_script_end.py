"""The end of a rank's cell as a script's end (kernel_ext/rank/script_end.py),
in a real forked process: no kernel needed, so each case runs in milliseconds.
The end-to-end wiring (a rank's cell, a session's stop) is in test_magic_e2e
and test_sessions."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

PRELUDE = """
import atexit, concurrent.futures, os, sys, tempfile, threading, time, weakref
from accel_magics.kernel_ext.rank import script_end
# What the launcher holds before the fork: an exit handler and a finalizer of its own.
atexit.register(lambda: print("the launcher's handler ran", flush=True))
launchers_dir = tempfile.TemporaryDirectory()
pid = os.fork()
if pid:
    os.waitpid(pid, 0)
    print("launcher's dir kept:", os.path.isdir(launchers_dir.name), flush=True)
    launchers_dir.cleanup()   # checked: now this test's own, removed as the launcher would at its end
    atexit._clear()
    os._exit(0)
script_end.begin()   # the rank
"""


def run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body) + "\nscript_end.end()\nprint('ended', flush=True)\nos._exit(0)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_only_the_cells_own_handlers_and_finalizers_run_after_its_threads():
    out = run("""
        def save():
            time.sleep(0.2)
            print("thread saved", flush=True)
        threading.Thread(target=save).start()
        atexit.register(lambda: print("cell's handler ran", flush=True))
        cells_dir = tempfile.TemporaryDirectory()
        print("cell's dir", cells_dir.name, flush=True)
        """)
    lines = out.splitlines()
    assert lines.index("thread saved") < lines.index("cell's handler ran") < lines.index("ended"), out
    assert "the launcher's handler ran" not in out
    assert "launcher's dir kept: True" in out
    cells_dir = next(line.split()[-1] for line in lines if line.startswith("cell's dir"))
    assert not os.path.exists(cells_dir)   # the cell's own finalizer ran at its end


def test_an_executor_left_open_does_not_hold_the_end_and_a_long_thread_is_named():
    out = run("""
        pool = concurrent.futures.ThreadPoolExecutor(2)
        pool.submit(int).result()
        """)
    assert "waits for its thread" not in out and "ended" in out, out
    # The thread ends once the note was said (not after a sleep that a late
    # end() on a loaded machine outlasts), or after 20 s: then no note came.
    out = run("""
        said, say = threading.Event(), script_end._say_waiting
        script_end._say_waiting = lambda *a, **k: (say(*a, **k), said.set())
        threading.Thread(target=said.wait, args=(20,), name="uploader").start()
        """)
    assert "this rank waits for its thread(s) 'uploader' to end" in out and "ended" in out, out
