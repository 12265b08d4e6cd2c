"""Root cause and conclusion as plain functions of a run's messages.

``fold.RunFold`` and ``run.conclude`` are fed recorded sequences
(tests/recorded_runs.py): one-shot, restarts, Slurm, session cells.  No
process starts; every test runs in milliseconds.  The end-to-end tests
(test_engine, test_slurm, test_sessions) check the wiring to real ranks.
"""
from __future__ import annotations

import pytest

import recorded_runs as rec
from accel_magics.kernel_ext.environment import LaunchConfig
from accel_magics.kernel_ext.kernel import events as ev
from accel_magics.kernel_ext.kernel.errors import (DistributedRunError, DistributedStallError, DistributedTimeoutError,
                                                 RunInterrupted)
from accel_magics.kernel_ext.kernel.fold import RunFold
from accel_magics.kernel_ext.kernel.run import conclude
from accel_magics.kernel_ext.wire.messages import Kind, Status, StopReason

pytestmark = pytest.mark.timeout(30)

CFG = LaunchConfig(num_processes=2)
SLURM_CFG = LaunchConfig(num_processes=2, num_nodes=2)


def replay(name_or_seq, ranks=(0, 1), **kw):
    seq = rec.LOCAL[name_or_seq] if isinstance(name_or_seq, str) else name_or_seq
    return RunFold.replay(seq, run_id="r1", ranks=list(ranks), **kw)


def of_type(events, cls):
    return [e for e in events if isinstance(e, cls)]


# -- one node, recorded -----------------------------------------------------------------

def test_a_clean_run_gives_rank_0s_value_and_its_lines():
    events, outcome = replay("ok_value")
    assert outcome.finished.status == Status.OK == "ok"
    assert [(e.rank, e.text) for e in of_type(events, ev.Output)] == [(0, "hi 0"), (1, "hi 1")]
    assert of_type(events, ev.RunStarted)[0].pids == rec.LOCAL["ok_value"][0]["pids"]
    result = conclude(outcome, CFG, attempt=0, started=0.0)
    assert result.has_value and result.value == 41 and result.attempts == 1
    assert isinstance(events[-1], ev.RunFinished)


def test_the_rank_that_raised_is_the_root_cause_and_the_stopped_one_is_said_so():
    _, outcome = replay("exception_rank1")
    cause = outcome.finished.root_cause
    assert (cause.rank, cause.summary) == (1, "ValueError: boom")
    assert outcome.others == {0: "stopped (SIGTERM)"}
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, CFG, attempt=0, started=0.0)
    assert str(info.value).startswith("rank 1 failed: ValueError: boom")
    assert "raise ValueError('boom')" in info.value.report()


def test_a_rank_that_finished_the_cell_before_the_stop_is_not_called_stopped():
    """Rank 0 raises, rank 1 had already finished the cell (its result came)
    and was parked when the run's stop ended its process: it was listed as
    "stopped (exit code 0)", as if the stop had cut its cell short."""
    seq = [dict(m) for m in rec.LOCAL["exception_rank1"]]
    failed = next(m for m in seq if m["kind"] == "rank_event")
    seq.insert(seq.index(failed), {"kind": "rank_event", "node_rank": 0, "rank": 0,
                                   "event": {"kind": "result", "timestamp": failed["event"]["timestamp"] - 0.01}})
    exit0 = next(m for m in seq if m["kind"] == "exit" and m["rank"] == 0)
    exit0.update(exitcode=0, signal=None)   # released from its parking by the stop
    _, outcome = replay(seq)
    assert outcome.finished.root_cause.rank == 1
    assert outcome.others == {} and outcome.unfinished == []
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, CFG, attempt=0, started=0.0)
    assert "stopped" not in info.value.report(), info.value.report()


def test_a_rank_killed_by_a_signal_is_named():
    _, outcome = replay("sigkill_rank1")
    assert outcome.finished.root_cause.summary == "killed by SIGKILL"
    assert outcome.finished.root_cause.kind == "signal"


def test_a_timeout_keeps_every_ranks_stacks():
    events, outcome = replay("timeout")
    assert outcome.finished.status == Status.TIMEOUT
    assert sorted(outcome.finished.stacks) == [0, 1]
    assert len(of_type(events, ev.RankStacks)) == 2
    with pytest.raises(DistributedTimeoutError):
        conclude(outcome, LaunchConfig(num_processes=2, timeout=2), attempt=0, started=0.0)


def test_a_rank_that_left_early_is_why_its_peer_failed():
    _, outcome = replay("rank_left_early")
    assert outcome.finished.root_cause.rank == 0 and outcome.finished.root_cause.secondary
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, CFG, attempt=0, started=0.0)
    assert "rank 1 (sys.exit(0))" in str(info.value)


def test_a_rank_whose_set_up_failed_after_a_peer_left_is_said_to_have_failed_there():
    """A finished rank waits PEERS_JOIN_WAIT for its peers' init_process_group,
    no longer; a peer whose set-up then fails ("Connection closed by peer",
    its joined event says failed) was not "waiting in a collective"."""
    seq = list(rec.LOCAL["rank_left_early"])
    at = next(i for i, m in enumerate(seq) if m.get("event", {}).get("kind") == "failed")
    seq.insert(at, {"kind": "rank_event", "node_rank": 0, "rank": seq[at]["rank"],
                    "event": {"kind": "joined", "round": 1, "failed": True}})
    _, outcome = replay(seq)
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, CFG, attempt=0, started=0.0)
    assert str(info.value).startswith("rank 0 failed in init_process_group, still connecting to a rank that had "
                                      "already finished the cell: rank 1 (sys.exit(0)). A finished rank waits at "
                                      "most 2 s"), str(info.value)
    assert "dist.barrier()" in str(info.value)
    _, plain = replay("rank_left_early")   # its set-up went through: a collective, as before
    with pytest.raises(DistributedRunError) as info:
        conclude(plain, CFG, attempt=0, started=0.0)
    assert str(info.value).startswith("rank 0 failed waiting in a collective")


def test_restarts_a_failed_attempt_asks_for_another_and_the_next_one_succeeds():
    cfg = LaunchConfig(num_processes=2, max_restarts=1)
    events, first = replay("restart_attempt_0", attempt=0, max_restarts=1)
    assert of_type(events, ev.RunStarted)[0].attempt == 0
    assert conclude(first, cfg, attempt=0, started=0.0, last=False) is None   # another attempt may start
    events, second = replay("restart_attempt_1", attempt=1, max_restarts=1)
    assert of_type(events, ev.RunStarted)[0].attempt == 1
    result = conclude(second, cfg, attempt=1, started=0.0, last=True)
    assert result.value == "done" and result.attempts == 2


def test_the_last_failed_attempt_is_the_cells_error():
    cfg = LaunchConfig(num_processes=2, max_restarts=1)
    _, outcome = replay("restart_attempt_0", attempt=1, max_restarts=1)
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, cfg, attempt=1, started=0.0, last=True)
    assert "[after 2 attempts]" in str(info.value) and "flaky" in str(info.value)


def test_the_stop_button_during_a_run_is_an_interrupt_whatever_the_supervisor_said():
    fold = RunFold(run_id="r1", ranks=[0, 1])
    for msg in rec.LOCAL["exception_rank1"]:
        fold.feed(msg)
    fold.interrupted = True
    outcome = fold.outcome()
    assert outcome.finished.status == Status.INTERRUPTED
    with pytest.raises(RunInterrupted):
        conclude(outcome, CFG, attempt=0, started=0.0)


def test_a_forced_end_counts_every_rank_that_did_not_exit_as_unfinished():
    seq = rec.LOCAL["ok_value"][:1] + [{"kind": "finished", "reason": "interrupt", "forced": "it did not answer"}]
    _, outcome = replay(seq)
    assert outcome.unfinished == [0, 1] and outcome.forced == "it did not answer"
    with pytest.raises(RunInterrupted) as info:
        conclude(outcome, CFG, attempt=0, started=0.0)
    assert "did not answer" in str(info.value.report() if hasattr(info.value, "report") else info.value)


def test_unknown_kinds_are_ignored_and_a_supervisor_error_is_raised():
    from accel_magics.kernel_ext.kernel.errors import LauncherError

    fold = RunFold(run_id="r1", ranks=[0, 1])
    fold.feed({"kind": "from_a_newer_version", "x": 1})
    fold.feed({"kind": "released"})
    with pytest.raises(LauncherError, match="boom in the supervisor"):
        fold.feed({"kind": "supervisor_error", "traceback": "boom in the supervisor"})


# -- every node of an allocation --------------------------------------------------------

def test_slurm_the_rank_that_failed_on_the_other_node_is_named_with_its_node():
    events, outcome = replay(rec.SLURM_REMOTE_RANK_FAILS, ranks=range(4), num_nodes=2)
    cause = outcome.finished.root_cause
    assert cause.rank == 3 and cause.summary == "RuntimeError: node 2 broke (on node n2)"
    started = of_type(events, ev.RunStarted)[0]
    assert started.placement() == "n1: ranks 0-1, n2: ranks 2-3"
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, SLURM_CFG, attempt=0, started=0.0)
    assert str(info.value).startswith("rank 3 failed: RuntimeError: node 2 broke (on node n2)")
    assert "rank 0" in info.value.report() and "(on node n1)" in info.value.report()


def test_slurm_a_rank_that_exited_after_init_is_the_root_cause_not_the_gloo_errors_it_caused():
    _, outcome = replay(rec.SLURM_REMOTE_RANK_EXITS, ranks=range(4), num_nodes=2)
    cause = outcome.finished.root_cause
    assert cause.rank == 3 and "exited with code 3" in cause.summary and "(on node n2)" in cause.summary


def test_slurm_a_stop_shows_the_stacks_of_every_node():
    _, outcome = replay(rec.SLURM_INTERRUPTED, ranks=range(4), num_nodes=2)
    assert outcome.finished.status == Status.INTERRUPTED and sorted(outcome.finished.stacks) == [0, 1, 2, 3]
    with pytest.raises(RunInterrupted) as info:
        conclude(outcome, SLURM_CFG, attempt=0, started=0.0)
    assert all(f"stuck_{r}" in info.value.report() for r in range(4))


# -- session cells ------------------------------------------------------------------------

def test_a_session_cell_reports_the_names_it_bound_and_stays_alive():
    _, outcome = replay(rec.SESSION_CELL_OK, session_cell=True)
    assert outcome.session == "alive" and outcome.assigned == {"model"} and outcome.deleted == {"tmp"}
    assert conclude(outcome, CFG, attempt=0, started=0.0).attempts == 1


def test_a_session_cell_whose_rank_died_loses_the_session_and_names_the_rank():
    _, outcome = replay(rec.SESSION_CELL_LOST, session_cell=True)
    assert outcome.session == "lost" and "rank 1" in outcome.lost
    assert outcome.finished.root_cause.rank == 1 and outcome.finished.root_cause.summary == "killed by SIGKILL"


def test_a_stopped_rank_says_where_it_was():
    """Issue 25 item 9: a rank stopped while it waited in a barrier said only
    "stopped (SIGTERM)"; its stacks (sent before its exit) say where."""
    seq = [{"kind": "rank_event", "rank": 1, "event": {"kind": "failed", "exc_type": "ValueError", "message": "boom",
                                                         "traceback": "...", "timestamp": 1.0, "secondary": False}},
           {"kind": "stacks", "rank": 0, "native": False, "text": "the cell's thread: ...",
            "where": "barrier (Cell In[5], line 3)"},
           {"kind": "exit", "rank": 0, "exitcode": None, "signal": "SIGTERM", "stopped": True, "timestamp": 2.0},
           {"kind": "exit", "rank": 1, "exitcode": 1, "signal": None, "stopped": False, "timestamp": 2.0},
           {"kind": "finished", "reason": "failed"}]
    _, outcome = replay(seq)
    assert outcome.others == {0: "stopped (SIGTERM) in barrier (Cell In[5], line 3)"}
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, CFG, attempt=0, started=0.0)
    assert "rank 0: stopped (SIGTERM) in barrier (Cell In[5], line 3)" in info.value.report(), info.value.report()


def test_a_session_timeout_names_the_rank_that_never_came_back():
    """Hostile pass: a session cell with --timeout, rank 1 finished and rank 0
    in a barrier: the error said "its ranks were stopped" and named no rank
    (rank 0 did not come back to its prompt, so no "stopped" exit of it was
    counted).  A rank whose stacks were taken had not finished."""
    seq = [{"kind": "rank_event", "rank": 1, "event": {"kind": "result", "timestamp": 5.0, "in_world": True,
                                                         "rounds": 1}},
           {"kind": "stacks", "rank": 0, "native": True, "text": "barrier (torch/distributed/distributed_c10d.py)"},
           {"kind": "exit", "rank": 0, "exitcode": None, "signal": "SIGKILL", "stopped": True, "timestamp": 9.0,
            "prompt": False},
           {"kind": "finished", "reason": "timeout", "session": "lost",
            "lost": "rank 0 was in barrier and did not come back from the --timeout stop"}]
    _, outcome = replay(seq, session_cell=True)
    assert outcome.unfinished == [0]
    with pytest.raises(DistributedTimeoutError) as info:
        conclude(outcome, LaunchConfig(num_processes=2, timeout=8), attempt=0, started=0.0)
    assert str(info.value).endswith("rank(s) 0 had not finished and were stopped"), str(info.value)
    seq_no_exit = [m for m in seq if m["kind"] != "exit"]   # its exit not seen before the verdict
    _, outcome = replay(seq_no_exit, session_cell=True)
    assert outcome.unfinished == [0]


def _session_stop(agreed: tuple, in_world: bool = True) -> list:
    """A session cell's stop button, recorded: both ranks back at their prompt
    with KeyboardInterrupt, those in ``agreed`` after the optimizer step their
    peers agreed on."""
    seq = []
    for rank in (0, 1):
        seq.append({"kind": "exit", "rank": rank, "exitcode": 0, "signal": None, "stopped": True, "prompt": True,
                    "timestamp": 2.0, "where": "Cell In[7], line 4", **({"agreed": True} if rank in agreed else {}),
                    **({"in_world": True} if in_world else {})})   # its world from an earlier cell
    return seq + [{"kind": "finished", "reason": "interrupt", "session": "alive"}]


@pytest.mark.parametrize("agreed, in_world, says", [
    ((0, 1), True, None),
    ((0,), True, "did not all stop after an optimizer step they agreed on"),
    ((), True, "did not all stop after an optimizer step they agreed on"),
    ((), False, "had no process group to agree on a step"),
])
def test_a_session_stop_warns_that_states_may_differ_unless_every_rank_stopped_at_the_agreed_step(
        agreed, in_world, says):
    from accel_magics.kernel_ext.kernel.session import apart_note

    _, outcome = replay(_session_stop(agreed, in_world), session_cell=True)
    assert outcome.agreed == set(agreed) and outcome.in_world == in_world
    note = apart_note(outcome, 2)
    if says is None:
        assert note == ""
    else:
        assert says in note and "their state may differ" in note, note
    assert apart_note(outcome, 1) == ""   # one rank: nothing to differ from


def test_a_session_cell_the_kernel_had_to_end_is_a_lost_session():
    seq = [{"kind": "finished", "reason": "interrupt", "forced": "it did not answer the stop"}]
    _, outcome = replay(seq, session_cell=True)
    assert outcome.session == "lost" and "did not answer the stop" in outcome.lost


def test_a_session_cell_sent_as_its_session_was_lost_ends_with_the_sessions_word():
    """The supervisor lost its session (a rank died at its prompt) before it
    read the cell and exited: its "session lost" for the session (which the
    cell's handle takes too) is the cell's end, naming the rank; before, the
    cell waited for the supervisor's exit and blamed that."""
    seq = [{"kind": "session_lost", "lost": "rank 1 killed by SIGKILL; a session cannot go on without one of "
                                            "its ranks"}]
    _, outcome = replay(seq, session_cell=True)
    assert outcome.session == "lost" and outcome.lost.startswith("rank 1 killed by SIGKILL")
    assert outcome.finished.status == "failed" and outcome.finished.root_cause is None


# -- the schema ---------------------------------------------------------------------------

def test_the_schema_reads_as_text_and_refuses_unknown_values_in_one_place():
    assert Kind("output") is Kind.OUTPUT and f"{Kind.OUTPUT}" == "output" and str(Status.OK) == "ok"
    assert Kind.parse("nope") is None
    assert {Kind.FINISHED: 1}[Kind.parse("finished")] == 1


@pytest.mark.parametrize("reasons, merged", [
    ([None, None], None),
    (["failed", "remote_failed"], StopReason.FAILED),
    (["remote_failed", None], StopReason.FAILED),
    (["failed", "interrupt"], StopReason.INTERRUPT),
    (["timeout", "failed"], StopReason.TIMEOUT),
    (["terminated", "remote_failed"], StopReason.TERMINATED),
])
def test_the_reason_a_run_on_several_nodes_ended(reasons, merged):
    assert StopReason.merged(reasons) == merged


@pytest.mark.parametrize("reason, failed, status", [
    (None, False, Status.OK), (None, True, Status.FAILED), ("failed", True, Status.FAILED),
    ("remote_failed", True, Status.FAILED), ("interrupt", True, Status.INTERRUPTED),
    ("timeout", False, Status.TIMEOUT), ("rendezvous", False, Status.RENDEZVOUS_FAILED),
    ("stalled", False, Status.STALLED), ("terminated", True, Status.TERMINATED),
])
def test_the_status_of_a_reason(reason, failed, status):
    assert Status.of(reason, failed) is status


# -- a rank that leaves the world before or after it forms --------------------------------

def _fold(**kw):
    return RunFold("r1", list(range(4)), num_nodes=2, **kw)


def test_ranks_waiting_in_init_process_group_for_a_rank_that_finished_are_stopped_once():
    fold = _fold()
    stops = []
    for msg in rec.SLURM_LEFT_BEFORE_INIT:
        fold.feed(msg)
        stops.append(fold.must_stop())
    assert stops == [False] * 4 + [True, False]   # at rank 2's result, and only once
    for msg in rec.SLURM_LEFT_BEFORE_INIT_STOPPED:
        fold.feed(msg)
        assert not fold.must_stop()
    outcome = fold.outcome()
    assert outcome.finished.status == Status.STALLED
    with pytest.raises(DistributedStallError) as info:
        conclude(outcome, SLURM_CFG, attempt=0, started=0.0)
    assert str(info.value).startswith("rank(s) 0, 1, 3 wait in init_process_group for rank 2 (on node n2), "
                                      "which had already finished the cell (sys.exit(0))")
    assert "dist.init_process_group('gloo')" in info.value.report()


@pytest.mark.parametrize("case", ["no one in init yet", "it had joined", "joined in an earlier session cell",
                                  "init went by"])
def test_a_rank_that_finished_strands_no_one_unless_they_wait_for_it_in_init(case):
    fold = _fold()
    result = {"kind": "result", "exited": True, "in_world": case == "joined in an earlier session cell",
              "timestamp": 1.0}
    seq = {"no one in init yet": [(2, result)],
           "it had joined": [(2, {"kind": "joining"}), (2, {"kind": "joined"}), (0, {"kind": "joining"}),
                             (2, result)],
           "joined in an earlier session cell": [(0, {"kind": "joining"}), (2, result)],
           "init went by": [(0, {"kind": "joining"}), (0, {"kind": "joined"}), (2, result)]}[case]
    for rank, event in seq:
        fold.feed({"kind": "rank_event", "rank": rank, "event": event})
        assert not fold.must_stop(), (rank, event)


def test_a_rank_that_did_fewer_rounds_of_init_strands_a_rank_in_a_later_round():
    """Hostile pass: rank 1 skipped one of three init/destroy rounds and
    finished; rank 0 waited in its third init_process_group for good (rank 1
    had joined earlier rounds, so "it was in the world" hid it).  Each join
    says its round: a rank that finished after fewer rounds never comes."""
    fold = RunFold("r1", [0, 1], num_nodes=1)
    seq = [(r, {"kind": k, "round": n}) for n in (1, 2) for r in (0, 1) for k in ("joining", "joined")]
    seq += [(1, {"kind": "result", "in_world": False, "rounds": 2, "timestamp": 3.0}),
            (0, {"kind": "joining", "round": 3})]
    stops = []
    for rank, event in seq:
        fold.feed({"kind": "rank_event", "rank": rank, "event": event})
        stops.append(fold.must_stop())
    assert stops == [False] * (len(seq) - 1) + [True]
    assert fold.stranded["ranks"] == [0] and fold.stranded["finished"] == [1]


def test_a_later_round_waits_for_no_one_while_every_peer_did_as_many_rounds():
    """The same rounds with rank 1 finishing last: its result (3 rounds) comes
    before rank 0's last "joined" (events of two ranks are not ordered)."""
    fold = RunFold("r1", [0, 1], num_nodes=1)
    seq = [(r, {"kind": k, "round": n}) for n in (1, 2) for r in (0, 1) for k in ("joining", "joined")]
    seq += [(0, {"kind": "joining", "round": 3}), (1, {"kind": "joining", "round": 3}),
            (1, {"kind": "joined", "round": 3}),
            (1, {"kind": "result", "in_world": False, "rounds": 3, "timestamp": 3.0})]
    for rank, event in seq:
        fold.feed({"kind": "rank_event", "rank": rank, "event": event})
        assert not fold.must_stop(), (rank, event)


def test_an_exit_with_code_0_mid_cell_is_the_root_cause_of_the_lost_connections_it_caused():
    _, outcome = replay(rec.SLURM_EXIT_0_AFTER_INIT, ranks=range(4), num_nodes=2)
    cause = outcome.finished.root_cause
    assert cause.rank == 2 and not cause.secondary
    with pytest.raises(DistributedRunError) as info:
        conclude(outcome, SLURM_CFG, attempt=0, started=0.0)
    assert str(info.value).startswith("rank 2 failed: exited with code 0 before the cell ended"), str(info.value)
    assert "(on node n2)" in str(info.value)


def test_an_exit_with_code_0_mid_cell_that_hurt_no_one_is_no_failure():
    seq = [m for m in rec.SLURM_EXIT_0_AFTER_INIT if m.get("rank") != 1] + []
    seq = [m if m["kind"] != "finished" else {**m, "reason": None} for m in seq]
    _, outcome = replay(seq, ranks=range(4), num_nodes=2)
    assert outcome.finished.status == Status.OK and outcome.finished.root_cause is None


def test_an_exit_with_code_0_mid_cell_is_the_root_cause_even_when_its_supervisor_counts_it_stopped():
    """Its supervisor began stopping the node's ranks (a peer failed) before it had
    reaped the rank that left: that exit reads "stopped", yet it is still the cause."""
    seq = [({**m, "stopped": True} if m["kind"] == "exit" and m["rank"] == 2 else m)
           for m in rec.SLURM_EXIT_0_AFTER_INIT]
    _, outcome = replay(seq, ranks=range(4), num_nodes=2)
    assert outcome.finished.root_cause.rank == 2


def test_a_kernel_per_node_stops_its_ranks_waiting_for_a_rank_that_left_on_another_node():
    """Node 0's fold sees only node 0's ranks; node 1's departure comes through the
    store as ``remote_departed`` (see supervisor/nodes.py, Nodes.check_remote)."""
    fold = RunFold("r1", [0, 1], num_nodes=2)
    for msg in ({"kind": "started", "pids": {0: 11, 1: 12}},
                {"kind": "rank_event", "rank": 0, "event": {"kind": "joining"}},
                {"kind": "rank_event", "rank": 1, "event": {"kind": "joining"}}):
        fold.feed(msg)
        assert not fold.must_stop()
    fold.feed({"kind": "remote_departed", "rank": 2, "node": 1, "how": "sys.exit(0)"})
    assert fold.must_stop()
    for msg in rec.SLURM_LEFT_BEFORE_INIT_STOPPED:
        if msg.get("rank") in (None, 0, 1):
            fold.feed(msg)
    with pytest.raises(DistributedStallError) as info:
        conclude(fold.outcome(), SLURM_CFG, attempt=0, started=0.0)
    assert str(info.value).startswith("rank(s) 0, 1 wait in init_process_group for rank 2 (on node 1), "
                                      "which had already finished the cell (sys.exit(0))")


def test_an_unfinished_rank_without_a_stack_is_named_not_left_out():
    """A SIGSTOP'd rank cannot dump its stack: the interrupt's report listed
    only rank 0's, with no word of rank 1."""
    from accel_magics.kernel_ext.kernel.errors import NO_STACK, RunInterrupted

    report = RunInterrupted({0: 'File "Cell In[3]", line 2, in <module>'}, [0, 1]).report()
    assert 'rank 0:\n    File "Cell In[3]", line 2' in report
    assert f"rank 1: {NO_STACK}" in report and "SIGSTOP" in report
    assert "rank 1" not in DistributedTimeoutError(3, {0: "x"}, [0]).report()   # only unfinished ranks


def test_no_message_says_rank_s_dash():
    """Issue 24 item 8: "rank(s) - were stopped" when no rank was listed."""
    from accel_magics.kernel_ext.kernel.errors import RunInterrupted

    assert str(RunInterrupted({}, [])) == "interrupted: no rank was still running"
    assert str(RunInterrupted({}, [0, 2])) == "interrupted: rank(s) 0, 2 were stopped"
    assert str(DistributedTimeoutError(3, {}, [])) == "the run exceeded --timeout 3s; its ranks were stopped"
    assert str(DistributedTimeoutError(3, {}, [1])).endswith("rank(s) 1 had not finished and were stopped")
    seq = [m for m in rec.LOCAL["timeout"] if m["kind"] != "finished"] + [
        {"kind": "finished", "reason": "terminated", "forced": None, "terminated_on": []}]
    seq = [({**m, "stopped": False} if m["kind"] == "exit" else m) for m in seq]
    _, outcome = replay(seq)
    outcome.unfinished = []
    with pytest.raises(Exception) as info:
        conclude(outcome, CFG, attempt=0, started=0.0)
    assert "rank(s) -" not in str(info.value) and str(info.value).endswith("so every rank was stopped."), info.value


def test_resource_samples_reach_the_views_as_events():
    events, _ = replay([{"kind": "resources", "ranks": {"0": [50.0, 1024, None], "1": [0.0, 2048, 4096]}}])
    assert of_type(events, ev.Resources) == [ev.Resources({0: (50.0, 1024, None, None), 1: (0.0, 2048, 4096, None)})]


# -- the outcome's parts, as plain functions ----------------------------------------------

def test_a_session_cell_is_completed_only_when_every_rank_reported_and_nothing_failed():
    from accel_magics.kernel_ext.kernel.fold import completed_cell

    args = dict(session_cell=True, ranks=[0, 1], results={0, 1}, failures={}, unfinished=[], forced=None,
                session="alive", reason=StopReason.TIMEOUT)
    assert completed_cell(**args) is True
    assert not completed_cell(**{**args, "session_cell": False})
    assert not completed_cell(**{**args, "results": {0}})
    assert not completed_cell(**{**args, "session": "lost"})
    assert not completed_cell(**{**args, "forced": "SIGKILL"})
    assert not completed_cell(**{**args, "reason": StopReason.FAILED})


def test_unfinished_ranks_count_those_with_stacks_and_after_a_forced_end_every_rank_not_exited():
    from accel_magics.kernel_ext.kernel.fold import unfinished_ranks

    assert unfinished_ranks([2], {0: "s", 1: "s"}, {1: ("returned", 0.0)}, None, [0, 1, 2, 3], {0, 1, 2}) == [0, 2]
    assert unfinished_ranks([2], {}, {}, "SIGKILL", [0, 1, 2, 3], {0, 1}) == [2, 3]


def test_a_mid_cell_exit_is_blamed_only_when_every_failure_is_a_consequence():
    from accel_magics.kernel_ext.kernel.fold import blame_mid_cell_exits

    lost = {1: ev.RankFailure(1, "exception", "gloo: connection closed", secondary=True)}
    blamed = blame_mid_cell_exits(lost, {0: 5.0})
    assert blamed[0].kind == "exit" and blamed[0].timestamp == 5.0 and blamed[1] is lost[1]
    assert 0 not in lost   # the recorded failures are not changed
    real = {1: ev.RankFailure(1, "exception", "ValueError: boom")}
    assert blame_mid_cell_exits(real, {0: 5.0}) == real


def test_failures_say_their_node_once_and_another_nodes_word_weighs_as_verified():
    from accel_magics.kernel_ext.kernel.fold import placed, weigh_remote

    here = placed({1: ev.RankFailure(1, "exception", "ValueError: boom", timestamp=2.0),
                   0: ev.RankFailure(0, "exception", "lost (on node b)", secondary=True)}, {0: "b", 1: "a"})
    assert [(f.rank, f.summary) for f in here] == [(0, "lost (on node b)"), (1, "ValueError: boom (on node a)")]
    remote = ev.RankFailure(3, "remote", "KeyError: x (on node c)")
    listed, cause = weigh_remote(list(here), remote, verified=False)
    assert cause.rank == 1 and [f.rank for f in listed] == [0, 1, 3]
    listed, cause = weigh_remote(list(here), remote, verified=True)
    assert cause is remote and [f.rank for f in listed] == [3, 0, 1] and all(f.secondary for f in listed[1:])
    assert weigh_remote([], None, True) == ([], None)


def test_a_session_cell_without_the_sessions_word_lost_it_and_stopped_ranks_say_where():
    from accel_magics.kernel_ext.kernel.fold import session_after, stopped_others

    assert session_after(None, None, True, "SIGKILL") == (
        "lost", "its supervisor did not respond (SIGKILL), so the kernel killed it")
    assert session_after("alive", None, True, None) == ("alive", None)
    assert session_after(None, None, False, None) == (None, None)
    assert stopped_others({0: ("SIGTERM", False), 1: ("KeyboardInterrupt", True)}, {1: "barrier"}) == {
        0: "stopped (SIGTERM)", 1: "stopped (KeyboardInterrupt) in barrier, back at its prompt"}

def test_a_restarts_lines_that_come_before_its_started_are_shown_after_it():
    """On several nodes one node's output can come before every node's
    "started" (slurm merges those): a restart's views drop the last attempt's
    lines at its RunStarted, so its own earlier lines must come after it."""
    seq = [{"kind": "output", "rank": 0, "text": "early\n"},
           {"kind": "started", "pids": {0: 10, 1: 11}},
           {"kind": "output", "rank": 1, "text": "later\n"},
           {"kind": "finished", "reason": None}]
    events, _ = replay(seq, attempt=1, max_restarts=1)
    kinds = [(type(e).__name__, getattr(e, "text", "")) for e in events if not isinstance(e, ev.Heartbeat)]
    assert kinds[:3] == [("RunStarted", ""), ("Output", "early\n"), ("Output", "later\n")], kinds
    first, _ = replay(seq)   # a first attempt: as they come
    assert [type(e).__name__ for e in first][:2] == ["Output", "RunStarted"]
    never, _ = replay([seq[0], seq[3]], attempt=1, max_restarts=1)   # never started: said all the same
    assert [type(e).__name__ for e in never][:2] == ["Output", "RunFinished"]
