"""A PS count change stops the whole TF cluster and starts it again with what was missing; the
data follows the model back to the checkpoint made for it."""

from __future__ import annotations

from master.job.checkpoints import Checkpoint
from master.job.model import NodeStart
from master.job.ps_change import cluster_to_start, cluster_to_stop
from master.job.rollback import (
    MODEL_RESTORED,
    PS_FAILED,
    DatasetRollback,
    rollback_step,
    rollbacks_to_report,
)
from master.nodes.model import Node, NodeState

R, S, F = NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.FAILED


def test_every_running_ps_chief_and_worker_stops_but_not_the_evaluator():
    nodes = [
        Node("ps", 0, id=1, state=R),
        Node("ps", 1, id=2, state=F),
        Node("chief", 0, id=3, state=R),
        Node("worker", 0, id=4, state=R),
        Node("worker", 1, id=5, state=S),
        Node("evaluator", 0, id=6, state=R),
    ]
    assert [n.id for n in cluster_to_stop(nodes)] == [1, 3, 4]


def test_the_new_cluster_starts_each_missing_rank_with_its_resources():
    nodes = [
        Node("ps", 0, id=1, state=NodeState.DELETED, relaunches=1, memory_mb=2048, cpu=2.0),
        Node("chief", 0, id=2, state=F, relaunches=0),
        Node("worker", 0, id=3, state=R),  # already up again: left alone
        Node("worker", 1, id=4, state=S),  # done: not started again
        Node("evaluator", 0, id=5, state=F),  # not part of the TF cluster
    ]
    starts = cluster_to_start({"ps": 2, "chief": 1, "worker": 3, "evaluator": 1}, nodes)
    assert starts == [
        NodeStart("ps", 0, 1, 2048, 2.0),
        NodeStart("ps", 1, 0),  # a new rank
        NodeStart("chief", 0, 0, 0, 0.0),
        NodeStart("worker", 2, 0),
    ]


def test_starting_again_is_idempotent_once_everything_runs():
    nodes = [Node("ps", r, id=r + 1, state=R) for r in range(2)] + [
        Node("worker", 0, id=9, state=R)
    ]
    assert cluster_to_start({"ps": 2, "chief": 0, "worker": 1}, nodes) == []


def test_without_a_known_step_the_data_goes_back_to_the_latest_checkpoint_or_the_start():
    assert rollback_step(Checkpoint(1200, "/ckpt/model.ckpt-1200", ("train",))) == 1200
    assert rollback_step(None) == 0


def test_a_ps_failure_reports_every_dataset_a_restore_only_those_that_moved():
    before = {"train": 5000, "eval": 100}
    after = {"train": 4200, "eval": 100}
    assert rollbacks_to_report(before, after, PS_FAILED) == [
        DatasetRollback("train", 800),
        DatasetRollback("eval", 0),
    ]
    assert rollbacks_to_report(before, after, MODEL_RESTORED) == [DatasetRollback("train", 800)]


def test_a_restore_after_a_ps_loss_is_reported_even_when_the_data_was_already_there():
    # The PS died just after a checkpoint: the chief restores where the data already is.
    same = {"train": 4200}
    assert rollbacks_to_report(same, same, MODEL_RESTORED) == []
    assert rollbacks_to_report(same, same, MODEL_RESTORED, report_unchanged=True) == [
        DatasetRollback("train", 0)
    ]
