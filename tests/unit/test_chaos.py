"""The chaos planner: reproducible, spread over the run, only targets the job has, budgets."""

from __future__ import annotations

import pytest

from master.cli.chaos import FIRST_KILL_PERCENT, LAST_KILL_PERCENT, plan_kills
from master.config import parse_job_spec
from master.job.faults import parse_fault


def spec(**groups):
    data = {"name": "c", "command": ["true"], "max_relaunches": 50} | groups
    return parse_job_spec(data, source="test", base_dir="/tmp")


def test_the_same_seed_gives_the_same_plan_and_another_seed_another():
    s = spec(worker={"replicas": 4, "max_relaunches": 20}, ps={"replicas": 2})
    assert plan_kills(s, 10, seed=5) == plan_kills(s, 10, seed=5)
    assert plan_kills(s, 10, seed=5).kills != plan_kills(s, 10, seed=6).kills


def test_kills_are_valid_spread_and_aimed_at_nodes_the_job_has():
    s = spec(worker={"replicas": 3, "max_relaunches": 50}, ps={"replicas": 1})
    faults = [parse_fault(k) for k in plan_kills(s, 40, seed=1).kills]
    percents = [f.at_percent for f in faults]
    assert percents == sorted(percents)
    assert percents[0] == FIRST_KILL_PERCENT and percents[-1] == LAST_KILL_PERCENT
    assert {f.node_type for f in faults} == {"worker", "ps", "master"}  # no chief: none exists
    assert all(f.rank < 3 for f in faults if f.node_type == "worker")
    assert all(f.rank == 0 for f in faults if f.node_type in ("ps", "master"))


def test_a_plan_the_budgets_cannot_absorb_is_flagged():
    tight = spec(worker={"replicas": 1, "max_relaunches": 1})
    plan = plan_kills(tight, 12, seed=0)
    assert any("worker-0 is killed" in w and "max_relaunches is 1" in w for w in plan.warnings)
    roomy = spec(worker={"replicas": 1, "max_relaunches": 50})
    assert plan_kills(roomy, 12, seed=0).warnings == ()


def test_zero_kills_is_refused():
    with pytest.raises(ValueError, match="--kills must be at least 1"):
        plan_kills(spec(worker={"replicas": 1}), 0, seed=0)
