"""The stop ladders' timing constants live in one module and keep their order."""
from __future__ import annotations

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
])
def test_a_constant_out_of_order_is_caught(monkeypatch, name, value, broken):
    monkeypatch.setattr(timing, name, value)
    assert any(broken in why for why in timing.check_order())


def test_the_modules_take_their_times_from_the_one_module():
    from accel_magics import background_handle
    from accel_magics.kernel_ext.kernel import run_handle, session, slurm
    from accel_magics.kernel_ext.node_agent import slurm_agent
    from accel_magics.kernel_ext.supervisor import session_supervisor, supervisor

    assert (run_handle.STOP_WAIT, run_handle.KILL_WAIT) == (timing.STOP_WAIT, timing.KILL_WAIT)
    assert (slurm.STOP_WAIT, slurm.KILL_WAIT) == (timing.SLURM_STOP_WAIT, timing.SLURM_KILL_WAIT)
    assert session.SESSION_STOP_WAIT == timing.SESSION_STOP_WAIT
    assert supervisor.STACK_WAIT == timing.STACK_WAIT and supervisor.NATIVE_WAIT == timing.NATIVE_WAIT
    assert session_supervisor.RECALL_WAIT == timing.RECALL_WAIT
    assert slurm_agent.LOST_AFTER == timing.AGENT_LOST_AFTER
    assert slurm_agent.HEARTBEAT_MS == timing.AGENT_HEARTBEAT * 1000
    assert background_handle.STOP_WAIT == timing.BACKGROUND_STOP_WAIT
    # No module defines a ladder time of its own any more.
    root = pathlib.Path(timing.__file__).parent
    own = re.compile(r"^(STOP_WAIT|KILL_WAIT|[A-Z_]*_WAIT|TIMEOUT_SLACK|GONE_DRAIN|LOST_AFTER) = [0-9.]", re.M)
    for path in root.rglob("*.py"):
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
