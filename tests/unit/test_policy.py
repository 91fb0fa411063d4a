"""Relaunch and completion policies are pure functions: state in, decision out."""

import signal

from master.nodes.model import ExitReason, Node, NodeState
from master.nodes.policy import (
    Action,
    JobOutcome,
    classify_exit,
    decide_on_exit,
    heartbeat_lost,
    training_finished,
)


def node(t="worker", rank=0, relaunches=0, memory_mb=0, state=NodeState.FAILED):
    return Node(type=t, rank=rank, id=7, relaunches=relaunches, memory_mb=memory_mb, state=state)


def test_classify_exit():
    assert classify_exit(0) == ExitReason.SUCCEEDED
    assert classify_exit(-signal.SIGKILL) == ExitReason.KILLED
    assert classify_exit(137) == ExitReason.KILLED
    assert classify_exit(1) == ExitReason.USER_ERROR
    assert classify_exit(77) == ExitReason.UNKNOWN
    assert classify_exit(-9, oom_killed=True) == ExitReason.OOM
    assert classify_exit(-15, stop_requested=True) == ExitReason.STOPPED


def test_relaunch_within_budgets():
    d = decide_on_exit(node(), ExitReason.KILLED, 3, 0, 10, False)
    assert d.action == Action.RELAUNCH and "worker-0" in d.reason


def test_rank_budget_exhausted_fails_job_with_reason():
    d = decide_on_exit(node(relaunches=3), ExitReason.USER_ERROR, 3, 3, 10, False)
    assert d.action == Action.FAIL_JOB
    assert "max_relaunches" in d.reason and "3" in d.reason


def test_job_budget_exhausted_fails_job():
    d = decide_on_exit(node(relaunches=0), ExitReason.KILLED, 3, 5, 5, False)
    assert d.action == Action.FAIL_JOB and "budget" in d.reason


def test_evaluator_exhausted_does_not_fail_job():
    d = decide_on_exit(node("evaluator", relaunches=2), ExitReason.USER_ERROR, 2, 0, 10, False)
    assert d.action == Action.NONE


def test_ps_oom_relaunches_with_more_memory():
    d = decide_on_exit(node("ps", memory_mb=1000), ExitReason.OOM, 3, 0, 10, False)
    assert d.action == Action.RELAUNCH and d.memory_mb == 1500


def test_ps_exit_zero_during_training_is_relaunched():
    assert (
        decide_on_exit(node("ps"), ExitReason.SUCCEEDED, 3, 0, 10, False).action == Action.RELAUNCH
    )


def test_no_relaunch_when_stopped_or_job_ending():
    assert decide_on_exit(node(), ExitReason.STOPPED, 3, 0, 10, False).action == Action.NONE
    assert decide_on_exit(node("ps"), ExitReason.KILLED, 3, 0, 10, True).action == Action.NONE
    assert decide_on_exit(node(), ExitReason.SUCCEEDED, 3, 0, 10, False).action == Action.NONE


def test_training_finished_needs_every_chief_and_worker_rank():
    replicas = {"ps": 1, "chief": 1, "worker": 2, "evaluator": 0}
    done = [
        node("chief", 0, state=NodeState.SUCCEEDED),
        node("worker", 0, state=NodeState.SUCCEEDED),
        node("ps", 0, state=NodeState.RUNNING),
    ]
    assert training_finished(done, replicas) == JobOutcome.RUNNING
    done.append(node("worker", 1, state=NodeState.SUCCEEDED))
    assert training_finished(done, replicas) == JobOutcome.SUCCEEDED


def test_heartbeat_lost_only_for_registered_running_nodes():
    n = node(state=NodeState.RUNNING)
    n.last_heartbeat = 100.0
    assert not heartbeat_lost(n, 200.0, 10.0)  # never registered: judged by process exit only
    n.registered = True
    assert heartbeat_lost(n, 200.0, 10.0)
    assert not heartbeat_lost(n, 105.0, 10.0)


def test_reported_reason_wins_over_the_exit_code_but_not_over_success():
    assert classify_exit(1, reported=ExitReason.HARDWARE) == ExitReason.HARDWARE
    assert classify_exit(-9, reported=ExitReason.OOM) == ExitReason.OOM
    assert classify_exit(0, reported=ExitReason.HARDWARE) == ExitReason.SUCCEEDED
    assert classify_exit(1, stop_requested=True, reported=ExitReason.OOM) == ExitReason.STOPPED


def test_is_hung_needs_held_shards_and_silence():
    from master.nodes.policy import is_hung

    n = node(state=NodeState.RUNNING)
    n.last_progress = 100.0
    assert is_hung(n, 200.0, 50.0, holds_shards=True)
    assert not is_hung(n, 200.0, 50.0, holds_shards=False)  # waiting for others' last shards
    assert not is_hung(n, 120.0, 50.0, holds_shards=True)
    assert not is_hung(n, 200.0, 0.0, holds_shards=True)  # detection off
    assert not is_hung(node("ps", state=NodeState.RUNNING), 200.0, 50.0, holds_shards=True)
