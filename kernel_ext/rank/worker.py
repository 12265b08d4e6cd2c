"""One rank: the code a freshly forked worker process runs, then exits.

The supervisor forks this process and calls :func:`run_rank`, which never
returns.  It makes the process look like a rank that torchrun started (its
own process group, the torchrun environment, fd-level stdout/stderr into the
supervisor's pipe, stdin from /dev/null), runs the cell, and reports the
outcome as one frame on its event pipe: the result (rank 0's last expression
and ``--return`` values) or the failure with the rank's own traceback and the
time it happened, which is how the root cause is told from the secondary
errors of ranks that were waiting for it.
"""
from __future__ import annotations

import ast
import ctypes
import faulthandler
import functools
import io
import itertools
import os
import pickle
import select
import signal
import stat
import sys
import threading
import time
import traceback
import types
from typing import NoReturn, Optional

import cloudpickle

from ..supervisor import native_stacks
from . import liveness, pg_guard
from .. import PACKAGE_DIR, hooks, process_tree
from . import bounded_traceback, held, rank_bars, script_end, startup
from .. import wire
from ..timing import PEERS_JOIN_WAIT
from .rank_stdio import RankStderr, RankStdout
from .rank_stdin import RankStdin
from ..wire.payload import Payload, cache_source

#: The event pipe of this rank while a rank runs in this process (None elsewhere).
_event_fd: Optional[int] = None
_local_rank: Optional[int] = None
#: The rank's own process.  A process the cell forks (os.fork) inherits the
#: event pipe; if it runs on through the cell it is not the rank: it reports
#: nothing (its prints still reach the rank's output, as in plain Python).
_rank_pid: Optional[int] = None
_idle_environ: Optional[dict] = None   # os.environ as the rank forked ahead had it, just before its spec came

PR_SET_PDEATHSIG = 1

# Errors a rank sees because *another* rank died: never the root cause.
_SECONDARY_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError"}
_SECONDARY_TEXT = (
    "Connection closed by peer",
    "Connection closed",
    "remote worker crashing",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
    "Socket Timeout",
    "failed to recv, got 0 bytes",
    "Connection refused",
)


def set_parent_death_signal(sig: int = signal.SIGKILL, expected_parent: Optional[int] = None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    If the parent died between the fork and this call, the signal would never
    come: then exit at once (``expected_parent`` is the pid before the fork).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        pass
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


_emit_lock = threading.Lock()   # frames from several threads (tqdm's monitor, the user's) never interleave


def emit(event: dict) -> bool:
    """Send an event frame from inside a rank; False outside a rank."""
    with _emit_lock:
        if _event_fd is None or os.getpid() != _rank_pid:
            return False
        wire.write_frame(_event_fd, event)
    return True


def emit_now(event: dict) -> bool:
    """:func:`emit`, or nothing when it would wait (another thread is
    sending, the pipe is full): for the heartbeat thread, which must not block."""
    if not _emit_lock.acquire(blocking=False):
        return False
    try:
        if _event_fd is None or os.getpid() != _rank_pid:
            return False
        poller = select.poll()
        poller.register(_event_fd, select.POLLOUT)
        if not poller.poll(0):
            return False
        wire.write_frame(_event_fd, event)
        return True
    finally:
        _emit_lock.release()


def _emit_last(event: dict) -> None:
    """The rank's final event (its result): everything it printed goes first, so
    the supervisor may end the rank's story there, even if a process the cell
    started still holds the rank's pipes (a daemon inherits them)."""
    rank_bars.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    emit(event)


def in_rank() -> bool:
    return _event_fd is not None


def is_secondary(exc_type: str, message: str) -> bool:
    return exc_type in _SECONDARY_TYPES or any(text in message for text in _SECONDARY_TEXT)


#: Notebook functions and classes that came from the kernel, by name (in a rank).
_kernel_definitions: dict = {}


def _kernel_main_attr(name: str):
    """In the kernel: one of its notebook definitions, by name."""
    return getattr(sys.modules["__main__"], name)


class _CpuPickler(cloudpickle.Pickler):
    """Pickles results with tensors moved to the CPU (and detached if needed),
    and the kernel's own notebook classes and functions by reference."""

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)):
            name = getattr(obj, "__name__", None)
            if isinstance(name, str) and _kernel_definitions.get(name) is obj:
                return _kernel_main_attr, (name,)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu" or (obj.requires_grad and not obj.is_leaf):
                return _identity, (obj.detach().cpu(),)
        return super().reducer_override(obj)


def _identity(x):
    return x


def dumps_result(value) -> bytes:
    buf = io.BytesIO()
    _CpuPickler(buf, protocol=5).dump(value)
    return buf.getvalue()


def _setup_stdio(out_fd: int) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    sys.stdin = RankStdin(emit, None)   # its go pipe once it runs (run_rank)
    # Live like a terminal, fast under a flood of prints (rank_stdio).
    sys.stdout = RankStdout(1)
    sys.stderr = RankStderr(2, sys.stdout)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
    try:  # C stdio: line-buffered too, so native printf output is live.
        libc = ctypes.CDLL(None)
        for name in ("stdout", "stderr"):
            stream = ctypes.c_void_p.in_dll(libc, name)
            libc.setvbuf(stream, None, 1, 0)  # _IOLBF
    except (OSError, ValueError, AttributeError):  # pragma: no cover
        pass


def _reset_signals(stack_fd: int) -> None:
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR2, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python does at start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A stop asks for stacks first, through the heartbeat thread (liveness.py);
    # the signal only reaches a rank whose thread cannot take the GIL.
    faulthandler.register(signal.SIGUSR1, file=stack_fd, all_threads=True, chain=False)


def _prepare_torch(env: dict, local_rank: int, gpu_count: int) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    if gpu_count and local_rank < gpu_count:
        torch.cuda.set_device(local_rank)


#: Where the cell's trailing expression leaves its value (taken out at once).
VALUE_NAME = "__accel_magics_value__"


def _compile_cell(source: str, filename: str):
    """Compile the cell as one code object, as a script is: (code, whether it
    ends in an expression whose value it leaves in ``VALUE_NAME``).  One code
    object, so pdb steps from a ``breakpoint()`` to the last line as in a
    script (evaluated apart, the last line was a frame of its own and pdb
    stopped at the body's return instead)."""
    tree = ast.parse(source, filename=filename, mode="exec")
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return compile(tree, filename, "exec"), False
    last = tree.body[-1]
    keep = ast.copy_location(ast.Assign(targets=[ast.Name(VALUE_NAME, ast.Store())], value=last.value), last)
    tree.body[-1] = ast.fix_missing_locations(keep)
    return compile(tree, filename, "exec"), True


def _warm_up() -> None:
    """While idle, walk the code paths a run takes, once, on a dummy cell.

    A forked rank pays a copy-on-write page fault for every page of the
    inherited heap it first writes to (reference counts are writes), so the
    first run through the interpreter's and our own code is slow.  Doing it
    before the spec arrives takes those faults off the next cell's critical
    path.  Nothing here is visible to the run.
    """
    try:
        blob = cloudpickle.dumps({"x": 1}, protocol=5)
        cloudpickle.loads(blob)
        body, _ = _compile_cell("x = 1\nx", "<warm-up>")
        ns = {"__builtins__": __builtins__}
        exec(body, ns)
        ns.pop(VALUE_NAME, None)
        pickle.loads(pickle.dumps({"kind": "result", "value": _pack_value(1), "returns": {}}))
        pickle.loads(pickle.dumps({"env": {"X": "1"}, "payload": Payload("", "<warm-up>", b"", [])}))   # a spec's shape
        _new_modules(_modules_mark())
        _in_world()           # what a result reports (torch.distributed's state, the world's rounds)
        pg_guard.rounds()
        traceback.format_exception(ValueError, ValueError("warm-up"), None)
    except Exception:
        pass


def wait_and_run(go_fd: int, local_rank: int, out_fd: int, event_fd: int, stack_fd: int,
                 parent: int, beat=None, ask_fd: Optional[int] = None) -> NoReturn:
    """A rank forked ahead of its run: wait for the spec, then run. Never returns.

    Until the spec arrives nothing of the run exists here: the environment,
    the payload and the rank's number all come with it.
    """
    global _idle_environ
    try:
        set_parent_death_signal(signal.SIGKILL, expected_parent=parent)
        native_stacks.allow_supervisor_to_trace(parent)
        # Its own session, as torchrun starts each rank (start_new_session):
        # with the kernel's autogroup scheduling (sched_autogroup_enabled)
        # each session is one scheduling group, so ranks in one session share
        # one group's CPU share with each other: DDP ran 0.93x torchrun in
        # one process group, 1.008x in sessions (bench A/B).  The session id
        # is the pid, so the rank's process group is still its pid.
        os.setsid()
        _reset_signals(stack_fd)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])   # blocked across the fork
        _setup_stdio(out_fd)
        _warm_up()
        _become_ready()
        # The heartbeat thread starts while idle, off the run's start; it
        # says nothing until the run's event pipe is this rank's (emit_now).
        beating = liveness.install(beat, ask_fd, stack_fd)
        _idle_environ = dict(os.environ)   # decoded now, not in the run (see _enter_rank)
        spec_bytes = wire.read_frame(go_fd)
        if spec_bytes is None:   # the run needed fewer ranks, or the supervisor is gone
            os._exit(0)
        spec = pickle.loads(spec_bytes)
        if beating:
            liveness.on_beat = startup.Watcher(emit_now, threading.get_ident())
    except BaseException:
        os._exit(1)
    run_rank(spec, local_rank, event_fd, stack_fd, go_fd)


def run_rank(spec: dict, local_rank: int, event_fd: int, stack_fd: int, release_fd: int) -> NoReturn:
    """Run the cell as one rank, report, and exit. Never returns.

    stdout/stderr are already the rank's pipe.  A rank that succeeded waits
    for EOF on ``release_fd`` (its go pipe) before it exits: see :func:`_park`.
    """
    global _event_fd, _local_rank, _rank_pid
    code = 1
    try:
        _event_fd, _local_rank, _rank_pid = event_fd, local_rank, os.getpid()
        if isinstance(sys.stdin, RankStdin):
            sys.stdin = sys.__stdin__ = RankStdin(emit, release_fd)   # answers come on the go pipe
        code = _serve_session(spec, local_rank, release_fd) if spec.get("session") else \
            _execute(spec, local_rank, release_fd)
    except BaseException as exc:  # the harness itself failed: say so, never hang
        try:
            emit(_failure(exc, exc.__traceback__, harness=True))
        except BaseException:
            pass
    finally:
        if os.getpid() != _rank_pid:   # a child the cell forked ran to the cell's end: it just exits
            _end_forked_child(code)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            # Close the outputs now: the supervisor sees the end of this rank
            # at once, not after the (slow) teardown of a large process.
            rank_bars.stop()
            with _emit_lock:
                _event_fd = None     # a thread still running writes no frame to a closed (or reused) fd
            liveness.stop_dumps()    # nor a stack dump
            faulthandler.unregister(signal.SIGUSR1)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)   # a late ask for stacks: nothing left to show
            for fd in (1, 2, event_fd, stack_fd):
                os.close(fd)
            if code == 0 and not _holds_sockets():
                _park(release_fd)
            elif code == 0:   # its peers may still be connecting to it: they finish that first
                pg_guard.wait_for_peers_joined(PEERS_JOIN_WAIT)
        finally:
            os._exit(code)


def _thread_excepthook(args) -> None:
    """An exception that ends a thread of the cell, printed as the main
    thread's are: with each frame's source line (the default hook, in C,
    reads files only, so the cell's and the notebook's lines were missing)."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    print(f"Exception in thread {name}:", file=sys.stderr)
    if args.exc_value is None:
        te = traceback.TracebackException(args.exc_type, args.exc_value, args.exc_traceback)
    else:
        te = bounded_traceback.exception(args.exc_value, args.exc_traceback, prune=_without_own_frames)
    sys.stderr.write("".join(te.format()))
    sys.stderr.flush()


def _in_forked_child(event: dict) -> bool:
    """Is this a process the cell forked, at its end of the cell?  Then it
    reports nothing (the rank does) and its error is printed, as Python would."""
    if os.getpid() == _rank_pid:
        return False
    if event["kind"] == "failed":
        sys.stderr.write(event.get("traceback", ""))
    return True


def _end_forked_child(code: int) -> NoReturn:
    """A process the cell forked that ran on to the cell's end (plain Python
    would run the rest of the script in it too): it flushes what it printed
    and exits, reporting nothing: the rank (its parent) reports the cell."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _park(release_fd: int) -> None:
    """A rank that succeeded: wait until the supervisor lets it exit.

    Its result and outputs are delivered already, so nobody waits for this
    process; but tearing down a torch-sized address space takes milliseconds
    and slows everything else on the machine (freeing pages, TLB flushes)
    while the kernel is still showing the result.  So the supervisor lets
    its ranks exit a moment after the run is reported (EOF on the go pipe,
    also when the supervisor dies).
    """
    try:
        os.read(release_fd, 1)
    except OSError:
        pass


def _holds_sockets() -> bool:
    """Whether this rank still has a socket open (a process group's connections,
    a store client): then it must not park, its peers would wait on it."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:   # pragma: no cover - no procfs: be safe, do not park
        return True
    for fd in fds:
        try:
            if stat.S_ISSOCK(os.fstat(int(fd)).st_mode):   # the listing's own descriptor: closed, skipped
                return True
        except (OSError, ValueError):
            continue
    return False


def _safe_str(prefix: str, exc: BaseException) -> str:
    """``prefix + str(exc)``, even for an exception whose ``__str__`` raises."""
    try:
        return prefix + str(exc)
    except BaseException as err:
        return prefix + f"<str() of the exception failed: {type(err).__name__}>"


def _failure(exc: BaseException, tb, harness: bool = False) -> dict:
    exc_type = type(exc).__name__
    message = _safe_str("", exc)
    if harness:
        text = "accel_magics could not start the rank:\n" + bounded_traceback.format_exception(exc, tb)
    else:   # bounded in time and size (a recursion a million frames deep): see bounded_traceback
        text = bounded_traceback.format_exception(exc, tb, prune=_without_own_frames)
    return {
        "kind": "failed",
        "exc_type": exc_type,
        "message": message,
        "traceback": text,
        "timestamp": time.time(),
        "secondary": is_secondary(exc_type, message),
    }


def _without_own_frames(te: traceback.TracebackException) -> traceback.TracebackException:
    """The user's traceback without accel_magics' frames between theirs (the
    guard around ``init_process_group``, a rank's stdin): the cell calls torch
    or reads input, it never called us.  Chained exceptions too."""
    own = os.path.join(PACKAGE_DIR, "")
    seen: set[int] = set()
    stack = [te]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        kept = [f for f in t.stack if not f.filename.startswith(own)]
        if kept and len(kept) != len(t.stack):
            t.stack = traceback.StackSummary.from_list(kept)
        stack.extend(x for x in (t.__cause__, t.__context__) if x is not None)
    return te


def _installed_roots() -> tuple[str, ...]:
    """Where installed code lives (the standard library, site-packages): code
    there does not change under the user, unlike modules next to a notebook
    or an editable install."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:   # pragma: no cover - a virtualenv's old site.py
        pass
    roots.discard(None)
    return tuple({os.path.join(form, "") for r in roots for form in (os.path.abspath(r), os.path.realpath(r))})


_INSTALLED = _installed_roots()


def preloadable(module) -> bool:
    """Whether the launcher may keep ``module`` imported for later runs: only
    installed code (stdlib, site-packages) and built-in modules.  A module the
    user can edit is imported afresh by every run, so a run never uses old code."""
    paths = [getattr(module, "__file__", None)] if getattr(module, "__file__", None) else \
        list(getattr(module, "__path__", []) or [])
    if not paths:
        return getattr(module, "__spec__", None) is not None and module.__spec__.origin in ("built-in", "frozen")
    return all(p.startswith(_INSTALLED) or os.path.realpath(p).startswith(_INSTALLED) for p in paths)


#: The modules the launcher had when it forked this process (set there,
#: after each preload: a lookup in it here writes no page).
_launcher_modules: frozenset = frozenset()
_MODULES_SLACK = 64   # names read back past the count, should the mark's last name be gone


def note_launcher_modules() -> None:
    """In the launcher, after each preload: what its ranks need not report."""
    global _launcher_modules
    _launcher_modules = frozenset(sys.modules)


def _modules_mark() -> tuple:
    """Where ``sys.modules`` ends now: its length and its last name.

    Not ``set(sys.modules)``: a walk over every name writes each name's
    reference count, and in a freshly forked rank that was about 700
    copy-on-write page faults (3.6 ms of CPU a rank, a cell), twice."""
    return len(sys.modules), next(reversed(sys.modules), None)


def _new_modules(mark: tuple) -> list[str]:
    """Installed modules this rank imported since ``mark`` that the launcher
    did not have: worth preloading.  ``sys.modules`` keeps insertion order,
    so they are its last entries: read back from its end to the name that
    was last at the mark (at most the growth and some slack, should that
    name be gone)."""
    count, last = mark
    # One C call (no bytecode runs, so no other thread imports meanwhile).
    tail = list(itertools.islice(reversed(sys.modules), max(0, len(sys.modules) - count) + _MODULES_SLACK))
    if last in tail:
        tail = tail[:tail.index(last)]
    return sorted(m for m in tail
                  if m not in _launcher_modules and not m.startswith(("__main__", "_distutils_hack"))
                  and sys.modules.get(m) is not None and preloadable(sys.modules[m]))


def _become_ready() -> None:
    """While idle, what makes this process a rank whatever its run: tqdm's
    bars as events, the hooks for its threads' and unraisable exceptions,
    the process-group guard, nothing inherited run at its end.

    None of it depends on the spec, and doing it before the spec arrives
    takes it (0.3-0.5 ms a rank, most of it walking the launcher's
    finalizers) off the cell's critical path; :func:`_enter_rank` does the
    rest once the spec is here.
    """
    pg_guard.install()   # normally done in the launcher already: then a no-op
    pg_guard.announce = emit
    rank_bars.install(emit)
    threading.excepthook = _thread_excepthook
    sys.unraisablehook = _unraisable_hook
    script_end.begin()


def _enter_rank(spec: dict, local_rank: int) -> types.ModuleType:
    """Become this run's rank (after :func:`_become_ready`): its environment,
    a fresh ``__main__``, torch set up.  Returns the ``__main__`` the cell runs in."""
    env = dict(spec["env"])
    env.update(spec["rank_env"][local_rank])
    marker = os.environ.get(process_tree.MARKER)
    if marker:   # kept, so processes the cell starts can be found and stopped with the run
        env[process_tree.MARKER] = marker
    # The kernel's environment, as a diff: it is mostly what this process
    # inherited already, and each change is a putenv.  A rank forked ahead
    # compares with the copy it decoded while idle (os.environ's own lookups
    # encode and decode every name).
    global _idle_environ
    current = _idle_environ if _idle_environ is not None else dict(os.environ)
    _idle_environ = None
    for name in [n for n in current if n not in env]:
        del os.environ[name]
    for name, value in env.items():
        if current.get(name) != value:
            os.environ[name] = value
    sys.argv = list(spec.get("argv") or [""])
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    _prepare_torch(env, local_rank, spec.get("gpu_count", 0))
    return main


_previous_unraisablehook = sys.unraisablehook


def _unraisable_hook(unraisable) -> None:
    """A KeyboardInterrupt Python could not raise is raised again, not dropped.

    Python runs some code where an exception cannot propagate: fork handlers
    (``os.register_at_fork``: logging's runs in the parent after every fork,
    and a DataLoader forks its workers every epoch), ``__del__``, weakref
    callbacks.  The stop's SIGINT handled there raised a KeyboardInterrupt
    that was printed as "Exception ignored" and dropped, and the loop ran on
    (a plain torch script: 4 stops in 60; a session lost its state).  So the
    interrupt is asked for again (:func:`liveness.interrupt_again`: the
    heartbeat thread runs the SIGINT handler once more, as soon as the main
    thread is past this place).  One that lands in such a place once more
    comes back here, until it lands where it can raise.

    In a session it is asked for this cell only: dropped in the cell's last
    finalizer, it is no longer wanted once the rank is back at its prompt or
    in the next cell (:func:`_still_in`).
    """
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        wanted = functools.partial(_still_in, _cell_id, _cell_begun)
        try:
            if liveness.interrupt_again(wanted):
                return
        except KeyboardInterrupt:   # another one (the second SIGINT) landed here: ask for it instead
            liveness.interrupt_again(wanted)
            return
    _previous_unraisablehook(unraisable)


def _still_in(cell_id: str, begun: bool) -> bool:
    """Is the rank still where an interrupt was dropped: the same session
    cell, not yet back at its prompt?  (A one-shot rank has one cell: its
    id and ``_cell_begun`` never change, so always.)"""
    return _cell_id == cell_id and _cell_begun == begun


liveness.defer_in(_unraisable_hook.__code__)


#: A session rank: True while it runs a cell's code (SIGINT raises there);
#: ``_cell_begun`` from reading a cell to reporting it (a SIGINT then is kept
#: in ``_interrupt_pending`` and raised as the cell's code starts).
_in_cell = False
_cell_begun = False
_interrupt_pending = False
_in_post_mortem = False   # a session rank in a post-mortem (_session_post_mortem)

# The stop in a session's training loop.  DDP ranks meet in an all-reduce every
# step; a KeyboardInterrupt that lands on one rank before the step's
# all-reduce, while its peer already waits in it, leaves the peer stuck for
# good.  So in a rank of a world of several ranks (a process group is up),
# the first SIGINT asks for a stop at an optimizer step every rank agrees on
# (the first rank to get there proposes its step + 2 in the process group's
# store, the others read it; DDP ranks are at most one step apart), raised
# right after that step.  A second SIGINT (the supervisor sends one when a
# rank is not back soon: no optimizer steps) raises at once.
_cell_id = ""
_steps = 0                  # optimizer steps in this cell
_stop_wanted = False        # a stop was asked for, at the agreed step
_stop_step: Optional[int] = None
_step_hook = None


def _run_cell(payload, ns: dict, reports_values: bool, session: bool = False) -> tuple[dict, int]:
    """Run one cell in ``ns``: (the event that reports it, the exit code a
    one-shot rank ends with).  The event is the result or the failure; in a
    session it also names what the cell bound and unbound in the namespace."""
    global _kernel_definitions, _in_cell
    before = _modules_mark()
    if payload.cwd:
        try:
            os.chdir(payload.cwd)
        except OSError:
            pass
    sys.path[:] = payload.sys_path or sys.path
    cache_source(payload.filename, payload.source)
    try:
        body, has_value = _compile_cell(payload.source, payload.filename)
        loaded = payload.load_into(ns)
    except BaseException as exc:   # e.g. a shipped value whose module this rank cannot import
        return _failure(exc, exc.__traceback__), 1
    # The kernel's own functions and classes, as they arrived: a result that
    # holds one goes back by reference, so the kernel gets its own class.
    _kernel_definitions = {name: ns[name] for name in loaded
                           if isinstance(ns[name], (type, types.FunctionType)) and ns[name].__module__ == "__main__"}
    ids = {name: id(value) for name, value in ns.items()} if session else None
    event: dict
    code = 0
    try:
        _in_cell = session
        try:
            if session and _interrupt_pending:
                raise KeyboardInterrupt   # stopped before its code began
            exec(body, ns)
        finally:
            _in_cell = False
            value = ns.pop(VALUE_NAME, None) if has_value else None
    except SystemExit as exc:
        event, code = _exit_event(exc)
        _hold(exc)
    except BaseException as exc:
        event, code = _failure(exc, exc.__traceback__.tb_next), 1
        _hold(exc)
        if session and isinstance(exc, KeyboardInterrupt):   # a stop: did it keep the ranks in step?
            event["in_world"] = _in_world()
            if getattr(exc, "accel_magics_agreed_step", None) is not None:
                event["agreed_step"] = exc.accel_magics_agreed_step
    else:
        event = {"kind": "result", "timestamp": time.time()}
        if reports_values:
            event.update(_values(value, ns, payload.return_names))
    if event["kind"] == "result":
        event["in_world"] = _in_world()   # a session's rank may have joined in an earlier cell
        event["rounds"] = pg_guard.rounds()   # of the world's init, this cell and earlier ones (fold.must_stop)
    if reports_values:
        event["new_modules"] = _new_modules(before)
    if ids is not None:
        event["assigned"] = sorted(name for name, value in ns.items()
                                   if ids.get(name) != id(value) and name != "__builtins__")
        event["deleted"] = sorted(name for name in ids if name not in ns)
        if os.environ.get("RANK") == "0":   # what each name is, for %distributed_session status (bounded)
            event["kinds"] = {name: describe(ns[name]) for name in event["assigned"][:200]}
    return event, code


def describe(value) -> tuple[str, Optional[int]]:
    """A name's type and the bytes it holds where that is cheap to know
    (tensors, arrays, a module's parameters and buffers, bytes and str); None
    otherwise.  Never raises: a value's own code is not trusted to."""
    try:
        kind = type(value)
        name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
        size = None
        if hasattr(value, "element_size") and hasattr(value, "nelement"):   # a torch tensor
            size = int(value.element_size() * value.nelement())
        elif hasattr(value, "nbytes") and isinstance(getattr(value, "nbytes"), int):   # numpy
            size = int(value.nbytes)
        elif hasattr(value, "parameters") and hasattr(value, "buffers") and callable(value.parameters):   # nn.Module
            size = sum(int(t.element_size() * t.nelement()) for t in (*value.parameters(), *value.buffers()))
        elif isinstance(value, (bytes, bytearray, str)):
            size = sys.getsizeof(value)
        return name, size
    except Exception:
        return "?", None


#: The exception that ended the cell, kept until the rank has reported it.
_held: Optional[BaseException] = None


def _hold(exc: BaseException) -> None:
    """Keep the cell's exception (its traceback, the frames in it, what they
    hold) until the rank has said how the cell ended (:func:`_release`).
    Dropped at the end of the ``except``, the frames' objects were finalized
    before the report: a DataLoader iterator's ``__del__`` joins its workers
    for up to 5 s each, so a stopped session rank, already out of the cell,
    was not back within the recall's wait and the session was lost (a
    hostile run: 1 stop in 40), and a one-shot rank's failure reached its
    peers that much later."""
    global _held
    _held = exc


def _release() -> None:
    """Let the cell's exception go, after its report (see :func:`_hold`): what
    its frames held is finalized now (a DataLoader's workers end here)."""
    global _held
    _held = None


def _exit_event(exc: SystemExit) -> tuple[dict, int]:
    """sys.exit() in a cell: 0 or None finishes it (a result with no value), else a failure."""
    if exc.code in (None, 0):
        return {"kind": "result", "exited": True, "timestamp": time.time()}, 0
    event = {
        "kind": "failed", "exc_type": "SystemExit", "message": f"sys.exit({exc.code!r})",
        "traceback": bounded_traceback.format_exception(exc, exc.__traceback__.tb_next),
        "timestamp": time.time(), "secondary": False,
    }
    return event, exc.code if isinstance(exc.code, int) and 0 < exc.code < 256 else 1


def _values(value, ns: dict, return_names) -> dict:
    """Rank 0's value and --return names, packed to travel (what is missing, named)."""
    returns, missing = {}, []
    for name in return_names:
        if name in ns:
            returns[name] = _pack_value(ns[name])
        else:
            missing.append(name)
    # The last expression is often a --return name (`losses` at the end): sent once, as that name.
    same = next((name for name in returns if ns[name] is value and "blob" in returns[name]), None)
    packed = None if value is None else {"same_as": same} if same is not None else _pack_value(value)
    return {"value": packed, "returns": returns, "missing": missing}


def _execute(spec: dict, local_rank: int, go_fd: Optional[int] = None) -> int:
    """Run the cell once, report it, and end as a script does; a failed
    rank of a run with a hold is held for a post-mortem first (held.py)."""
    main = _enter_rank(spec, local_rank)
    event, code = _run_cell(spec["payload"], main.__dict__, local_rank == 0)
    if _in_forked_child(event):
        return code
    if event["kind"] == "result":
        _release()         # sys.exit(0): its frames' objects finalized as the script's end begins
        script_end.end()   # the cell ends as a script does: its threads, then its atexit handlers
        _emit_last(event)
    else:
        rank_bars.flush()
        emit(event)        # the failure first: the run stops the other ranks at once
        if event["kind"] == "failed":   # frames alive until %distributed_debug, the next cell or the hold's end
            held.hold(_held, spec.get("debug_hold") or 0, go_fd, emit)
        _release()
        script_end.end()   # then as a script that raised: its threads, its atexit handlers (bounded:
                           # the supervisor kills it RANK_GRACE after the stop)
    return code


def _on_session_sigint(signum, frame) -> None:
    """A session rank's SIGINT (the stop button): KeyboardInterrupt in the
    cell's code (at an agreed optimizer step in a world of several ranks, see
    _after_optimizer_step), kept for it if the code has not begun; at the prompt
    (between cells) it is ignored."""
    global _interrupt_pending, _stop_wanted
    if _in_post_mortem:   # a command typed at a post-mortem's prompt: back to the prompt, as pdb does
        raise KeyboardInterrupt
    if _in_cell and frame is not None and frame.f_code is _run_cell.__code__:
        # Handled between the cell's code and its report (its last expression
        # just returned): the cell completed.  Raised here, a cell that had
        # done all it does was reported stopped (and run again, twice).
        _interrupt_pending = True
        return
    if _in_cell:
        if _stop_wanted or _world_store() is None:   # no peers to agree with: at once
            raise KeyboardInterrupt
        _stop_wanted = True
        return
    if _cell_begun:
        _interrupt_pending = True


def _in_world() -> bool:
    """Is the default process group up (the rank is part of the run's world)?"""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def _world_store():
    """The default process group's store when several ranks train together, else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """torch's global optimizer step hook: count steps; stop at the agreed one."""
    global _steps, _stop_step
    _steps += 1
    if not (_stop_wanted and _in_cell):
        return
    if _stop_step is None:
        store = _world_store()
        try:
            agreed = store.compare_set(f"accel_magics/stop/{_cell_id}", "", str(_steps + 2)) if store else b""
            _stop_step = int(agreed) if agreed else _steps
        except Exception:
            _stop_step = _steps
    if _steps >= _stop_step:
        stop = KeyboardInterrupt(f"stopped after optimizer step {_steps} of this cell (the same step on every rank)")
        stop.accel_magics_agreed_step = _steps   # its report says so: the kernel warns only of a stop that was not
        raise stop


def step_hook_unsupported() -> Optional[str]:
    if "torch" not in sys.modules:
        return "torch is not imported"
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: F401
    except ImportError:
        return "torch.optim.optimizer.register_optimizer_step_post_hook is missing"
    return None


def _install_step_hook() -> None:
    """The ``step_stop`` hook (a session's stop lands after an optimizer step);
    without it the stop raises at once, as in any cell."""
    global _step_hook
    if _step_hook is None:
        def register() -> None:
            global _step_hook
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _step_hook = register_optimizer_step_post_hook(_after_optimizer_step)

        if not hooks.install("step_stop", register, guard=step_hook_unsupported):
            _step_hook = False


def _serve_session(spec: dict, local_rank: int, go_fd: int) -> int:
    """A session's rank: one namespace, cells one after another until EOF.

    Each cell arrives as a frame on the go pipe; its outcome goes out as one
    event (result or failure, as in a one-shot run) and the rank is back at
    its prompt.  EOF (the session is stopped, or its supervisor is gone)
    ends the rank.
    """
    global _cell_begun, _interrupt_pending, _cell_id, _steps, _stop_wanted, _stop_step
    main = _enter_rank(spec, local_rank)
    signal.signal(signal.SIGINT, _on_session_sigint)
    _install_step_hook()
    emit({"kind": "session_ready"})
    kept = None   # a failed cell's traceback, for a post-mortem until the next cell (held.py)
    while True:
        frame = wire.read_frame(go_fd)
        if frame is None:   # the session's end is its script's end: its threads, its atexit handlers
            _release()
            script_end.end()
            return 0
        if isinstance(frame, dict):   # a post-mortem asked for; or an answer to a question of a stopped cell
            kept = _at_prompt(frame, kept)
            continue
        kept = None
        _release()   # the last cell's frames (kept for a post-mortem) are finalized before this one runs
        _interrupt_pending, _cell_begun = False, True
        _steps, _stop_wanted, _stop_step = 0, False, None
        cell = pickle.loads(frame)
        _cell_id = cell["run_id"]
        pg_guard.release_kept()   # nothing of the last cell runs now: its destroyed groups may go
        emit({"kind": "cell_started", "cell": cell["run_id"]})
        event, code = _run_cell(cell["payload"], main.__dict__, local_rank == 0, session=True)
        if _in_forked_child(event):   # it never reads the next cell
            return code
        event["cell"] = cell["run_id"]
        kept = held.held_traceback(_held) if event["kind"] == "failed" and cell.get("debug_hold") else None
        if kept is not None:
            event["held"] = True   # the kernel may open its post-mortem until the next cell
        _emit_last(event)
        if kept is None:
            _release()   # back at its prompt: what the failed cell's frames held is finalized before the next
        _cell_begun = False


def _at_prompt(frame: dict, kept):
    """The supervisor's word to a session rank at its prompt about the
    frames it kept (``debug``: the post-mortem; ``drop``: let go now); what it keeps after."""
    if frame.get("debug"):
        return _session_post_mortem(kept)
    if frame.get("drop") and kept is not None:   # its memory back now, not at the next cell
        _release()
        return None
    return kept


def _session_post_mortem(kept) -> None:
    """A session rank at its prompt: pdb's post-mortem of its last failed
    cell (a SIGINT ends a long command of it, as at a terminal), then the
    cell's frames are let go; None (nothing is kept after it)."""
    global _in_post_mortem
    if kept is not None:
        _in_post_mortem = True
        try:
            held.post_mortem(kept)
        finally:
            _in_post_mortem = False
        _release()
    emit({"kind": "held_end", "gone": kept is None})
    return None


def _pack_value(value) -> dict:
    """The value pickled for the kernel, or its repr if it cannot travel."""
    try:
        kind = type(value)
        return {"blob": dumps_result(value), "type": f"{kind.__module__}.{kind.__qualname__}"}
    except Exception as exc:
        try:
            text = repr(value)
        except Exception:
            text = f"<{type(value).__name__}>"
        if len(text) > 4096:
            text = text[:4096] + f"... [{len(text) - 4096} more characters]"
        return {"repr": text, "error": _safe_str(f"{type(exc).__name__}: ", exc)[:4096]}


def loads_value(packed: dict):
    """Inverse of _pack_value, in the kernel."""
    if "blob" in packed:
        return pickle.loads(packed["blob"])
    raise ValueError(packed.get("error", "value could not be pickled"))
