"""Scaling workers and evaluators: which requests are refused, which ranks start and stop; the
autoscaler hands its decisions to the job instead of acting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from master.config import AutoscaleSpec, parse_job_spec
from master.job.autoscale_policy import SCALE_WORKERS
from master.job.autoscaler import Autoscaler
from master.job.model import JobState
from master.job.scaling import MAX_REPLICAS, check_scale_request, plan_scale
from master.nodes.model import Node, NodeState
from master.sharding.service import DatasetStats

SPEC = parse_job_spec(
    {
        "name": "j",
        "command": "python train.py",
        "ps": {"replicas": 1},
        "worker": {"replicas": 2, "max_replicas": 4},
        "evaluator": {"replicas": 1},
    },
    "job.yaml",
    "/tmp",
)


@pytest.mark.parametrize(
    "node_type, replicas, chief, message",
    [
        ("chief", 2, 0, "cannot scale 'chief' at run time; scalable types: ps, worker, evaluator"),
        ("worker", -1, 0, f"replicas must be in [0, {MAX_REPLICAS}], got -1"),
        ("evaluator", MAX_REPLICAS + 1, 0, "replicas must be in"),
        ("worker", 5, 0, "worker.max_replicas is 4: the TF cluster spec has 4 worker slots"),
        ("worker", 0, 0, "the job has no chief: scaling workers to 0 would stop training"),
    ],
)
def test_refused_requests_say_why(node_type, replicas, chief, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("(", r"\(")):
        check_scale_request(SPEC, node_type, replicas, chief)


def test_accepted_requests():
    check_scale_request(SPEC, "worker", 4, 0)
    check_scale_request(SPEC, "worker", 0, 1)  # the chief trains on
    check_scale_request(SPEC, "evaluator", 0, 0)


def _workers(*states):
    return [Node("worker", r, id=10 + r, state=s, relaunches=r) for r, s in enumerate(states)]


def test_scaling_up_starts_the_new_ranks_and_counts_a_rank_that_ran_before():
    # worker-2 ran before (scaled down earlier, relaunched once): its next incarnation counts.
    nodes = _workers(NodeState.RUNNING, NodeState.RUNNING, NodeState.SUCCEEDED)
    plan = plan_scale("worker", 2, 4, nodes)
    assert [(s.node_type, s.rank, s.relaunches) for s in plan.launch] == [
        ("worker", 2, 3),
        ("worker", 3, 0),
    ]
    assert plan.stop == () and plan.new_cluster


def test_scaling_down_stops_the_running_ranks_that_go():
    nodes = _workers(NodeState.RUNNING, NodeState.RUNNING, NodeState.FAILED, NodeState.RUNNING)
    plan = plan_scale("worker", 4, 1, nodes)
    assert [n.rank for n in plan.stop] == [1, 3] and plan.launch == ()


def test_evaluators_are_outside_the_cluster():
    assert not plan_scale("evaluator", 1, 2, []).new_cluster


class _Nodes:
    def __init__(self, nodes):
        self._nodes = nodes

    def all_current(self):
        return list(self._nodes)


class _Sharding:
    def __init__(self):
        self.done = 0

    def stats(self):
        return [
            DatasetStats(
                name="train",
                size=10_000,
                epochs=1,
                current_epoch=0,
                records_done=self.done,
                records_redone=0,
                records_todo=10_000 - self.done,
                records_doing=0,
                finished=False,
            )
        ]


def _job(workers: int):
    """A job as the autoscaler reads it (master.job.autoscaler.ObservedJob)."""
    trainers = [
        Node("worker", r, id=r + 1, state=NodeState.RUNNING, steps=5) for r in range(workers)
    ]
    return SimpleNamespace(
        state=JobState.RUNNING,
        spec=SPEC,
        nodes=_Nodes(trainers),
        sharding=_Sharding(),
        migrator=SimpleNamespace(active=None),
        replicas={"ps": 1, "chief": 0, "worker": workers, "evaluator": 1},
    )


def test_the_autoscaler_decides_and_leaves_acting_to_the_job():
    cfg = AutoscaleSpec(enabled=True, min_workers=3, max_workers=4, interval_seconds=1.0)
    job = _job(workers=2)
    scaler = Autoscaler(job, cfg)
    d = scaler.tick(now=100.0)
    assert d is not None and (d.action, d.workers) == (SCALE_WORKERS, 3)
    assert scaler.decisions == 1 and scaler.last_decision == d
    assert job.replicas["worker"] == 2  # nothing applied: that is the job's part
    details = scaler.event_details(d)
    assert details["reason"] == details["action"] == SCALE_WORKERS
    assert (details["workers"], details["previous_workers"]) == (3, 2)
    assert scaler.tick(now=100.5) is None  # within the interval: no sample
    scaler.not_applied(d, ValueError("the job has already ended"))
    assert scaler.note == "could not apply the last decision: the job has already ended"


def test_an_autoscaler_of_an_ended_job_decides_nothing():
    job = _job(workers=2)
    job.state = JobState.STOPPED
    scaler = Autoscaler(job, AutoscaleSpec(enabled=True, min_workers=3, max_workers=4))
    assert scaler.tick(now=100.0) is None and scaler.decisions == 0
    assert scaler.last_decision is None


def test_a_ps_job_without_reserved_slots_cannot_add_workers_its_ps_do_not_know():
    spec = parse_job_spec(
        {
            "name": "j",
            "command": ["python", "t.py"],
            "ps": {"replicas": 1},
            "worker": {"replicas": 2},
        },
        "job.yaml",
        "/tmp",
    )
    assert spec.worker_limit == 2
    with pytest.raises(ValueError, match="reserve_slots: true"):
        check_scale_request(spec, "worker", 3, 0)
    check_scale_request(spec, "worker", 1, 0)  # fewer is fine
    reserved = spec.with_overrides(worker=spec.worker.__class__(replicas=2, reserve_slots=True))
    assert reserved.worker_limit == 4
    check_scale_request(reserved, "worker", 4, 0)
