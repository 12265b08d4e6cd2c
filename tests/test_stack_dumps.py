"""A stop's first step, the ranks' Python stacks, asked of a real forked
process the way a supervisor asks a rank (rank_process.RankProcess over the
rank's ask pipe, its heartbeat thread in rank/liveness.py dumping).

faulthandler's own signal handler crashes a process whose threads start,
end or push frames while it reads them (cpython#116008): a DDP session rank
died of SIGSEGV at the stop button on CI.  These tests hold the replacement
to what the signal did: a dump every time, whatever the threads do, and the
signal still used where nothing else can dump (a thread holding the GIL in
native code)."""
from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import re
import select
import signal
import threading
import time

import pytest

from accel_magics.kernel_ext.rank import liveness
from accel_magics.kernel_ext.supervisor.rank_process import (
    NO_STACK, RankProcess, first_dump, set_nonblocking, user_stack, where_blocked,
)
from accel_magics.kernel_ext.timing import STACK_ASK_WAIT

pytestmark = pytest.mark.timeout(90)


_IN_BODY = mmap.mmap(-1, 1)   # shared with the forked test process: 1 once the body's frame is on the stack


def _churn_and_recurse() -> None:
    """What crashed faulthandler's signal handler: threads that come and go
    while others push and pop frames and raise."""
    _IN_BODY[0] = 1
    def deep(n: int) -> int:
        if n % 7 == 0:
            try:
                raise ValueError(n)
            except ValueError:
                pass
        return n if n < 2 else deep(n - 1) + sum(x for x in range(2))

    def work(stop=lambda: False) -> None:
        while not stop():
            deep(40)

    def churn() -> None:
        while True:
            began = time.monotonic()
            t = threading.Thread(target=work, args=(lambda: time.monotonic() - began > 0.002,))
            t.start()
            t.join()

    for target in (work, churn):
        threading.Thread(target=target, daemon=True).start()
    work()


_IN_NATIVE = mmap.mmap(-1, 1)   # shared with the forked test process: 1 once it is about to block


def _hold_the_gil_in_native_code() -> None:
    pause = ctypes.PyDLL(None).pause   # PyDLL keeps the GIL: the deadlocked destructor's state
    _IN_NATIVE[0] = 1                  # no GIL release between this and the call
    while True:
        pause()                        # a signal's handler ends a pause


def _rank_like(body, in_body: bool = False) -> RankProcess:
    """A process set up as worker.wait_and_run sets up a rank: faulthandler on
    SIGUSR1 for the fallback, the heartbeat thread on the ask pipe.
    ``in_body``: returned only once ``body`` has marked itself running (a
    stack asked for before that has none of its frames)."""
    _IN_BODY[0] = 0
    st_r, st_w = os.pipe()
    ask_r, ask_w = os.pipe()
    set_nonblocking(ask_w)
    counter = liveness.new_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(st_r)
            os.close(ask_w)
            faulthandler.register(signal.SIGUSR1, file=st_w, all_threads=True, chain=False)
            liveness.start(counter, ask_r, st_w)
            body()
        finally:
            os._exit(0)
    os.close(st_w)
    os.close(ask_r)
    deadline = time.monotonic() + 20
    while liveness.read(counter) == 0 and time.monotonic() < deadline:   # set up: it has its spec
        time.sleep(0.005)
    assert liveness.read(counter) > 0, "the heartbeat never started"
    while in_body and _IN_BODY[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not in_body or _IN_BODY[0] == 1, "the body never started"
    return RankProcess(local=0, rank=0, pid=pid, fds={"st": st_r}, ask=ask_w, beat=counter)


def _end(r: RankProcess) -> None:
    r.release()
    os.close(r.fds["st"])
    if r.status is None:
        os.kill(r.pid, signal.SIGKILL)
        os.waitpid(r.pid, 0)


def _read_dumps(r: RankProcess, until: str, timeout: float = 20.0) -> str:
    """What the stack pipe brings until ``until`` is in it (a dump lists the
    main thread last, so its function's name marks a dump that is whole)."""
    text = ""
    deadline = time.monotonic() + timeout
    while until not in text and time.monotonic() < deadline:
        if select.select([r.fds["st"]], [], [], 0.5)[0]:
            data = os.read(r.fds["st"], 1 << 16)
            if not data:
                break
            text += data.decode("utf-8", "replace")
    return text


def _alive(r: RankProcess) -> bool:
    pid, status = os.waitpid(r.pid, os.WNOHANG)
    if pid:
        r.status = status
    return not pid


def _death(r: RankProcess) -> str:
    return f"killed by {signal.Signals(os.WTERMSIG(r.status)).name}" if os.WIFSIGNALED(r.status) \
        else f"exit {os.WEXITSTATUS(r.status)}"


def test_stacks_asked_of_a_rank_whose_threads_come_and_go_never_crash_it():
    r = _rank_like(_churn_and_recurse, in_body=True)
    try:
        r.ask_stacks(time.monotonic())
        first = _read_dumps(r, "_churn_and_recurse")
        assert "_churn_and_recurse" in first, first
        # A burst, as fast as the pipe takes them (faulthandler's signal
        # crashed this within 50 to 550 of them, at one every 0.5 ms).
        asked = 2000
        for _ in range(asked):
            liveness.ask(r.ask)
            while select.select([r.fds["st"]], [], [], 0)[0] and os.read(r.fds["st"], 1 << 16):
                pass
            time.sleep(0.0005)   # pacing the burst, not waiting for anything
        assert _alive(r), f"the rank died during {asked} asks: {_death(r)}"
        liveness.ask(r.ask)   # and it still answers
        last = _read_dumps(r, "_churn_and_recurse")
        assert "_churn_and_recurse" in last and " in work" in last, last
        assert signal.SIGUSR1 not in r.sent
    finally:
        _end(r)


def _start_threads_all_the_time() -> None:
    """Threads that do nothing but start threads (each a moment inside
    ``Thread.start()``), beside a main thread that works.

    The moment is from ``pthread_create`` to the new thread's first
    instruction, which takes the id; left to the scheduler it is a few
    microseconds, and on CI's machine (Python 3.13) 4998 dumps in 60 s never
    fell into it.  So every thread here shares one CPU, and the starters (and
    the threads they start, which inherit it) run as SCHED_IDLE, behind the
    main thread and the heartbeat: a new thread waits for its first
    instruction until the CPU is free of those two, and a dump taken
    meanwhile lists its maker's id twice."""
    cpu = min(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):   # the main thread and the heartbeat
        os.sched_setaffinity(int(tid), {cpu})

    def starter() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # this thread only
        except OSError:   # a sandbox that forbids the policy: the lowest priority instead
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()

    for _ in range(8):
        threading.Thread(target=starter, daemon=True).start()   # inherits the one CPU
    while True:
        sum(range(1000))


@pytest.mark.timeout(150)   # its waits: set-up 20 s, the asking 60 s, the last dump 20 s
def test_a_dump_taken_as_a_thread_starts_another_still_shows_the_cells_thread():
    """A thread inside ``Thread.start()`` is listed twice: itself, and the
    new thread's state, made ahead with its maker's id and no frame yet.
    That repeated id was read as the start of a second dump, so the dump was
    cut there and the cell's thread (listed last) was "(its code had not
    started)" after it had printed for seconds (a stop during a cell whose
    threads churn: 4 stops in 12 in a hostile run).  The heartbeat's marks
    now say where a dump ends."""
    r = _rank_like(_start_threads_all_the_time)
    twice = dumps = 0
    try:
        deadline = time.monotonic() + 60
        while (twice < 1 or dumps < 50) and time.monotonic() < deadline:
            liveness.ask(r.ask)
            text = _read_dumps(r, liveness.DUMP_END)
            assert text.count(liveness.DUMP_END) == 1, text
            dump, dumps = first_dump(text), dumps + 1
            listed = dump.partition(liveness.DUMP_MAIN)[0]   # faulthandler's list (the main thread comes after)
            ids = [re.search(r"0x[0-9a-f]+", line).group(0) for line in listed.splitlines()
                   if line.endswith("(most recent call first):")]
            twice += len(ids) != len(set(ids))
            assert "had not started" not in user_stack(text), text
            assert where_blocked(text) != NO_STACK and "_start_threads_all_the_time" in user_stack(text), text
        assert twice, f"no dump in {dumps} caught a thread starting another: nothing was tested"
    finally:
        _end(r)


_IN_RECURSION = mmap.mmap(-1, 1)   # shared with the forked test process: 1 once it is at its deepest


def _many_threads_then_deep() -> None:
    """A cell that started more threads than faulthandler lists (it stops
    at 100, newest first, so the oldest, the cell's own, was left out), then
    recursed deeper than the 100 frames it lists of a thread (the cell's own
    line, the outermost, was left out)."""
    done = threading.Event()
    for _ in range(150):
        threading.Thread(target=done.wait, daemon=True).start()

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        else:
            _IN_RECURSION[0] = 1   # at the bottom: a dump from now on shows every frame
            while True:
                time.sleep(0.001)

    _cells_own_line(deep)


def _cells_own_line(deep) -> None:
    deep(300)


@pytest.mark.timeout(150)   # its waits: set-up 20 s, the cell 60 s, the dump 25 s
def test_the_cells_thread_is_whole_past_100_threads_and_100_frames():
    # Asked once the cell is at its deepest, not over and over until then:
    # a rank asked without pause spends its time dumping 150 threads, and
    # on a loaded CI machine its threads started one in a second (CI on
    # record: 25 of 150 started in 20 s, so the dump showed Thread.start).
    _IN_RECURSION[0] = 0
    r = _rank_like(_many_threads_then_deep)
    try:
        deadline = time.monotonic() + 60
        while not _IN_RECURSION[0] and time.monotonic() < deadline:
            time.sleep(0.01)   # a poll with a deadline on the flag the cell sets
        assert _IN_RECURSION[0], "the cell did not start its 150 threads and recurse in 60 s"
        liveness.ask(r.ask)
        shown = user_stack(_read_dumps(r, liveness.DUMP_END, timeout=25))
        assert shown.startswith("the cell's thread:\n"), shown
        cells = shown.split("thread 0x")[0]
        assert " in deep" in cells and " in _cells_own_line" in cells and "frames)" in cells, cells
        assert "(+ more threads: faulthandler lists 100 at most)" in shown, shown
    finally:
        _end(r)


def _code_from_an_odd_file() -> None:
    exec(compile("def spin():\n    while True:\n        pass\nspin()\n", "odd\nname \udcff.py", "exec"), {})


def test_a_file_name_with_a_newline_or_undecodable_bytes_keeps_the_dump_whole():
    """A frame's file name is written as one line, its bytes escaped: the
    main thread's part and the end mark still come (a strict encode lost
    both, and a newline made a second "thread")."""
    r = _rank_like(_code_from_an_odd_file)
    try:
        text = ""
        deadline = time.monotonic() + 20
        while " in spin" not in text.partition(liveness.DUMP_MAIN)[2] and time.monotonic() < deadline:
            liveness.ask(r.ask)
            text = _read_dumps(r, liveness.DUMP_END)
        main = text.partition(liveness.DUMP_MAIN)[2]
        assert liveness.DUMP_END in main and re.search(r'File "odd\\nname \\udcff.py", line \d+ in spin', main), main
        shown = user_stack(text)
        assert re.match(r'the cell\'s thread:\n  File "odd\\nname \\udcff.py", line \d+, in spin', shown), shown
    finally:
        _end(r)


def test_a_rank_that_answers_gets_no_signal():
    """It began a dump (counted in the shared page), so the fallback never
    doubles it, even before the dump's bytes are read: the ask waits again,
    and ends once the dump is in."""
    r = _rank_like(_churn_and_recurse, in_body=True)
    try:
        r.ask_stacks(time.monotonic())
        assert r.asked_at is not None and signal.SIGUSR1 not in r.sent
        text = _read_dumps(r, liveness.DUMP_END)
        assert "_churn_and_recurse" in text
        assert liveness.dumps(r.beat) == r.asked_dumps + 1
        r.check_ask(r.asked_at + STACK_ASK_WAIT)   # nothing in r.stack yet: the count says wait
        assert r.asked_at is not None and signal.SIGUSR1 not in r.sent
        r.add_stack(text.encode())
        r.check_ask(r.asked_at + STACK_ASK_WAIT)
        assert r.asked_at is None and signal.SIGUSR1 not in r.sent
    finally:
        _end(r)


def test_a_rank_whose_gil_is_held_in_native_code_gets_the_signal():
    """Its heartbeat thread cannot take the GIL, so it cannot dump; nothing
    moves then, and faulthandler's signal is safe and shows where it is."""
    _IN_NATIVE[0] = 0
    r = _rank_like(_hold_the_gil_in_native_code)
    try:
        deadline = time.monotonic() + 20
        while not _IN_NATIVE[0] and time.monotonic() < deadline:
            time.sleep(0.005)
        asked = time.monotonic()
        r.ask_stacks(asked)
        assert signal.SIGUSR1 not in r.sent
        r.check_ask(asked + STACK_ASK_WAIT / 2)   # not yet
        assert signal.SIGUSR1 not in r.sent
        r.check_ask(asked + STACK_ASK_WAIT)
        assert signal.SIGUSR1 in r.sent
        assert "_hold_the_gil_in_native_code" in _read_dumps(r, "_hold_the_gil_in_native_code")
        assert _alive(r), _death(r)
    finally:
        _end(r)


def test_a_rank_whose_heartbeat_has_not_started_gets_the_signal_at_once():
    """Before its spec the rank is one thread, waiting: the signal is safe, and
    nothing else would answer."""
    st_r, st_w = os.pipe()
    ask_r, ask_w = os.pipe()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})   # as fork_idle_rank does
    pid = os.fork()
    if pid == 0:
        try:
            faulthandler.register(signal.SIGUSR1, file=st_w, all_threads=True, chain=False)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.read(ask_r, 1)   # waits, as an idle rank waits for its spec
        finally:
            os._exit(0)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(st_w)
    r = RankProcess(local=0, rank=0, pid=pid, fds={"st": st_r}, ask=ask_w, beat=liveness.new_counter())
    try:
        r.ask_stacks(time.monotonic())
        assert signal.SIGUSR1 in r.sent and r.asked_at is None
        assert "test_a_rank_whose_heartbeat_has_not_started" in _read_dumps(r, "test_a_rank_whose_heartbeat")
    finally:
        os.close(ask_r)
        _end(r)


def test_a_rank_whose_code_closed_the_stack_pipe_and_reused_its_number_gets_no_dump_in_its_file(tmp_path):
    """``os.closerange`` in a cell, then a file of its own on the same number:
    the heartbeat thread checks which pipe the number is before it writes."""
    path = tmp_path / "own.txt"
    st_r, st_w = os.pipe()
    ask_r, ask_w = os.pipe()
    counter = liveness.new_counter()
    written = mmap.mmap(-1, 1)
    pid = os.fork()
    if pid == 0:
        try:
            liveness.start(counter, ask_r, st_w)
            os.close(st_w)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            assert fd == st_w, (fd, st_w)   # the lowest free number: the pipe's
            os.write(fd, b"its own data\n")
            written[0] = 1
            while True:
                time.sleep(1)
        finally:
            os._exit(0)
    os.close(st_w)
    os.close(ask_r)
    r = RankProcess(local=0, rank=0, pid=pid, fds={"st": st_r}, ask=ask_w, beat=counter)
    try:
        deadline = time.monotonic() + 20
        while not written[0] and time.monotonic() < deadline:
            time.sleep(0.005)
        for _ in range(3):
            r.ask_stacks(time.monotonic())
        before = liveness.read(counter)
        # Two beats after the asks: a whole turn of its loop began after them, so it took them.
        while liveness.read(counter) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert liveness.read(counter) >= before + 2
        # It beats but began no dump: not a rank where nothing runs, so no
        # signal (faulthandler's handler would write into the file).
        r.check_ask(r.asked_at + STACK_ASK_WAIT)
        assert signal.SIGUSR1 not in r.sent and r.asked_at is not None   # waits on, until the stop's end
        assert path.read_bytes() == b"its own data\n"
        assert _alive(r), _death(r)
    finally:
        _end(r)
