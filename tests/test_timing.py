"""The stop ladders' timing constants live in one module and keep their order."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from accel_magics.kernel_ext import timing

pytestmark = pytest.mark.timeout(30)

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def page(path: str) -> str:
    return (DOCS / path).read_text(encoding="utf-8")


def test_every_ladder_keeps_its_order():
    assert timing.check_order() == []


@pytest.mark.parametrize("name, value, broken", [
    ("STOP_WAIT", 5.0, "supervisor finishes a stop by itself"),
    ("SLURM_STOP_WAIT", 8.0, "each node's own ladder ends a stop"),
    ("AGENT_LOST_AFTER", 2.0, "heartbeat timed out"),
    ("TIMEOUT_SLACK", 3.0, "every rank's stacks before the kernel's backstop"),
    ("LAUNCHER_CLOSE_WAIT", 3.0, "a closed launcher stops its supervisors"),
    ("SHUTDOWN_STOP_WAIT", 6.0, "a closed launcher stops its supervisors"),
    ("SHUTDOWN_ORPHAN_WAIT", 2.5, "a closed launcher stops its supervisors"),
    ("ORPHAN_SWEEP_WAIT", 6.0, "a stopped session's supervisor ends its ranks"),
    ("SESSION_END_WAIT", 11.0, "a stopped session's supervisor ends its ranks"),
    ("PROBE_WAIT", 2.0, "look at node 0's port"),
    ("PORT_ASK_WAIT", 3.0, "whose port it is"),
    ("AGENT_HEARTBEAT_TIMEOUT", 6.0, "heartbeat timed out"),
])
def test_a_constant_out_of_order_is_caught(monkeypatch, name, value, broken):
    monkeypatch.setattr(timing, name, value)
    assert any(broken in why for why in timing.check_order())


def test_the_modules_take_their_times_from_the_one_module():
    from accel_magics import background_handle
    from accel_magics.kernel_ext.kernel import local_placement, run_handle, slurm
    from accel_magics.kernel_ext.node_agent import slurm_agent
    from accel_magics.kernel_ext.supervisor import session_supervisor, supervisor

    assert (run_handle.STOP_WAIT, run_handle.KILL_WAIT) == (timing.STOP_WAIT, timing.KILL_WAIT)
    assert (slurm.STOP_WAIT, slurm.KILL_WAIT) == (timing.SLURM_STOP_WAIT, timing.SLURM_KILL_WAIT)
    assert local_placement.SESSION_STOP_WAIT == timing.SESSION_STOP_WAIT
    assert supervisor.STACK_WAIT == timing.STACK_WAIT and supervisor.NATIVE_WAIT == timing.NATIVE_WAIT
    assert session_supervisor.RECALL_WAIT == timing.RECALL_WAIT
    assert slurm_agent.LOST_AFTER == timing.AGENT_LOST_AFTER
    assert slurm_agent.HEARTBEAT_MS == timing.AGENT_HEARTBEAT * 1000
    assert background_handle.STOP_WAIT == timing.BACKGROUND_STOP_WAIT
    # No module defines a time of its own any more (a wait, a polling or refresh interval).
    own = re.compile(r"^(STOP_WAIT|KILL_WAIT|[A-Z_]*_WAIT|TIMEOUT_SLACK|GONE_DRAIN|LOST_AFTER|INTERVAL|[A-Z_]*_INTERVAL"
                     r"|[A-Z_]*_WINDOW|[A-Z_]*_POLL|[A-Z_]*_DELAY|[A-Z_]*_SLICE|[A-Z_]*_TICK|TIMEOUT) = [0-9.]", re.M)
    for path in _product_files():
        if path.name != "timing.py":
            assert not own.search(path.read_text()), path


def test_the_documented_numbers_are_the_modules():
    failures = page("reference/failure-modes.md")
    assert (f"after a stop, {timing.STOP_WAIT:g} s later it asks for the ranks to be killed, "
            f"{timing.KILL_WAIT:g} s after that") in failures
    assert f"within {timing.AGENT_LOST_AFTER:g} s of a kernel killed with" in page("how-to/slurm.md")
    sessions = page("how-to/sessions.md")
    assert f"if they all come back within {timing.RECALL_WAIT:g} s" in sessions
    assert f"optimizer step within {timing.FORCE_AFTER:g} s" in sessions
    tenth = {0.1: "a tenth"}[timing.BEHIND_SHARE]
    assert f"at least {timing.BEHIND_LAG:g} s and {tenth} of the run ago" in page("reference/views.md")
    assert f"runs its `atexit` handlers (a checkpoint writer finishes, wandb marks the run failed), at most " \
           f"{timing.RANK_GRACE:g} s before it is killed" in failures


# -- no wait outside timing.py ---------------------------------------------------------
# Calls whose positional arguments are waits, timeouts or polling intervals.
WAITING_CALLS = {"sleep", "wait", "join", "poll", "select", "settimeout", "set_timeout", "acquire", "communicate",
                 "receive", "recv", "bounded", "messages", "said_lost", "stop_supervisors", "try_connect", "probe"}
NOT_WAITING = {"waitpid"}   # its arguments are a pid and flags
# Keyword arguments and parameters that are waits.
WAIT_WORDS = ("timeout", "wait", "interval", "heartbeat", "grace")
# ZMQ socket options that are times.
TIME_OPTIONS = {"LINGER", "SNDTIMEO", "RCVTIMEO", "HEARTBEAT_IVL", "HEARTBEAT_TIMEOUT", "HEARTBEAT_TTL",
                "HANDSHAKE_IVL", "RECONNECT_IVL", "RECONNECT_IVL_MAX", "CONNECT_TIMEOUT"}
UNITS = {1000, 1e3, 1_000_000}   # seconds to milliseconds (or microseconds): a conversion, not a time
# Where a number in a waiting place is not a time: "relative path of the file: the source text" -> why.
# Kept tiny; every entry says why.
NOT_A_WAIT: dict = {}


def _timed_literal(node) -> bool:
    """Does ``node`` (a wait's value) put a number of its own into the time?  0 is
    allowed (a non-blocking look); so are unit conversions and names."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float) and node.value != 0
    if isinstance(node, ast.UnaryOp):
        return _timed_literal(node.operand)
    if isinstance(node, ast.BinOp):
        sides = [node.left, node.right]
        if isinstance(node.op, (ast.Mult, ast.Div, ast.FloorDiv)):
            sides = [s for s in sides if not (isinstance(s, ast.Constant) and s.value in UNITS)]
        return any(_timed_literal(s) for s in sides)
    if isinstance(node, ast.IfExp):
        return _timed_literal(node.body) or _timed_literal(node.orelse)
    if isinstance(node, ast.Call) and _name(node.func) in ("min", "max", "int", "float", "round", "timedelta"):
        return any(_timed_literal(a) for a in [*node.args, *(k.value for k in node.keywords)])
    return False


def _name(func) -> str:
    return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")).lstrip("_").lower()


def _is_clock(node) -> bool:
    return isinstance(node, ast.Call) and _name(node.func) in ("monotonic", "time", "perf_counter") and not node.args


def _waits_in(tree) -> list[tuple[int, str]]:
    """(line, what) for every bare number used as a wait in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            waiting = name not in NOT_WAITING and (name in WAITING_CALLS or "wait" in name or "sleep" in name
                                                  or name == "timedelta")
            if waiting and any(_timed_literal(a) for a in node.args):
                found.append((node.lineno, ast.unparse(node)))
            for k in node.keywords:
                if k.arg and (k.arg == "seconds" and name == "timedelta" or any(w in k.arg for w in WAIT_WORDS)) \
                        and _timed_literal(k.value):
                    found.append((node.lineno, ast.unparse(node)))
            if name == "setsockopt" and len(node.args) == 2 and _name(node.args[0]).upper() in TIME_OPTIONS \
                    and _timed_literal(node.args[1]):
                found.append((node.lineno, ast.unparse(node)))
            if name == "get" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                    and any(w in str(node.args[0].value) for w in WAIT_WORDS) and _timed_literal(node.args[1]):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            if _is_clock(node.left) and _timed_literal(node.right) or _is_clock(node.right) and _timed_literal(node.left):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, default in pairs:
                if any(w in arg.arg for w in WAIT_WORDS) and _timed_literal(default):
                    found.append((node.lineno, f"def {node.name}(... {arg.arg}={ast.unparse(default)})"))
    return found


def _product_files():
    root = pathlib.Path(timing.__file__).resolve().parent.parent
    for folder in ("kernel_ext", "accel_magics", "widgets"):
        yield from sorted((root / folder).rglob("*.py"))


def test_no_module_waits_a_bare_number():
    root = pathlib.Path(timing.__file__).resolve().parent.parent
    files = [p for p in _product_files() if p.name != "timing.py"]
    names = {p.name for p in files}
    assert len(files) > 50 and {"supervisor.py", "magics.py", "progress_view.py"} <= names   # the scan sees them all
    bare = [f"{p.relative_to(root)}:{line}: {what}" for p in files
            for line, what in _waits_in(ast.parse(p.read_text(), str(p)))
            if f"{p.relative_to(root)}: {what}" not in NOT_A_WAIT]
    assert not bare, "waits written as bare numbers (name them in kernel_ext/timing.py):\n" + "\n".join(bare)


@pytest.mark.parametrize("source", [
    "time.sleep(0.05)",
    "proc.wait(0 if kill else 5)",
    "thread.join(2.0)",
    "self._poll(0.5)",
    "poller.poll(200)",
    "select.select([r], [], [], 1.0)",
    "sock.settimeout(3)",
    "q.get(timeout=1)",
    "subprocess.run(cmd, timeout=10)",
    "execute(cfg, heartbeat=0.25)",
    "deadline = time.monotonic() + 5.0",
    "until = time.time() + 30",
    "store.set_timeout(timedelta(seconds=30))",
    "_bounded(ask, 5.0)",
    "sock.setsockopt(zmq.LINGER, 2000)",
    "self.receive(int(0.5 * 1000))",
    "grace = spec.get('grace', 3.0)",
    "def sweep(self, wait: float = 2.0): pass",
    "def view(interval=0.2): pass",
])
def test_a_bare_wait_is_found(source):
    assert _waits_in(ast.parse(source))


@pytest.mark.parametrize("source", [
    "time.sleep(WAIT)",
    "proc.wait(0 if kill else LAUNCHER_CLOSE_WAIT)",
    "poller.poll(0)",
    "poller.poll(BEAT * 1000)",
    "poller.wait(None)",
    "os.waitpid(-1, os.WNOHANG)",
    "', '.join(names[-20:])",
    "deadline = time.monotonic() + STOP_WAIT",
    "q.get(timeout=None)",
])
def test_a_named_wait_passes(source):
    assert not _waits_in(ast.parse(source))
