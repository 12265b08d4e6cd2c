"""Outbox: what a supervisor says in one turn of its loop goes as one message.

Plain Python over the messages a supervisor makes (the supervisor sends
through it in every run: tests/test_engine.py counts the frames of a real run)."""
from __future__ import annotations

import time

import pytest

from accel_magics.kernel_ext.supervisor.outbox import Outbox
from accel_magics.kernel_ext.timing import BATCH_HOLD
from accel_magics.kernel_ext.wire.messages import Kind, unbatched

pytestmark = pytest.mark.timeout(30)


def _msg(kind, run_id="r1", **extra):
    return {"kind": kind, "run_id": run_id, "node_rank": 0, **extra}


def _box(spec=None):
    sent = []
    return Outbox.of(spec or {}, sent.append), sent


def _kinds(sent):
    return [[m["kind"] for m in unbatched(one)] for one in sent]


def test_a_turn_of_a_one_node_run_goes_as_one_message_when_the_loop_waits():
    box, sent = _box()
    box.add(_msg("started"))
    box.add(_msg("rank_event", rank=0))
    box.add(_msg("exit", rank=0))
    box.turn_ended()
    assert sent == []                     # the turn's end alone sends nothing: "finished" may still come
    assert box.wait() is None             # the loop is about to wait: it goes, as one
    assert _kinds(sent) == [["started", "rank_event", "exit"]]
    assert sent[0]["kind"] == Kind.BATCH and sent[0]["run_id"] == "r1"


def test_finished_goes_at_once_with_what_the_last_turn_held():
    box, sent = _box()
    box.add(_msg("rank_event", rank=1))
    box.add(_msg("exit", rank=1))
    box.turn_ended()
    box.add(_msg("finished", reason=None))
    assert _kinds(sent) == [["rank_event", "exit", "finished"]]


@pytest.mark.parametrize("kind", ["supervisor_error", "input_request", "rendezvous_failed", "session_lost"])
def test_what_the_kernel_waits_on_goes_at_once(kind):
    box, sent = _box()
    box.add(_msg(kind))
    assert _kinds(sent) == [[kind]]
    assert sent[0]["kind"] == kind        # a single message goes as it is, not as a batch of one


def test_a_batch_is_of_one_run():
    """A session's cells are runs of their own: a cell's messages never ride with the next's."""
    box, sent = _box()
    box.add(_msg("rank_event", run_id="cell-1"))
    box.add(_msg("rank_event", run_id="cell-2"))
    box.wait()
    assert [[m["run_id"] for m in unbatched(one)] for one in sent] == [["cell-1"], ["cell-2"]]


def test_a_slurm_node_holds_its_messages_past_the_turn_until_their_time():
    box, sent = _box({"dispatched_together": True})
    box.add(_msg("started"))
    box.turn_ended()
    left = box.wait()
    assert sent == [] and left is not None and 0 < left <= BATCH_HOLD
    box.due = time.monotonic() - 1e-3     # its time has come
    box.turn_ended()
    assert _kinds(sent) == [["started"]]


def test_output_on_a_slurm_node_goes_when_the_loop_next_waits():
    box, sent = _box({"dispatched_together": True})
    box.add(_msg("started"))
    box.add(_msg("output", rank=0, text="hi"))
    assert box.wait() is None
    assert _kinds(sent) == [["started", "output"]]
