"""The chaos planner (reproducible, spread over the run, only targets the job has, within the
budgets, by records, steps or time) and the report's count of what fired."""

from __future__ import annotations

import pytest

from master.cli.chaos import (
    FIRST_KILL_PERCENT,
    LAST_KILL_PERCENT,
    ChaosAction,
    JobScale,
    Trigger,
    count_faults,
    plan_kills,
)
from master.config import parse_job_spec
from master.job.faults import FaultAction, parse_fault


def spec(max_relaunches=50, **groups):
    data = {"name": "c", "command": ["true"], "max_relaunches": max_relaunches} | groups
    return parse_job_spec(data, source="test", base_dir="/tmp")


def test_the_same_seed_gives_the_same_plan_and_another_seed_another():
    s = spec(worker={"replicas": 4, "max_relaunches": 20}, ps={"replicas": 2})
    assert plan_kills(s, 10, seed=5) == plan_kills(s, 10, seed=5)
    assert plan_kills(s, 10, seed=5).kills != plan_kills(s, 10, seed=6).kills


def test_kills_are_valid_spread_and_aimed_at_nodes_the_job_has():
    s = spec(worker={"replicas": 3, "max_relaunches": 50}, ps={"replicas": 1, "max_relaunches": 9})
    faults = [parse_fault(k) for k in plan_kills(s, 40, seed=1).kills]
    percents = [f.at_percent for f in faults]
    assert percents == sorted(percents)
    assert percents[0] == FIRST_KILL_PERCENT and percents[-1] == LAST_KILL_PERCENT
    assert {f.node_type for f in faults} == {"worker", "ps", "master"}  # no chief: none exists
    assert all(f.rank < 3 for f in faults if f.node_type == "worker")
    assert all(f.rank == 0 for f in faults if f.node_type in ("ps", "master"))
    assert {f.action for f in faults} == {FaultAction.KILL}


def test_a_plan_stays_within_the_budgets_while_they_allow():
    # The torch example's budgets: 2 per worker, 4 for the job; the master restarts 5 times.
    s = spec(max_relaunches=4, worker={"replicas": 2, "max_relaunches": 2})
    for seed in range(20):
        plan = plan_kills(s, 9, seed=seed)
        targets = [k.split("@")[0] for k in plan.kills]
        assert targets.count("worker:0") <= 2 and targets.count("worker:1") <= 2
        assert len([t for t in targets if t.startswith("worker")]) <= 4
        assert targets.count("master:0") <= 5
        assert plan.warnings == ()


def test_a_plan_the_budgets_cannot_absorb_is_flagged():
    tight = spec(max_relaunches=1, worker={"replicas": 1, "max_relaunches": 1})
    plan = plan_kills(tight, 12, seed=0)
    assert plan.notes and "budgets were not spent" in plan.notes[0]
    assert any("worker-0 is hit" in w and "max_relaunches is 1" in w for w in plan.warnings)
    assert any("restarted at most 5 times" in w for w in plan.warnings)
    roomy = spec(worker={"replicas": 1, "max_relaunches": 50})
    assert plan_kills(roomy, 12, seed=0).warnings == ()


def test_a_job_without_records_is_planned_by_its_global_step_or_its_time():
    s = spec(worker={"replicas": 2, "max_relaunches": 20})
    torch_like = JobScale(records=0, global_step=400, wall_seconds=36.0)
    assert torch_like.trigger() == Trigger.STEPS
    steps = [
        parse_fault(k) for k in plan_kills(s, 10, 1, trigger=Trigger.STEPS, scale=torch_like).kills
    ]
    assert [f.at_step for f in steps][0] == 40 and steps[-1].at_step == 280
    assert all(f.at_percent is None for f in steps)
    silent = JobScale(records=0, global_step=0, wall_seconds=40.0)
    assert silent.trigger() == Trigger.TIME
    times = [parse_fault(k) for k in plan_kills(s, 4, 1, trigger=Trigger.TIME, scale=silent).kills]
    assert [f.at_seconds for f in times] == [4.0, 12.0, 20.0, 28.0]
    assert JobScale(records=100, global_step=7, wall_seconds=1.0).trigger() == Trigger.RECORDS
    with pytest.raises(ValueError, match="needs a fault-free run"):
        plan_kills(s, 3, 1, trigger=Trigger.STEPS)
    with pytest.raises(ValueError, match="reported no global step: use --by time"):
        plan_kills(s, 3, 1, trigger=Trigger.STEPS, scale=silent)
    with pytest.raises(ValueError, match="read no dataset of the master"):
        plan_kills(s, 3, 1, trigger=Trigger.RECORDS, scale=torch_like)


def test_freezes_hit_only_nodes_that_send_heartbeats():
    s = spec(worker={"replicas": 2, "max_relaunches": 50}, ps={"replicas": 1, "max_relaunches": 50})
    plan = plan_kills(s, 30, 3, actions=(ChaosAction.KILL, ChaosAction.FREEZE))
    faults = [parse_fault(k) for k in plan.kills]
    frozen = [f for f in faults if f.action == FaultAction.FREEZE]
    assert frozen and {f.node_type for f in frozen} == {"worker"}
    assert any(f.action == FaultAction.KILL for f in faults)


def test_zero_kills_is_refused():
    with pytest.raises(ValueError, match="--kills must be at least 1"):
        plan_kills(spec(worker={"replicas": 1}), 0, seed=0)


def _event(kind, message, reason="", node_id=0, **details):
    return {
        "kind": kind,
        "message": message,
        "reason": reason,
        "node_id": node_id,
        "details": details,
    }


def test_only_faults_that_fired_count_as_fired():
    """The report of issue 37: ten faults that never fired were said done."""
    events = [
        _event("fault", "SIGKILL to worker-1 ...", "fault_injection", 2, action="kill"),
        _event("fault", "SIGKILL to master-0 ...", "fault_injection", action="kill"),
        _event(
            "fault", "SIGSTOP (a freeze) to worker-0 ...", "fault_injection", 1, action="freeze"
        ),
        _event("heartbeat_lost", "worker-0 (id 1) sent no heartbeat", "heartbeat_lost", 1),
        _event(
            "fault", "SIGSTOP (a freeze) to worker-1 ...", "fault_injection", 3, action="freeze"
        ),
        _event("fault", "worker-1 (id 3) thawed", "fault_thawed", 3),
        _event("fault", "SIGKILL to ps-0 ...: node not running, skipped", "skipped"),
        _event("fault", "SIGKILL to worker-0 at 50% never fired before the job's end", "not_fired"),
        _event("heartbeat_lost", "worker-1 (id 2) sent no heartbeat", "heartbeat_lost", 2),
    ]
    count = count_faults(events)
    assert len(count.fired) == 4 and len(count.skipped) == 1 and len(count.not_fired) == 1
    assert count.detected_freezes == 1 and count.thawed == 1
