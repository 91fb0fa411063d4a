"""The job anchor: the Ray actor that creates and owns a run's node actors.

Started by the `dlrover submit` supervisor (or, detached, next to the master actor), so the
node actors share the anchor's fate rather than the master's and outlive a master that dies.
"""

from __future__ import annotations

from typing import Any

from master.platform.api import NodeLaunchSpec
from master.platform.ray.connect import connect
from master.platform.ray.node_actor import NodeActor, node_actor_name

# The job anchor's name in the run's namespace, and its concurrent calls (launches).
ANCHOR_NAME = "dlrover-job-anchor"
ANCHOR_MAX_CONCURRENCY = 16


class JobAnchor:
    """Creates and holds the node actors of one run, so that they outlive its master.

    Owned by the `dlrover submit` supervisor's Ray driver: when that driver goes, Ray ends the
    anchor and every actor it owns.
    """

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._actor_class = ray.remote(NodeActor)
        self._actors: dict[int, Any] = {}

    def ping(self) -> bool:
        """Answers once the anchor is up."""
        return True

    def node_id(self) -> str:
        """The Ray node the anchor (and so every node actor's owner) runs on."""
        return str(self._ray.get_runtime_context().get_node_id())

    def launch(self, spec: NodeLaunchSpec, ray_node: str, options: dict[str, Any]) -> Any:
        """Start a node actor named node-<id> with `options`; its handle."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = dict(options)
        node_id = options.pop("node_id")
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        actor = self._actor_class.options(name=node_actor_name(spec.id), **options).remote(
            spec, ray_node
        )
        self._actors[spec.id] = actor
        return actor

    def release(self, node_id: int) -> None:
        """The master is done with this node (it ended and was reported)."""
        actor = self._actors.pop(node_id, None)
        if actor is not None:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass


def start_job_anchor(address: str, namespace: str) -> Any:
    """Connect this process (the supervisor) to Ray and start the run's job anchor in it.

    The anchor lives as long as this process's Ray connection does.
    """
    ray = connect(address, namespace)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On this process's Ray node: every node actor shares the anchor's fate, so it must not sit
    # on another Ray node whose loss would take the whole job with it.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    anchor = (
        ray.remote(JobAnchor)
        .options(
            name=ANCHOR_NAME,
            num_cpus=0,
            max_concurrency=ANCHOR_MAX_CONCURRENCY,
            scheduling_strategy=here,
        )
        .remote()
    )
    ray.get(anchor.ping.remote(), timeout=120)
    return anchor
