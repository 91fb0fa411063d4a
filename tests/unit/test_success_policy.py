"""The TFJob success policies: the chief's success ends the job, the servers still running are
stopped (plain servers at once, our-hook trainers after they finish or their grace, PS last)."""

from __future__ import annotations

import pytest

from master.config import SpecError, parse_job_spec
from master.job.completion import (
    ALL_WORKERS_REASON,
    SERVER_SETTLE_SECONDS,
    decide_completion,
    success_reached,
    success_reason,
)
from master.nodes.model import Node, NodeState

R, S, F = NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.FAILED
REPLICAS = {"ps": 1, "chief": 1, "worker": 2, "evaluator": 0}
GRACE = 60.0


def _tfjob(chief=S, w0=R, w1=R, ps=R, registered=False):
    """1 PS, chief, 2 workers; workers in server.join() unless `registered` (our hooks)."""
    return [
        Node("ps", 0, id=1, state=ps),
        Node("chief", 0, id=2, state=chief),
        Node("worker", 0, id=3, state=w0, registered=registered),
        Node("worker", 1, id=4, state=w1, registered=registered),
    ]


def _ids(decision):
    return [n.id for n in decision.stop]


def test_the_chief_policy_ends_the_job_when_the_chief_succeeds():
    assert success_reached(_tfjob(), REPLICAS, "chief")
    assert not success_reached(_tfjob(chief=R), REPLICAS, "chief")
    assert not success_reached(_tfjob(chief=F), REPLICAS, "chief")
    assert not success_reached(_tfjob(), REPLICAS, "all_workers")
    assert success_reached(_tfjob(w0=S, w1=S), REPLICAS, "all_workers")


def test_without_a_chief_worker_0_decides():
    nodes = [Node("worker", 0, id=1, state=S), Node("worker", 1, id=2, state=R)]
    assert success_reached(nodes, {"worker": 2}, "chief")
    assert success_reason("chief", {"worker": 2}) == "worker-0 finished (success_policy: chief)"
    assert success_reason("chief", REPLICAS) == "chief-0 finished (success_policy: chief)"
    assert success_reason("all_workers", REPLICAS) == ALL_WORKERS_REASON


def test_servers_in_join_and_the_ps_are_stopped_within_seconds_then_the_job_succeeds():
    d = decide_completion(_tfjob(), REPLICAS, None, 100.0, GRACE, "chief")
    assert d.training_done and not d.succeeded and _ids(d) == []  # they may exit themselves
    d = decide_completion(_tfjob(), REPLICAS, 100.0, 100.0 + SERVER_SETTLE_SECONDS, GRACE, "chief")
    assert _ids(d) == [3, 4, 1]  # the workers' servers, then the PS
    ended = _tfjob(w0=NodeState.DELETED, w1=NodeState.DELETED, ps=NodeState.DELETED)
    assert decide_completion(ended, REPLICAS, 100.0, 100.5, GRACE, "chief").succeeded


def test_workers_using_our_hooks_finish_their_shards_within_the_grace_with_the_ps_up():
    d = decide_completion(_tfjob(registered=True), REPLICAS, None, 100.0, GRACE, "chief")
    assert d.training_done and _ids(d) == []  # they still train: the PS stays up
    nodes = _tfjob(w0=S, registered=True)
    assert _ids(decide_completion(nodes, REPLICAS, 100.0, 110.0, GRACE, "chief")) == []
    d = decide_completion(nodes, REPLICAS, 100.0, 160.0, GRACE, "chief")  # grace over
    assert _ids(d) == [4, 1]  # the last one is stopped, and the PS with it
    done = _tfjob(w0=S, w1=S, registered=True)
    assert _ids(decide_completion(done, REPLICAS, 100.0, 111.0, GRACE, "chief")) == [1]


def test_workers_using_our_hooks_are_stopped_within_seconds_once_every_dataset_is_done():
    # e.g. a worker asleep in TF's own recovery wait after a PS loss: nothing is left to train.
    nodes = _tfjob(w0=S, registered=True)
    early = 100.0 + SERVER_SETTLE_SECONDS / 2
    assert _ids(decide_completion(nodes, REPLICAS, 100.0, early, GRACE, "chief", True)) == []
    settled = 100.0 + SERVER_SETTLE_SECONDS
    d = decide_completion(nodes, REPLICAS, 100.0, settled, GRACE, "chief", data_done=True)
    assert _ids(d) == [4, 1]
    # While data is left, the same worker keeps its grace.
    assert _ids(decide_completion(nodes, REPLICAS, 100.0, settled, GRACE, "chief")) == []


def test_a_node_asked_to_stop_is_not_asked_again():
    nodes = _tfjob()
    for n in nodes:
        n.stop_requested = n.type != "chief"
    d = decide_completion(nodes, REPLICAS, 100.0, 101.0, GRACE, "chief")
    assert _ids(d) == [] and not d.succeeded


def test_the_success_policy_is_read_from_the_job_yaml_and_checked():
    base = {"name": "j", "command": ["python", "t.py"], "worker": {"replicas": 1}}
    assert parse_job_spec(base, "job.yaml", "/tmp").success_policy == "chief"
    spec = parse_job_spec({**base, "success_policy": "all_workers"}, "job.yaml", "/tmp")
    assert spec.success_policy == "all_workers"
    with pytest.raises(SpecError, match="success_policy.*'any' is not one of chief, all_workers"):
        parse_job_spec({**base, "success_policy": "any"}, "job.yaml", "/tmp")


def test_only_workers_reserve_slots():
    base = {"name": "j", "command": ["python", "t.py"], "worker": {"replicas": 1}}
    spec = parse_job_spec({**base, "worker": {"replicas": 2, "reserve_slots": True}}, "j.yaml", "/")
    assert spec.worker.reserves_slots and spec.worker.slots == 4
    with pytest.raises(SpecError, match="ps.reserve_slots: a ps has no slots to reserve"):
        parse_job_spec({**base, "ps": {"replicas": 1, "reserve_slots": True}}, "j.yaml", "/")
    with pytest.raises(SpecError, match="worker.reserve_slots: expected true or false"):
        parse_job_spec({**base, "worker": {"replicas": 1, "reserve_slots": "yes"}}, "j.yaml", "/")
