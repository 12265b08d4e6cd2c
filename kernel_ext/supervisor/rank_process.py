"""One rank as the supervisor sees it: a forked process, its pipes, its signals.

The supervisor forks each rank ahead of the run (:func:`fork_idle_rank`): the
rank blocks on its "go" pipe until the spec arrives, and writes to three
pipes the supervisor reads: merged stdout/stderr ("out"), framed events
("ev") and stack dumps ("st", faulthandler's format).  :class:`RankProcess` holds those
fds and what the supervisor learnt about the rank; signalling a rank and
finding processes that escaped it are here too, so that the supervisor
itself only decides *when*.
"""
from __future__ import annotations

import fcntl
import linecache
import os
import re
import signal
import sysconfig
from dataclasses import dataclass, field
from typing import NoReturn, Optional

from .. import PACKAGE_DIR, wire
from ..rank import liveness, worker
from . import native_text
from .output_batch import Excerpt, OutputBatch
from ..process_tree import descendants
from ..timing import STACK_ASK_WAIT

PIPE_BYTES = 1 << 20      # a rank's output pipe (see widen_pipe)


@dataclass
class RankProcess:
    local: int
    rank: int
    pid: int
    fds: dict = field(default_factory=dict)   # "out"/"ev"/"st" -> read fd
    output: OutputBatch = field(default_factory=OutputBatch)
    excerpt: Optional[Excerpt] = None  # None: the kernel is sent every line
    frames: wire.FrameBuffer = field(default_factory=wire.FrameBuffer)
    stack: bytearray = field(default_factory=bytearray)
    stack_time: float = 0.0
    status: Optional[int] = None       # waitpid status once exited
    exit_time: float = 0.0
    signalled: bool = False            # the supervisor sent it a stopping signal
    sent: set = field(default_factory=set)   # which signals (a death by another is not its stop)
    failed: bool = False               # it reported a failure of its own
    done: bool = False                 # it reported its result (it exits with 0 right after)
    reported: bool = False
    native: str = ""                   # its native stack (py-spy) when a diagnosis was asked for
    done_time: float = 0.0             # when it reported its result
    last_output: float = 0.0           # when it last wrote to its output
    cpu_seen: Optional[float] = None   # CPU seconds at cpu_since (stall detection)
    cpu_since: float = 0.0
    beat: Optional[object] = None      # its interpreter's heartbeat counter (rank/liveness.py)
    beat_seen: int = -1                # the count at beat_since
    beat_since: float = 0.0
    go: Optional[int] = None           # write end of its go pipe: the spec goes in; closing it
                                       # lets a rank that succeeded (parked) exit
    ask: Optional[int] = None          # write end of its ask pipe: a byte asks for its stacks
    asked_at: Optional[float] = None   # when its stacks were asked for through it, unanswered yet
    asked_beat: int = 0                # its heartbeat count then
    asked_dumps: int = 0               # and the dumps it had begun
    asked_bytes: int = 0               # and the stack bytes come back
    skipping: bool = False             # the rest of an earlier ask's dump still comes (forget_stack)
    skipped: bytes = b""
    # A session's rank (session_supervisor): at its prompt, or running a cell.
    back: bool = True                  # at its prompt (the cell's outcome reported)
    ready: bool = False                # set up, waiting for its first cell
    stopped: bool = False              # brought back by the stop (KeyboardInterrupt), not failed
    reported_stack: bool = False       # its stack for this cell was sent
    in_cell: bool = False              # it said it began the current cell
    # A failed one-shot rank held for a post-mortem (rank/held.py, one_shot.py).
    held_until: Optional[float] = None   # held: until then, unless a post-mortem opens
    debugging: bool = False              # its post-mortem is open (no limit but the user's q)
    let_go_at: Optional[float] = None    # let go (EOF): SIGKILL if still there a grace later

    def stopped_by_us(self, sig: Optional[int]) -> bool:
        """Did it end because the supervisor stopped it?  Not when it died of a
        signal the supervisor never sent (a SIGKILL from elsewhere, a crash)
        after it was asked to stop: that death is its own, and a failure."""
        return self.signalled and not self.failed and (sig is None or sig in self.sent)

    def python_silent_for(self, now: float) -> float:
        """Seconds since its interpreter last ran Python (0.0: just now); call
        it at every stall check, which is when the count is compared."""
        if self.beat is None:
            return 0.0
        count = liveness.read(self.beat)
        if not count:   # no heartbeat (not started, or the hook is off): nothing to judge by
            return 0.0
        if count != self.beat_seen:
            self.beat_seen, self.beat_since = count, now
        return now - self.beat_since

    def release(self) -> None:
        """Close the go pipe (an idle or parked rank sees EOF and exits) and the
        ask pipe (nothing is asked of a rank that is let go)."""
        for name in ("go", "ask"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def ask_stacks(self, now: float) -> None:
        """A stop's first step: ask for its Python stacks.  Its heartbeat thread
        writes them, holding the GIL (rank/liveness.py says why not
        faulthandler's signal, which crashes a rank whose threads run); the
        signal only while that thread has not started (the rank is then one
        thread, waiting for its spec)."""
        self.signalled = True
        if self.ask is None or self.beat is None or not liveness.read(self.beat):
            if not self.stack:   # one signal's dump at most: it carries no marks (see first_dump)
                self.signal(signal.SIGUSR1)
            return
        self.asked_at, (self.asked_beat, self.asked_dumps, self.asked_bytes) = now, self._progress()
        if not liveness.ask(self.ask):   # its end is closed: it is gone, or its cell's code closed
            self.asked_at = None         # our fds, and a dump would go to a file of its own

    def _progress(self) -> tuple[int, int, int]:
        """What moves while a rank answers an ask: its beats, its dumps begun,
        the stack bytes come back."""
        return liveness.read(self.beat), liveness.dumps(self.beat), len(self.stack)

    def dumped(self) -> bool:
        """Whether a dump came back: more than the heartbeat's mark alone
        (written just before faulthandler's dump; the GIL may change hands
        between the two, so a mark can wait for its dump)."""
        text = bytes(self.stack).strip()
        if not text:
            return False
        if b"\n" in text:
            return True
        return not _BEGIN.startswith(text[:len(_BEGIN)])

    def ask_due(self) -> Optional[float]:
        """When :meth:`check_ask` has to look (None: nothing asked)."""
        return None if self.asked_at is None else self.asked_at + STACK_ASK_WAIT

    def check_ask(self, now: float) -> None:
        """``STACK_ASK_WAIT`` after the ask, no dump come back: if its
        heartbeat thread has not beaten either, it cannot take the GIL, so a
        thread holds it in native code (the deadlocked destructor).  Nothing
        moves then, so faulthandler's signal is safe, and it is the only way
        to the stacks.  A rank that beat, began a dump (its count) or sent
        bytes meanwhile gets another wait: the signal is for a rank where
        nothing runs.  That includes one whose heartbeat wrote its mark and
        then lost the GIL for good before the dump."""
        due = self.ask_due()
        if due is None or now < due:
            return
        if self.status is not None or self.dumped():
            self.asked_at = None
            return
        seen = self._progress()
        if seen != (self.asked_beat, self.asked_dumps, self.asked_bytes):
            self.asked_at, (self.asked_beat, self.asked_dumps, self.asked_bytes) = now, seen
            return
        self.asked_at = None
        self.signal(signal.SIGUSR1)

    def forget_stack(self) -> None:
        """A new ask of a session's recall: what is left of the last dump is
        not this ask's.  If that dump is still coming (its mark came, its end
        not yet), its rest is skipped (:meth:`add_stack`)."""
        text = bytes(self.stack)
        self.skipping = text.rfind(_BEGIN) > text.rfind(_END) or (self.skipping and _END not in text)
        self.stack = bytearray()

    def add_stack(self, data: bytes) -> None:
        """Bytes from the stack pipe."""
        if self.skipping:
            data = self.skipped + data
            end = data.find(_END)
            if end < 0:
                self.skipped = data[-len(_END):]   # the end mark may come split
                return
            self.skipping, self.skipped, data = False, b"", data[end + len(_END):]
        self.stack += data

    def signal(self, sig: int) -> None:
        """The rank process alone (SIGUSR1: dump stacks)."""
        self.signalled = True
        self.sent.add(sig)
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def signal_group(self, sig: int) -> None:
        """The rank and everything it started (stop, kill): by pid, the rank and
        its descendants (a process the rank started can leave its process
        group; the rank itself cannot, it leads its session), and by group,
        what is in the rank's process group."""
        if self.status is None:
            self.signalled = True
            self.sent.add(sig)
        for pid in [self.pid, *descendants(self.pid)]:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def widen_pipe(fd: int) -> None:
    """Give a rank's output pipe 1 MB instead of 64 KB (Linux's unprivileged maximum).

    A rank printing in a flood then rarely waits for the supervisor to drain
    the pipe, and the supervisor reads it in fewer, larger pieces.
    """
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:   # a lower limit here (/proc/sys/fs/pipe-max-size): keep the default
        pass


def set_nonblocking(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)


def fork_idle_rank(local: int, close_in_child: list[int], blocked_signals: set) -> RankProcess:
    """Fork a rank that waits for its spec; returns it with its read ends non-blocking.

    ``close_in_child``: the supervisor's fds (and other ranks' pipe ends) the
    rank must not hold.  ``blocked_signals`` stay blocked across the fork so
    the child cannot run the supervisor's handlers before it resets them.
    """
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    widen_pipe(out_w)
    ev_r, ev_w = os.pipe()
    st_r, st_w = os.pipe()
    ask_r, ask_w = os.pipe()
    set_nonblocking(ask_w)
    beat = liveness.new_counter()
    parent = os.getpid()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, blocked_signals)
    pid = os.fork()
    if pid == 0:  # the rank
        _become_rank(close_in_child + [go_w, out_r, ev_r, st_r, ask_w], go_r, local, out_w, ev_w, st_w, ask_r,
                     parent, beat)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    for fd in (go_r, out_w, ev_w, st_w, ask_r):
        os.close(fd)
    rank = RankProcess(local=local, rank=-1, pid=pid, fds={"out": out_r, "ev": ev_r, "st": st_r}, go=go_w,
                       ask=ask_w, beat=beat)
    for fd in rank.fds.values():
        set_nonblocking(fd)
    return rank


def _become_rank(close: list[int], go_r: int, local: int, out_w: int, ev_w: int, st_w: int, ask_r: int,
                 parent: int, beat) -> NoReturn:
    signal.set_wakeup_fd(-1)
    for fd in close:
        try:
            os.close(fd)
        except OSError:
            pass
    worker.wait_and_run(go_r, local, out_w, ev_w, st_w, parent, beat, ask_r)


# The launcher's frames below the cell: ours, and runpy's (``python -m``; a
# frozen module from Python 3.11, a file before).
_OWN_FRAMES = (f'File "{PACKAGE_DIR}{os.sep}', 'File "<frozen runpy>"',
               f'File "{os.path.join(os.path.dirname(os.__file__), "runpy.py")}"')


#: The rank's heartbeat thread (rank/liveness.py) is known by its loop's frame.
_HEARTBEAT_FRAME = re.compile(r'File ".*%s", line \d+ in _?beat$' % re.escape(os.sep + os.path.join("rank", "liveness.py")))
_NO_FRAME = "<no Python frame>"
_THREAD_ID = re.compile(r"0x[0-9a-fA-F]+")
_UNKNOWN = "?"   # the cell's thread, where a dump lost it (see _threads)
_UNKNOWN_CUT = "?cut"   # ... in a thread list that faulthandler cut at 100
_BEGIN, _END = liveness.DUMP_BEGIN.encode(), liveness.DUMP_END.encode()
_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_TB_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)$')   # a traceback's
_INSTALLED = tuple({os.path.join(p, "") for p in (sysconfig.get_paths().get(k) for k in
                   ("stdlib", "platstdlib", "purelib", "platlib")) if p})


def _is_library(filename: str) -> bool:
    return filename.startswith(_INSTALLED) or "site-packages" in filename or filename.startswith("<frozen")


def first_dump(text: str) -> str:
    """The first dump in a rank's stack pipe: where it was when the stop asked."""
    return _first(text)[0]


def _first(text: str) -> tuple[str, Optional[int]]:
    """The first dump, and the main thread's id where its mark says it.

    The heartbeat thread marks each of its dumps (``liveness.DUMP_BEGIN`` ..
    ``DUMP_END``); faulthandler's signal, the fallback, cannot, and is sent
    only while nothing came back yet, so its dump is whatever precedes the
    first mark.  A rank whose GIL came free after that signal answers the
    ask too: that second dump is left out.  What is left of an earlier ask's
    dump (after its main-thread mark or its end mark) is not this one's."""
    head, begun, rest = text.partition(liveness.DUMP_BEGIN)
    if liveness.DUMP_END in head:
        head = head.rpartition(liveness.DUMP_END)[2]
    elif liveness.DUMP_MAIN in head:
        head = ""
    if head.strip() or not begun:
        return head, None
    mark, _, body = rest.partition("\n")
    ident = _THREAD_ID.search(mark)
    return body.partition(liveness.DUMP_END)[0], int(ident.group(0), 16) if ident else None


def _blocks(text: str) -> tuple[list[tuple[str, list]], set[int], bool]:
    """A faulthandler dump's threads in its order as [(title, frames)], which
    of them are the heartbeat thread, and whether the list was cut (a
    "..." where faulthandler stops, after 100 threads)."""
    threads: list[tuple[str, list]] = []
    heartbeat: set[int] = set()
    cut = False
    for line in text.split("\n"):   # only faulthandler's line ends: a name may hold a \f or \u2028
        stripped = line.strip()
        if not stripped:
            continue
        if line == "...":
            cut = True
            continue
        if stripped.endswith("(most recent call first):"):
            threads.append((stripped, []))
            continue
        if not threads:
            threads.append(("", []))
        if _HEARTBEAT_FRAME.search(stripped):
            heartbeat.add(len(threads) - 1)
        if stripped == _NO_FRAME:
            continue
        m = _FRAME.match(line)
        frame = m.groupdict() if m else {"raw": stripped}
        frame["own"] = stripped.startswith(_OWN_FRAMES)
        threads[-1][1].append(frame)
    return threads, heartbeat, cut


def _ident(title: str) -> Optional[int]:
    """The thread id in a title ("Thread 0x00007f... (most recent call first):")."""
    found = _THREAD_ID.search(title)
    return int(found.group(0), 16) if found else None


def _threads(text: str) -> list[tuple[str, list]]:
    """:func:`_parse`'s threads."""
    return _parse(text)[0]


def _parse(text: str) -> tuple[list[tuple[str, list]], bool]:
    """A rank's stack dump as [(title, frames)], the cell's thread last, and
    whether faulthandler cut its thread list (it lists 100).

    The cell runs in the rank's main thread.  The heartbeat thread's dump
    ends with that thread once more, whole (``liveness.DUMP_MAIN``):
    faulthandler's list may have lost it (over 100 threads) or its outer
    frames (over 100 of them); without that part, its mark names the main
    thread.  The signal's dump has it last (faulthandler lists the newest
    first) unless the list was cut: then the cell's thread is
    :data:`_UNKNOWN`.  "Current thread" is the thread that wrote the dump,
    so it says nothing about the cell.  A thread id may come twice in one
    dump (a thread in ``Thread.start()`` and the new thread's state, made
    with its maker's id).  Left out: the heartbeat thread, threads with no
    Python frame (one just starting or ending, or native), accel_magics' own
    frames, and in the main thread whatever our code called outside the cell
    (a stop as the rank begins: the launcher's frames and the stdlib they
    called)."""
    dump, main_id = _first(text)
    listed, has_main, main = dump.partition(liveness.DUMP_MAIN)
    threads, heartbeat, cut = _blocks(listed)
    named = [t for i, t in enumerate(threads) if i not in heartbeat]
    named = _cell_thread_last(named, _blocks(main)[0][-1:] if has_main else [], main_id, cut)
    if not named:
        return [], cut
    title, frames = named[-1]
    users = [i for i, f in enumerate(frames) if not f["own"] and ("raw" in f or not _is_library(f["file"]))]
    if any(f["own"] for f in frames):   # a rank: the cell's frames end at its outermost one
        frames = frames[:users[-1] + 1] if users else []
    others = [(t, [f for f in fs if not f["own"]]) for t, fs in named[:-1]]
    return [t for t in others if t[1]] + [(title, [f for f in frames if not f["own"]])], cut


def _cell_thread_last(named: list, main_thread: list, main_id: Optional[int], cut: bool) -> list:
    """``named`` with the cell's (main) thread last: ``main_thread`` (the
    heartbeat thread's whole copy of it, if any), else the listed thread of
    ``main_id``, else :data:`_UNKNOWN` (or :data:`_UNKNOWN_CUT`)."""
    if main_thread:
        main_id = _ident(main_thread[0][0])
    elif main_id is not None:
        main_thread = [t for t in named if _ident(t[0]) == main_id][-1:] or [(_UNKNOWN_CUT if cut else _UNKNOWN, [])]
    elif cut:
        main_thread = [(_UNKNOWN_CUT, [])]
    if main_thread:
        named = [t for t in named if main_id is None or _ident(t[0]) != main_id] + main_thread
    return named


def stacks_message(r: "RankProcess", sources: dict) -> dict:
    """The one ``stacks`` message of a stopped rank (both supervisors send it):
    its stack as a person reads it (native frames when they were dumped) and
    where it was in a few words, for the line that says it was stopped."""
    raw = r.stack.decode("utf-8", "replace")
    text = native_text.readable(r.native, sources) if r.native else user_stack(raw, sources)
    where = where_blocked(raw) if raw.strip() else ""
    return {"kind": "stacks", "rank": r.rank, "text": text, "native": bool(r.native),
            "where": "" if where == NO_STACK else where}


def user_stack(text: str, sources: Optional[dict] = None) -> str:
    """A faulthandler dump as a person reads it: the thread that ran the cell
    first, with the source line of each frame (the cells' own text included),
    without the launcher's frames below the cell; threads that are only
    library code (tqdm's monitor, a DataLoader's pin thread) counted in one
    line instead of five frames each."""
    sources = sources or {}
    threads, cut = _parse(text)
    if not threads:
        return "the cell's thread: (no Python frame)\n"

    def source_line(frame: dict) -> str:
        if frame["file"] in sources:
            lines = sources[frame["file"]].splitlines()
            n = int(frame["line"])
            return lines[n - 1].strip() if 0 < n <= len(lines) else ""
        return linecache.getline(frame["file"], int(frame["line"])).strip()

    def render(frames: list) -> list[str]:
        out = []
        for frame in frames:
            if "raw" in frame:
                out.append(f"  {frame['raw']}")
                continue
            out.append(f'  File "{frame["file"]}", line {frame["line"]}, in {frame["func"]}')
            code = source_line(frame)
            if code:
                out.append(f"    {code}")
        return out

    main, others = threads[-1:], threads[:-1]
    busy = [t for t in others if any("raw" in f or not _is_library(f["file"]) for f in t[1])]
    idle = [t for t in others if t not in busy]
    out = []
    for title, frames in main:
        if title in (_UNKNOWN, _UNKNOWN_CUT):
            out.append("the cell's thread: (not in the dump" +
                       (": faulthandler lists 100 threads)" if title == _UNKNOWN_CUT else ")"))
            continue
        out.append("the cell's thread:" if frames else f"the cell's thread: {OUTSIDE_THE_CELL}")
        out.extend(render(frames))
    for title, frames in busy:
        out.append(title.replace("Thread", "thread", 1))
        out.extend(render(frames))
    if idle:
        def owner(frames: list) -> str:
            named = [f for f in frames if "file" in f and not f["file"].endswith("threading.py")] or frames
            f = named[0] if named else {"file": "?", "func": "?"}
            return f"{os.path.basename(os.path.dirname(f['file']))}/{os.path.basename(f['file'])} {f['func']}"
        where = sorted({owner(t[1]) for t in idle})
        out.append(f"(+ {len(idle)} other thread{'s' if len(idle) != 1 else ''} in library code only: "
                   f"{', '.join(where)})")
    if cut:
        out.append("(+ more threads: faulthandler lists 100 at most)")
    return "\n".join(out) + "\n"


NO_STACK = "a place it gave no stack for"
#: The cell's thread in accel_magics' own code: the stop came as the rank
#: began the cell, or as it reported how the cell ended.
OUTSIDE_THE_CELL = "(in accel_magics' own code: its code had not started, or had ended)"
_DECORATOR_FRAMES = {"wrapper", "inner", "_fn", "decorate_context", "wrapped"}


def where_blocked(text: str) -> str:
    """Where a faulthandler dump says the cell's thread is, in a few words:
    ``all_reduce (In[5] line 3)``: the innermost function that is not a
    decorator's wrapper, and the innermost line of the cell's own code."""
    if "Traceback (most recent call last):" in text:   # a session rank's KeyboardInterrupt, as it came back
        frames = [m.groupdict() for m in map(_TB_FRAME.match, text.splitlines())
                  if m and not m.group(0).strip().startswith(_OWN_FRAMES)][::-1]   # innermost first
    else:
        threads = _threads(text)
        frames = [f for f in threads[-1][1] if "raw" not in f] if threads else []
    if not frames:
        return NO_STACK
    named = next((f for f in frames if f["func"] not in _DECORATOR_FRAMES), frames[0])
    cell = next((f for f in frames if "In[" in f["file"]), None)
    if cell is None:
        return named["func"]
    label = f"{cell['file'].strip('<>').replace('%%distributed ', '')}, line {cell['line']}"
    return label if cell is named else f"{named['func']} ({label})"   # in the cell's own code: its line
