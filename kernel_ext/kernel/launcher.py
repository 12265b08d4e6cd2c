"""Kernel side of the launcher: start/stop the launcher process, open runs.

:class:`Launcher` owns, for the life of the kernel, the launcher process
(zygote), a private 0700 directory and the ZMQ PULL socket bound to an
``ipc://`` path in it.  :meth:`Launcher.launch` hands the zygote a run spec;
the returned :class:`RunHandle` yields the run's verified messages and can
interrupt or kill the run.  Nothing here imports IPython.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from typing import Callable, Optional

import zmq

from .. import child_environment, process_tree
from .. import wire
from ..environment import (LaunchConfig, environ_now, error_dir, error_file, free_port, rank_base_environment,
                           rank_environment, visible_gpus)
from .errors import LauncherError
from .escapes import EscapeWatch
from .preloads import ImportEnvironment, Preloads
from ..wire.payload import Payload
from .run_handle import RunHandle
from ..sigint import sigint_deferred
# The ladders' order: see timing.py.
from ..timing import DISPATCH_WAIT, LAUNCHER_CLOSE_WAIT, LAUNCHER_READY_WAIT, PRELOAD_WAIT, RANK_GRACE, WAIT_TICK

log = logging.getLogger("accel_magics.launcher")

_live_launchers: "weakref.WeakSet[Launcher]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for launcher in list(_live_launchers):
        launcher.close()


SUN_PATH_MAX = 107   # bytes in an AF_UNIX socket path (Linux: 108 with the final NUL)


OWNER_LOCK = "owner.lock"   # in each launcher directory: flock()ed by the process that made it, for its life


def _private_dir() -> tuple[str, int]:
    """A new private (0700) directory for the run channel's ipc:// socket, and
    the fd of its owner lock (see :func:`_prune_abandoned`).

    In the temp directory, unless its path is too long for a socket (a long
    ``TMPDIR``): then in /tmp or the user's runtime directory.
    """
    tried = []
    for base in (None, "/tmp", os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm"):
        base = base or tempfile.gettempdir()
        if base in tried:
            continue
        tried.append(base)
        if len(os.fsencode(os.path.join(base, "accel_magics-xxxxxxxx", "events"))) > SUN_PATH_MAX:
            continue
        try:
            path = tempfile.mkdtemp(prefix="accel_magics-", dir=base)   # 0700, whatever the umask
        except OSError:
            continue
        os.chmod(path, 0o700)
        lock = _hold_owner_lock(path)
        _prune_abandoned(base, keep=path)
        return path, lock
    raise LauncherError(
        f"no directory for the launcher's socket: {', '.join(tried)} are not writable or their path is longer "
        f"than a socket path may be ({SUN_PATH_MAX} bytes). Set TMPDIR to a short, writable directory."
    )


def _hold_owner_lock(path: str) -> int:
    """Lock the new directory for this process's life (the lock ends with it,
    however it ends).  Locked before it gets its name, so a pruner never finds
    it unlocked."""
    temp = os.path.join(path, f".{OWNER_LOCK}.new")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(temp, os.path.join(path, OWNER_LOCK))
    return fd


def _prune_abandoned(base: str, keep: str) -> None:
    """Remove launcher directories whose owner is gone without removing them.

    The owner (a kernel, a Slurm node's agent) and its launcher process remove
    the directory themselves, whichever outlives the other; only when both die
    at once (Slurm SIGKILLs every process of a cancelled step; the OOM killer
    takes a process group) is it left.  Such a one is this user's, carries an
    owner lock, and the lock is free: no one is there to use it.
    """
    uid = os.getuid()
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith("accel_magics-") or entry.path == keep:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            fd = os.open(os.path.join(entry.path, OWNER_LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:   # not a launcher directory of this version, or gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # its owner lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def run_spec(cfg: LaunchConfig, payload: Optional[Payload], *, run_id: str, port: int, attempt: int, gpus: int,
             private_dir: str, events_addr: str, grace: float, log_dir: str, excerpt: Optional[tuple[int, int]],
             extra: dict) -> dict:
    """What the launcher gets of a run (its supervisor's spec): ``gpus``, what
    these ranks see of the GPUs; ``private_dir``, the launcher's directory
    (where the ranks' error files go)."""
    return {
        "run_id": run_id,
        "events_addr": events_addr,
        "num_processes": cfg.num_processes,
        "ranks": [cfg.global_rank(i) for i in cfg.local_ranks],
        "env": rank_base_environment(environ_now()),
        # What sys.argv[0] is in the kernel (ipykernel's launcher), without
        # the kernel's own flags: argparse in a rank sees no arguments.
        "argv": [os.path.abspath(sys.argv[0])] if sys.argv and sys.argv[0] else [""],
        "rank_env": [
            rank_environment(cfg, i, port, run_id=run_id, attempt=attempt, gpu_count=gpus,
                             error_file=error_file(private_dir, run_id, attempt, i))
            for i in cfg.local_ranks
        ],
        "error_dir": error_dir(private_dir, run_id),
        "payload": payload,
        "gpu_count": gpus,
        "timeout": cfg.timeout,
        "master_addr": cfg.master_addr,
        "master_port": port,
        "num_nodes": cfg.num_nodes,
        "node_rank": cfg.node_rank,
        "rdzv_timeout": cfg.rendezvous_timeout,
        "stall_timeout": cfg.stall_timeout if cfg.num_nodes == 1 else 0,
        # A failed rank held for %distributed_debug: the last attempt only (another would wait for it).
        "debug_hold": cfg.debug_hold if attempt >= cfg.max_restarts else 0,
        "rendezvous_key": cfg.rendezvous_key if cfg.num_nodes > 1 else None,   # the supervisor's only
        "grace": grace,
        "attempt": attempt,
        "max_restarts": cfg.max_restarts,
        "log_dir": log_dir,
        "excerpt": excerpt,
        **extra,
    }


class Launcher:
    """The kernel's handle on its launcher process."""

    def __init__(self, preload: Optional[list[str]] = None, python: str = sys.executable,
                 report_to: Optional[str] = None, report_keys=None) -> None:
        """``report_to``: where runs send their messages instead of this
        launcher's own socket (a Slurm node's agent: the kernel's, over TCP;
        the runs sign them with a key the kernel knows, see ``launch(key=)``).
        ``report_keys``: that socket's CURVE keys (``wire.transport``)."""
        self.preload = preload
        self.python = python
        self.report_to = report_to
        self.report_keys = report_keys
        self.proc: Optional[subprocess.Popen] = None
        self.info: dict = {}
        self._tick: Optional[Callable[..., None]] = None   # see waiting()
        self.phase = "starting Python"   # what the launcher does until it is ready
        self.dropped = 0          # messages that failed verification (forged, stale)
        self.received = 0         # signed messages of runs taken in (a supervisor's batch is one)
        self.runs_started = 0     # runs handed to a supervisor (what "nothing was launched" counts)
        self._lock = threading.RLock()   # a background run's thread launches too
        self.escapes = EscapeWatch()
        self.live: dict[str, int] = {}    # run/session id -> supervisor pid: runs that outlive a cell
        self.preloads = Preloads()
        self.env = ImportEnvironment()

    # -- life cycle -------------------------------------------------------
    def start(self) -> None:
        """Start the launcher process; returns at once (torch loads meanwhile)."""
        if self.proc is not None:
            return
        self.phase = "starting Python"
        self.dir, self._owner_lock = _private_dir()
        self.pull = None
        try:
            self._start()
        except BaseException as exc:   # leave nothing behind: no socket, directory or process
            self._abandon_start()
            if isinstance(exc, (LauncherError, KeyboardInterrupt)):
                raise
            raise LauncherError(f"could not start the launcher process: {type(exc).__name__}: {exc}") from exc

    def _abandon_start(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        if self.pull is not None:
            self.pull.close()
            self.pull = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self._release_owner_lock()

    def _release_owner_lock(self) -> None:
        if getattr(self, "_owner_lock", None) is not None:
            os.close(self._owner_lock)
            self._owner_lock = None

    def _start(self) -> None:
        self.events_addr = self.report_to or f"ipc://{self.dir}/events"
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(f"ipc://{self.dir}/events")
        # What a rank gets of the kernel's environment, not the kernel's own
        # (a terminal's TERM and colours, the inline MPLBACKEND): the imports
        # here are a rank's, and see what a process torchrun started would.
        self.env.at_start = rank_base_environment(os.environ)
        self.env.reads = set()
        env = child_environment(self.env.at_start)
        # Every process of this launcher carries the marker (ranks keep it too),
        # so whatever escapes the process tree is still found and killed (close).
        self.token = uuid.uuid4().hex
        env[process_tree.MARKER] = self.token
        self.log_path = os.path.join(self.dir, "launcher.log")
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [self.python, "-m", "accel_magics.kernel_ext.launcher.zygote"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=env, start_new_session=True, close_fds=True,
            )
        finally:
            log.close()
        init = {"private_dir": self.dir, "events_addr": self.events_addr, "kernel_pid": os.getpid()}
        if self.report_to and self.report_keys is not None:
            init["events_curve"] = self.report_keys.client_half()
        if self.preload is not None:
            init["preload"] = self.preload
        self._send(init)
        self.info = {}
        _live_launchers.add(self)
        self.escapes.watch(self.proc, self.token)

    def escaped_ended(self) -> int:
        """For a launcher that died: wait until what its runs left outside its
        tree is ended (see :class:`.escapes.EscapeWatch`); how many processes that was."""
        return self.escapes.ended(getattr(self, "token", None))


    def wait_ready(self, timeout: float = LAUNCHER_READY_WAIT) -> dict:
        """Block until the launcher has loaded torch; its ready message."""
        if self.proc is None:
            self.start()
        if not self.info:
            self.info = self._reply("ready", timeout)
            self.env.reads.update(self.info.get("env_reads", ()))
        return self.info

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self, kill: bool = False) -> None:
        """Stop the launcher and every run; remove the private directory.

        ``kill``: it does not answer (frozen, stuck): SIGKILL it and its runs
        at once instead of asking it to stop them.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()   # EOF: the zygote stops its runs and exits
        except OSError:
            pass
        # Removed now, not after the wait: nothing needs it any more (the log's
        # tail was read by whoever closes for a reason), and a kernel killed
        # while it waits (a shutdown that takes too long) must not leave it,
        # since a zygote that saw EOF from a live kernel leaves it to the kernel.
        shutil.rmtree(self.dir, ignore_errors=True)
        self._release_owner_lock()
        try:
            proc.wait(0 if kill else LAUNCHER_CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        # Anything of this launcher still alive escaped its tree (setsid and
        # double fork, after its supervisor was killed): end it too.
        self.escaped_ended()
        proc.stdout.close()
        self.pull.close()
        self.info = {}
        self.live.clear()
        self.preloads.reset()   # a new launcher preloads from scratch
        self.env.reset()
        _live_launchers.discard(self)

    def ensure_running(self) -> dict:
        with self._lock:
            return self._ensure_running()

    def _ensure_running(self) -> dict:
        if self.preloads.pending:
            self._settle_preload()
        alive = self.alive   # one look (a waitpid) for the checks below: each cell comes here twice
        if alive and self.preloads.stale():
            # A module it keeps imported changed on disk (pip upgraded it): a
            # run must never see old code, so a fresh launcher imports it anew.
            # Not while a session or a background run lives on it: they would die.
            if not self.live:
                log.info("replacing the launcher process (pid %d): a module it imported changed on disk",
                         self.proc.pid)
                self.close()
            elif not self.preloads.stale_warned:
                self.preloads.stale_warned = True
                warnings.warn("accel_magics: a module the launcher keeps imported changed on disk, but a session "
                              "or a background run is alive, so this run still uses the version loaded before. "
                              "Stop them (%distributed_session stop) to get the new one.", RuntimeWarning,
                              stacklevel=3)
        if alive and self.proc and not self.info and not self.live and self.env.outdated(self.live, self.proc.pid, reads=()):
            # Still importing (a cell right after %load_ext and an %env): what
            # native code reads has changed already; no need to wait for it.
            self.close(kill=True)
        if self.proc is not None and not alive:
            warnings.warn(f"the launcher process had exited (code {self.proc.returncode}); starting a new one. "
                          f"Its log:\n{self.launch_log_tail()}", RuntimeWarning, stacklevel=2)
            self.close()
        if self.proc is None:
            self.start()
        info = self.wait_ready()
        if self.env.outdated(self.live, self.proc.pid):   # known once it is ready: what its imports looked up
            self.close()
            self.start()
            info = self.wait_ready()
        return info

    def launch_log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return ""

    # -- control pipe -------------------------------------------------------
    def _send(self, *frames) -> None:
        """Write control frames, whole: an interrupt waits until they are written.

        A frame cut in half by KeyboardInterrupt would desynchronise the
        pipe for good, so SIGINT is blocked while writing (it is delivered
        right after).  A frame that fails midway retires the launcher; the
        next run starts a fresh one.
        """
        with sigint_deferred():
            try:   # in one write: the launcher wakes once for a run and its key
                wire.write_all(self.proc.stdin.fileno(), b"".join(wire.frame(obj) for obj in frames))
            except (BrokenPipeError, OSError) as exc:
                tail = self.launch_log_tail()
                self.close()
                raise LauncherError(f"the launcher process is gone ({exc}).\n{tail}") from None

    @contextlib.contextmanager
    def waiting(self, tick: Callable[[], None]):
        """While the block waits for the launcher (the first cell of a kernel:
        it imports torch, seconds), call ``tick()`` a few times a second, so
        a view's elapsed time moves and slow is told from stuck, and
        ``tick(phase)`` as the launcher says what it does ("importing torch")."""
        if tick is not None and not self.info:
            tick(self.phase)
        self._tick, previous = tick, self._tick
        try:
            yield
        finally:
            self._tick = previous

    def _reply(self, kind: str, timeout: float) -> dict:
        fd = self.proc.stdout.fileno()
        poller = zmq.Poller()
        poller.register(fd, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        tick = self._tick
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LauncherError(f"the launcher process did not answer within {timeout:g}s.\n"
                                    + self.launch_log_tail())
            if not poller.poll(min(left, WAIT_TICK) * 1000 if tick else left * 1000):
                if tick is not None:
                    tick()
                continue
            msg = wire.read_frame(fd)
            if msg is None:
                code = self.proc.wait()
                raise LauncherError(
                    f"the launcher process exited (code {code}) before it was ready:\n"
                    + self.launch_log_tail()
                )
            if msg.get("kind") == kind:
                return msg
            if msg.get("kind") == "phase":
                self.phase = str(msg.get("text", ""))
                if tick is not None:
                    tick(self.phase)

    def session_for(self, key: bytes):
        """The verifying Session, re-keyed per run (building one costs ~1 ms)."""
        if getattr(self, "_session", None) is None:
            self._session = wire.signed_session(key)
        else:
            self._session.key = key
            self._session.digest_history.clear()
        return self._session

    def learn_modules(self, modules: list[str]) -> None:
        """Ask the launcher to preload modules payloads use, for the next runs.

        Asynchronous: the import happens while the user reads the output; the
        reply is read at the next launch.  A module whose import makes forking
        unsafe (starts a thread, initialises CUDA) taints the launcher, which
        is then replaced by a fresh one that never preloads that module.
        """
        new = self.preloads.learn(modules)
        # The lock: a background run's thread learns here while the main thread
        # may be dispatching a run; their frames (and replies) must not interleave.
        with self._lock:
            if not new or not self.alive or self.preloads.pending:
                return
            self.preloads.preloaded.update(new)
            self._send({"op": "preload", "modules": new})
            self.preloads.pending = new

    def _settle_preload(self) -> None:
        pending, self.preloads.pending = self.preloads.pending, []
        if not pending or not self.alive:
            return
        try:
            reply = self._reply("preloaded", PRELOAD_WAIT)
        except LauncherError:   # an import that hangs (or kills it): never preload these again
            self.preloads.deny(pending)
            self.close(kill=True)
            return
        self.preloads.files.update(reply.get("files", {}))
        self.env.reads.update(reply.get("env_reads", ()))
        if reply.get("taint"):
            self.preloads.deny(pending)
            self.close()

    # -- runs -------------------------------------------------------------
    def _dispatch(self, run_id: str, num_processes: int, spec: dict, key: bytes) -> Optional[dict]:
        """Hand a run to the launcher: its "run_started" reply, None if it gave none."""
        # The key travels in a frame of its own, read by the launcher only
        # after it has forked the run's supervisor (and the supervisor its
        # ranks): no process that runs user code ever holds it.
        self._send({"op": "run", "run_id": run_id, "num_processes": num_processes,
                    "keep": sorted(self.live.values()),
                    "spec": pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)}, {"key": key})
        try:
            return self._reply("run_started", DISPATCH_WAIT)
        except KeyboardInterrupt:  # the run exists now: stop it before giving up
            reply = self._reply("run_started", DISPATCH_WAIT)
            if "pid" in reply:
                handle = RunHandle(self, run_id, key, reply["pid"], spec["master_port"], None)
                handle.kill()
                handle.force_kill()
                handle.close()
            raise
        except LauncherError:
            if self.alive:    # frozen or stuck, not gone
                return None
            raise

    def channel(self, kind: int, name: str):
        """A socket of its own for a session or a background run (bound, in the
        private directory): (socket, address).  ``kind``: zmq.PULL (its
        events) or zmq.PUSH (a session's cells)."""
        self.ensure_running()
        addr = f"ipc://{self.dir}/{name}"
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM if kind == zmq.PULL else zmq.SNDHWM, 0)
        sock.bind(addr)
        return sock, addr

    def launch(self, cfg: LaunchConfig, payload: Optional[Payload], *, attempt: int = 0, grace: float = RANK_GRACE,
               log_dir: str = "", excerpt: Optional[tuple[int, int]] = None, events=None,
               extra: Optional[dict] = None, stop_wait: Optional[float] = None,
               persistent: bool = False, run_id: Optional[str] = None,
               key: Optional[bytes] = None) -> "RunHandle":
        """Hand the run to the launcher; ``log_dir`` and ``excerpt``: see ``run.execute``.

        ``events``: (PULL socket, address) from :meth:`channel`, for a run read
        on a socket of its own (a background run, a session); ``extra``: more
        of the spec (a session's).  ``persistent``: the run may outlive the cell
        (a session, a background run): later runs must not end it; it stays in
        :attr:`live` until the caller removes it.  ``run_id`` and ``key``: the
        run's id and signing key, when its messages go to a reader that chose
        them (``report_to``); else a fresh id and a fresh random key.
        """
        with self._lock:
            handle = self._launch(cfg, payload, attempt, grace, log_dir, excerpt, events, extra or {}, stop_wait,
                                  run_id, key)
            if persistent:   # before the lock is let go: no other run's dispatch may end it
                self.live[handle.run_id] = handle.supervisor_pid
            return handle

    def _launch(self, cfg, payload, attempt, grace, log_dir, excerpt, events, extra, stop_wait,
                run_id=None, key=None) -> "RunHandle":
        info = self.ensure_running()
        gpus = visible_gpus(info.get("gpu_count", 0), cfg, os.environ)   # what these ranks see of them
        run_id = run_id or wire.new_id()
        port = cfg.master_port or free_port(cfg.master_addr if cfg.num_nodes == 1 else "0.0.0.0")
        key = key or wire.new_key()
        spec = run_spec(cfg, payload, run_id=run_id, port=port, attempt=attempt, gpus=gpus, private_dir=self.dir,
                        events_addr=self.events_addr, grace=grace, log_dir=log_dir, excerpt=excerpt, extra=extra)
        if events is not None:
            spec["events_addr"] = events[1]
        if extra.get("session"):
            spec["debug_hold"] = 0   # a session's ranks are not held (not yet)
        rdzv = cfg.rendezvous_timeout if cfg.num_nodes > 1 else None
        reply = self._dispatch(run_id, cfg.num_processes, spec, key)
        if reply is None:   # it did not answer: a fresh launcher gets the run
            warnings.warn("accel_magics: the launcher process did not answer; it was replaced by a new one "
                          f"(its log:\n{self.launch_log_tail()})", RuntimeWarning, stacklevel=3)
            self.close(kill=True)
            self.ensure_running()
            if events is None:
                spec["events_addr"] = self.events_addr
            else:   # its socket was in the old launcher's directory: the caller must start over
                raise LauncherError("the launcher process did not answer and was replaced; run the cell again.")
            reply = self._dispatch(run_id, cfg.num_processes, spec, key)
            if reply is None:
                self.close(kill=True)
                raise LauncherError(f"the launcher process did not answer within {DISPATCH_WAIT:g}s, twice.")
        self.runs_started += 1
        if "error" in reply:
            raise LauncherError(f"the launcher could not start the run: {reply['error']}")
        return RunHandle(self, run_id, key, reply["pid"], port, cfg.timeout, rdzv,
                         pull=events[0] if events is not None else None, stop_wait=stop_wait, ranks=spec["ranks"])
