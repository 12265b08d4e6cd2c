"""Runs in a rank: a heartbeat that says the rank's interpreter can still run
Python, and that writes the rank's stacks when its supervisor asks.

Why: the supervisor's stall check must tell a rank that merely waits from one
that nothing can move.  A rank that sleeps, waits for a subprocess or for a
socket has released the GIL, so this thread goes on counting; a rank where a
thread holds the GIL and blocks in native code (the deadlocked destructor of
pytorch#56297) stops it, because the count needs the GIL.  The count lives in
a page of shared memory the supervisor mapped before it forked the rank
(:func:`new_counter`), so reading it costs the supervisor nothing and the
rank no system call.

The same thread writes the stacks a stop asks for (:func:`ask`, a byte on a
pipe), because it holds the GIL while it does.  faulthandler's own signal
handler (``faulthandler.register``) reads every thread's frames from
whichever thread the signal lands on, while the others run: a thread that
starts or ends, or pushes a frame, under it crashes the rank with SIGSEGV
(cpython#116008, every version; a DDP session lost to the stop button on
CI).  Under the GIL no other thread runs Python, so the frames hold still.
Only when this thread cannot get the GIL (a thread holds it in native code,
so nothing moves) does the supervisor fall back to the signal.
"""
from __future__ import annotations

import _thread
import collections
import ctypes
import faulthandler
import mmap
import os
import select
import struct
import sys
import time
from typing import Callable, Optional

from ..timing import BEAT_INTERVAL, MAIN_FRAME_POLL, STACK_LOCK_WAIT

_FORMAT = "<Q"
_BEATS, _DUMPS = 0, 8   # the page's two counts: beats, and stack dumps begun


def new_counter() -> mmap.mmap:
    """A shared anonymous page (MAP_SHARED): mapped before the fork, it is the
    same memory in the supervisor and the rank."""
    return mmap.mmap(-1, 2 * struct.calcsize(_FORMAT))


def read(counter: mmap.mmap) -> int:
    """Its beats (0: the heartbeat has not started)."""
    return struct.unpack_from(_FORMAT, counter, _BEATS)[0]


def dumps(counter: mmap.mmap) -> int:
    """The stack dumps it began (each when it held the GIL and the pipe was ours)."""
    return struct.unpack_from(_FORMAT, counter, _DUMPS)[0]


def ask(fd: int) -> bool:
    """In the supervisor: ask the rank for its stacks (``fd``: the write end of
    its ask pipe).  False if its end is closed: it is gone."""
    try:
        os.write(fd, b"s")
        return True
    except (BlockingIOError, InterruptedError):   # the rank has not read the asks before: one is enough
        return True
    except OSError:
        return False


#: The lines around each dump the heartbeat thread writes (never a line of
#: faulthandler's).  A rank's stack pipe can hold more than one dump (the
#: fallback signal's, then the heartbeat's once the GIL came free; a later
#: ask's), and a thread id can repeat inside one dump (a thread that ended
#: and a new one on the same pthread id, both still listed), so only these
#: marks tell where a dump ends (``supervisor.rank_process.first_dump``).
DUMP_BEGIN = "-- accel_magics: every thread's stack --"
DUMP_END = "-- accel_magics: end of the stacks --"
#: Inside a marked dump, after faulthandler's part: the main thread (the
#: cell's) once more, whole.  faulthandler lists at most 100 threads, newest
#: first, so a cell with more loses the oldest, its own, and at most 100
#: frames of a thread, so a deep recursion loses the cell's own line.
DUMP_MAIN = "-- accel_magics: the cell's thread --"
_MAIN_EDGE = 50   # frames kept at each end of a longer main-thread stack

_main_ident: Optional[int] = None   # the rank's main thread, which runs the cell
#: Called once a beat, with the GIL (startup.Watcher: what the cell is busy with); never blocks.
on_beat: Optional[Callable[[], None]] = None
_current_frames = sys._current_frames   # taken now: a cell that replaces sys's does not change the dump
try:   # see _write_holding_gil
    _libc_write = ctypes.PyDLL(None, use_errno=True).write
    _libc_write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    _libc_write.restype = ctypes.c_ssize_t
except (OSError, AttributeError):  # pragma: no cover - a static build: os.write, which lets the GIL go
    _libc_write = None

# The rank's stack pipe while the rank may write to it; None once it is closed
# (an fd closed and reused must never get a dump), under _stack_lock.
_stack_fd: Optional[int] = None
_stack_pipe: Optional[tuple] = None   # its identity (_identity)
_stack_lock = _thread.allocate_lock()


def stop_dumps() -> None:
    """In the rank, before it closes its stack pipe: no dump after this."""
    global _stack_fd
    if _stack_lock.acquire(timeout=STACK_LOCK_WAIT):   # a dump in progress ends first
        _stack_fd = None
        _stack_lock.release()
    else:   # pragma: no cover - a fork taken mid-dump holds a copy of the lock
        _stack_fd = None


def unsupported() -> Optional[str]:
    """The ``heartbeat`` hook's guard."""
    for module, name in ((sys, "_current_frames"), (faulthandler, "dump_traceback"), (_thread, "start_new_thread")):
        if not hasattr(module, name):
            return f"{module.__name__}.{name} is missing"
    return None


def install(counter, ask_fd: Optional[int] = None, stack_fd: Optional[int] = None) -> bool:
    """The ``heartbeat`` hook: :func:`start`, unless it is off or cannot work here.
    Without it the stall check cannot tell a GIL deadlock from a wait (a rank
    is judged by its native stack alone) and stacks come by signal only."""
    from .. import hooks

    return hooks.install("heartbeat", lambda: start(counter, ask_fd, stack_fd), guard=unsupported)


def start(counter, ask_fd: Optional[int] = None, stack_fd: Optional[int] = None) -> None:
    """In the rank, once its run is known: count while the interpreter runs.
    A thread of ``_thread``'s, not ``threading``'s: it is not the user's, so
    it is not in ``threading.enumerate()`` (code that joins every thread but
    its own would wait for it for ever); it never keeps the rank from
    exiting, and a process the rank forks (a DataLoader worker) has no copy
    of it.  The stacks the user reads leave it out by its frame (``_beat``).

    ``ask_fd``: the read end of the pipe the supervisor asks for stacks on;
    they go to ``stack_fd``, faulthandler's format."""
    global _stack_fd, _stack_pipe, _main_ident, _again, _again_pid
    if counter is None:
        return
    _main_ident = _thread.get_ident()
    _again, _again_pid = os.pipe(), os.getpid()
    for fd in _again:
        os.set_blocking(fd, False)
    if ask_fd is not None and stack_fd is not None:
        _stack_fd, _stack_pipe = stack_fd, _identity(stack_fd)
        os.set_blocking(ask_fd, False)   # a byte someone else took is no ask, not a wait
    else:
        ask_fd = None
    struct.pack_into(_FORMAT, counter, _BEATS, 1)   # the first beat before the thread runs: 0 means "not started"
    _thread.start_new_thread(_beat, (counter, ask_fd, _again[0]))


_again: Optional[tuple] = None   # the pipe interrupt_again wakes the heartbeat thread with
_again_pid = 0                   # ... of this process (a child the rank forked has a copy, not a heartbeat)
_again_if: Optional[Callable[[], bool]] = None   # the last ask's "is it still wanted?" (see interrupt_again)


_deferring: set = set()   # code objects: the main thread in one of them is not interrupted (see defer_in)


def defer_in(code) -> None:
    """Never run the re-asked interrupt while the main thread is in ``code``
    (the hook that asks: an interrupt raised there is dropped for good)."""
    _deferring.add(code)


def _interrupt_main_outside(codes: set, wanted: Optional[Callable[[], bool]], tries: int = 200) -> None:
    """``_thread.interrupt_main()``, once the main thread is in none of
    ``codes`` (looked at under the GIL, so it cannot move in between); a
    millisecond between looks, at most ``tries`` of them.  Not at all if
    ``wanted`` says the interrupt is no longer wanted, asked right before
    (the main thread moved on meanwhile: the interrupt would land in what
    came next)."""
    for _ in range(tries):
        frame = sys._current_frames().get(_main_ident)
        while frame is not None and frame.f_code not in codes:
            frame = frame.f_back
        if frame is None:
            break
        time.sleep(MAIN_FRAME_POLL)
    try:
        if wanted is not None and not wanted():
            return
    except Exception:   # pragma: no cover - the check is worker code; a broken one asks as before
        pass
    _thread.interrupt_main()


def interrupt_again(still_wanted: Optional[Callable[[], bool]] = None) -> bool:
    """The SIGINT handler run once more in the main thread, asked from the
    heartbeat thread: for a KeyboardInterrupt Python dropped (a fork handler,
    ``__del__``: see worker._unraisable_hook).  Asked from here, where the
    interrupt was dropped, the handler would run here again and be dropped
    again; the heartbeat thread gets the GIL only once the main thread lets
    go of it (a system call, the switch interval), by then past this place.
    The byte is written keeping the GIL for the same reason.

    ``still_wanted`` is called in the heartbeat thread under the GIL just
    before it interrupts: a session rank whose cell ended meanwhile (the
    interrupt was dropped in its last finalizer) must not carry it into the
    next cell.  Whether it was asked (not in a process without a heartbeat)."""
    global _again_if
    if _again is None or os.getpid() != _again_pid:
        return False
    _again_if = still_wanted
    try:
        _write_holding_gil(_again[1], b"i")
    except OSError:   # a full pipe: asked already
        pass
    return True


def _identity(fd: int) -> Optional[tuple]:
    """Which pipe ``fd`` is: a cell's code may close our fds (``os.closerange``)
    and open its own files on the same numbers, which we must never read or
    write."""
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    except OSError:
        return None


def _take(fd: int, pipe: Optional[tuple]) -> Optional[bytes]:
    """What waits on our pipe ``fd``: None if nothing after all; b"" if it is
    closed, or no longer ours (the cell's code closed or reused the number)."""
    try:
        return os.read(fd, 64) if _identity(fd) == pipe else b""
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _beat(counter, ask_fd: Optional[int], again_fd: int) -> None:
    n = 1
    ask_pipe = _identity(ask_fd) if ask_fd is not None else None
    again_pipe = _identity(again_fd)
    poller = select.poll()
    poller.register(again_fd, select.POLLIN)
    if ask_fd is not None:
        poller.register(ask_fd, select.POLLIN)
    while True:
        try:
            ready = {fd for fd, _ in poller.poll(BEAT_INTERVAL * 1000)}
        except (OSError, ValueError):   # pragma: no cover - poll itself failing: beat on, nothing asked
            ready = set()
            time.sleep(BEAT_INTERVAL)
        n += 1
        struct.pack_into(_FORMAT, counter, _BEATS, n)
        if on_beat is not None:
            try:
                on_beat()
            except Exception:   # pragma: no cover - never the end of the heartbeat
                pass
        if again_fd in ready:
            again = _take(again_fd, again_pipe)
            if again:
                _interrupt_main_outside(_deferring, _again_if)
            elif again == b"":   # the cell's code closed or reused it: no more of these
                poller.unregister(again_fd)
        asked = ask_fd is not None and ask_fd in ready
        if not asked:
            continue
        asks = _take(ask_fd, ask_pipe)
        if asks is None:
            continue
        if asks:
            try:
                _dump(counter)
            except Exception:   # pragma: no cover - never the end of the heartbeat
                pass
        else:   # the supervisor is gone, or the cell's code closed the pipe: beat on, ask no more
            poller.unregister(ask_fd)
            ask_fd = None


def main_stack() -> str:
    """The main thread's stack in faulthandler's format, innermost first; a
    stack deeper than ``2 * _MAIN_EDGE`` keeps both ends (the cell's own line
    is at the outer one).  Python code, run holding the GIL between
    bytecodes: the frames it walks are objects, safe to read while others run."""
    frame = _current_frames().get(_main_ident)
    inner: list[str] = []
    outer: collections.deque = collections.deque(maxlen=_MAIN_EDGE)   # memory bounded, however deep
    depth = 0
    while frame is not None:
        code = frame.f_code
        line = f'  File "{_one_line(code.co_filename)}", line {frame.f_lineno or 0} in {_one_line(code.co_name)}\n'
        (inner if depth < _MAIN_EDGE else outer).append(line)
        depth += 1
        frame = frame.f_back
    middle = depth - len(inner) - len(outer)
    lines = inner + ([f"  ... ({middle} frames)\n"] if middle else []) + list(outer)
    return _title(_main_ident) + ("".join(lines) or "  <no Python frame>\n")


def _one_line(text: str) -> str:
    """A name as one line of the dump (a file name may hold a newline)."""
    return text.replace("\n", "\\n").replace("\r", "\\r")


def _title(ident: Optional[int]) -> str:
    return f"Thread 0x{ident or 0:016x} (most recent call first):\n"


def _write_holding_gil(fd: int, data: bytes) -> None:
    """``os.write`` that keeps the GIL for the system call (a ``PyDLL`` call):
    the mark and faulthandler's dump after it then come in one hold of the
    GIL, but for the interpreter's switch check at the call's end, so a mark
    rarely waits for its dump (``RankProcess.dumped`` counts a mark alone as
    nothing).  Like faulthandler's own writes, it blocks only on a full
    pipe, which the supervisor drains."""
    written = _libc_write(fd, data, len(data)) if _libc_write is not None else 0
    if written < len(data):   # not at all (EINTR), or in part (a full pipe): the rest as usual
        os.write(fd, data[max(written, 0):])


def _dump(counter) -> None:
    """Every thread's stack to the stack pipe, faulthandler's format, under the
    GIL.  Counted first, a few bytecodes before the dump: the supervisor falls
    back to the signal only while the count stands still."""
    with _stack_lock:
        if _stack_fd is None or _identity(_stack_fd) != _stack_pipe:
            return
        struct.pack_into(_FORMAT, counter, _DUMPS, dumps(counter) + 1)
        try:
            _write_holding_gil(_stack_fd, f"{DUMP_BEGIN} {_main_ident or 0:#x}\n".encode())
            faulthandler.dump_traceback(file=_stack_fd, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass
        try:
            main = main_stack()
        except BaseException:   # a cell's audit hook (sys._current_frames is audited), a MemoryError
            main = ""
        try:
            os.write(_stack_fd, f"{DUMP_MAIN}\n{main}{DUMP_END}\n".encode("utf-8", "backslashreplace"))
        except (OSError, ValueError):
            pass
