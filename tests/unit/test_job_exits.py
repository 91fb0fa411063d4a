"""After a node's end: why it ended, how the data follows a lost PS, relaunch or fail the job."""

from __future__ import annotations

from master.config import parse_job_spec
from master.job.exit_plan import (
    STARTUP_WINDOW_SECONDS,
    DataRecovery,
    diagnose_node_exit,
    ended_cleanly,
    exit_message,
    failure_message,
    last_line,
    ps_loss_recovery,
    relaunch_decision,
)
from master.job.model import NodeStart
from master.nodes.model import Diagnosis, ExitReason, Finding, Node, NodeState, ReportedExit
from master.nodes.policy import Action
from master.platform.api import NodeEvent

TRACEBACK = (
    "loading data\n"
    "Traceback (most recent call last):\n"
    '  File "train.py", line 3, in <module>\n'
    "    import tensorflw\n"
    "ModuleNotFoundError: No module named 'tensorflw'\n"
)
SPEC = parse_job_spec(
    {
        "name": "j",
        "command": "python train.py",
        "ps": {"replicas": 1, "max_relaunches": 2},
        "worker": {"replicas": 2, "max_relaunches": 3},
        "evaluator": {"replicas": 1},
        "max_relaunches": 5,
    },
    "job.yaml",
    "/tmp",
)


def _event(node: Node, exit_code: int, message: str = "", oom_killed: bool = False) -> NodeEvent:
    return NodeEvent(node.type, node.rank, node.id, exit_code, oom_killed, message)


def test_the_masters_own_findings_explain_a_kill_first():
    for flag, reason in (
        (Finding.HEARTBEAT_LOST, ExitReason.HEARTBEAT_LOST),
        (Finding.HUNG, ExitReason.HANG),
        (Finding.STRAGGLER_REPLACED, ExitReason.STRAGGLER),
    ):
        node = Node("worker", 0, id=1, steps=10)
        node.findings.add(flag)
        assert diagnose_node_exit(node, _event(node, -9), job_ended=False).reason == reason


def test_an_error_before_the_first_step_is_deterministic_and_after_it_is_not():
    fresh = Node("worker", 0, id=1, steps=0)
    d = diagnose_node_exit(fresh, _event(fresh, 1, TRACEBACK), job_ended=False)
    assert d.reason == ExitReason.USER_ERROR and d.deterministic
    assert d.excerpt.endswith("No module named 'tensorflw'")
    trained = Node("worker", 0, id=2, steps=100)
    assert not diagnose_node_exit(trained, _event(trained, 1, TRACEBACK), False).deterministic
    # A PS never reports steps: it is never taken as failing at start-up.
    ps = Node("ps", 0, id=3)
    assert not diagnose_node_exit(ps, _event(ps, 1, TRACEBACK), False).deterministic


def test_a_node_stopped_by_the_master_or_after_the_job_ended_is_stopped():
    node = Node("ps", 0, id=1, stop_requested=True)
    assert diagnose_node_exit(node, _event(node, -15), job_ended=False).reason == (
        ExitReason.STOPPED
    )
    other = Node("worker", 0, id=2, steps=3)
    assert diagnose_node_exit(other, _event(other, -15), job_ended=True).reason == (
        ExitReason.STOPPED
    )
    assert ended_cleanly(ExitReason.STOPPED) and ended_cleanly(ExitReason.SUCCEEDED)
    assert not ended_cleanly(ExitReason.KILLED)


def test_what_the_node_reported_wins_over_the_exit_code_and_is_its_message():
    node = Node("worker", 0, id=1, steps=10)
    node.reported_exit = ReportedExit(ExitReason.HARDWARE, "ECC error on GPU 0")
    event = _event(node, 1, "exit status 1")
    assert diagnose_node_exit(node, event, job_ended=False).reason == ExitReason.HARDWARE
    assert exit_message(node, event) == "ECC error on GPU 0"
    silent = Node("worker", 1, id=2)
    assert exit_message(silent, _event(silent, 1, "exit status 1")) == "exit status 1"


def test_a_sigkill_near_the_memory_limit_is_an_oom():
    node = Node("ps", 0, id=1, memory_mb=1000, memory_rss_bytes=990 * 2**20)
    assert diagnose_node_exit(node, _event(node, -9), job_ended=False).reason == ExitReason.OOM


def test_a_ps_lost_while_training_sends_the_data_back():
    ps = Node("ps", 0, id=1)
    assert ps_loss_recovery(ps, ExitReason.KILLED, False, False) == DataRecovery.ROLLBACK
    # The chief reports the step it restored: until then the held shards go back.
    assert ps_loss_recovery(ps, ExitReason.OOM, False, True) == DataRecovery.FREE_HELD_SHARDS
    assert ps_loss_recovery(ps, ExitReason.STOPPED, False, False) == DataRecovery.NONE
    assert ps_loss_recovery(ps, ExitReason.KILLED, True, False) == DataRecovery.NONE  # ending
    worker = Node("worker", 0, id=2)
    assert ps_loss_recovery(worker, ExitReason.KILLED, False, False) == DataRecovery.NONE


def _diagnosis(reason: ExitReason, deterministic: bool = False, excerpt: str = "") -> Diagnosis:
    return Diagnosis(reason, reason.value, excerpt, deterministic)


def test_relaunch_within_the_rank_and_job_budgets():
    node = Node("worker", 1, id=4, relaunches=2, exit_code=-9)
    d = relaunch_decision(node, _diagnosis(ExitReason.KILLED), SPEC, 4, training_done=False)
    assert d.action == Action.RELAUNCH
    spent = Node("worker", 1, id=5, relaunches=3, exit_code=-9)
    d = relaunch_decision(spent, _diagnosis(ExitReason.KILLED), SPEC, 4, training_done=False)
    assert d.action == Action.FAIL_JOB and "worker.max_relaunches is 3" in d.reason
    d = relaunch_decision(node, _diagnosis(ExitReason.KILLED), SPEC, 5, training_done=False)
    assert d.action == Action.FAIL_JOB and "(max_relaunches: 5) is used up" in d.reason


def test_nothing_is_relaunched_once_the_job_has_ended():
    # A node killed just before the job failed ends while the platform shuts down: recorded,
    # never relaunched (a launch on the closed platform crashed the master's exit).
    node = Node("worker", 1, id=4, relaunches=0, exit_code=-9)
    d = relaunch_decision(
        node, _diagnosis(ExitReason.HEARTBEAT_LOST), SPEC, 0, training_done=False, job_ended=True
    )
    assert d.action == Action.NONE


def test_a_ps_out_of_memory_comes_back_with_more():
    ps = Node("ps", 0, id=1, memory_mb=1000)
    d = relaunch_decision(ps, _diagnosis(ExitReason.OOM), SPEC, 0, training_done=False)
    assert (d.action, d.memory_mb) == (Action.RELAUNCH, 1500)


def test_once_training_is_done_ps_and_evaluators_are_not_relaunched_but_workers_are():
    for node_type in ("ps", "evaluator"):
        node = Node(node_type, 0, id=1, exit_code=-9)
        d = relaunch_decision(node, _diagnosis(ExitReason.KILLED), SPEC, 0, training_done=True)
        assert d.action == Action.NONE
    worker = Node("worker", 0, id=2, exit_code=-9)
    d = relaunch_decision(worker, _diagnosis(ExitReason.KILLED), SPEC, 0, training_done=True)
    assert d.action == Action.RELAUNCH


def test_a_deterministic_failure_fails_the_job_with_its_excerpt():
    node = Node("worker", 0, id=1, exit_code=1)
    diagnosis = _diagnosis(ExitReason.USER_ERROR, deterministic=True, excerpt="NameError: x")
    d = relaunch_decision(node, diagnosis, SPEC, 0, training_done=False)
    assert d.action == Action.FAIL_JOB
    assert failure_message(d.reason, diagnosis, "ignored") == f"{d.reason}\nNameError: x"


def test_any_other_failure_names_the_last_line_the_node_wrote():
    diagnosis = _diagnosis(ExitReason.UNKNOWN)
    assert failure_message("worker-0 failed", diagnosis, "a\n  last words  \n\n") == (
        "worker-0 failed (last log line: last words)"
    )
    assert failure_message("worker-0 failed", diagnosis, "") == "worker-0 failed"
    assert last_line("x" * 400) == "x" * 300


def test_a_worker_that_succeeded_is_done_but_a_ps_that_exited_is_relaunched():
    worker = Node("worker", 0, id=1, state=NodeState.SUCCEEDED, exit_code=0)
    d = relaunch_decision(worker, _diagnosis(ExitReason.SUCCEEDED), SPEC, 0, False)
    assert d.action == Action.NONE
    ps = Node("ps", 0, id=2, state=NodeState.SUCCEEDED, exit_code=0)
    assert relaunch_decision(ps, _diagnosis(ExitReason.SUCCEEDED), SPEC, 0, False).action == (
        Action.RELAUNCH
    )


def test_a_trainer_failing_soon_after_a_ps_loss_names_it_as_the_cause():
    from master.job.exit_plan import PS_LOSS_WINDOW_SECONDS, ps_loss_cause

    chief, worker, ps = Node("chief", 0, id=2), Node("worker", 1, id=4), Node("ps", 0, id=1)
    losses = {"ps-0": 100.0}
    cause = ps_loss_cause(chief, losses, 130.0)
    assert cause.startswith("after ps-0 was lost (a TF2 coordinator cannot rebuild the variables")
    assert ps_loss_cause(worker, losses, 130.0) == "after ps-0 was lost"
    assert ps_loss_cause(ps, losses, 130.0) == ""
    assert ps_loss_cause(chief, losses, 100.0 + PS_LOSS_WINDOW_SECONDS + 1) == ""
    assert ps_loss_cause(chief, {}, 130.0) == ""


def test_in_a_job_without_step_reports_an_error_after_the_start_up_window_is_not_deterministic():
    node = Node("chief", 0, id=1, steps=0, started_at=1000.0)
    early = diagnose_node_exit(
        node, _event(node, 1, TRACEBACK), False, job_reports_steps=False, now=1010.0
    )
    assert early.reason == ExitReason.USER_ERROR and early.deterministic
    late = diagnose_node_exit(
        node,
        _event(node, 1, TRACEBACK),
        False,
        job_reports_steps=False,
        now=1000.0 + STARTUP_WINDOW_SECONDS,
    )
    assert late.reason == ExitReason.USER_ERROR and not late.deterministic
    # Where the job reports steps, a node that never stepped is still at start-up.
    hooked = diagnose_node_exit(
        node, _event(node, 1, TRACEBACK), False, job_reports_steps=True, now=5000.0
    )
    assert hooked.deterministic


def _plan(node: Node, diagnosis: Diagnosis, **overrides):
    from master.job.exit_plan import plan_exit

    facts = dict(
        ps_losses={},
        now=1000.0,
        to_ps_change=False,
        training_done=False,
        chief_reports_restores=False,
        coordinator=None,
        job_relaunches_used=0,
        job_ended=False,
    )
    facts.update(overrides)
    return plan_exit(node, diagnosis, SPEC, **facts)


def test_plan_relaunches_a_failed_worker_with_its_budget():
    worker = Node("worker", 1, id=4, relaunches=1, state=NodeState.FAILED)
    plan = _plan(worker, _diagnosis(ExitReason.KILLED))
    assert plan.failed and not plan.fail_job and plan.data_recovery == DataRecovery.NONE
    assert plan.relaunch.start.relaunches == 2 and plan.relaunch.uses_budget
    assert plan.relaunch.may_promote_standby and plan.relaunch.reason == "killed"
    # The job's budget used up: the job fails, naming the node's last line.
    worker.exit_message = "step 10\nsegfault somewhere"
    spent = _plan(worker, _diagnosis(ExitReason.KILLED), job_relaunches_used=5)
    assert spent.relaunch is None and spent.fail_job.endswith("(last log line: segfault somewhere)")


def test_plan_leaves_a_node_a_ps_change_stopped_to_the_change():
    ps = Node("ps", 0, id=1, state=NodeState.FAILED)
    plan = _plan(ps, _diagnosis(ExitReason.STOPPED), to_ps_change=True)
    assert plan.to_ps_change and plan.relaunch is None and not plan.fail_job
    assert plan.data_recovery == DataRecovery.NONE


def test_plan_for_a_lost_ps_moves_the_data_and_restarts_the_tf2_coordinator():
    ps = Node("ps", 0, id=1, state=NodeState.FAILED)
    plan = _plan(ps, _diagnosis(ExitReason.KILLED), coordinator=7, chief_reports_restores=True)
    assert plan.data_recovery == DataRecovery.FREE_HELD_SHARDS and plan.restart_coordinator == 7
    assert plan.relaunch.start == NodeStart("ps", 0, 1)
    # Without a TF2 coordinator nothing is restarted; without restore reports, a rollback.
    plain = _plan(ps, _diagnosis(ExitReason.KILLED))
    assert plain.data_recovery == DataRecovery.ROLLBACK and plain.restart_coordinator is None


def test_plan_restarts_a_coordinator_without_budget_and_a_ps_loss_is_not_its_fault():
    chief = Node("chief", 0, id=7, relaunches=2, steps=5, state=NodeState.FAILED)
    chief.coordinator_restart = True
    diagnosis = Diagnosis(ExitReason.USER_ERROR, "user error", "Traceback", deterministic=True)
    plan = _plan(chief, diagnosis, ps_losses={"ps-0": 990.0}, job_relaunches_used=5)
    assert plan.cause.startswith("after ps-0 was lost") and not plan.diagnosis.deterministic
    assert plan.relaunch.start.relaunches == 2 and not plan.relaunch.uses_budget
    assert plan.relaunch.reason == "ps_lost" and not plan.fail_job


def test_a_node_lost_with_its_host_is_not_blamed_on_a_ps_lost_meanwhile():
    worker = Node("worker", 1, id=4, state=NodeState.FAILED)
    plan = _plan(worker, _diagnosis(ExitReason.NODE_LOST), ps_losses={"ps-0": 990.0})
    assert plan.failed and plan.cause == ""
    killed = _plan(worker, _diagnosis(ExitReason.KILLED), ps_losses={"ps-0": 990.0})
    assert killed.cause == "after ps-0 was lost"


def test_plan_for_a_clean_end_relaunches_nothing():
    worker = Node("worker", 0, id=3, state=NodeState.SUCCEEDED, exit_code=0)
    plan = _plan(worker, _diagnosis(ExitReason.SUCCEEDED), ps_losses={"ps-0": 990.0})
    assert not plan.failed and not plan.cause and plan.relaunch is None and not plan.fail_job
