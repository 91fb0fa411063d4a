"""How many Ray nodes a job can lose and go on: the cap on `dlrover chaos`'s Ray node
removals (`--actions ...,node`), from the cluster's alive nodes and the job's CPU requests."""

from __future__ import annotations

from dataclasses import dataclass

from master.config import NODE_TYPES, JobSpec
from master.platform.ray.actor_end import MIN_NODE_CPU
from master.platform.ray.node_removal import HEAD_RESOURCE


@dataclass(frozen=True)
class ClusterNode:
    """An alive Ray node: its id, CPUs and whether it is the head."""

    node_id: str
    cpu: float
    head: bool = False


def survey(address: str) -> tuple[list[ClusterNode], str]:
    """The alive Ray nodes of the cluster at `address`, and the Ray node a driver on this
    machine joins: where `dlrover submit` runs its master and job anchor (never removed)."""
    from master.platform.ray.connect import connect

    ray = connect(address, "dlrover-chaos-survey")
    try:
        nodes = [
            ClusterNode(
                n["NodeID"], float(n["Resources"].get("CPU", 0)), HEAD_RESOURCE in n["Resources"]
            )
            for n in ray.nodes()
            if n.get("Alive")
        ]
        here = str(ray.get_runtime_context().get_node_id())
    finally:
        ray.shutdown()
    return nodes, here


def job_cpu(spec: JobSpec) -> float:
    """The CPUs the job's nodes ask Ray for (a standby PS included)."""
    total = sum(spec.group(t).replicas * max(spec.group(t).cpu, MIN_NODE_CPU) for t in NODE_TYPES)
    if spec.ps_standby and spec.ps.replicas:
        total += max(spec.ps.cpu, MIN_NODE_CPU)
    return total


def spare_ray_nodes(nodes: list[ClusterNode], here: str, demand_cpu: float) -> int:
    """How many Ray nodes the job can lose: nodes with CPUs that may be removed (not the head,
    not `here`), the biggest first, while the CPU nodes left hold `demand_cpu` and one is left."""
    with_cpu = [n for n in nodes if n.cpu > 0]
    removable = sorted(
        (n for n in with_cpu if not n.head and n.node_id != here), key=lambda n: -n.cpu
    )
    left_cpu, left, spare = sum(n.cpu for n in with_cpu), len(with_cpu), 0
    for node in removable:
        if left <= 1 or left_cpu - node.cpu < demand_cpu:
            break
        left_cpu, left, spare = left_cpu - node.cpu, left - 1, spare + 1
    return spare
