"""Drive a real IPython kernel over the Jupyter protocol, as a frontend does.

Also: what a kernel leaves behind (processes, listening ports, temp files), read
from /proc and the temp directory, so tests can assert nothing leaks.
"""
from __future__ import annotations

import os
import queue
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from jupyter_client.manager import KernelManager


@dataclass
class CellResult:
    status: str
    stdout: str = ""
    stderr: str = ""
    error: Optional[dict] = None      # ename, evalue, traceback
    result: Optional[str] = None      # text/plain of execute_result
    messages: list = field(default_factory=list)
    reply: dict = field(default_factory=dict)
    live: list = field(default_factory=list)   # texts of the live display's updates
    execution_count: Optional[int] = None
    prompts: list = field(default_factory=list)   # the input_requests' prompts, in order (run(stdin=...))

    @property
    def error_text(self) -> str:
        if not self.error:
            return ""
        return "\n".join([self.error["ename"], self.error["evalue"], *self.error["traceback"]])


class KernelSession:
    def __init__(self, extra_env: Optional[dict] = None, km: Optional[KernelManager] = None,
                 cwd: Optional[str] = None) -> None:
        env = dict(os.environ)
        env.update(extra_env or {})
        # iopub messages of other cells that came while a cell ran (a
        # background run's display updates go to the cell that started it).
        self.elsewhere: deque = deque(maxlen=5000)
        self.km = km or KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, **({"cwd": cwd} if cwd else {}))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self._last_pid = self.km.provisioner.process.pid

    @property
    def pid(self) -> int:
        """The kernel's pid; after its shutdown, the pid it had (a test then
        waits for what it left to end, and must still tell the kernel apart)."""
        provisioner = self.km.provisioner
        if provisioner is not None and getattr(provisioner, "process", None) is not None:
            self._last_pid = provisioner.process.pid
        return self._last_pid

    def run(self, code: str, timeout: float = 60, on_output: Optional[Callable[[str], bool]] = None,
            stdin=None) -> CellResult:
        """Execute ``code``.  ``on_output(text)`` is called on each stream message
        with all the cell's stream text so far (not the chunk: two ranks' lines
        may come in one message or in two, and a test that waits for both must
        not depend on which), and on each display message with that display's
        text (a live view's text is already its whole state).

        ``stdin``: a function ``stdin(prompt)``: each ``input_request`` is
        answered with what it returns, as a frontend's input box is (the
        prompts are in :attr:`CellResult.prompts`); False: the cell runs as
        nbclient runs one, with allow_stdin off; None: jupyter_client's
        default (allow_stdin on, nothing answered)."""
        allow = None if stdin is None else stdin is not False
        return self.result_of(self.submit(code, allow_stdin=allow), timeout, on_output, stdin or None)

    def submit(self, code: str, allow_stdin: Optional[bool] = None) -> str:
        """Send ``code`` for execution without waiting: its msg_id, for :meth:`result_of`."""
        return self.kc.execute(code, store_history=True, allow_stdin=allow_stdin)

    def result_of(self, msg_id: str, timeout: float = 60, on_output: Optional[Callable[[str], bool]] = None,
                  stdin: Optional[Callable[[str], Optional[str]]] = None) -> CellResult:
        """The result of the cell sent as ``msg_id`` (see :meth:`run`)."""
        res = CellResult(status="")
        deadline = time.monotonic() + timeout
        idle = False
        while not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell did not finish within {timeout}s; stdout so far:\n{res.stdout}")
            if stdin is not None:
                self._answer_stdin(stdin, res)
                left = min(left, 0.05)
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                self.elsewhere.append(msg)
                continue
            res.messages.append(msg)
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    res.stdout += content["text"]
                else:
                    res.stderr += content["text"]
                if on_output is not None:
                    on_output(res.stdout + res.stderr)
            elif kind in ("display_data", "update_display_data"):
                text = content["data"].get("text/plain", "")
                res.live.append(text)
                if on_output is not None:
                    on_output(text)
            elif kind == "error":
                res.error = content
            elif kind == "execute_result":
                res.result = content["data"].get("text/plain")
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        reply = self.reply_to(msg_id, deadline)
        res.reply = reply["content"]
        res.status = res.reply["status"]
        res.execution_count = res.reply.get("execution_count")
        if res.status == "error" and res.error is None:
            # UsageError is printed on stderr, not published as an error message.
            res.error = {k: res.reply.get(k) for k in ("ename", "evalue", "traceback")}
        return res

    def _answer_stdin(self, stdin: Callable[[str], Optional[str]], res: CellResult) -> None:
        """Answer every input_request waiting now, as a frontend's input box does."""
        while True:
            try:
                msg = self.kc.get_stdin_msg(timeout=0)
            except queue.Empty:
                return
            if msg["msg_type"] != "input_request":
                continue
            prompt = msg["content"]["prompt"]
            res.prompts.append(prompt)
            answer = stdin(prompt)
            self.kc.input(answer if answer is not None else "")

    def pump(self, timeout: float = 0.1) -> list:
        """Read what iopub has now (waiting up to ``timeout`` for the first)
        into :attr:`elsewhere`, between cells; the whole of it."""
        try:
            while True:
                self.elsewhere.append(self.kc.get_iopub_msg(timeout=timeout))
                timeout = 0.01
        except queue.Empty:
            pass
        return list(self.elsewhere)

    def updates_of(self, res: "CellResult") -> list[dict]:
        """The display updates that reached ``res``'s cell after it returned
        (a background run's view and value), ``data`` dicts, oldest first."""
        msg_id = res.messages[0]["parent_header"]["msg_id"]
        return [m["content"]["data"] for m in self.elsewhere
                if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "update_display_data"]

    def reply_to(self, msg_id: str, deadline: float) -> dict:
        """The shell reply to ``msg_id``.  Others are skipped: jupyter_client's
        wait_for_ready sends a kernel_info_request every second until one is
        answered, so a kernel slow to start (CI's load) leaves extra
        kernel_info_replies on the shell channel, and taking the next reply
        as this cell's put every later cell's status one cell behind."""
        while True:
            reply = self.kc.get_shell_msg(timeout=max(1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def ok(self, code: str, timeout: float = 60) -> CellResult:
        res = self.run(code, timeout)
        assert res.status == "ok", f"cell failed:\n{res.error_text}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
        return res

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


# -- what a process tree leaves behind ------------------------------------------

def _ppid_map() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":  # zombies are gone for our purposes once reaped
            pass
        parents[int(entry)] = int(fields[1])
    return parents


def children(pid: int) -> set[int]:
    return {p for p, pp in _ppid_map().items() if pp == pid}


def descendants(pid: int) -> set[int]:
    parents = _ppid_map()
    found, frontier = set(), {pid}
    while frontier:
        children = {p for p, pp in parents.items() if pp in frontier}
        frontier = children - found
        found |= children
    return found


def session_members(sid_leader: int) -> set[int]:
    """Processes whose session id is ``sid_leader`` (the launcher starts its own session)."""
    members = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid_leader:
            members.add(int(entry))
    return members


def listening_ports(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state held by any of ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and parts[9] in inodes:
                        ports.add(int(parts[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


# Caches that torch itself keeps in the temp directory for the user (created
# the first time something imports torch._inductor, with or without us).
_TORCH_CACHES = ("torchinductor_",)


def temp_entries(directory: Optional[str] = None) -> set[str]:
    directory = directory or tempfile.gettempdir()
    return {e for e in os.listdir(directory) if not e.startswith(_TORCH_CACHES)}


def typed(*lines: str) -> Callable[[str], str]:
    """A frontend that types ``lines`` at the input box, one per prompt, then
    only Enter ("") (for ``KernelSession.run(stdin=...)``)."""
    left = list(lines)
    return lambda prompt: left.pop(0) if left else ""


def alive(pid: int) -> bool:
    """The process is there and not a zombie (its parent may not have reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll a condition about the outside world (process exit) with a deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}")
        time.sleep(0.05)


SLOW_LAUNCHER = "import os, time\nif os.environ.get('ACCEL_MAGICS_LAUNCHER'):\n    time.sleep({seconds})\n"


def with_sitecustomize(directory, code: str) -> dict:
    """The environment of a kernel (and all it starts) that runs ``code`` at
    start-up, from a ``sitecustomize.py`` in ``directory``: a fault injected
    where nothing else reaches (a launcher slow to import torch, an import
    that takes seconds), whatever the machine's speed."""
    with open(os.path.join(str(directory), "sitecustomize.py"), "w") as f:
        f.write(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}
