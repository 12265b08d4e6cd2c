"""The stall check's verdicts (issue 24 item 5) as plain functions of what it
reads: recorded py-spy dumps and the rank's interpreter heartbeat.  The end-to-end
tests (test_hardening) check the wiring: a waiting rank runs to the end, a
stuck one is stopped."""
from __future__ import annotations

import ctypes
import os
import signal
import struct
import time

import pytest

from accel_magics.kernel_ext.rank import liveness
from accel_magics.kernel_ext.supervisor import native_stacks
from accel_magics.kernel_ext.supervisor.rank_process import NO_STACK, OUTSIDE_THE_CELL, RankProcess, user_stack, where_blocked
from accel_magics.kernel_ext.timing import BEAT_INTERVAL, STACK_ASK_WAIT

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
# The heartbeat started with _thread (not in threading's registry): py-spy knows no name.
HEARTBEAT_UNNAMED = """Thread 2472 (idle)
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    _beat (kernel_ext/rank/liveness.py:52)
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
    # Recorded: a rank in a barrier, its innermost frame an unnamed address.
    barrier = ('Thread 6295 (idle): "MainThread"\n    0x7fe55f0a3f16 (libc.so.6)\n    pthread_cond_wait (libc.so.6)\n'
               "    barrier (torch/distributed/distributed_c10d.py:5356)\n    <module> (<%%distributed In[4]>:6)\n")
    assert native_stacks.where(barrier) == "pthread_cond_wait in barrier (torch/distributed/distributed_c10d.py:5356)"


def test_the_heartbeat_thread_is_left_out_of_what_the_user_reads():
    raw = "Process 1: python\nPython v3.11.7\n\n" + SLEEPING + HEARTBEAT
    trimmed = native_stacks.trim(raw)
    assert "MainThread" in trimmed and "clock_nanosleep" in trimmed
    assert "0x7f8b06c4524a" not in trimmed   # an unnamed address: noise
    assert "accel_magics-alive" not in trimmed and "beat (" not in trimmed
    faulthandler = ("Thread 0x00007f0000000002 (most recent call first):\n"
                    f'  File "{os.path.dirname(liveness.__file__)}/liveness.py", line 46 in beat\n'
                    '  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
                    "Current thread 0x00007f0000000001 (most recent call first):\n"
                    '  File "<%%distributed In[3]>", line 4 in <module>\n')
    shown = user_stack(faulthandler)
    assert "In[3]" in shown and "other thread" not in shown and "threading.py" not in shown


_PKG = os.path.dirname(os.path.dirname(liveness.__file__))   # kernel_ext/
_STDLIB = os.path.dirname(os.__file__)


def _frame(path: str, line: int, func: str) -> str:
    return f'  File "{path}", line {line} in {func}\n'


def _marked(dump: str) -> str:
    """A dump as the heartbeat thread writes it: between its marks."""
    return f"{liveness.DUMP_BEGIN}\n{dump}{liveness.DUMP_END}\n"


def _dump_at(line: int) -> str:
    return ("Current thread 0x00007f0000000002 (most recent call first):\n"
            + _frame(f"{_PKG}/rank/liveness.py", 150, "_dump") + _frame(f"{_PKG}/rank/liveness.py", 130, "_beat")
            + "\nThread 0x00007f0000000001 (most recent call first):\n"
            + _frame("<%%distributed In[3]>", line, "<module>") + _frame(f"{_PKG}/rank/worker.py", 470, "_run_cell"))


@pytest.mark.parametrize("two", [
    # the fallback signal's dump, then the heartbeat's once the GIL came free
    _dump_at(4) + "\n" + _marked(_dump_at(9)),
    # the heartbeat's, twice (a second ask)
    _marked(_dump_at(4)) + _marked(_dump_at(9)),
], ids=["signal-then-heartbeat", "heartbeat-twice"])
def test_only_the_first_dump_counts_when_a_rank_wrote_two(two):
    """The fallback signal reached a rank whose GIL came free a moment later,
    and its heartbeat thread answered the ask too: the second dump's threads
    come again.  Where the rank was at the stop is the first one."""
    shown = user_stack(two, {"<%%distributed In[3]>": "\n".join(f"line {n}" for n in range(1, 12))})
    assert shown == 'the cell\'s thread:\n  File "<%%distributed In[3]>", line 4, in <module>\n    line 4\n', shown
    assert where_blocked(two) == "In[3], line 4"


def test_a_thread_listed_twice_in_one_dump_does_not_end_it():
    """A thread in ``Thread.start()``: the new thread's state is made ahead
    with its maker's id and no frame, so that id comes twice in one dump (as
    recorded in a stop of a cell whose threads churn).  It was read as a
    second dump, the cell's thread was cut off, and the stop said "(its code
    had not started)"."""
    churn = "Thread 0x00007f0000000003 (most recent call first):\n"
    dump = (churn + "  <no Python frame>\n\n" + churn
            + _frame("/usr/lib/python3.11/threading.py", 327, "wait")
            + _frame("<%%distributed In[5]>", 5, "churn")
            + _frame("/usr/lib/python3.11/threading.py", 1002, "_bootstrap") + "\n"
            + _dump_at(9).replace("In[3]", "In[5]"))
    shown = user_stack(_marked(dump))
    assert shown.startswith('the cell\'s thread:\n  File "<%%distributed In[5]>", line 9, in <module>'), shown
    assert "thread 0x00007f0000000003" in shown and "had not started" not in shown, shown
    assert where_blocked(_marked(dump)) == "In[5], line 9"


_BUSY = ("Thread 0x00007f0000000005 (most recent call first):\n"
         + _frame("<%%distributed In[5]>", 3, "upload") + _frame("/usr/lib/python3.11/threading.py", 982, "run") + "\n")
_LIBRARY_ONLY = ("Thread 0x00007f0000000004 (most recent call first):\n"
                 + _frame(f"{_STDLIB}/queue.py", 171, "get")
                 + _frame(f"{_STDLIB}/threading.py", 982, "run") + "\n")
_MAIN_AT_9 = ("Thread 0x00007f0000000001 (most recent call first):\n"
              + _frame("<%%distributed In[5]>", 9, "<module>") + _frame(f"{_PKG}/rank/worker.py", 470, "_run_cell"))


def _heartbeats(listed: str, main: str = _MAIN_AT_9, main_id: int = 0x7f0000000001) -> str:
    """A dump as the heartbeat thread writes it: its mark (naming the main
    thread), faulthandler's list, then the main thread again."""
    part = f"{liveness.DUMP_MAIN}\n{main}" if main is not None else ""
    return f"{liveness.DUMP_BEGIN} {main_id:#x}\n{listed}{part}{liveness.DUMP_END}\n"


def test_the_other_threads_are_shown_beside_the_main_threads_own_part():
    """The main thread comes twice in a heartbeat's dump (faulthandler's
    list, then whole): once shown, and the other threads stay (a busy one in
    full, a library-only one counted)."""
    listed = _BUSY + _LIBRARY_ONLY + _MAIN_AT_9.replace("line 9", "line 8") + "\n"
    shown = user_stack(_heartbeats(listed))
    assert shown.startswith('the cell\'s thread:\n  File "<%%distributed In[5]>", line 9, in <module>'), shown
    assert shown.count("line 8") == 0 and "thread 0x00007f0000000005" in shown and " in upload" in shown, shown
    library = f"{os.path.basename(_STDLIB)}/queue.py get"
    assert f"(+ 1 other thread in library code only: {library})" in shown, shown


def test_where_the_dump_lost_the_main_thread_it_is_not_guessed():
    """faulthandler's list cut at 100 threads with no main-thread part after
    it (a dump whose end never came; the fallback signal's): the last listed
    thread is not the cell's."""
    cut = _BUSY + _LIBRARY_ONLY + "...\n"
    for dump in (cut, _heartbeats(cut, main=None)):
        shown = user_stack(dump)
        assert shown.startswith("the cell's thread: (not in the dump: faulthandler lists 100 threads)"), shown
        assert " in upload" in shown and where_blocked(dump) == NO_STACK, shown
    # the main thread is in the list: its mark names it
    named = user_stack(_heartbeats(_MAIN_AT_9 + "\n" + _BUSY, main=None))
    assert named.startswith('the cell\'s thread:\n  File "<%%distributed In[5]>", line 9'), named


def test_the_tail_of_an_earlier_dump_is_not_taken_for_this_one():
    """A session's recall asks again after the stop's ask: what was left of
    the first dump in the pipe comes before the new one's mark."""
    stale = f"{liveness.DUMP_MAIN}\n" + _MAIN_AT_9.replace("line 9", "line 2") + f"{liveness.DUMP_END}\n"
    shown = user_stack(stale + _heartbeats(_BUSY))
    assert "line 9" in shown and "line 2" not in shown and liveness.DUMP_END not in shown, shown


def test_a_mark_alone_is_no_dump_yet():
    """The heartbeat writes its mark just before faulthandler's dump, and the
    GIL may change hands between them: a stop that took the mark alone for
    the stacks showed "(no Python frame)" and did not wait for them."""
    r = RankProcess(local=0, rank=0, pid=0, fds={})
    mark = f"{liveness.DUMP_BEGIN} 0x7f0000000001\n".encode()
    for stack, dumped in ((b"", False), (mark[:10], False), (mark, False), (mark + b"Thread 0x", True),
                          (b"Current thread 0x00007f0000000001 (most recent call first):\n", True)):
        r.stack = bytearray(stack)
        assert r.dumped() is dumped, stack


def test_the_rest_of_an_earlier_dump_is_skipped_after_a_new_ask():
    """A session's recall asks again while the stop's dump is still coming:
    its rest (however it is split across reads) is skipped, the new dump is
    read; and a main-thread part with no end of its own is never a dump."""
    r = RankProcess(local=0, rank=0, pid=0, fds={})
    old = _heartbeats(_BUSY, main=_MAIN_AT_9.replace("line 9", "line 2")).encode()
    new = _heartbeats(_BUSY).encode()
    r.add_stack(old[:40])
    r.forget_stack()
    rest = old[40:] + new
    for cut in range(0, len(rest), 23):   # the end mark split across reads too
        r.add_stack(rest[cut:cut + 23])
    shown = user_stack(r.stack.decode())
    assert "line 9" in shown and "line 2" not in shown, shown
    stale = f"{liveness.DUMP_MAIN}\n{_MAIN_AT_9}"
    assert where_blocked(stale) == NO_STACK and "line 9" not in user_stack(stale)


def test_a_mark_whose_dump_never_comes_gets_the_signal():
    """The heartbeat wrote its mark, then a thread took the GIL in native code
    for good: no beat, no byte, no dump.  The fallback signal comes on the
    next look, not never.  (The counts are set by hand: the page's layout is
    liveness's; a real process with that state is in test_stack_dumps.)"""
    r = RankProcess(local=0, rank=0, pid=0, fds={}, beat=liveness.new_counter())
    struct.pack_into(liveness._FORMAT, r.beat, liveness._BEATS, 1)   # its heartbeat started
    ask_r, r.ask = os.pipe()
    sent = []
    r.signal = sent.append   # pid 0 is not a rank: record what would be sent
    try:
        r.ask_stacks(100.0)
        assert r.asked_at == 100.0 and not sent
        struct.pack_into(liveness._FORMAT, r.beat, liveness._DUMPS, 1)   # it began a dump: the mark
        r.add_stack(f"{liveness.DUMP_BEGIN} 0x1\n".encode())
        r.check_ask(100.0 + STACK_ASK_WAIT)   # something moved: wait again
        assert not sent and r.asked_at is not None
        r.check_ask(r.asked_at + STACK_ASK_WAIT)   # nothing moved since
        assert sent == [signal.SIGUSR1], sent
    finally:
        os.close(ask_r)
        r.release()


def test_a_missing_cells_thread_is_named_as_missing():
    shown = user_stack(_heartbeats(_BUSY, main=None, main_id=0x7f00000000ff))
    assert shown.startswith("the cell's thread: (not in the dump)\n"), shown


def test_a_heartbeat_thread_without_a_name_is_left_out_too():
    trimmed = native_stacks.trim("Process 1: python\nPython v3.11.7\n\n" + HEARTBEAT_UNNAMED + SLEEPING)
    assert "clock_nanosleep" in trimmed and "MainThread" in trimmed
    assert "beat (" not in trimmed and "Thread 2472" not in trimmed


# Hostile pass, recorded: a stop 20-30 ms into a warm cell lands while the
# rank starts its heartbeat (liveness.start, inside threading.Thread.__init__),
# below it only the launcher's frames.  The whole dump was shown, launcher
# frames and all, because a frame in liveness.py marked the *main* thread as
# the heartbeat's.
STOP_IN_LIVENESS_START = (
    "Current thread 0x00007f4fb3264b80 (most recent call first):\n"
    + _frame(f"{_STDLIB}/threading.py", 248, "__init__")
    + _frame(f"{_STDLIB}/threading.py", 905, "__init__")
    + _frame(f"{_PKG}/rank/liveness.py", 50, "start")
    + _frame(f"{_PKG}/rank/worker.py", 257, "wait_and_run")
    + _frame(f"{_PKG}/supervisor/spare.py", 68, "prefork")
    + _frame(f"{_PKG}/launcher/zygote.py", 402, "main")
    + _frame("<frozen runpy>", 88, "_run_code"))
# The signal was taken by the heartbeat thread as it began (no Python frame
# yet): faulthandler calls it current; the cell runs in the main thread,
# listed last.
STOP_AS_THE_HEARTBEAT_BEGINS = (
    "Current thread 0x00007f0000000002 (most recent call first):\n  <no Python frame>\n\n"
    "Thread 0x00007f0000000001 (most recent call first):\n"
    + _frame("<%%distributed In[4]>", 3, "<module>")
    + _frame(f"{_PKG}/rank/worker.py", 470, "_run_cell"))
STOP_BEFORE_THE_CELL_BEGAN = (
    "Current thread 0x00007f0000000002 (most recent call first):\n  <no Python frame>\n\n"
    "Thread 0x00007f0000000001 (most recent call first):\n"
    + _frame(f"{_PKG}/rank/worker.py", 257, "wait_and_run")
    + _frame(f"{_PKG}/launcher/zygote.py", 402, "main"))


@pytest.mark.parametrize("dump, cell", [(STOP_IN_LIVENESS_START, False), (STOP_AS_THE_HEARTBEAT_BEGINS, True),
                                        (STOP_BEFORE_THE_CELL_BEGAN, False)])
def test_a_stop_as_a_rank_begins_shows_the_cell_or_says_it_had_not_begun(dump, cell):
    shown = user_stack(dump, {"<%%distributed In[4]>": "import time\nx = 1\ntime.sleep(5)\n"})
    for internal in ("zygote", "spare", "worker.py", "liveness", "runpy", "0x", "no Python frame",
                     "threading.py", "Current thread"):
        assert internal not in shown, (internal, shown)
    if cell:
        assert shown.startswith("the cell's thread:\n") and "time.sleep(5)" in shown, shown
    else:
        assert shown == f"the cell's thread: {OUTSIDE_THE_CELL}\n", shown


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


def test_a_long_cpp_frame_is_folded_to_a_line_a_person_reads():
    """Hostile pass: template lists were folded, parameter lists not: lines of
    320 characters with a lambda's signature in every collective's stack."""
    pybind = ("    pybind11::cpp_function::initialize<pybind11::cpp_function::cpp_function<bool, c10d::Work>"
              "(bool (c10d::Work::*)(std::chrono::duration<long, std::ratio<1l, 1000l> >), pybind11::name const&, "
              "char const (&) [654])::{lambda(c10d::Work*)#1}, bool>::_FUN (libtorch_python.so)")
    loop = ("    c10d::ProcessGroupGloo::runLoop(unsigned long, std::vector<std::shared_ptr<c10d::Work>, "
            "std::allocator<std::shared_ptr<c10d::Work> > > const&, std::chrono::duration<long, std::ratio<1l, "
            "1000l> >, bool, int, int, int) (libtorch_cpu.so)")
    assert native_stacks.trim(f'Thread 1 (idle): "MainThread"\n{pybind}\n{loop}\n') == (
        'Thread 1 (idle): "MainThread"\n    pybind11::cpp_function::initialize<...>::_FUN (libtorch_python.so)\n'
        '    c10d::ProcessGroupGloo::runLoop(...) (libtorch_cpu.so)\n')


# Recorded (py-spy 0.4, trimmed): a --timeout stop of a rank paused in C under
# two notebook functions, and its interpreter's idle native-only thread.
PAUSED_UNDER_TWO_CELLS = """Thread 14526 (idle): "MainThread"
    pause (libc.so.6)
    ffi_call (libffi.so.8.1.2)
    _call_function_pointer (callproc.c:943)
    _ctypes_callproc (callproc.c:1262)
    PyCFuncPtr_call (_ctypes.c:4201)
    wait_in_native_code (Cell In[3]:3)
    inner (Cell In[4]:4)
    <module> (Cell In[4]:5)
Thread 14536 (idle)
    pthread_cond_timedwait (libc.so.6)
    thread_run (libpython3.11.so.1.0)
"""


def test_a_native_dump_leads_with_the_cells_frames_and_folds_the_native_ones():
    from accel_magics.kernel_ext.supervisor.native_text import readable
    sources = {"Cell In[3]": "import ctypes\ndef wait_in_native_code():\n    ctypes.PyDLL(None).pause()\n",
               "Cell In[4]": "import time\ndef inner():\n    x = 1\n    wait_in_native_code()\ninner()\n"}
    assert readable(PAUSED_UNDER_TWO_CELLS, sources) == (
        "the cell's thread:\n"
        '  File "Cell In[3]", line 3, in wait_in_native_code\n'
        "    ctypes.PyDLL(None).pause()\n"
        '  File "Cell In[4]", line 4, in inner\n'
        "    wait_in_native_code()\n"
        '  File "Cell In[4]", line 5, in <module>\n'
        "    inner()\n"
        "  ... 5 native frames (innermost: pause in libc.so.6)\n"
        "(+ 1 other thread in native code only)\n")


def test_the_cells_thread_comes_first_and_a_collective_is_named_in_the_fold():
    from accel_magics.kernel_ext.supervisor.native_text import readable
    pin_first = IN_A_COLLECTIVE.split("Thread 2470")[1]
    dump = "Thread 2470" + pin_first + "    worker (torch/utils/data/_utils/pin_memory.py:52)\n" + \
        IN_A_COLLECTIVE.split("Thread 2470")[0]
    shown = readable(dump).splitlines()
    assert shown[0] == "the cell's thread:"
    assert shown[1] == '  File "torch/distributed/distributed_c10d.py", line 3252, in all_reduce'
    assert shown[2] == '  File "<%%distributed In[6]>", line 5, in <module>'
    assert shown[3] == ("  ... 5 native frames (innermost: pthread_cond_wait in libc.so.6; "
                        "waiting in c10d::Work::wait in libtorch_cpu.so)")
    # a library's thread: one line, as the stop button's stacks say it
    assert shown[4:] == ["(+ 1 other thread in no notebook cell: _utils/pin_memory.py worker)"]
    with_a_cell = dump.replace("worker (torch/utils/data/_utils/pin_memory.py:52)", "loop (Cell In[2]:3)")
    shown = readable(with_a_cell).splitlines()
    assert shown[4:] == ['thread "Thread-1 (pin_memory)":', '  File "Cell In[2]", line 3, in loop',
                         "  ... 1 native frame (innermost: pthread_cond_wait in libc.so.6)"]


def test_a_dump_with_no_thread_title_is_still_read():
    from accel_magics.kernel_ext.supervisor.native_text import readable
    assert readable("    clock_nanosleep (libc.so.6)\n    <module> (Cell In[2]:1)\n") == (
        "the cell's thread:\n  File \"Cell In[2]\", line 1, in <module>\n"
        "  ... 1 native frame (innermost: clock_nanosleep in libc.so.6)\n")


def test_a_dump_with_no_python_frame_is_shown_as_it_came():
    """gdb's dump (no py-spy) names no Python frame: nothing to lead with, and
    folding would hide every frame it has."""
    from accel_magics.kernel_ext.supervisor.native_text import readable
    gdb = ("Thread 1 (Thread 0x7f3c1a2b3740 (LWP 4242) \"python\"):\n"
           "#0  0x00007f3c1a4e5c3f in __GI___clock_nanosleep () from /lib/x86_64-linux-gnu/libc.so.6\n"
           "#1  0x000055d1c0a1b2c3 in pysleep () at ./Modules/timemodule.c:2159\n")
    assert readable(gdb) == gdb
