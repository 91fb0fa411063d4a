"""What a node actor's failure says about its node: its Ray node died, or the actor alone failed."""

from __future__ import annotations

import signal

from master.platform.api import NodeEvent, NodeLaunchSpec

# A node that asks for no CPU still takes a sliver of one, so many fit on a small cluster.
MIN_NODE_CPU = 0.01


def says_node_died(text: str) -> bool:
    """Whether Ray's error text says the actor's Ray node died."""
    lowered = text.lower()
    return "its node has died" in lowered or "node is dead" in lowered


def actor_failure_event(
    spec: NodeLaunchSpec, node_ip: str, error: Exception, actor_died: bool
) -> NodeEvent:
    """The end of a node whose actor failed while its Ray node lives (``actor_died``: Ray's
    RayActorError): SIGKILL, the error named, OOM when Ray says memory ran low."""
    text = " ".join(str(error).split())
    if type(error).__name__ == "ActorUnschedulableError":
        asked = f"{spec.cpu if spec.cpu > 0 else MIN_NODE_CPU:g} CPU" + (
            f", {spec.memory_mb} MB memory" if spec.memory_mb > 0 else ""
        )
        what = (
            f"cannot run on Ray node {node_ip}, which is gone or has less than the "
            f"{asked} it asks for"
        )
    elif actor_died:
        what = "its Ray actor died"
    else:
        what = f"its Ray actor failed ({type(error).__name__})"
    lowered = text.lower()
    return NodeEvent(
        spec.type,
        spec.rank,
        spec.id,
        exit_code=-signal.SIGKILL,
        oom_killed="low on memory" in lowered or "memory pressure" in lowered,
        message=f"{spec.type}-{spec.rank} id={spec.id}: {what}: {text[:600]}",
        details={"ray_error": type(error).__name__},
    )
