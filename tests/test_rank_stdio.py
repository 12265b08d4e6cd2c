"""A rank's stdout/stderr (kernel_ext.rank.rank_stdio): live line by line, one big
buffer in a flood, order kept across the two streams, no duplicate after fork.

Each case runs in a fresh interpreter over a real pipe (the objects install
fork handlers, which must not stay in the test process)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(body: str) -> str:
    """Run ``body`` with ``out``/``err`` writing into a pipe; returns what the pipe got."""
    script = textwrap.dedent('''
        import os, sys, threading, time
        from accel_magics.kernel_ext.rank.rank_stdio import RankStdout, RankStderr, BURST_LINES
        r, w = os.pipe()
        out = RankStdout(w)
        err = RankStderr(w, out)
        got = []
        reader = threading.Thread(target=lambda: got.extend(iter(lambda: os.read(r, 1 << 16), b"")))
        reader.start()
    ''') + textwrap.dedent(body) + textwrap.dedent('''
        out.flush(); err.flush()
        os.close(w)
        reader.join()
        sys.__stdout__.buffer.write(b"".join(got))
    ''')
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT, timeout=50)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def test_a_line_is_in_the_pipe_as_soon_as_it_is_printed():
    script = textwrap.dedent('''
        import os
        from accel_magics.kernel_ext.rank.rank_stdio import RankStdout
        r, w = os.pipe()
        os.set_blocking(r, False)
        out = RankStdout(w)
        out.write("first\\n")       # no flush: line buffering alone must write it
        print(os.read(r, 100).decode(), end="")
    ''')
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT, timeout=50)
    assert proc.stdout.decode() == "first\n", proc.stderr.decode()


def test_a_flood_keeps_every_line_in_order_with_stderr_between():
    got = run_case('''
        for i in range(BURST_LINES * 50):
            out.write(f"line {i}\\n")
            if i % 1000 == 999:
                err.write(f"err after {i}\\n")
        assert out.fast is not None, "a flood switches to the big buffer"
    ''')
    expected = []
    for i in range(200 * 50):
        expected.append(f"line {i}")
        if i % 1000 == 999:
            expected.append(f"err after {i}")
    assert got.splitlines() == expected


def test_a_child_forked_in_a_flood_does_not_repeat_the_parents_buffer():
    got = run_case('''
        for i in range(BURST_LINES * 5):
            out.write(f"parent {i}\\n")
        pid = os.fork()
        if pid == 0:
            out.write("from the child\\n")
            out.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        out.write("parent after\\n")
    ''')
    lines = got.splitlines()
    parent = [ln for ln in lines if ln.startswith("parent ") and ln != "parent after"]
    assert parent == [f"parent {i}" for i in range(200 * 5)]
    assert lines.count("from the child") == 1
    assert lines[-1] == "parent after"
