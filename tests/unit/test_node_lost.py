"""A node lost with its host (NodeLost from the Ray or Kubernetes platform): diagnosed as such,
relaunched, and its rank's address asked anew (a PS that moved changes the TF cluster)."""

from __future__ import annotations

import signal

from master.config import parse_job_spec
from master.job.cluster import Cluster
from master.job.exit_plan import diagnose_node_exit, relaunch_decision
from master.nodes.model import ExitReason, Node
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
