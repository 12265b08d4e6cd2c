"""The launcher process: a clean interpreter that forks one supervisor per run.

Started once per kernel (``python -m accel_magics.kernel_ext.launcher.zygote``) in its own session,
so the kernel's interrupt (SIGINT to its process group) never reaches it.  It
imports torch and the modules payloads use, freezes the heap (``gc.freeze``,
so forked ranks do not copy it on their first collection) and then only
forks; it never touches a GPU and never starts a thread.

Control comes from the kernel on stdin as frames; replies go back on a private
copy of the original stdout (fd 1 itself is pointed at the log, so a module
that prints cannot corrupt the replies).  It ends, and takes every run with
it, when stdin reaches EOF or the kernel process exits (kill -9 included).
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import selectors
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Optional

from ..environment import EnvironmentReads, error_dir

# What the imports look up in the environment, from here to the ready reply and
# during each preload: the kernel replaces this process when one of those
# variables changes (see kernel.launcher), as a new process would see it.
# Only in the launcher process itself, not in one that imports this module.
ENV_READS = EnvironmentReads()
if __name__ == "__main__":
    ENV_READS.start()

# Everything a supervisor and a rank need, imported once here rather than after
# every fork (an import after the fork costs each run milliseconds).
from .. import logs, wire  # noqa: E402,F401
from ..rank import pg_guard, rank_stdio, worker  # noqa: E402,F401
from ..supervisor import session_supervisor, supervisor  # noqa: E402,F401
from .. import hooks  # noqa: E402
from ..supervisor import native_stacks, rendezvous  # noqa: E402
from ..wire import payload, transport  # noqa: E402,F401
from ..process_tree import children, kill_orphans, running  # noqa: E402
from ..supervisor.error_file import ahead_dir  # noqa: E402
from ..supervisor.run_state import RunState  # noqa: E402
# The ladders' order: see timing.py.
from ..timing import (COLLAPSE_AT_START, COLLAPSE_IDLE, END_WAIT, SHUTDOWN_ORPHAN_POLL, SHUTDOWN_ORPHAN_WAIT,  # noqa: E402
                      SHUTDOWN_STOP_WAIT, SPARE_FORK_DEFER, STORE_THREADS_POLL, STORE_THREADS_WAIT)
from .hugepages import Collapser  # noqa: E402
from .imports import Imports  # noqa: E402
from .replies import Replies  # noqa: E402

log = logging.getLogger("accel_magics.launcher")

SUPERVISOR_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD}
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data")


def _hook_state(name: str) -> list:
    """[state, detail] of a launcher hook, for the kernel (its pre-run warnings)."""
    state, detail = hooks.states().get(name, (None, ""))
    return [state.value if state is not None else None, detail]


def gpu_count() -> int:
    """GPUs visible to the ranks, counted without initialising CUDA.

    ``torch.cuda.device_count()`` initialises the CUDA driver, after which a
    fork cannot use CUDA; NVML (or AMD SMI) answers without it.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda._is_compiled():
        return 0
    for probe in ("_device_count_nvml", "_device_count_amdsmi"):
        fn = getattr(torch.cuda, probe, None)
        if fn is not None:
            try:
                n = fn()
            except Exception:
                continue
            if n >= 0:
                return n
    return 0


def os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - non-Linux
        return threading.active_count()


def cuda_driver_loaded() -> bool:
    """True once libcuda is mapped: the CUDA driver was touched, forks can't use CUDA."""
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" in f.read()
    except OSError:  # pragma: no cover
        return False


def taint(baseline_threads: int = 1) -> str | None:
    """Why forking from this process would be unsafe, or None."""
    from ..kernel.preflight import initialised_runtimes

    runtimes = initialised_runtimes()
    if runtimes:
        return f"{'/'.join(runtimes)} was initialised by a preloaded module"
    if cuda_driver_loaded():
        return "the CUDA driver was loaded by a preloaded module"
    if threading.active_count() > 1 or os_threads() > baseline_threads:
        return "a preloaded module started a thread"
    return None


class Zygote:
    def __init__(self, control_fd: int, reply_fd: int) -> None:
        self.control_fd = control_fd
        self.reply_fd = reply_fd
        self.supervisors: dict[int, str] = {}   # pid -> run_id, runs in progress
        self.keep: set[int] = set()              # supervisors of live sessions and background runs
        # Each supervisor's status pipe (see run_state): a one-shot run's
        # supervisor says there when its ranks are gone.
        self.status_fds: dict[int, int] = {}     # pid -> read end of its status pipe
        self.ranks_gone: set[int] = set()        # every rank reaped: it holds nothing a new run needs
        self.finished: set[int] = set()          # its run is over: the next run's spare may be forked
        self.spare: Optional[tuple[int, int, int]] = None  # (pid, control fd, ranks) forked ahead
        self.expected_ranks = 2
        self.sel = selectors.DefaultSelector()
        self.replies = Replies(reply_fd, self.sel)
        self.extra_fds: list[int] = []           # fds a forked child must close
        self.terminating = False
        self.kernel_gone = False   # the kernel died or closed a pipe to this process: done with it
        self.collapser = Collapser()               # the heap into huge pages, while idle (hugepages)
        self.imports = Imports(ENV_READS, self.collapser, self.replies.say_phase)
        self.quiet_since = time.monotonic()        # the last control message, signal or status
        self.finished_at = -float("inf")            # when a run last said it finished

    def serve(self, init: dict) -> None:
        self.private_dir = init["private_dir"]
        self.events_addr = init["events_addr"]
        curve = init.get("events_curve")   # a Slurm node: the kernel's events socket is a CURVE server
        self.events_keys = transport.CurveKeys.from_client_half(curve) if curve else None
        self.imports.private_dir = self.private_dir
        self.listen(init["kernel_pid"])
        self.set_up(init.get("preload", DEFAULT_PRELOAD))
        try:
            try:
                self.replies.send({"kind": "ready", "pid": os.getpid(), "gpu_count": gpu_count(),
                                   "preloaded": self.imports.preloaded, "taint": taint(self.baseline_threads),
                                   "env_reads": self.imports.env_reads(),
                                   "native_stacks": _hook_state("native_stacks"),
                                   "python": sys.version})
            except OSError:
                # The kernel went away while torch was importing (shut down right
                # after %load_ext): the same clean-up as any other end.
                self.kernel_gone = True
                return
            self.loop()
        finally:
            self.shutdown()

    def listen(self, kernel_pid: int) -> None:
        """Signals, the control pipe and the kernel's end, each a source of the selector."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wakeup_r = r
        self._wakeup_w = w
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # What a killed supervisor's ranks leave behind is reparented here, not
        # to init: this process kills it (see reap), so nothing outlives the run.
        try:
            ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - non-Linux
            pass
        self.sel.register(self.control_fd, selectors.EVENT_READ, "control")
        self.sel.register(r, selectors.EVENT_READ, "signal")
        self.kernel_pid = kernel_pid
        try:
            kernel = os.pidfd_open(kernel_pid)
            self.sel.register(kernel, selectors.EVENT_READ, "kernel")
            self.extra_fds.append(kernel)
        except (AttributeError, OSError):
            pass

    def set_up(self, modules) -> None:
        """Import what runs need (each phase said to the kernel) and make this the forks' base."""
        native_stacks.start_probe()   # ptrace, for native_stacks' guard: while torch imports
        self.imports.preload(modules, phases=True)   # recording goes on until ready
        self.replies.say_phase("setting up torch.distributed")
        native_stacks.install()
        if "torch.distributed" in sys.modules:
            from . import dnsfix
            threads_before = os_threads()   # numpy's OpenBLAS keeps a (fork-safe) pool thread
            rendezvous.install_store_hook()   # tries a store on a bound socket: its threads end below too
            dnsfix.install()
            gc.freeze()   # the few objects the fix made (preload already collected)
            # The throwaway store's threads end as it is destroyed: wait for
            # that, forks must not copy a thread of ours in the middle of work.
            deadline = time.monotonic() + STORE_THREADS_WAIT
            while os_threads() > threads_before and time.monotonic() < deadline:
                time.sleep(STORE_THREADS_POLL)
        self.baseline_threads = os_threads()
        self.collapser.run_for(COLLAPSE_AT_START)   # the first spare's fork is cheaper already

    def loop(self) -> None:
        """Serve the kernel until it goes, closes the control pipe or SIGTERM comes."""
        while not self.terminating:
            idle = not set(self.supervisors) - self.keep - self.finished
            timeout, spare_due = self.idle_work(idle)
            ready = self.sel.select(timeout)
            if not ready:
                if not spare_due:
                    self.collapser.step()   # idle and quiet: one huge page, then look again
                continue
            self.quiet_since = time.monotonic()
            for key, _ in ready:
                if not self.on_ready(key.data):
                    return

    def idle_work(self, idle: bool) -> tuple[Optional[float], bool]:
        """What to do while no run is in progress (``idle``): fork the next
        run's spare, or say how long to wait (the select's timeout) and
        whether that wait is for the spare (else for the heap's next step)."""
        if self.spare is None and idle:
            # Idle time (or the last run just finished, its ranks ending): the
            # next run's fork is done now, not in its cell; but not while the
            # kernel delivers the run that just finished (a run frame that
            # comes meanwhile forks it at once).
            defer = self.finished_at + SPARE_FORK_DEFER - time.monotonic()
            if defer > 0:
                return defer, True
            self.fork_spare()
        if idle and self.collapser.pending:
            return max(0.0, self.quiet_since + COLLAPSE_IDLE - time.monotonic()), False
        return None, False

    def on_ready(self, source) -> bool:
        """Serve one source the selector found ready; False: this process is done."""
        if isinstance(source, tuple):   # ("status", pid): a supervisor's status pipe
            self.on_status(source[1])
            return True
        if source == "kernel":
            self.kernel_gone = True
            return False
        if source == "reply":
            try:
                self.replies.flush()
            except OSError:   # the kernel closed its end
                self.kernel_gone = True
                return False
            return True
        if source == "signal":
            try:
                data = os.read(self.wakeup_r, 512)
            except BlockingIOError:   # read meanwhile by wait_previous_runs
                data = b""
            if signal.SIGTERM in data:
                return False
            self.reap()
        elif not self.on_control():
            self.kernel_gone = True   # EOF: it closed the pipe (see shutdown)
            return False
        return True

    def on_control(self) -> bool:
        msg = wire.read_frame(self.control_fd)
        if msg is None or msg.get("op") == "shutdown":
            return False
        op = msg["op"]
        if op == "run":
            try:
                pid = self.dispatch(msg)
            except EOFError:
                return False
            except Exception as exc:
                self.replies.send({"kind": "run_started", "run_id": msg["run_id"], "error": f"{type(exc).__name__}: {exc}"})
                return True
            self.replies.send({"kind": "run_started", "run_id": msg["run_id"], "pid": pid})
        elif op == "preload":
            self.drop_spare()   # it lacks the new modules
            files = self.imports.preload(msg["modules"])
            self.replies.send({"kind": "preloaded", "preloaded": self.imports.preloaded, "files": files,
                        "env_reads": self.imports.env_reads(),
                        "failed": self.imports.failed_preload, "taint": taint(self.baseline_threads)})
        elif op == "ping":
            self.replies.send({"kind": "pong"})
        return True

    def dispatch(self, msg: dict) -> int:
        """Hand the run to the spare supervisor (forking one now if none is ready).

        The earlier runs' ends and the spare's fork overlap (a cell sent as
        soon as the last one ended, as "Run All" does, finds the last run's
        ranks still parked): the earlier runs are told to end, the spare is
        forked meanwhile (its ranks idle, running nothing of the user's),
        and the spec goes to it only once the earlier runs' ranks are gone.

        The key comes in the next control frame, read only once the spare
        exists: the spare gets it after it forked its ranks, and it is never
        in this process's memory at a fork, so no rank (which runs user code)
        ever holds it.
        """
        self.keep = set(msg.get("keep", ()))
        ending = self.end_previous_runs()
        if self.spare is not None and self.spare[2] < msg["num_processes"]:
            self.drop_spare()
        if self.spare is None:
            self.fork_spare(msg["num_processes"])
        self.wait_previous_runs(ending, time.monotonic() + END_WAIT)
        pid, control, _ = self.spare
        self.spare = None
        key = wire.read_frame(self.control_fd)
        if key is None:
            os.close(control)
            raise EOFError("the kernel closed the control pipe")
        try:
            wire.write_frame(control, (key["key"], msg["spec"]))
        except BrokenPipeError:   # the spare died meanwhile: reaped like any supervisor
            raise RuntimeError("the run's supervisor exited before the run reached it; run the cell again") \
                from None
        finally:
            os.close(control)
            del key
            self.supervisors[pid] = msg["run_id"]
        self.expected_ranks = msg["num_processes"]
        return pid

    def end_previous_runs(self) -> set[int]:
        """Tell the earlier runs to end now; the supervisors to wait for.

        A run starts only once the ranks of the earlier runs are gone.  The
        kernel sends a run only after the previous one reported "finished",
        so a supervisor still alive now is past its run (its ranks parked or
        exiting, see ``Supervisor._reap_rest``), unless the kernel says it is
        still live (``keep``: a session, a background run).  Ending it first
        means the new ranks never compete for the memory (GPU memory
        included) that the old ones still hold.  SIGTERM makes it kill its
        ranks at once instead of after their parking (see
        :meth:`wait_previous_runs`).
        """
        ending = set(self.supervisors) - self.keep
        for pid in ending:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        return ending

    def wait_previous_runs(self, ending: set[int], deadline: float, exited: bool = False) -> None:
        """Until every supervisor in ``ending`` has said its ranks are gone or
        has exited (``exited``: has exited), for at most until ``deadline``.

        Its ranks are what holds memory, ports and GPUs; the supervisor's own
        exit (tearing down a torch-sized process) may overlap the next run.
        Nothing to wait for (the earlier supervisors were reaped between
        cells, their orphans killed then): it returns at once, without a
        look through /proc on the run's start.
        """
        if not ending:
            return
        while True:
            self.reap()
            for pid in ending & set(self.status_fds):
                self.on_status(pid)
            waiting = ending & set(self.supervisors) - (set() if exited else self.ranks_gone)
            if not waiting or time.monotonic() >= deadline:
                return
            with selectors.DefaultSelector() as waiter:
                waiter.register(self.wakeup_r, selectors.EVENT_READ)   # SIGCHLD's wake-up byte
                for pid in waiting & set(self.status_fds) - self.ranks_gone:
                    waiter.register(self.status_fds[pid], selectors.EVENT_READ)
                if not waiter.select(deadline - time.monotonic()):
                    return
            try:
                if signal.SIGTERM in os.read(self.wakeup_r, 512):
                    self.terminating = True   # served by the main loop
            except BlockingIOError:
                pass

    def on_status(self, pid: int) -> None:
        """Read what a supervisor said on its status pipe (see RunState)."""
        fd = self.status_fds.get(pid)
        if fd is None:
            return
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if RunState.FINISHED.value in data:
            self.finished.add(pid)
            self.finished_at = time.monotonic()
        if RunState.RANKS_GONE.value in data or not data:   # EOF: it exited (its ranks reaped, or orphans here)
            self.ranks_gone.add(pid)
            self.forget_status(pid)

    def forget_status(self, pid: int) -> None:
        fd = self.status_fds.pop(pid, None)
        if fd is not None:
            try:
                self.sel.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)

    def stop_supervisors(self, wait: float) -> None:
        """Stop every supervisor (on SIGTERM each kills its ranks and exits);
        reap them for at most ``wait`` seconds."""
        self.keep = set()
        self.wait_previous_runs(self.end_previous_runs(), time.monotonic() + wait, exited=True)

    def fork_spare(self, ranks: Optional[int] = None) -> None:
        from ..supervisor.spare import serve_spare

        ranks = ranks or self.expected_ranks
        control_r, control_w = os.pipe()
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        parent = os.getpid()
        # Signals sent to the child before it has its own handlers must not
        # run the zygote's (inherited) handlers and wake-up fd: block them
        # across the fork; the supervisor unblocks once its handlers are set.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)
        pid = os.fork()
        if pid == 0:
            try:
                worker.set_parent_death_signal(signal.SIGKILL, expected_parent=parent)
                os.setpgid(0, 0)
                signal.set_wakeup_fd(-1)
                self.sel.close()
                for fd in {self.control_fd, self.reply_fd, self.wakeup_r, self._wakeup_w, control_w, status_r,
                           *self.extra_fds, *self.status_fds.values()}:
                    os.close(fd)
                serve_spare(control_r, status_w, ranks, self.events_addr, self.events_keys, self.private_dir)
            finally:
                os._exit(70)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(control_r)
        os.close(status_w)
        self.status_fds[pid] = status_r
        self.sel.register(status_r, selectors.EVENT_READ, ("status", pid))
        self.spare = (pid, control_w, ranks)

    def drop_spare(self) -> None:
        if self.spare is not None:
            pid, control, _ = self.spare
            self.spare = None
            os.close(control)    # EOF: the spare and its idle ranks exit
            self.supervisors[pid] = "spare"   # reaped like any supervisor

    def reap(self) -> None:
        """Reap exited children; kill the orphans a dead supervisor's ranks left."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
            self.forget_supervisor(pid)
        keep = set(self.supervisors) | ({self.spare[0]} if self.spare is not None else set())
        kill_orphans(keep)

    def forget_supervisor(self, pid: int) -> None:
        """A reaped child: what it left of its run (its folders of error files) goes."""
        run_id = self.supervisors.pop(pid, None)
        was_spare = self.spare is not None and self.spare[0] == pid
        if run_id not in (None, "spare"):   # a supervisor removes it as it ends; not one that was killed
            shutil.rmtree(error_dir(self.private_dir, run_id), ignore_errors=True)
        if run_id is not None or was_spare:   # what a spare made ahead, if no run took it before it died
            shutil.rmtree(ahead_dir(self.private_dir, pid), ignore_errors=True)
        self.forget_status(pid)
        self.ranks_gone.discard(pid)
        self.finished.discard(pid)
        if was_spare:
            os.close(self.spare[1])
            self.spare = None

    def shutdown(self) -> None:
        """Stop every run (supervisors kill their ranks on SIGTERM), then leave."""
        self.drop_spare()
        self.stop_supervisors(SHUTDOWN_STOP_WAIT)
        for pid in list(self.supervisors):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.supervisors.clear()
        deadline = time.monotonic() + SHUTDOWN_ORPHAN_WAIT
        while True:   # orphans arrive here one generation at a time: until none is left
            self.reap()
            if not children() or time.monotonic() > deadline:
                break
            time.sleep(SHUTDOWN_ORPHAN_POLL)
        # The kernel owns the private directory (its log tells why this
        # process ended); only when the kernel is gone is nobody left to remove
        # it.  A pipe it closed says so too: the kernel closes them only once
        # done with the directory (Launcher.close removes it first), or as it
        # dies -- and a process being killed closes its files before it is a
        # zombie, so ``running`` can still say yes then (a leak CI found).
        # Left for the kernel: a SIGTERM or a crash of this process.
        if self.kernel_gone or not running(self.kernel_pid):
            shutil.rmtree(self.private_dir, ignore_errors=True)


def main() -> None:
    # Libraries that call torch.cuda.is_available() at import time must not
    # initialise the CUDA driver here: NVML answers instead (torch >= 2.1).
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # Replies get their own fd; fd 1 becomes the log (stderr), so stray prints
    # from imported modules cannot corrupt the reply stream.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    control_fd = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.set_inheritable(reply_fd, False)
    os.set_blocking(reply_fd, False)   # its own description (fd 1 is the log now): see Zygote.outbox
    os.set_inheritable(control_fd, False)
    logs.to_log_file(2)   # launcher.log: this process, the supervisors and ranks it forks
    init = wire.read_frame(control_fd)
    if init is None:
        return
    zygote = Zygote(control_fd, reply_fd)
    try:
        zygote.serve(init)
    except BaseException:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
