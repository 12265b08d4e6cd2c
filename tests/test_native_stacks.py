"""The stall check's verdicts (issue 24 item 5) as plain functions of what it
reads: recorded py-spy dumps and the rank's interpreter heartbeat.  The end-to-end
tests (test_hardening) check the wiring: a waiting rank runs to the end, a
stuck one is stopped."""
from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from accel_magics.kernel_ext.rank import liveness
from accel_magics.kernel_ext.supervisor import native_stacks
from accel_magics.kernel_ext.supervisor.rank_process import user_stack
from accel_magics.kernel_ext.timing import BEAT_INTERVAL

pytestmark = pytest.mark.timeout(60)

# py-spy 0.4 dump --native of real processes (trimmed as native_stacks.trim does).
SLEEPING = """Thread 2431 (idle): "MainThread"
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    <module> (<%%distributed In[3]>:4)
    0x7f8b06c4524a (libc.so.6)
"""
IN_SUBPROCESS = """Thread 2435 (idle): "MainThread"
    wait4 (libc.so.6)
    os_waitpid (libpython3.11.so.1.0)
    Popen._try_wait (subprocess.py:2004)
    Popen.wait (subprocess.py:1264)
    run (subprocess.py:550)
    <module> (<%%distributed In[4]>:2)
"""
ON_A_SOCKET = """Thread 2440 (idle): "MainThread"
    recv (libc.so.6)
    sock_call_ex (socketmodule.c:921)
    sock_recv (socketmodule.c:3567)
    <module> (<%%distributed In[5]>:3)
"""
IN_A_COLLECTIVE = """Thread 2469 (idle): "MainThread"
    pthread_cond_wait (libc.so.6)
    std::condition_variable::wait (libstdc++.so.6.0.30)
    c10d::Work::wait (libtorch_cpu.so)
    pybind11::cpp_function::initialize<...>::_FUN (libtorch_python.so)
    pybind11::cpp_function::dispatcher (libtorch_python.so)
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    <module> (<%%distributed In[6]>:5)
Thread 2470 (idle): "Thread-1 (pin_memory)"
    pthread_cond_wait (libc.so.6)
"""
ON_THE_STORE = """Thread 3101 (idle): "MainThread"
    poll (libc.so.6)
    c10d::detail::SocketImpl::waitForInput (libtorch_cpu.so)
    c10d::TCPStore::doWait (libtorch_cpu.so)
    c10d::TCPStore::wait (libtorch_cpu.so)
    <module> (<%%distributed In[7]>:6)
"""
HEARTBEAT = """Thread 2471 (idle): "accel_magics-alive"
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    beat (liveness.py:45)
"""


@pytest.mark.parametrize("dump", [SLEEPING, IN_SUBPROCESS, ON_A_SOCKET, ON_THE_STORE])
def test_a_wait_that_can_end_is_not_stuck(dump):
    assert native_stacks.stuck_in(dump) is None


def test_a_collective_is_where_nothing_can_move_a_rank():
    why = native_stacks.stuck_in(IN_A_COLLECTIVE)
    assert why is not None and "c10d::Work::wait" in why and "collective" in why


def test_where_names_the_innermost_native_and_python_frame():
    assert native_stacks.where(SLEEPING) == "clock_nanosleep in <module> (<%%distributed In[3]>:4)"
    assert native_stacks.where(IN_SUBPROCESS) == "wait4 in Popen._try_wait (subprocess.py:2004)"
    assert native_stacks.where("") == "an unknown place (no native stack)"


def test_the_heartbeat_thread_is_left_out_of_what_the_user_reads():
    raw = "Process 1: python\nPython v3.11.7\n\n" + SLEEPING + HEARTBEAT
    trimmed = native_stacks.trim(raw)
    assert "MainThread" in trimmed and "clock_nanosleep" in trimmed
    assert "accel_magics-alive" not in trimmed and "beat (" not in trimmed
    faulthandler = ("Thread 0x00007f0000000002 (most recent call first):\n"
                    f'  File "{os.path.dirname(liveness.__file__)}/liveness.py", line 46 in beat\n'
                    '  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
                    "Current thread 0x00007f0000000001 (most recent call first):\n"
                    '  File "<%%distributed In[3]>", line 4 in <module>\n')
    shown = user_stack(faulthandler)
    assert "In[3]" in shown and "other thread" not in shown and "threading.py" not in shown


def _child_with_heartbeat(body) -> tuple[int, object]:
    counter = liveness.new_counter()
    pid = os.fork()
    if pid == 0:   # a rank as the supervisor forks it: the counter mapped before the fork
        try:
            liveness.start(counter)
            body()
        finally:
            os._exit(0)
    return pid, counter


def _beats_during(counter, seconds: float) -> int:
    first = liveness.read(counter)
    time.sleep(seconds)          # measuring a rate over a wall-clock window, not synchronising
    return liveness.read(counter) - first


@pytest.mark.parametrize("holds_gil, expect_beats", [(False, True), (True, False)])
def test_the_heartbeat_stops_only_while_a_thread_holds_the_gil_in_native_code(holds_gil, expect_beats):
    """pause() through ctypes.PyDLL keeps the GIL (the deadlocked destructor's
    state); through CDLL it releases it (a rank that waits).  Only the first
    stops the count."""
    lib = ctypes.PyDLL(None) if holds_gil else ctypes.CDLL(None)
    pid, counter = _child_with_heartbeat(lambda: lib.pause())
    try:
        deadline = time.monotonic() + 10
        while liveness.read(counter) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert liveness.read(counter) > 0, "the heartbeat never started"
        beats = _beats_during(counter, 6 * BEAT_INTERVAL)
        assert (beats >= 3) if expect_beats else (beats <= 1), beats
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
