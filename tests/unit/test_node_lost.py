"""A node lost with its host (NodeLost from the Ray or Kubernetes platform): diagnosed as such,
relaunched, and its rank's address asked anew (a PS that moved changes the TF cluster); the
peers of a moved rank restart with the new cluster spec (master.job.moves)."""

from __future__ import annotations

import signal

from master.config import parse_job_spec
from master.job.cluster import Cluster
from master.job.exit_plan import DataRecovery, diagnose_node_exit, plan_exit, relaunch_decision
from master.job.model import NodeStart
from master.job.moves import MoveRestarts, plan_move_restarts
from master.nodes.model import Diagnosis, ExitReason, Node, NodeState
from master.nodes.policy import Action
from master.platform.api import NODE_LOST, REASON_DETAIL, NodeEvent, node_lost
from master.platform.local import LocalPlatform

SPEC = parse_job_spec(
    {"name": "j", "command": "python t.py", "ps": {"replicas": 1}, "worker": {"replicas": 2}},
    "job.yaml",
    "/tmp",
)


def _lost(node: Node) -> NodeEvent:
    return NodeEvent(
        node.type,
        node.rank,
        node.id,
        -signal.SIGKILL,
        message=f"{NODE_LOST}: its Ray node died",
        details={REASON_DETAIL: NODE_LOST},
    )


def test_a_node_lost_with_its_host_is_diagnosed_so_and_relaunched():
    for fresh in (Node("worker", 1, id=3, steps=0), Node("ps", 0, id=1)):  # at start-up too
        event = _lost(fresh)
        assert node_lost(event)
        d = diagnose_node_exit(fresh, event, job_ended=False)
        assert d.reason == ExitReason.NODE_LOST and not d.deterministic
        decision = relaunch_decision(fresh, d, SPEC, 0, training_done=False)
        assert decision.action == Action.RELAUNCH, decision
    plain = NodeEvent("worker", 0, 2, -signal.SIGKILL)
    assert not node_lost(plain)
    assert diagnose_node_exit(Node("worker", 0, id=2, steps=5), plain, False).reason == (
        ExitReason.KILLED
    )


class _MovingPlatform(LocalPlatform):
    """Hands out a new address for a rank once its host is lost, as the Ray platform does."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: set[tuple[str, int]] = set()

    def address_for(self, node_type: str, rank: int) -> str:
        base = super().address_for(node_type, rank)
        return base.replace("127.0.0.1", "127.0.0.2") if (node_type, rank) in self.lost else base


def test_a_rank_that_moved_gets_its_new_address_and_a_new_cluster_version():
    platform = _MovingPlatform()
    try:
        cluster = Cluster(SPEC, platform)
        before = cluster.tf_cluster()
        assert not cluster.refresh("ps", 0) and cluster.version == 1  # same host: no change
        platform.lost.add(("ps", 0))
        assert cluster.refresh("ps", 0) and cluster.version == 2
        after = cluster.tf_cluster()
        assert after["ps"] != before["ps"] and after["ps"][0].startswith("127.0.0.2:")
        assert after["worker"] == before["worker"]
    finally:
        platform.shutdown(1)


def test_every_rank_the_lost_host_held_moves_at_once_with_a_new_cluster_version():
    platform = _MovingPlatform()
    try:
        cluster = Cluster(SPEC, platform)
        for key in (("ps", 0), ("worker", 0), ("worker", 1)):
            cluster.address(*key)
        assert cluster.refresh_running() == [] and cluster.version == 1  # Kubernetes-like
        platform.lost |= {("ps", 0), ("worker", 1)}
        assert cluster.refresh_running() == [("ps", 0), ("worker", 1)]
        assert cluster.version > 1 and cluster.tf_cluster()["worker"][1].startswith("127.0.0.2")
        assert cluster.refresh_running() == []  # the second end of that host moves nothing
    finally:
        platform.shutdown(1)


def _running(*names: str) -> list[Node]:
    nodes = []
    for i, name in enumerate(names):
        node_type, _, rank = name.rpartition("-")
        nodes.append(Node(node_type, int(rank), id=10 + i, state=NodeState.RUNNING))
    return nodes


def test_a_moved_worker_restarts_every_ps_and_no_trainer():
    nodes = _running("ps-0", "ps-1", "chief-0", "worker-0", "worker-1", "evaluator-0")
    nodes[1].restart_for_move = "worker-0"  # already restarting: not again
    plan = plan_move_restarts([("worker", 1)], nodes, training_done=False)
    assert [n.name for n in plan.ps] == ["ps-0"] and plan.trainers == ()
    assert plan.moved_trainers == "worker-1"
    both = plan_move_restarts([("chief", 0), ("worker", 1)], _running("ps-0"), False)
    assert [n.name for n in both.ps] == ["ps-0"] and both.moved_trainers == "chief-0, worker-1"


def test_a_moved_ps_restarts_the_trainers_and_no_ps():
    nodes = _running("ps-0", "ps-1", "chief-0", "worker-0", "worker-1")
    nodes[3].coordinator_restart = True  # already restarting
    plan = plan_move_restarts([("ps", 1)], nodes, training_done=False)
    assert [n.name for n in plan.trainers] == ["chief-0", "worker-1"] and plan.ps == ()
    assert plan.moved_trainers == ""


def test_ranks_lost_together_are_not_restarted_their_own_end_relaunches_them():
    """ps-0 and worker-1 on the same lost host: each is relaunched once, by its own end, with
    the spec that has both new addresses; the others restart once."""
    nodes = _running("ps-0", "ps-1", "chief-0", "worker-0", "worker-1")
    plan = plan_move_restarts([("ps", 0), ("worker", 1)], nodes, training_done=False)
    assert [n.name for n in plan.trainers] == ["chief-0", "worker-0"]
    assert [n.name for n in plan.ps] == ["ps-1"] and plan.moved_trainers == "worker-1"


def test_nodes_that_follow_the_moved_ranks_in_place_are_not_restarted():
    """On Ray every node reaches its peers through forwarders: those that now reach the new
    addresses go on; one that dials directly (a promoted standby PS) restarts as before."""
    nodes = _running("ps-0", "ps-1", "chief-0", "worker-0", "worker-1")
    ps0, ps1, chief, w0 = nodes[0], nodes[1], nodes[2], nodes[3]
    plan = plan_move_restarts([("worker", 1)], nodes, False, following={ps0.id})
    assert [n.name for n in plan.ps] == ["ps-1"] and plan.moved_trainers == "worker-1"
    every = {n.id for n in nodes}
    assert plan_move_restarts([("worker", 1)], nodes, False, every) == MoveRestarts()
    plan = plan_move_restarts([("ps", 1)], nodes, False, following={chief.id, ps1.id})
    assert [n.name for n in plan.trainers] == ["worker-0", "worker-1"]
    assert w0 in plan.trainers


def test_nothing_restarts_without_a_move_without_ps_or_once_training_is_done():
    nodes = _running("ps-0", "chief-0", "worker-0", "worker-1")
    assert plan_move_restarts([], nodes, training_done=False) == MoveRestarts()  # Kubernetes
    assert plan_move_restarts([("worker", 1)], nodes, training_done=True) == MoveRestarts()
    torch = _running("worker-0", "worker-1")
    assert plan_move_restarts([("worker", 1)], torch, training_done=False) == MoveRestarts()
    ended = _running("ps-0")
    ended[0].state = NodeState.FAILED
    assert plan_move_restarts([("worker", 1)], ended, training_done=False) == MoveRestarts()


def _plan_killed(node: Node, **facts):
    args = (
        dict(
            ps_losses={},
            now=1000.0,
            to_ps_change=False,
            training_done=False,
            chief_reports_restores=False,
            coordinator=None,
            job_relaunches_used=SPEC.max_relaunches,  # the job's budget spent: no matter
            job_ended=False,
        )
        | facts
    )
    return plan_exit(node, Diagnosis(ExitReason.KILLED, "killed"), SPEC, **args)


def test_a_ps_restarted_for_a_moved_worker_is_a_ps_failure_that_uses_no_budget():
    ps = Node("ps", 0, id=1, relaunches=1, state=NodeState.FAILED)
    ps.restart_for_move = "worker-1"
    plan = _plan_killed(ps)
    r = plan.relaunch
    assert r is not None and not plan.fail_job
    assert r.start == NodeStart("ps", 0, 1) and not r.uses_budget and r.may_promote_standby
    assert r.reason == "peer_moved"
    assert (
        r.message
        == "ps-0 restarted with the new cluster spec after worker-1 moved (no budget used)"
    )
    assert plan.cause == "restarted with the new cluster spec after worker-1 moved"
    assert plan.data_recovery == DataRecovery.ROLLBACK  # the data follows the model back
    tf2 = _plan_killed(ps, coordinator=7, chief_reports_restores=True)
    assert tf2.data_recovery == DataRecovery.FREE_HELD_SHARDS and tf2.restart_coordinator == 7
    # Training over (the PS are being stopped): no restart.
    assert _plan_killed(ps, training_done=True).relaunch is None
    assert _plan_killed(ps, job_ended=True).relaunch is None
